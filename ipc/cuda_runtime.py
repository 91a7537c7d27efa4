"""What the CUDA IPC code needs from the process: is a GPU usable here, cupy, device ordinals.

Every CUDA entry point of kvtier checks :func:`require_cuda` (or reports
:func:`cuda_unavailable_reason`) first, so a machine without a GPU or without cupy gets one
sentence saying which is missing instead of an import error or a CUDA error later on. cupy (the
``cuda`` extra) is imported only by :func:`cupy_module`, and nothing here creates a CUDA context.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from kvtier.config.errors import KvtierError

__all__ = [
    "NEEDS_GPU",
    "CudaIpcError",
    "CudaUnavailable",
    "cuda_error_types",
    "cuda_unavailable_reason",
    "cupy_module",
    "ordinal_of",
    "require_cuda",
]

NEEDS_GPU = "needs an NVIDIA GPU with cupy (pip install -e .[cuda])"
"""The reason every CUDA-only entry point (and test) gives on a machine without one."""


class CudaIpcError(KvtierError):
    """CUDA memory or an event could not be exported or opened; the message says why."""


class CudaUnavailable(CudaIpcError, RuntimeError):
    """A CUDA-only operation was called where there is no GPU or no cupy."""


# -- availability -------------------------------------------------------------------------------


def cuda_unavailable_reason() -> str | None:
    """Why the GPU path cannot run here, or None when it can.

    Returns:
        None when torch sees a CUDA device and cupy is installed; otherwise a sentence that
        starts with :data:`NEEDS_GPU`. Does not create a CUDA context.
    """
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return f"{NEEDS_GPU}: torch {torch.__version__} ({build}) sees no CUDA device"
    if importlib.util.find_spec("cupy") is None:
        return f"{NEEDS_GPU}: cupy is not installed"
    return None


def require_cuda(what: str) -> None:
    """Raise :class:`CudaUnavailable` naming ``what`` unless the GPU path can run here.

    Args:
        what: the operation, e.g. ``"CudaKVPool"``, used as the message's subject.
    """
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise CudaUnavailable(f"{what} {reason}")


def cupy_module() -> Any:
    """Import and return cupy.

    Raises:
        CudaUnavailable: cupy is missing, or installed but does not load (e.g. built for
            another CUDA major version than the driver's).
    """
    try:
        import cupy
    except ImportError as err:
        raise CudaUnavailable(f"{NEEDS_GPU}: cupy does not import: {err}") from err
    return cupy


def cuda_error_types() -> tuple[type[BaseException], ...]:
    """The exception types cupy's runtime wrappers raise.

    Raises:
        CudaUnavailable: cupy does not import.
    """
    cupy = cupy_module()
    return (cupy.cuda.runtime.CUDARuntimeError,)


def ordinal_of(device: torch.device | int | str) -> int:
    """The CUDA ordinal (in this process) of ``device``; ``"cuda"`` means the current device.

    Raises:
        CudaIpcError: ``device`` is not a CUDA device.
    """
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise CudaIpcError(f"device must be a CUDA device, got {dev}")
    return torch.cuda.current_device() if dev.index is None else int(dev.index)
