"""The DMA copy path's CPU-side glue: torch views of strided engine memory → regions → copies.

No GPU here, so the one thing that cannot run, CuPy's ``cudaMemcpyAsync`` binding, is replaced by
a stand-in that says what it is (``FakeRuntime``: a ``memmove`` between host addresses, recording
its calls). Everything else is the real code: :class:`DeviceBuffer` reading a torch tensor's
strides, :func:`plan_segments`, :func:`plan_rows`, :func:`issue_rows` and its argument order. The same paths on
a GPU are in ``tests/cuda/test_cuda_dma.py``.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvtier.kernels.cuda_buffers import DeviceBuffer
from kvtier.kernels.cuda_dma import check_mode, issue_rows, use_device
from kvtier.kernels.cuda_kernel import cupy_stream
from kvtier.kernels.cuda_plan import CudaCopyPlan
from kvtier.kernels.cuda_segments import plan_rows, plan_segments
from kvtier.kernels.plan import PageCopyError, PagePlan

CPU = torch.device("cpu")
P, HEADS, BLOCK, DIM = 12, 2, 4, 8  # fp16 pages: 2 * 4 * 8 * 2 = 128 bytes per K or V
CHUNK = HEADS * BLOCK * DIM * 2


class FakeRuntime:
    """A stand-in for ``cupy.cuda.runtime`` (no GPU here): its copies are host ``memmove``s."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.calls: list[tuple[int, int, int, int, int]] = []
        self.calls_2d: list[tuple[int, int, int, int, int, int, int, int]] = []
        self.set_devices: list[int] = []

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self.calls.append((dst, src, size, kind, stream))
        ctypes.memmove(dst, src, size)

    def memcpy2DAsync(
        self,
        dst: int,
        dpitch: int,
        src: int,
        spitch: int,
        width: int,
        height: int,
        kind: int,
        stream: int,
    ) -> None:
        self.calls_2d.append((dst, dpitch, src, spitch, width, height, kind, stream))
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    def getDevice(self) -> int:
        return self.device

    def setDevice(self, index: int) -> None:
        self.set_devices.append(index)
        self.device = index


def _fake_cupy(runtime: FakeRuntime) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))


def _hnd_storage(gen: torch.Generator) -> torch.Tensor:
    """vLLM's HND / FlashInfer memory for one layer: ``[num_blocks, 2, heads, block, dim]``."""
    raw = torch.randint(0, 256, (P * 2 * CHUNK,), dtype=torch.uint8, generator=gen)
    return raw.view(torch.float16).view(P, 2, HEADS, BLOCK, DIM)


def _copy(
    plan: PagePlan, bufs: list[torch.Tensor], arena: torch.Tensor, *, to_host: bool
) -> FakeRuntime:
    """What ``CudaCopyPlan`` does in dma mode for one layer, on host memory."""
    views = [DeviceBuffer.of(b, f"engine_bufs[0][{c}]", CPU) for c, b in enumerate(bufs)]
    segments = plan_segments(
        plan,
        [v.region for v in views],
        [c * CHUNK for c in range(len(views))],
        arena_nbytes=arena.numel(),
        to_host=to_host,
    )
    runtime = FakeRuntime()
    issue_rows(
        _fake_cupy(runtime),
        plan_rows(segments),
        engine_base=0,
        host_base=arena.data_ptr(),
        stream=77,
    )
    return runtime


@pytest.mark.parametrize("permuted", [False, True], ids=["hnd", "nhd-view-of-hnd"])
def test_store_and_load_of_a_strided_hnd_layer_through_torch_views(permuted: bool) -> None:
    gen = torch.Generator().manual_seed(38)
    storage = _hnd_storage(gen)
    k, v = storage[:, 0], storage[:, 1]
    if permuted:  # the logical [blocks, block_size, heads, dim] view of the same memory
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    pages = np.array([7, 2, 3, 4, 11], dtype=np.int64)
    slots = np.array([0, 5, 6, 7, 2], dtype=np.int64)
    plan = PagePlan.build(pages, slots * 2 * CHUNK, CHUNK, slot_bytes=2 * CHUNK)
    fill = torch.randint(0, 256, (8 * 2 * CHUNK,), dtype=torch.uint8, generator=gen)

    expected = fill.clone()
    physical = storage.view(torch.uint8).reshape(P, 2 * CHUNK)  # K then V of each block
    for page, slot in zip(pages.tolist(), slots.tolist()):
        expected[slot * 2 * CHUNK : (slot + 1) * 2 * CHUNK] = physical[page]
    before = storage.clone()
    arena = fill.clone()
    runtime = _copy(plan, [k, v], arena, to_host=True)
    assert torch.equal(arena, expected)
    assert torch.equal(storage.view(torch.uint8), before.view(torch.uint8))  # read only
    # K and V of a block are side by side in both places, and blocks 2-4 go to slots 5-7:
    # one copy for blocks 2-4, one each for blocks 7 and 11, all on the caller's stream
    assert sorted(size for _, _, size, _, _ in runtime.calls) == [2 * CHUNK, 2 * CHUNK, 6 * CHUNK]
    assert {(kind, stream) for _, _, _, kind, stream in runtime.calls} == {(4, 77)}

    source = torch.randint(0, 256, arena.shape, dtype=torch.uint8, generator=gen)
    want = before.view(torch.uint8).reshape(P, 2 * CHUNK).clone()
    for page, slot in zip(pages.tolist(), slots.tolist()):
        want[page] = source[slot * 2 * CHUNK : (slot + 1) * 2 * CHUNK]
    source_before = source.clone()
    _copy(plan, [k, v], source, to_host=False)
    assert torch.equal(source, source_before)  # a load reads the arena only
    assert torch.equal(storage.view(torch.uint8).reshape(P, 2 * CHUNK), want)  # others untouched


def test_a_region_as_a_strided_uint8_view_copies_the_described_bytes() -> None:
    gen = torch.Generator().manual_seed(5)
    segment = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    offset, stride, nbytes = 40, 96, 72  # a region (offset, page_stride, page_bytes)
    view = torch.as_strided(segment, (30, nbytes), (stride, 1), storage_offset=offset)
    pages = np.array([29, 0, 1, 2, 17], dtype=np.int64)
    slots = np.arange(5, dtype=np.int64) * nbytes
    plan = PagePlan.build(pages, slots, nbytes)
    expected = torch.cat([segment[offset + p * stride :][:nbytes] for p in pages.tolist()])
    arena = torch.zeros(5 * nbytes, dtype=torch.uint8)
    _copy(plan, [view], arena, to_host=True)
    assert torch.equal(arena, expected)


def test_one_layer_of_consecutive_pages_is_one_2d_copy_per_buffer() -> None:
    gen = torch.Generator().manual_seed(9)
    bufs = [
        [torch.randint(0, 256, (P, 64), dtype=torch.uint8, generator=gen) for _ in range(2)]
        for _ in range(2)
    ]
    slot_bytes = 4 * 64  # 2 layers x (K, V)
    pages = np.arange(3, 9, dtype=np.int64)
    plan = PagePlan.build(
        pages, np.arange(6, dtype=np.int64) * slot_bytes, 64, slot_bytes=slot_bytes
    )
    arena = torch.zeros(6 * slot_bytes, dtype=torch.uint8)
    views = [DeviceBuffer.of(b, f"engine_bufs[1][{c}]", CPU) for c, b in enumerate(bufs[1])]
    segments = plan_segments(
        plan, [v.region for v in views], [128, 192], arena_nbytes=arena.numel(), to_host=True
    )
    runtime = FakeRuntime()
    issue_rows(
        _fake_cupy(runtime),
        plan_rows(segments),
        engine_base=0,
        host_base=arena.data_ptr(),
        stream=5,
    )
    assert runtime.calls == []
    assert [
        (w, h, sp, dp, kind, stream) for _, dp, _, sp, w, h, kind, stream in runtime.calls_2d
    ] == [(64, 6, 64, slot_bytes, 4, 5)] * 2
    slots = arena.view(6, 4, 64)
    assert torch.equal(slots[:, 2], bufs[1][0][3:9]) and torch.equal(slots[:, 3], bufs[1][1][3:9])
    assert int(slots[:, :2].count_nonzero()) == 0  # layer 0's parts untouched


def test_device_buffer_reads_strides_and_refuses_what_is_not_pages() -> None:
    storage = torch.zeros((P, 2, HEADS, BLOCK, DIM), dtype=torch.float16)
    view = DeviceBuffer.of(storage[:, 1].permute(0, 2, 1, 3), "v", CPU)
    assert (view.num_pages, view.row_bytes, view.page_stride) == (P, CHUNK, 2 * CHUNK)
    assert view.address == storage.data_ptr() + CHUNK
    assert DeviceBuffer.of(storage, "kv", CPU).page_stride == 2 * CHUNK
    with pytest.raises(PageCopyError, match=r"k's pages must each be one dense range of bytes"):
        DeviceBuffer.of(storage[:, 0, :, :, ::2], "k", CPU)
    squeezed = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(
        PageCopyError, match=r"b's pages overlap: they lie 8 bytes apart and hold 16"
    ):
        DeviceBuffer.of(torch.as_strided(squeezed, (4, 16), (8, 1)), "b", CPU)
    with pytest.raises(PageCopyError, match=r"must be on cuda:0, got device cpu"):
        DeviceBuffer.of(storage, "kv", torch.device("cuda", 0))


def test_use_device_sets_only_when_another_is_current() -> None:
    runtime = FakeRuntime(device=1)
    use_device(_fake_cupy(runtime), 1)
    assert runtime.set_devices == []
    use_device(_fake_cupy(runtime), 0)
    assert runtime.set_devices == [0]


def test_an_unknown_mode_is_refused_naming_it() -> None:
    assert check_mode("dma") == "dma" and check_mode("kernel") == "kernel"
    with pytest.raises(PageCopyError, match=r"mode must be one of \['dma', 'kernel'\], got 'fast'"):
        CudaCopyPlan.build(
            np.array([0]),
            np.array([0]),
            16,
            device=0,
            mode="fast",  # type: ignore[arg-type]
        )


def test_cupy_stream_wraps_the_handle_by_the_stream_protocol_where_cupy_has_it() -> None:
    """CuPy 14 deprecates ``ExternalStream`` for ``Stream.from_external`` (the CUDA stream
    protocol); older CuPy has only ``ExternalStream``. Stand-ins for both (no CuPy here)."""
    wrapped: list[object] = []

    class NewStream:
        @staticmethod
        def from_external(obj: object) -> str:
            wrapped.append(obj.__cuda_stream__())  # type: ignore[attr-defined]
            return "from_external"

    new = SimpleNamespace(cuda=SimpleNamespace(Stream=NewStream))
    assert cupy_stream(new, 0xFFFF_0000_1234, 3) == "from_external"
    assert wrapped == [(0, 0xFFFF_0000_1234)]

    class OldStream:
        pass

    old = SimpleNamespace(
        cuda=SimpleNamespace(Stream=OldStream, ExternalStream=lambda h, d: ("external", h, d))
    )
    assert cupy_stream(old, 77, 1) == ("external", 77, 1)
