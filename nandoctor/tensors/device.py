"""Which device to run on: `auto` takes a GPU when Paddle was built with CUDA and one is present."""

from __future__ import annotations

from nandoctor.errors import UsageError


def resolve_device(requested: str) -> str:
    """'auto' | 'cpu' | 'gpu' | 'gpu:N' -> the Paddle device string to use; a GPU that is not there is an error."""
    import paddle

    has_cuda = paddle.device.is_compiled_with_cuda()
    count = paddle.device.cuda.device_count() if has_cuda else 0
    if requested == "auto":
        return "gpu:0" if count > 0 else "cpu"
    if requested == "cpu":
        return "cpu"
    index = int(requested.split(":", 1)[1]) if ":" in requested else 0
    if not has_cuda:
        raise UsageError(f"device {requested!r} asked for, but this Paddle build has no CUDA (it is the CPU wheel). "
                         "Use --device cpu, or install paddlepaddle-gpu (see docs/gpu.md).")
    if index >= count:
        raise UsageError(f"device {requested!r} asked for, but only {count} GPU(s) are visible. "
                         f"Use --device gpu:0{'' if count == 1 else f'..gpu:{count - 1}'} or --device cpu.")
    return f"gpu:{index}"


def use_device(device: str) -> None:
    import paddle

    paddle.set_device(device)
