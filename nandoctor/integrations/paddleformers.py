"""PaddleFormers `Trainer` watched by nandoctor: `Trainer(..., callbacks=[NanDoctorCallback()])`.

The callback itself is integrations/trainer.py's (paddlenlp's Trainer gets the same one, paddlenlp.py).
Importing this module without paddleformers raises an ImportError that says so.
"""

from __future__ import annotations

try:
    from paddleformers.trainer import TrainerCallback
except ImportError as exc:  # no hard dependency: say what to install
    raise ImportError("nandoctor.integrations.paddleformers needs paddleformers (`pip install paddleformers`); "
                      "for a plain loop use nandoctor.watch, for paddle.Model use nandoctor.hapi") from exc

from nandoctor.integrations.trainer import TrainerWatch

__all__ = ["NanDoctorCallback"]


class NanDoctorCallback(TrainerWatch, TrainerCallback):
    __doc__ = TrainerWatch.__doc__
