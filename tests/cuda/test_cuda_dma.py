"""GPU page copies in both modes (DMA, kernels) over strided layouts, against a page-by-page copy.

Each layout is one CUDA allocation viewed as ``engine_bufs[layer][component]`` the way an engine
lays its KV out (kvtier's layer_first, vLLM's HND / FlashInfer with K and V of a block side by
side, its logical view permuted over that memory, SGLang's page_first, padded pages). The
reference is computed on the CPU from the allocation's bytes and each region's
``(offset, page_stride, page_bytes)``, independently of the plan's code. Whole allocations and
whole arenas are compared, so pages and bytes the transfer does not name must stay unchanged.

Skipped where there is no NVIDIA GPU or no cupy (``make gpu-check`` runs them on a GPU).
"""

from __future__ import annotations

import importlib.util
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from kvtier.kernels import cuda_copy
from kvtier.kernels.plan import PageCopyError

MODES = ["dma", "kernel"]
NUM_PAGES = 24
NUM_SLOTS = 28
N_LAYERS = 2


def _gpu_and_cupy() -> bool:
    return importlib.util.find_spec("cupy") is not None and torch.cuda.is_available()


def needs_gpu(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test that runs on a GPU: skipped without one, and counted by `make gpu-check`."""
    skip = pytest.mark.skipif(not _gpu_and_cupy(), reason="needs an NVIDIA GPU and cupy")
    return pytest.mark.cuda(skip(test))  # type: ignore[no-any-return]


GEOMETRIES = [  # bytes per page of one buffer, and so the kernel's word width
    pytest.param(torch.float32, 2, 2, 8, id="fp32-128B"),  # 16-byte words
    pytest.param(torch.uint8, 4, 1, 2, id="u8-8B"),  # 8-byte words
    pytest.param(torch.float16, 1, 1, 2, id="fp16-4B"),  # 4-byte words
    pytest.param(torch.float16, 3, 1, 5, id="fp16-30B"),  # 2-byte words
    pytest.param(torch.uint8, 3, 1, 7, id="u8-21B"),  # 1-byte words
    pytest.param(torch.bfloat16, 16, 8, 128, id="bf16-32KiB"),  # several blocks per chunk
]
LAYOUTS = ["layer_first", "layer_first_mla", "hnd", "hnd_logical_view", "page_first", "padded"]


@dataclass
class Engine:
    """One CUDA allocation, the buffers viewed over it, and where each buffer's pages lie."""

    storage: torch.Tensor  # 1-D uint8 on the GPU
    bufs: list[list[torch.Tensor]]  # [layer][component]
    regions: list[tuple[int, int, int]]  # (offset, page_stride, page_bytes), layer-major
    chunk: int


def _engine(layout: str, dtype: torch.dtype, ps: int, heads: int, dim: int) -> Engine:
    itemsize = torch.empty((), dtype=dtype).element_size()
    chunk = ps * heads * dim * itemsize
    n_comp = 1 if layout == "layer_first_mla" else 2
    regions: list[tuple[int, int, int]] = []
    for layer in range(N_LAYERS):
        for c in range(n_comp):
            i = layer * n_comp + c
            if layout in ("layer_first", "layer_first_mla"):
                regions.append((i * NUM_PAGES * chunk, chunk, chunk))
            elif layout in ("hnd", "hnd_logical_view"):  # per layer [blocks, 2, heads, ps, dim]
                regions.append((layer * NUM_PAGES * 2 * chunk + c * chunk, 2 * chunk, chunk))
            elif layout == "page_first":  # [pages, layers, 2, ...]
                regions.append((i * chunk, N_LAYERS * n_comp * chunk, chunk))
            elif layout == "padded":  # pages 16 bytes apart beyond their size, 16 bytes in
                stride = chunk + 16
                regions.append((16 + i * NUM_PAGES * stride, stride, chunk))
            else:
                raise AssertionError(layout)
    total = max(o + (NUM_PAGES - 1) * s + b for o, s, b in regions) + 64
    gen = torch.Generator().manual_seed(len(layout) * 1000 + chunk)
    storage = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen).cuda()
    typed = storage[: total - total % itemsize].view(dtype)
    bufs: list[list[torch.Tensor]] = []
    for layer in range(N_LAYERS):
        row = []
        for c in range(n_comp):
            offset, stride, _ = regions[layer * n_comp + c]
            # hnd_logical_view: memory [heads, ps, dim] per page, viewed as [ps, heads, dim]
            logical = layout == "hnd_logical_view"
            inner = (dim, ps * dim, 1) if logical else (heads * dim, dim, 1)
            row.append(
                typed.as_strided(
                    (NUM_PAGES, ps, heads, dim),
                    (stride // itemsize, *inner),
                    offset // itemsize,
                )
            )
        bufs.append(row)
    return Engine(storage, bufs, regions, chunk)


def _indices(order: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(38)
    if order == "consecutive":
        pages, slots = np.arange(3, 20), np.arange(5, 22)
    else:
        pages = np.concatenate([np.arange(0, 5), rng.permutation(np.arange(8, NUM_PAGES))])
        slots = np.concatenate([np.arange(20, 25), rng.permutation(20)[:16]])
    return pages.astype(np.int64), slots.astype(np.int64)


class Arena:
    """A pinned host arena: a ``pin_memory()`` tensor or registered (mapped) anonymous memory."""

    def __init__(self, kind: str, fill: torch.Tensor) -> None:
        self._mapping: mmap.mmap | None = None
        if kind == "pin_memory":
            self.tensor = fill.clone().pin_memory()
        else:
            import cupy

            self._mapping = mmap.mmap(-1, fill.numel())
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
            self.tensor.copy_(fill)
            flags = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
            cupy.cuda.runtime.hostRegister(self.tensor.data_ptr(), fill.numel(), flags)

    def close(self) -> None:
        if self._mapping is not None:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.tensor.data_ptr())


@pytest.fixture(params=["pin_memory", "host_register"])
def make_arena(request: pytest.FixtureRequest) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    made: list[Arena] = []

    def make(fill: torch.Tensor) -> torch.Tensor:
        arena = Arena(str(request.param), fill)
        made.append(arena)
        return arena.tensor

    yield make
    torch.cuda.synchronize()
    for arena in made:
        arena.close()


@needs_gpu
@pytest.mark.parametrize("order", ["consecutive", "mixed"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "ps", "heads", "dim"), GEOMETRIES)
@pytest.mark.parametrize("mode", MODES)
def test_strided_layouts_match_the_page_by_page_copy(
    mode: str,
    dtype: torch.dtype,
    ps: int,
    heads: int,
    dim: int,
    layout: str,
    order: str,
    make_arena: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    engine = _engine(layout, dtype, ps, heads, dim)
    chunk, regions = engine.chunk, engine.regions
    slot_bytes = len(regions) * chunk
    base = 16
    pages, slots = _indices(order)
    offsets = base + slots * slot_bytes
    gen = torch.Generator().manual_seed(7)
    fill = torch.randint(
        0, 256, (base + NUM_SLOTS * slot_bytes + 5,), dtype=torch.uint8, generator=gen
    )
    stream = torch.cuda.Stream()
    plan = cuda_copy.CudaCopyPlan.build(
        pages,
        offsets,
        chunk,
        device=engine.storage.device,
        slot_bytes=slot_bytes,
        stream=stream,
        mode=mode,  # type: ignore[arg-type]
    )
    assert plan.mode == mode

    # store: every layer at once
    before = engine.storage.cpu()
    expected = fill.clone()
    for r, (offset, stride, nbytes) in enumerate(regions):
        for page, slot in zip(pages.tolist(), offsets.tolist()):
            at = offset + page * stride
            expected[slot + r * chunk : slot + r * chunk + nbytes] = before[at : at + nbytes]
    arena = make_arena(fill)
    plan.layers_to_host(arena, engine.bufs, stream=stream)
    stream.synchronize()
    assert torch.equal(arena, expected)
    assert torch.equal(engine.storage.cpu(), before)

    # load: layer by layer, into an engine whose other pages must stay as they are
    source = torch.randint(0, 256, tuple(fill.shape), dtype=torch.uint8, generator=gen)
    arena.copy_(source)
    want = before.clone()
    for r, (offset, stride, nbytes) in enumerate(regions):
        for page, slot in zip(pages.tolist(), offsets.tolist()):
            at = offset + page * stride
            want[at : at + nbytes] = source[slot + r * chunk : slot + r * chunk + nbytes]
    for layer in range(N_LAYERS):
        plan.layer_from_host(arena, engine.bufs[layer], layer, stream=stream)
    stream.synchronize()
    assert torch.equal(engine.storage.cpu(), want)
    assert torch.equal(arena, source)


@needs_gpu
@pytest.mark.parametrize("mode", MODES)
def test_slots_across_and_above_4_gib(mode: str) -> None:
    """A 4 GiB + pinned arena: slots straddling byte 2**32 and above it, untouched bytes kept."""
    import cupy

    chunk, n_comp = 4096 + 16, 2
    slot_bytes = n_comp * chunk

    nbytes = (1 << 32) + 16 * slot_bytes
    mapping = mmap.mmap(-1, nbytes)  # not pin_memory(): torch rounds pinned sizes up to 2**n
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    flags = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
    cupy.cuda.runtime.hostRegister(arena.data_ptr(), nbytes, flags)
    try:
        low, high = (1 << 32) - 4 * slot_bytes + 100, nbytes  # slot 3 straddles byte 2**32
        window = arena[low:high]
        window.fill_(0xAB)
        offsets = np.array([low + i * slot_bytes for i in (0, 3, 4, 5, 9, 15)], dtype=np.int64)
        pages = np.array([6, 0, 1, 2, 30, 17], dtype=np.int64)
        gen = torch.Generator().manual_seed(4)
        bufs = [
            [
                torch.randint(0, 256, (32, chunk), dtype=torch.uint8, generator=gen).cuda()
                for _ in range(n_comp)
            ]
        ]
        stream = torch.cuda.Stream()
        plan = cuda_copy.CudaCopyPlan.build(
            pages,
            offsets,
            chunk,
            device=bufs[0][0].device,
            slot_bytes=slot_bytes,
            stream=stream,
            mode=mode,  # type: ignore[arg-type]
        )
        plan.layers_to_host(arena, bufs, stream=stream)
        stream.synchronize()
        expected = torch.full((high - low,), 0xAB, dtype=torch.uint8)
        for page, offset in zip(pages.tolist(), offsets.tolist()):
            for c in range(n_comp):
                at = offset - low + c * chunk
                expected[at : at + chunk] = bufs[0][c][page].cpu()
        assert torch.equal(window, expected)

        back = [[torch.zeros_like(b) for b in bufs[0]]]
        plan.layers_from_host(arena, back, stream=stream)
        stream.synchronize()
        picked = torch.from_numpy(pages).cuda()
        for c in range(n_comp):
            assert torch.equal(back[0][c][picked], bufs[0][c][picked])
            untouched = torch.ones(32, dtype=torch.bool, device=picked.device)
            untouched[picked] = False
            assert int(back[0][c][untouched].count_nonzero()) == 0
    finally:
        torch.cuda.synchronize()
        cupy.cuda.runtime.hostUnregister(arena.data_ptr())


@needs_gpu
def test_dma_refuses_pageable_host_memory_and_overlapping_buffers() -> None:
    buf = torch.zeros((8, 64), dtype=torch.uint8, device="cuda")
    # two slots of two 64-byte chunks (a layer's two components) each
    pages, offsets = np.array([0, 1], dtype=np.int64), np.array([0, 128], dtype=np.int64)
    plan = cuda_copy.CudaCopyPlan.build(pages, offsets, 64, device=buf.device, slot_bytes=128)
    with pytest.raises(PageCopyError, match="not pinned"):
        plan.to_host(torch.zeros(256, dtype=torch.uint8), buf, 0)
    arena = torch.zeros(256, dtype=torch.uint8).pin_memory()
    # the same buffer as both components of a layer: a load would write its pages twice
    with pytest.raises(PageCopyError, match=r"write the same engine bytes"):
        plan.layer_from_host(arena, [buf, buf], 0)
    torch.cuda.synchronize()
    assert int(buf.count_nonzero()) == 0
