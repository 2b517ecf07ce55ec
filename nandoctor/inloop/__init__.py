"""nandoctor inside the user's own training loop: `nandoctor.watch(model, optimizer, step_fn)`."""

from nandoctor.inloop.doctor import Doctor, NonFiniteError, watch

__all__ = ["Doctor", "NonFiniteError", "watch"]
