"""CudaRegionMemory's checks of an engine's own KV views, and the regions it exports.

The CUDA calls are the FAKE backend of :mod:`tests.fake_cuda` (this machine has no GPU): its
"device memory" is host memory in a file. What is tested is kvtier's own logic: which views
are accepted, and the segments and regions they become. The round trip through a real kvtierd
is ``tests/integration/test_cuda_session_fake.py``; on a GPU, ``tests/cuda/test_cuda_ipc.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvtier.client.kv_pool.cuda_regions import CudaRegionMemory
from kvtier.ipc import protocol as P
from kvtier.ipc.cuda_ipc import CudaIpcError

from tests.fake_cuda import FakeCuda

G = P.Geometry(num_layers=2, page_size=4, kv_heads=2, head_dim=8, dtype="bfloat16")
CHUNK = G.chunk_bytes  # 128 bytes
PAGES = 6


@pytest.fixture
def fake(short_tmp: Path) -> FakeCuda:
    return FakeCuda(short_tmp / "fc")


def _hnd(fake: FakeCuda, pages: int = PAGES) -> tuple[list, list[torch.Tensor]]:
    allocs = [fake.allocate(pages * 2 * CHUNK, 0) for _ in range(G.num_layers)]
    views = [flat.view(pages, 2, CHUNK) for flat, _ in allocs]
    return allocs, [v[:, c] for v in views for c in range(2)]


def test_one_allocation_per_layer_becomes_one_segment_each_and_strided_regions(fake) -> None:
    allocs, buffers = _hnd(fake)
    m = CudaRegionMemory(G, PAGES, buffers, allocs, backend=fake)
    mem = m.export()
    assert mem.kind == "cuda_ipc" and mem.num_pages == PAGES and len(mem.segments) == 2
    assert [(r.segment, r.offset, r.page_stride, r.page_bytes, r.layer) for r in mem.regions] == [
        (0, 0, 2 * CHUNK, CHUNK, 0),
        (0, CHUNK, 2 * CHUNK, CHUNK, 0),
        (1, 0, 2 * CHUNK, CHUNK, 1),
        (1, CHUNK, 2 * CHUNK, CHUNK, 1),
    ]
    assert m.export() is mem  # made once, reused by re-registrations
    assert m.device == torch.device("cuda", 0)


def test_views_into_one_allocation_share_its_segment_at_their_offsets(fake) -> None:
    flat, path = fake.allocate(G.num_layers * PAGES * 2 * CHUNK + 64, 0)
    body = flat[64:].view(G.num_layers, PAGES, 2, CHUNK)  # a header, then every layer
    buffers = [body[layer, :, c] for layer in range(G.num_layers) for c in range(2)]
    mem = CudaRegionMemory(G, PAGES, buffers, [(flat, path)], backend=fake).export()
    assert len(mem.segments) == 1
    layer_bytes = PAGES * 2 * CHUNK
    assert [r.offset for r in mem.regions] == [
        64,
        64 + CHUNK,
        64 + layer_bytes,
        64 + layer_bytes + CHUNK,
    ]


def test_bad_views_are_refused_naming_the_buffer(fake) -> None:
    allocs, buffers = _hnd(fake)

    def make(bufs: list, pages: int = PAGES) -> CudaRegionMemory:
        return CudaRegionMemory(G, pages, bufs, allocs, backend=fake)

    with pytest.raises(ValueError, match=r"3 buffers; the geometry needs .* 4 \(2 layers x 2\)"):
        make(buffers[:3])
    with pytest.raises(ValueError, match=r"buffers\[0\] holds 6 pages, fewer than 7"):
        make(buffers, pages=7)
    with pytest.raises(ValueError, match=r"num_pages must be a positive int, got 0"):
        make(buffers, pages=0)
    halves = [b[:, : CHUNK // 2] for b in buffers]
    with pytest.raises(ValueError, match=rf"buffers\[0\]: a page must be {CHUNK} contiguous bytes"):
        make(halves)
    scattered = [*buffers[:2], buffers[2].view(PAGES, 2, CHUNK // 2).transpose(1, 2), buffers[3]]
    with pytest.raises(ValueError, match=r"buffers\[2\]: a page must be .* contiguous"):
        make(scattered)
    flat = allocs[0][0]
    overlapping = [
        flat.as_strided((PAGES, CHUNK), (CHUNK // 2, 1)),  # each page half over the next
        *buffers[1:],
    ]
    with pytest.raises(ValueError, match=r"buffers\[0\]: pages 64 bytes apart overlap"):
        make(overlapping)
    with pytest.raises(ValueError, match=r"buffers\[0\] must be a tensor"):
        make(["not a tensor", *buffers[1:]])


def test_a_view_outside_every_allocation_is_refused_at_export(fake) -> None:
    allocs, buffers = _hnd(fake)
    other, _ = fake.allocate(PAGES * CHUNK, 0)
    m = CudaRegionMemory(G, PAGES, [other.view(PAGES, CHUNK), *buffers[1:]], allocs, backend=fake)
    with pytest.raises(ValueError, match=r"buffers\[0\] .* lies in none of the allocations"):
        m.export()


def test_a_closed_memory_cannot_be_exported(fake) -> None:
    allocs, buffers = _hnd(fake)
    with CudaRegionMemory(G, PAGES, buffers, allocs, backend=fake) as m:
        m.export()
    with pytest.raises(CudaIpcError, match="closed"):
        m.export()


def test_only_allocations_a_view_lies_in_are_exported_and_a_view_twice_is_refused(fake) -> None:
    allocs, buffers = _hnd(fake)
    unused = fake.allocate(4096, 0)
    mem = CudaRegionMemory(G, PAGES, buffers, [unused, *allocs], backend=fake).export()
    assert len(mem.segments) == 2 and not any(unused[1].name in s.name for s in mem.segments)
    assert [r.segment for r in mem.regions] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"buffers\[2\] is buffers\[0\] again"):
        CudaRegionMemory(
            G, PAGES, [buffers[0], buffers[1], buffers[0], buffers[3]], allocs, backend=fake
        )
