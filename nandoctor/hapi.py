"""`from nandoctor.hapi import NanDoctorCallback`: the public path of the hapi callback, which lives with
the other framework callbacks in `nandoctor.integrations.hapi`."""

from nandoctor.integrations.hapi import *  # noqa: F403
from nandoctor.integrations.hapi import __all__  # noqa: F401
