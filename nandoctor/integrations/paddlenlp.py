"""paddlenlp's `Trainer` watched by nandoctor: `Trainer(..., callbacks=[NanDoctorCallback()])`.

The same callback as for PaddleFormers (integrations/trainer.py holds it); paddlenlp fires the same events.
Importing this module without paddlenlp raises an ImportError that says so.
"""

from __future__ import annotations

try:
    from paddlenlp.trainer import TrainerCallback
except ImportError as exc:  # no hard dependency: say what to install
    raise ImportError("nandoctor.integrations.paddlenlp needs paddlenlp (`pip install paddlenlp`); for "
                      "PaddleFormers use nandoctor.integrations.paddleformers, for a plain loop nandoctor.watch")\
        from exc

from nandoctor.integrations.trainer import TrainerWatch

__all__ = ["NanDoctorCallback"]


class NanDoctorCallback(TrainerWatch, TrainerCallback):
    __doc__ = TrainerWatch.__doc__
