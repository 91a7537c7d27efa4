"""Page copies by the GPU's copy engines: ``cudaMemcpyAsync`` of planned byte segments.

The default way :class:`~kvtier.kernels.cuda_plan.CudaCopyPlan` moves pages. Why DMA rather than
copy kernels: kvtierd's kernels run in its own CUDA context, and kernels of different processes
(without MPS) are time-sliced on the GPU, so a daemon kernel copying layer ``i + 1`` would take
turns with the engine's attention kernels for layer ``i``. The copy engines are scheduled apart
from the compute units, so a DMA copy overlaps the engine's computing.

The copies are planned by :mod:`kvtier.kernels.cuda_segments`: byte segments merged wherever
pages continue one another on both sides, then grouped into 2-D copies where they repeat at a
fixed distance (consecutive pages into consecutive slots: a slot holds every layer of a page, so
one layer's parts lie a slot apart). Each is one ``cudaMemcpyAsync`` or ``cudaMemcpy2DAsync``
(kind ``cudaMemcpyDefault``: unified addressing tells host from device) on the caller's stream;
nothing here waits for the GPU. CuPy's runtime binding issues the calls:
``cupy.cuda.runtime.memcpyAsync`` and ``memcpy2DAsync`` exist in every CuPy release for CUDA 11
to 13. A batched copy (``cudaMemcpyBatchAsync``, CUDA 12.8+) is not
used: CuPy does not expose it and its C signature differs between CUDA 12.8 and 13, so calling it
through ``ctypes`` unverified could corrupt memory rather than fail.

The current device is set explicitly (``cudaSetDevice``) and left set: CuPy's ``Device`` context
manager switches back to the previous device on exit, which is device 0 on a thread that never
chose one, and creates a context there (hundreds of MiB on a GPU the daemon may not serve).
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias, get_args

from kvtier.kernels.cuda_segments import Rows
from kvtier.kernels.plan import PageCopyError

__all__ = ["CopyMode", "check_mode", "issue_rows", "use_device"]

CopyMode: TypeAlias = Literal["dma", "kernel"]
"""How a GPU transfer moves bytes: ``dma`` (copy engines, the default) or ``kernel`` (a copy
kernel of :mod:`kvtier.kernels.cuda_kernel` reading and writing mapped host memory)."""

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the pointers (unified addressing)


def check_mode(mode: object) -> CopyMode:
    """Return ``mode`` if it names a copy mode.

    Raises:
        PageCopyError: Any other value, named.
    """
    if mode not in get_args(CopyMode):
        raise PageCopyError(f"mode must be one of {list(get_args(CopyMode))}, got {mode!r}")
    return mode  # type: ignore[return-value]


def use_device(cupy: Any, index: int) -> None:
    """Make GPU ``index`` current on the calling thread, and leave it current.

    Args:
        cupy: The cupy module.
        index: The device ordinal in this process.
    """
    runtime = cupy.cuda.runtime
    if runtime.getDevice() != index:
        runtime.setDevice(index)


def issue_rows(cupy: Any, rows: Rows, *, engine_base: int, host_base: int, stream: int) -> None:
    """Enqueue the planned copies on ``stream``; returns without waiting.

    A copy of height 1 is one ``cudaMemcpyAsync``, a taller one one ``cudaMemcpy2DAsync``. The
    caller made the stream's device current (:func:`use_device`) and keeps both sides' memory
    alive and unchanged until the stream has run the copies. Host memory must be pinned
    (page-locked or ``cudaHostRegister``-ed), or the copies would not be asynchronous.

    Args:
        cupy: The cupy module.
        rows: The planned copies (offsets relative to the two bases).
        engine_base: Address the engine regions' offsets are relative to (0 when the regions
            hold absolute device addresses).
        host_base: Address of the host arena's first byte.
        stream: The raw ``cudaStream_t`` handle.
    """
    src, dst = rows.addresses(engine_base=engine_base, host_base=host_base)
    runtime = cupy.cuda.runtime
    memcpy, memcpy_2d = runtime.memcpyAsync, runtime.memcpy2DAsync
    for s, d, w, h, sp, dp in zip(
        src.tolist(),
        dst.tolist(),
        rows.width.tolist(),
        rows.height.tolist(),
        rows.src_pitch.tolist(),
        rows.dst_pitch.tolist(),
        strict=True,
    ):
        if h == 1:
            memcpy(d, s, w, _MEMCPY_DEFAULT, stream)
        else:
            memcpy_2d(d, dp, s, sp, w, h, _MEMCPY_DEFAULT, stream)
