"""CUDA page copies (kvtier.kernels.cuda_copy) against the CPU reference on a small grid.

Skipped where there is no NVIDIA GPU or no cupy; the last test checks the error such a machine
gets instead.
"""

from __future__ import annotations

import importlib.util
import mmap
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from kvtier.kernels import cuda_copy, page_copy
from kvtier.kernels.page_copy import PageCopyError


def _gpu_and_cupy() -> bool:
    return importlib.util.find_spec("cupy") is not None and torch.cuda.is_available()


def needs_gpu(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test that runs on a GPU: skipped without one, and counted by `make gpu-check`."""
    skip = pytest.mark.skipif(not _gpu_and_cupy(), reason="needs an NVIDIA GPU and cupy")
    return pytest.mark.cuda(skip(test))  # type: ignore[no-any-return]


N_LAYERS = 3
NUM_PAGES = 40
NUM_SLOTS = 44

GEOMETRIES = [
    pytest.param(torch.float32, 2, 2, 8, id="fp32-128B"),  # 16-byte words
    pytest.param(torch.float16, 3, 1, 5, id="fp16-30B"),  # 2-byte words
    pytest.param(torch.bfloat16, 16, 8, 128, id="bf16-32KiB"),  # several blocks per chunk
    pytest.param(torch.uint8, 3, 1, 7, id="fp8-21B"),  # 1-byte words
    pytest.param(torch.uint8, 4, 1, 2, id="fp8-8B"),  # 8-byte words
]
ORDERS = ["consecutive", "reversed", "random", "mixed", "empty"]


def _indices(order: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if order == "consecutive":
        pages, slots = np.arange(3, 35), np.arange(5, 37)
    elif order == "reversed":
        pages, slots = np.arange(34, 2, -1), np.arange(36, 4, -1)
    elif order == "random":
        pages, slots = rng.permutation(NUM_PAGES)[:30], rng.permutation(NUM_SLOTS)[:30]
    elif order == "mixed":
        pages = np.concatenate([np.arange(0, 8), [20, 21], rng.permutation(np.arange(25, 40))])
        slots = np.concatenate([np.arange(10, 18), [2, 3], rng.permutation(np.arange(25, 40))])
    elif order == "empty":
        pages, slots = np.array([], dtype=np.int64), np.array([], dtype=np.int64)
    else:
        raise AssertionError(order)
    return pages.astype(np.int64), slots.astype(np.int64)


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


@pytest.fixture(params=["pin_memory", "host_register"])
def arena_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Arena:
    """A pinned host arena: a ``pin_memory()`` tensor or registered shared memory."""

    def __init__(self, nbytes: int, kind: str, fill: torch.Tensor) -> None:
        self.kind = kind
        self._mapping: mmap.mmap | None = None
        if kind == "pin_memory":
            self.tensor = fill.clone().pin_memory()
        else:
            import cupy

            self._mapping = mmap.mmap(-1, nbytes)
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
            self.tensor.copy_(fill)
            flags = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
            cupy.cuda.runtime.hostRegister(self.tensor.data_ptr(), nbytes, flags)

    def close(self) -> None:
        if self._mapping is not None:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.tensor.data_ptr())


@pytest.fixture
def make_arena(arena_kind: str) -> Iterator[object]:
    made: list[Arena] = []

    def make(fill: torch.Tensor) -> torch.Tensor:
        arena = Arena(fill.numel(), arena_kind, fill)
        made.append(arena)
        return arena.tensor

    yield make
    torch.cuda.synchronize()
    for arena in made:
        arena.close()


@needs_gpu
@pytest.mark.parametrize("n_comp", [2, 1], ids=["mha", "mla"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dtype", "page_size", "heads", "dim"), GEOMETRIES)
def test_cuda_matches_cpu_reference(
    dtype: torch.dtype,
    page_size: int,
    heads: int,
    dim: int,
    order: str,
    n_comp: int,
    make_arena: object,
) -> None:
    gen = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(11)
    shape = (NUM_PAGES, page_size, heads, dim)
    cpu_bufs = [[_random_bytes(shape, dtype, gen) for _ in range(n_comp)] for _ in range(N_LAYERS)]
    chunk = cpu_bufs[0][0][0].numel() * cpu_bufs[0][0].element_size()
    slot_bytes = N_LAYERS * n_comp * chunk
    base = 16
    cpu_arena = _random_bytes((base + NUM_SLOTS * slot_bytes,), torch.uint8, gen)
    pages, slots = _indices(order, rng)
    offsets = base + slots * slot_bytes
    stream = torch.cuda.Stream()

    # store: CPU reference vs CUDA
    expected_arena = cpu_arena.clone()
    page_copy.copy_layers_to_host(expected_arena, offsets, cpu_bufs, pages)
    gpu_bufs = [[b.cuda() for b in row] for row in cpu_bufs]
    arena = make_arena(cpu_arena)  # type: ignore[operator]
    cuda_copy.copy_layers_to_host(arena, offsets, gpu_bufs, pages, stream=stream)
    stream.synchronize()
    assert torch.equal(arena, expected_arena)

    # load: per layer through one plan, on the stream
    source = _random_bytes(tuple(cpu_arena.shape), torch.uint8, gen)
    expected_bufs = [[b.clone() for b in row] for row in cpu_bufs]
    page_copy.copy_layers_from_host(source, offsets, expected_bufs, pages)
    arena.copy_(source)
    plan = cuda_copy.CudaCopyPlan.build(
        pages, offsets, chunk, device=gpu_bufs[0][0].device, slot_bytes=slot_bytes, stream=stream
    )
    for layer in range(N_LAYERS):
        plan.layer_from_host(arena, gpu_bufs[layer], layer, stream=stream)
    stream.synchronize()
    for row_gpu, row_cpu in zip(gpu_bufs, expected_bufs):
        for g, c in zip(row_gpu, row_cpu):
            assert torch.equal(g.cpu().view(torch.uint8), c.view(torch.uint8))


@needs_gpu
def test_single_buffer_functions_and_default_stream(make_arena: object) -> None:
    gen = torch.Generator().manual_seed(12)
    cpu_buf = _random_bytes((NUM_PAGES, 16, 4, 64), torch.bfloat16, gen)
    chunk = cpu_buf[0].numel() * 2
    pages = np.random.default_rng(12).permutation(NUM_PAGES)[:20].astype(np.int64)
    offsets = (np.arange(20, dtype=np.int64) * 3 + 1) * 2 * chunk  # slots of 2 chunks, spaced out
    fill = _random_bytes((int(offsets.max()) + 2 * chunk,), torch.uint8, gen)
    expected = fill.clone()
    page_copy.copy_layer_to_host(expected, offsets, cpu_buf, pages, chunk)
    arena = make_arena(fill)  # type: ignore[operator]
    cuda_copy.copy_layer_to_host(arena, offsets, cpu_buf.cuda(), pages, chunk)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(arena, expected)

    back = torch.zeros_like(cpu_buf).cuda()
    cuda_copy.copy_layer_from_host(arena, offsets, back, pages, chunk)
    torch.cuda.current_stream().synchronize()
    # compared bit for bit: random bf16 bits hold NaNs, which torch.equal never calls equal
    picked = torch.from_numpy(pages)
    assert torch.equal(back.cpu()[picked].view(torch.int16), cpu_buf[picked].view(torch.int16))


@needs_gpu
def test_bad_input_raises_before_any_launch(make_arena: object) -> None:
    gen = torch.Generator().manual_seed(13)
    buf = _random_bytes((NUM_PAGES, 2, 2, 8), torch.float32, gen).cuda()
    chunk = 128
    fill = _random_bytes((NUM_SLOTS * chunk,), torch.uint8, gen)
    arena = make_arena(fill)  # type: ignore[operator]
    pages = np.array([0, NUM_PAGES], dtype=np.int64)
    offsets = np.array([0, chunk], dtype=np.int64)
    with pytest.raises(PageCopyError, match=rf"page_ids\[1\] = {NUM_PAGES} is out of range"):
        cuda_copy.copy_layer_to_host(arena, offsets, buf, pages, 0)
    with pytest.raises(PageCopyError, match="slot_offsets"):
        cuda_copy.copy_layer_to_host(
            arena, np.array([0, NUM_SLOTS * chunk]), buf, np.array([0, 1]), 0
        )
    with pytest.raises(PageCopyError, match="not pinned"):
        cuda_copy.copy_layer_to_host(fill.clone(), offsets[:1], buf, pages[:1], 0)
    with pytest.raises(PageCopyError, match="must be a CUDA tensor"):
        cuda_copy.copy_layer_to_host(arena, offsets[:1], buf.cpu(), pages[:1], 0)
    torch.cuda.synchronize()
    assert torch.equal(arena, fill)


@pytest.mark.skipif(_gpu_and_cupy(), reason="checks the error on machines without a GPU or cupy")
def test_without_gpu_or_cupy_calls_raise_a_clear_error() -> None:
    arena = torch.zeros(64, dtype=torch.uint8)
    bufs = [[torch.zeros((4, 16), dtype=torch.uint8)]]
    with pytest.raises(cuda_copy.CudaCopyUnavailable, match="cupy"):
        cuda_copy.copy_layers_to_host(arena, np.array([0]), bufs, np.array([1]))
