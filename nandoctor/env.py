"""Environment facts for bug tickets: versions, device, CUDA/cuDNN, GPUs and the Paddle flags that are set."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from nandoctor.version import __version__

# Flags that change numerics or NaN checking; worth a line in a bug ticket when set.
_RELEVANT_FLAG_PREFIXES = ("FLAGS_check_nan_inf", "FLAGS_cudnn_deterministic", "FLAGS_embedding_deterministic",
                           "FLAGS_use_", "FLAGS_enable_", "FLAGS_low_precision", "FLAGS_benchmark")


def collect(device: str | None = None) -> dict[str, Any]:
    """What a maintainer needs to reproduce: nandoctor, Paddle, Python, OS, device, CUDA and GPUs."""
    info: dict[str, Any] = {
        "nandoctor": __version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
    }
    try:
        import paddle
    except Exception as exc:  # noqa: BLE001 - a broken Paddle install is itself a fact to report
        info["paddle"] = f"not importable: {type(exc).__name__}: {exc}"
        info["device"] = device or "unknown"
        return info
    info["paddle"] = paddle.__version__
    info["paddle_commit"] = getattr(paddle.version, "commit", None)
    compiled_cuda = paddle.device.is_compiled_with_cuda()
    info["compiled_with_cuda"] = compiled_cuda
    info["device"] = device or paddle.device.get_device()
    if compiled_cuda:
        info["cuda"] = paddle.version.cuda()
        info["cudnn"] = paddle.version.cudnn()
        try:
            count = paddle.device.cuda.device_count()
            info["gpus"] = [paddle.device.cuda.get_device_name(i) for i in range(count)]
        except Exception as exc:  # noqa: BLE001
            info["gpus"] = f"unavailable: {exc}"
    info["numpy"] = _version("numpy")
    flags = {k: v for k, v in os.environ.items() if k.startswith(_RELEVANT_FLAG_PREFIXES)}
    if flags:
        info["paddle_flags"] = flags
    info["executable"] = home_relative(sys.executable)
    return info


def home_relative(path: str) -> str:
    """`/home/ana/x` as `~/x`: environment facts are pasted into public tickets."""
    home = os.path.expanduser("~").rstrip("/")
    if len(home) > 1 and (path == home or path.startswith(home + "/")):
        return "~" + path[len(home):]
    return path


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None
