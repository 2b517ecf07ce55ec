"""Callbacks for training frameworks built on Paddle; each imports its framework only when it is used
(`from nandoctor.integrations.paddleformers import NanDoctorCallback`), so none is a dependency."""
