"""A short instrumented training run that detects cheaply and localises the first fault by replay."""
