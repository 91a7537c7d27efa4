"""The CUDA page-copy kernel: its source, its compilation per device and word width, its launch.

One launch copies ``n`` chunks of ``chunk_bytes`` each: chunk ``i`` goes from
``src + src_off[i]`` to ``dst + dst_off[i]``, the two offsets read from int64 device arrays
(built once per transfer by :class:`~kvtier.kernels.cuda_plan.CudaCopyPlan`). Block ``(x, y)``
of the grid copies segment ``y`` of chunk ``x``. Each thread moves ``UNROLL`` words with all
loads issued before the stores, so many loads are in flight over PCIe. The word is the widest of
16 (``uint4``), 8, 4, 2 or 1 bytes that divides the chunk size and aligns every address of the
launch, so the usual layouts move 16 bytes per thread access.

cupy is imported on first use, so this module imports on machines with neither cupy nor a GPU;
a call there raises :class:`CudaCopyUnavailable`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from kvtier.config.errors import KvtierError
from kvtier.kernels.cuda_dma import use_device

__all__ = [
    "CudaCopyUnavailable",
    "alignment_of_offsets",
    "cupy_stream",
    "import_cupy",
    "launch_copy",
    "require_cuda",
]

_THREADS = 256
_UNROLL = 4
_WORDS_PER_BLOCK = _THREADS * _UNROLL * 2
"""Words one block copies (32 KiB with 16-byte words): a 128 KiB chunk spreads over 4 blocks."""
_MAX_GRID_Y = 65535
_WIDTHS = (16, 8, 4, 2, 1)

# KVTIER_UNROLL and KVTIER_THREADS come in as -D compiler options.
_SOURCE = r"""
template <typename T>
__device__ __forceinline__ void kvtier_copy_chunks(
    unsigned long long src_base, unsigned long long dst_base,
    const long long* __restrict__ src_off, const long long* __restrict__ dst_off,
    long long words, long long words_per_block) {
  const long long chunk = blockIdx.x;
  const T* __restrict__ src = reinterpret_cast<const T*>(src_base + src_off[chunk]);
  T* __restrict__ dst = reinterpret_cast<T*>(dst_base + dst_off[chunk]);
  const long long begin = (long long)blockIdx.y * words_per_block;
  const long long stop = begin + words_per_block;
  const long long end = stop < words ? stop : words;
  const long long step = (long long)blockDim.x * KVTIER_UNROLL;
  for (long long first = begin + threadIdx.x; first < end; first += step) {
    T v[KVTIER_UNROLL];
#pragma unroll
    for (int u = 0; u < KVTIER_UNROLL; ++u) {
      const long long i = first + (long long)u * blockDim.x;
      if (i < end) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < KVTIER_UNROLL; ++u) {
      const long long i = first + (long long)u * blockDim.x;
      if (i < end) dst[i] = v[u];
    }
  }
}

#define KVTIER_COPY_KERNEL(NAME, T)                                                     \
  extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(                  \
      unsigned long long src_base, unsigned long long dst_base,                         \
      unsigned long long src_off, unsigned long long dst_off,                           \
      long long words, long long words_per_block) {                                     \
    kvtier_copy_chunks<T>(src_base, dst_base,                                           \
                          reinterpret_cast<const long long*>(src_off),                  \
                          reinterpret_cast<const long long*>(dst_off),                  \
                          words, words_per_block);                                      \
  }

KVTIER_COPY_KERNEL(kvtier_copy_w16, uint4)
KVTIER_COPY_KERNEL(kvtier_copy_w8, unsigned long long)
KVTIER_COPY_KERNEL(kvtier_copy_w4, unsigned int)
KVTIER_COPY_KERNEL(kvtier_copy_w2, unsigned short)
KVTIER_COPY_KERNEL(kvtier_copy_w1, unsigned char)
"""


class CudaCopyUnavailable(KvtierError, RuntimeError):
    """The CUDA copies were called where cupy or an NVIDIA GPU is missing."""


def import_cupy() -> Any:
    """Import cupy.

    Returns:
        The cupy module.

    Raises:
        CudaCopyUnavailable: cupy is not installed.
    """
    try:
        import cupy
    except ImportError as err:
        raise CudaCopyUnavailable(
            "kvtier.kernels.cuda_copy needs cupy (pip install 'kvtier[cuda]') and an NVIDIA GPU"
        ) from err
    return cupy


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(cupy: Any, handle: int, device: int) -> Any:
    """A CuPy stream object for the existing CUDA stream ``handle`` of GPU ``device``, to use
    as a context manager around launches; CuPy neither owns nor destroys the stream.

    CuPy 14 and later wrap it with ``Stream.from_external`` (``ExternalStream`` is deprecated
    there); earlier releases only have ``ExternalStream``.
    """
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, device)


def require_cuda() -> None:
    """Check that the CUDA copies can run here.

    Raises:
        CudaCopyUnavailable: torch sees no GPU, or cupy does not import.
    """
    if not torch.cuda.is_available():
        raise CudaCopyUnavailable(
            "kvtier.kernels.cuda_copy needs an NVIDIA GPU visible to torch and cupy; torch sees "
            "no CUDA device"
        )
    import_cupy()


@functools.cache
def _kernel(device_index: int, width: int) -> Any:
    """The compiled copy kernel for ``width``-byte words on one device (compiled once)."""
    cupy = import_cupy()
    use_device(cupy, device_index)  # not cupy.cuda.Device: its exit may touch device 0
    options = ("--std=c++14", f"-DKVTIER_UNROLL={_UNROLL}", f"-DKVTIER_THREADS={_THREADS}")
    module = cupy.RawModule(code=_SOURCE, options=options)
    return module.get_function(f"kvtier_copy_w{width}")


def _alignment(value: int) -> int:
    """The largest of the copy widths that divides ``value``."""
    return next(w for w in _WIDTHS if value % w == 0)


def alignment_of_offsets(offsets: npt.NDArray[np.int64]) -> int:
    """The largest copy width dividing every offset.

    Args:
        offsets: Byte offsets a launch adds to a base address.

    Returns:
        16, 8, 4, 2 or 1; 16 when there are no offsets.
    """
    if offsets.size == 0:
        return _WIDTHS[0]
    return _alignment(int(np.bitwise_or.reduce(offsets)) | _WIDTHS[0])


def launch_copy(
    device_index: int,
    *,
    n_chunks: int,
    chunk_bytes: int,
    src: int,
    dst: int,
    src_off: np.uint64,
    dst_off: np.uint64,
    offsets_align: int,
) -> None:
    """Launch one copy of ``n_chunks`` chunks on cupy's current stream; returns at once.

    Chunk ``i`` is copied from ``src + src_off[i]`` to ``dst + dst_off[i]``. The caller makes the
    device and the stream current and keeps both offset arrays alive until the copy has run.

    Args:
        device_index: The GPU (its kernels are compiled once per word width).
        n_chunks: Chunks to copy (the length of both offset arrays), > 0.
        chunk_bytes: Bytes per chunk.
        src: Device-visible base address of the source.
        dst: Device-visible base address of the destination.
        src_off: Device address of the source offsets, an int64 array.
        dst_off: Device address of the destination offsets, an int64 array.
        offsets_align: A copy width dividing every offset that is not a multiple of
            ``chunk_bytes`` (see :func:`alignment_of_offsets`).
    """
    width = min(_alignment(chunk_bytes), _alignment(src), _alignment(dst), offsets_align)
    words = chunk_bytes // width
    per_block = max(_WORDS_PER_BLOCK, -(-words // _MAX_GRID_Y))
    grid = (n_chunks, -(-words // per_block), 1)
    _kernel(device_index, width)(
        grid,
        (_THREADS, 1, 1),
        (
            np.uint64(src),
            np.uint64(dst),
            src_off,
            dst_off,
            np.int64(words),
            np.int64(per_block),
        ),
    )
