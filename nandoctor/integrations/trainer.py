"""The Trainer callback's behaviour, for PaddleFormers' `Trainer` and paddlenlp's (one class each, thin).

Both Trainers fire the same events with the same arguments: `on_load_data_end` hands over the batch,
`on_substep_end` (a micro-batch of an accumulation) and `on_optimizer_begin` come after backward and before
the update, so `Doctor.check` runs there with the step's one host sync. The loss is the model's own
(`outputs.loss`, taken by a forward post-hook, as these models compute it from `labels`); the replay of a
faulty step calls the model on (part of) the batch the same way, with keyword inputs. On a fault the update
is dropped (the doctor's optimizer wrapper makes that `step()` a no-op) and, by default,
`control.should_training_stop` ends training after it. Nothing here imports either library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nandoctor.findings import Mode
from nandoctor.inloop.doctor import Doctor

__all__ = ["TrainerWatch"]


class TrainerWatch:
    """Detects the first non-finite step of `Trainer.train`, writes the report, stops training
    (`stop_training=False`: drops that update and goes on). `report` holds it afterwards. Mixed into each
    library's `TrainerCallback` (paddleformers.py, paddlenlp.py)."""

    def __init__(self, report_dir: str | Path | None = "nandoctor-report", stop_training: bool = True,
                 replay: bool = True) -> None:
        self.report_dir = report_dir
        self.stop_training = stop_training
        self.replay = replay
        self.doctor: Doctor | None = None
        self._inputs: Any = None
        self._loss: Any = None
        self._hook: Any = None

    @property
    def report(self) -> Any:
        return self.doctor.report if self.doctor is not None else None

    def on_load_data_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.doctor is None:
            self._attach(kwargs.get("model"), kwargs.get("optimizer"))
        self._inputs = kwargs.get("inputs")

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(control)

    def on_optimizer_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.doctor is not None:
            self.doctor.close()

    # ---- helpers ----------------------------------------------------------------------------------
    def _attach(self, model: Any, optimizer: Any) -> None:
        if model is None or optimizer is None:
            return
        self.doctor = Doctor(model, optimizer, step_fn=_model_loss if self.replay else None,
                             report_dir=self.report_dir, on_fault="skip_step", mode=Mode.TRAINER)
        self._hook = model.register_forward_post_hook(self._keep_loss)

    def _keep_loss(self, _layer: Any, _inputs: Any, outputs: Any) -> None:
        if self.doctor is not None and not self.doctor._busy and _layer.training:
            self._loss = _loss_of(outputs)

    def _check(self, control: Any) -> None:
        import paddle

        doctor = self.doctor
        if doctor is None or doctor._closed:
            return
        loss = self._loss
        if loss is None:  # a model that does not return its loss: the gradients still tell
            loss = paddle.zeros([1])
            loss.stop_gradient = False
        self._loss = None
        if not doctor.check(loss, self._inputs) and self.stop_training:
            control.should_training_stop = True
            control.should_epoch_stop = True


def _loss_of(outputs: Any) -> Any:
    """`outputs.loss`, `outputs["loss"]`, the first element of a tuple, or a scalar output itself."""
    import paddle

    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, (tuple, list)) and outputs:
        loss = outputs[0]
    if loss is None and isinstance(outputs, paddle.Tensor):
        loss = outputs
    if isinstance(loss, paddle.Tensor) and int(loss.size) == 1:
        return loss
    return None


def _model_loss(model: Any, batch: Any) -> Any:
    """The replay: the model on the (partial) batch, as the Trainer calls it, and its own loss."""
    from nandoctor.inloop.doctor import ReplayError

    outputs = model(**batch) if isinstance(batch, dict) else model(*batch)
    loss = _loss_of(outputs)
    if loss is None:
        raise ReplayError("the model returned no loss to replay (pass labels so it computes one)")
    return loss
