"""nandoctor: finds where a PaddlePaddle training run first goes NaN or Inf, and says what to change."""

__version__ = "0.1.0"
