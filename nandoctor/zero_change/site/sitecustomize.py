"""Put first on PYTHONPATH by `nandoctor run`: watch this process if NANDOCTOR_RUN says so, then hand over
to any sitecustomize that was there before ours (a venv's or a distribution's)."""

import importlib.util
import os
import sys

try:
    from nandoctor.zero_change import runtime

    runtime.install()
except Exception:  # noqa: BLE001 - never stop the user's program from starting
    pass

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    if _entry and os.path.abspath(_entry) != _here:
        _spec = importlib.util.spec_from_file_location("_nandoctor_prev_sitecustomize",
                                                       os.path.join(_entry, "sitecustomize.py"))
        if _spec is not None and os.path.isfile(os.path.join(_entry, "sitecustomize.py")):
            _module = importlib.util.module_from_spec(_spec)
            _spec.loader.exec_module(_module)
            break
