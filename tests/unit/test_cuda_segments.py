"""The DMA segment planner (kernels/cuda_segments.py) against a page-by-page numpy reference.

Segments are applied with numpy slices on small arrays and compared with a direct copy of each
page of each region; offsets above 4 GiB are checked on the offset arrays alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.kernels.cuda_segments import (
    MAX_PITCH,
    EngineRegion,
    Rows,
    Segments,
    default_part_offsets,
    plan_rows,
    plan_segments,
)
from kvtier.kernels.plan import PageCopyError, PagePlan

NUM_PAGES = 24
NUM_SLOTS = 30


def _apply(segments: Segments, engine: np.ndarray, arena: np.ndarray) -> None:
    """Move the bytes the segments describe, one numpy slice each."""
    src, dst = (engine, arena) if segments.to_host else (arena, engine)
    for s, d, n in zip(segments.src.tolist(), segments.dst.tolist(), segments.nbytes.tolist()):
        dst[d : d + n] = src[s : s + n]


def _apply_rows(rows: Rows, engine: np.ndarray, arena: np.ndarray) -> None:
    """Move the bytes the 2-D copies describe, one numpy slice per row."""
    src, dst = (engine, arena) if rows.to_host else (arena, engine)
    for s, d, w, h, sp, dp in zip(
        rows.src.tolist(),
        rows.dst.tolist(),
        rows.width.tolist(),
        rows.height.tolist(),
        rows.src_pitch.tolist(),
        rows.dst_pitch.tolist(),
    ):
        assert w > 0 and h > 0 and sp >= w and dp >= w
        for k in range(h):
            dst[d + k * dp : d + k * dp + w] = src[s + k * sp : s + k * sp + w]


def _segments(src: list[int], dst: list[int], nbytes: list[int], to_host: bool = True) -> Segments:
    def arr(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return Segments(arr(src), arr(dst), arr(nbytes), to_host)


def _reference(
    plan: PagePlan,
    regions: list[EngineRegion],
    parts: list[int],
    engine: np.ndarray,
    arena: np.ndarray,
    *,
    to_host: bool,
) -> None:
    """Copy page by page, region by region: the definition the segments must match."""
    for region, part in zip(regions, parts):
        for page, slot in zip(plan.page_ids.tolist(), plan.slot_offsets.tolist()):
            e = region.offset + page * region.page_stride
            h = slot + part
            if to_host:
                arena[h : h + region.page_bytes] = engine[e : e + region.page_bytes]
            else:
                engine[e : e + region.page_bytes] = arena[h : h + region.page_bytes]


def _layer_first(n_layers: int, n_comp: int, chunk: int) -> list[EngineRegion]:
    """kvtier's own layout: one contiguous buffer per (layer, component), back to back."""
    return [
        EngineRegion(i * NUM_PAGES * chunk, chunk, chunk, NUM_PAGES)
        for i in range(n_layers * n_comp)
    ]


def _hnd(n_layers: int, chunk: int) -> list[EngineRegion]:
    """vLLM HND / FlashInfer: per layer, ``[num_blocks, 2, ...]``: K and V of a block side by side."""
    layer_bytes = NUM_PAGES * 2 * chunk
    return [
        EngineRegion(layer * layer_bytes + c * chunk, 2 * chunk, chunk, NUM_PAGES)
        for layer in range(n_layers)
        for c in range(2)
    ]


def _page_first(n_layers: int, chunk: int) -> list[EngineRegion]:
    """SGLang page_first: ``[num_pages, layers, 2, ...]``: every layer of a page together."""
    stride = n_layers * 2 * chunk
    return [
        EngineRegion((layer * 2 + c) * chunk, stride, chunk, NUM_PAGES)
        for layer in range(n_layers)
        for c in range(2)
    ]


def _padded(n_layers: int, chunk: int) -> list[EngineRegion]:
    """One buffer per layer whose pages are padded (stride larger than the page, odd sizes)."""
    stride = chunk + 24
    return [
        EngineRegion(layer * NUM_PAGES * stride + 8, stride, chunk, NUM_PAGES)
        for layer in range(n_layers)
    ]


LAYOUTS = {
    "layer_first_mha": lambda: _layer_first(3, 2, 48),
    "layer_first_mla": lambda: _layer_first(2, 1, 40),
    "hnd": lambda: _hnd(3, 32),
    "page_first": lambda: _page_first(2, 24),
    "padded": lambda: _padded(3, 20),
}


def _indices(order: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Page ids and slot indices of one transfer."""
    if order == "consecutive":
        pages, slots = np.arange(2, 20), np.arange(5, 23)
    elif order == "reversed":
        pages, slots = np.arange(19, 1, -1), np.arange(22, 4, -1)
    elif order == "random":
        pages, slots = rng.permutation(NUM_PAGES)[:17], rng.permutation(NUM_SLOTS)[:17]
    elif order == "mixed":
        pages = np.concatenate([np.arange(0, 6), [9, 10], rng.permutation(np.arange(12, 24))])
        slots = np.concatenate([np.arange(20, 26), [1, 3], rng.permutation(np.arange(6, 18))])
    else:
        raise AssertionError(order)
    return pages.astype(np.int64), slots.astype(np.int64)


def _engine_bytes(regions: list[EngineRegion]) -> int:
    return max(g.offset + (g.num_pages - 1) * g.page_stride + g.page_bytes for g in regions)


@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("order", ["consecutive", "reversed", "random", "mixed"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_segments_match_the_page_by_page_copy(layout: str, order: str, to_host: bool) -> None:
    rng = np.random.default_rng(38)
    regions = LAYOUTS[layout]()
    parts = default_part_offsets(regions)
    slot_bytes = sum(g.page_bytes for g in regions)
    pages, slots = _indices(order, rng)
    base = 16
    plan = PagePlan.build(
        pages, base + slots * slot_bytes, regions[0].page_bytes, slot_bytes=slot_bytes
    )
    engine = rng.integers(0, 256, _engine_bytes(regions) + 32, dtype=np.uint8)
    arena = rng.integers(0, 256, base + NUM_SLOTS * slot_bytes + 7, dtype=np.uint8)

    segments = plan_segments(plan, regions, arena_nbytes=arena.size, to_host=to_host)
    rows = plan_rows(segments)
    got_engine, got_arena = engine.copy(), arena.copy()
    _apply(segments, got_engine, got_arena)
    rows_engine, rows_arena = engine.copy(), arena.copy()
    _apply_rows(rows, rows_engine, rows_arena)
    _reference(plan, regions, parts, engine, arena, to_host=to_host)
    assert np.array_equal(got_engine, engine)
    assert np.array_equal(got_arena, arena)
    assert np.array_equal(rows_engine, engine)
    assert np.array_equal(rows_arena, arena)
    assert rows.total_bytes == segments.total_bytes
    assert len(rows) <= len(segments)
    assert segments.total_bytes == len(plan) * slot_bytes
    assert segments.src.dtype == segments.dst.dtype == segments.nbytes.dtype == np.int64
    assert np.all(np.diff(segments.src) > 0)


@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
def test_one_layer_of_a_full_page_copies_only_its_part(to_host: bool) -> None:
    """Layer-wise steps: each layer's regions with their own part offsets; others untouched."""
    rng = np.random.default_rng(7)
    regions = _page_first(3, 16)
    parts = default_part_offsets(regions)
    slot_bytes = sum(g.page_bytes for g in regions)
    pages, slots = _indices("random", rng)
    plan = PagePlan.build(pages, slots * slot_bytes, 16, slot_bytes=slot_bytes)
    engine = rng.integers(0, 256, _engine_bytes(regions), dtype=np.uint8)
    arena = rng.integers(0, 256, NUM_SLOTS * slot_bytes, dtype=np.uint8)
    layer = slice(2, 4)
    segments = plan_segments(
        plan, regions[layer], parts[layer], arena_nbytes=arena.size, to_host=to_host
    )
    got_engine, got_arena = engine.copy(), arena.copy()
    _apply(segments, got_engine, got_arena)
    _reference(plan, regions[layer], parts[layer], engine, arena, to_host=to_host)
    assert np.array_equal(got_engine, engine) and np.array_equal(got_arena, arena)


def test_consecutive_pages_and_slots_of_a_contiguous_region_are_one_copy() -> None:
    chunk = 64
    regions = [EngineRegion(0, chunk, chunk, NUM_PAGES)]
    plan = PagePlan.build(np.arange(3, 13), np.arange(10) * chunk + 128, chunk)
    segments = plan_segments(plan, regions, arena_nbytes=4096, to_host=True)
    assert segments.src.tolist() == [3 * chunk]
    assert segments.dst.tolist() == [128]
    assert segments.nbytes.tolist() == [10 * chunk]


def test_runs_break_where_either_side_stops_being_contiguous() -> None:
    chunk = 32
    regions = [EngineRegion(0, chunk, chunk, NUM_PAGES)]
    # pages 0-2 into slots 0-2 (one run), page 3 into slot 5 (host gap), pages 5-6 into 6-7
    pages = np.array([6, 0, 1, 2, 3, 5], dtype=np.int64)
    slots = np.array([7, 0, 1, 2, 5, 6], dtype=np.int64)
    plan = PagePlan.build(pages, slots * chunk, chunk)
    segments = plan_segments(plan, regions, arena_nbytes=NUM_SLOTS * chunk, to_host=False)
    # a load: sources are arena offsets, ascending
    assert segments.src.tolist() == [0, 5 * chunk, 6 * chunk]
    assert segments.dst.tolist() == [0, 3 * chunk, 5 * chunk]
    assert segments.nbytes.tolist() == [3 * chunk, chunk, 2 * chunk]


def test_k_and_v_side_by_side_on_both_sides_merge_into_one_copy_per_page() -> None:
    chunk = 32
    regions = _hnd(1, chunk)
    slot_bytes = 2 * chunk
    plan = PagePlan.build(
        np.array([4, 9], dtype=np.int64),
        np.array([0, 5]) * slot_bytes,
        chunk,
        slot_bytes=slot_bytes,
    )
    segments = plan_segments(plan, regions, arena_nbytes=10 * slot_bytes, to_host=True)
    assert segments.src.tolist() == [4 * slot_bytes, 9 * slot_bytes]
    assert segments.dst.tolist() == [0, 5 * slot_bytes]
    assert segments.nbytes.tolist() == [slot_bytes, slot_bytes]


@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
def test_one_layer_of_consecutive_pages_into_page_major_slots_is_one_2d_copy_per_buffer(
    to_host: bool,
) -> None:
    chunk, n_layers = 48, 3
    regions = _layer_first(n_layers, 2, chunk)
    slot_bytes = n_layers * 2 * chunk
    plan = PagePlan.build(
        np.arange(2, 20), np.arange(5, 23) * slot_bytes, chunk, slot_bytes=slot_bytes
    )
    layer = slice(2, 4)  # layer 1's K and V
    parts = default_part_offsets(regions)[layer]
    segments = plan_segments(
        plan, regions[layer], parts, arena_nbytes=NUM_SLOTS * slot_bytes, to_host=to_host
    )
    assert len(segments) == 2 * 18  # a slot apart on the host: no 1-D merging
    rows = plan_rows(segments)
    engine_first = [regions[2].offset + 2 * chunk, regions[3].offset + 2 * chunk]
    host_first = [5 * slot_bytes + parts[0], 5 * slot_bytes + parts[1]]
    src, dst = (engine_first, host_first) if to_host else (host_first, engine_first)
    order = np.argsort(src)
    assert rows.src.tolist() == np.array(src)[order].tolist()
    assert rows.dst.tolist() == np.array(dst)[order].tolist()
    assert rows.height.tolist() == [18, 18]
    assert rows.width.tolist() == [chunk, chunk]
    engine_pitch, host_pitch = chunk, slot_bytes
    assert rows.src_pitch.tolist() == [engine_pitch if to_host else host_pitch] * 2
    assert rows.dst_pitch.tolist() == [host_pitch if to_host else engine_pitch] * 2


def test_touching_runs_with_different_steps_give_the_shared_copy_to_the_first() -> None:
    # steps of 10 for copies 0-3, then steps of 20 from copy 3 on: copy 3 belongs to both
    segments = _segments([0, 10, 20, 30, 50, 70, 90], [0, 10, 20, 30, 50, 70, 90], [5] * 7)
    rows = plan_rows(segments)
    assert rows.src.tolist() == [0, 50]
    assert rows.height.tolist() == [4, 3]
    assert rows.src_pitch.tolist() == [10, 20]
    assert rows.dst_pitch.tolist() == [10, 20]


def test_runs_shorter_than_three_copies_and_uneven_ones_stay_1d() -> None:
    rows = plan_rows(_segments([0, 10, 100, 200], [0, 10, 300, 310], [5, 5, 5, 5]))
    assert rows.height.tolist() == [1, 1, 1, 1]
    assert rows.src_pitch.tolist() == rows.width.tolist() == [5, 5, 5, 5]
    rows = plan_rows(_segments([0, 10, 20, 30], [0, 10, 20, 30], [5, 5, 6, 5]))
    assert rows.height.tolist() == [1, 1, 1, 1]
    # a store reading the same engine bytes into three parts: a pitch below the width (0 here)
    # is not a 2-D copy cudaMemcpy2DAsync accepts
    rows = plan_rows(_segments([0, 0, 0], [0, 8, 16], [8, 8, 8]))
    assert rows.height.tolist() == [1, 1, 1]
    far = MAX_PITCH + 1
    rows = plan_rows(_segments([0, far, 2 * far], [0, 8, 16], [8, 8, 8]))
    assert rows.height.tolist() == [1, 1, 1]
    rows = plan_rows(_segments([0, 8, 16], [0, 8, 16], [8, 8, 8]))  # 1-D neighbours: pitch = width
    assert rows.height.tolist() == [3] and rows.src_pitch.tolist() == [8]


def test_empty_transfer_has_no_segments() -> None:
    plan = PagePlan.build(np.empty(0, np.int64), np.empty(0, np.int64), 8)
    segments = plan_segments(plan, [EngineRegion(0, 8, 8, 4)], arena_nbytes=64, to_host=True)
    assert len(segments) == 0 and segments.total_bytes == 0
    assert len(plan_rows(segments)) == 0


# -- offsets past 4 GiB, on the arrays alone ---------------------------------------------------

GIB = 1 << 30


def test_offsets_above_4_gib_follow_the_formula_in_int64() -> None:
    """Buffers and an arena far larger than 4 GiB: no allocation, only the arithmetic."""
    chunk = 3 * (1 << 20) + 16  # not a power of two, so no wrap-around can look right by chance
    num_pages = 4096  # each region is > 12 GiB
    regions = [
        EngineRegion(c * (num_pages + 1) * chunk * 2, 2 * chunk, chunk, num_pages) for c in range(3)
    ]
    slot_bytes = 3 * chunk
    pages = np.array([num_pages - 1, 0, 2047, 1500, num_pages - 2], dtype=np.int64)
    slots = np.array([5000, 1, 1366, 4095, 5001], dtype=np.int64)
    plan = PagePlan.build(pages, slots * slot_bytes, chunk, slot_bytes=slot_bytes)
    arena_nbytes = 6000 * slot_bytes  # about 53 GiB
    store = plan_segments(plan, regions, arena_nbytes=arena_nbytes, to_host=True)
    load = plan_segments(plan, regions, arena_nbytes=arena_nbytes, to_host=False)

    expected = {
        (g.offset + p * g.page_stride, s * slot_bytes + r * chunk)
        for r, g in enumerate(regions)
        for p, s in zip(pages.tolist(), slots.tolist())
    }
    # consecutive pages 4094, 4095 into slots 5001, 5000: not contiguous, so nothing merges
    assert set(zip(store.src.tolist(), store.dst.tolist())) == expected
    assert set(zip(load.dst.tolist(), load.src.tolist())) == expected
    assert store.nbytes.tolist() == [chunk] * len(expected)
    assert int(store.src.max()) > 8 * (1 << 32) and int(store.dst.max()) > 8 * (1 << 32)
    for array in (store.src, store.dst, load.src, load.dst):
        assert array.dtype == np.int64
        assert not np.array_equal(array, array.astype(np.uint32).astype(np.int64))


def test_a_run_across_the_2_to_the_32_boundary_merges_without_wrapping() -> None:
    chunk = 1 << 20
    first = (1 << 32) // chunk - 2  # pages first .. first+3 straddle byte 2**32
    regions = [EngineRegion(0, chunk, chunk, first + 10)]
    pages = np.arange(first, first + 4, dtype=np.int64)
    offsets = (1 << 32) - chunk + np.arange(4, dtype=np.int64) * chunk
    plan = PagePlan.build(pages, offsets, chunk)
    segments = plan_segments(plan, regions, arena_nbytes=(1 << 33), to_host=True)
    assert segments.src.tolist() == [first * chunk]
    assert segments.dst.tolist() == [(1 << 32) - chunk]
    assert segments.nbytes.tolist() == [4 * chunk]
    src, dst = segments.addresses(engine_base=0x7F00_0000_0000, host_base=0x7E00_0000_0000)
    assert src.tolist() == [0x7F00_0000_0000 + first * chunk]
    assert dst.tolist() == [0x7E00_0000_0000 + (1 << 32) - chunk]


# -- bad input -------------------------------------------------------------------------------


def _small_plan(pages: list[int], slots: list[int], chunk: int = 16) -> PagePlan:
    return PagePlan.build(np.array(pages, np.int64), np.array(slots, np.int64) * chunk, chunk)


def test_page_id_past_a_region_is_refused_naming_it() -> None:
    plan = _small_plan([0, 4], [0, 1])
    regions = [EngineRegion(0, 16, 16, 8), EngineRegion(1024, 16, 16, 4)]
    with pytest.raises(PageCopyError, match=r"page_ids\[1\] = 4 is out of range for regions\[1\]"):
        plan_segments(plan, regions, [0, 0], arena_nbytes=1024, to_host=True)


def test_slot_past_the_arena_is_refused_naming_it() -> None:
    plan = _small_plan([0, 1], [0, 9])
    with pytest.raises(PageCopyError, match=r"slot_offsets\[1\] = 144 .* 128-byte arena"):
        plan_segments(plan, [EngineRegion(0, 16, 16, 8)], arena_nbytes=128, to_host=False)


def test_part_outside_the_slot_is_refused_naming_it() -> None:
    plan = _small_plan([0], [0])
    with pytest.raises(PageCopyError, match=r"part_offsets\[0\] = 8 puts a 16-byte chunk outside"):
        plan_segments(plan, [EngineRegion(0, 16, 16, 8)], [8], arena_nbytes=128, to_host=True)


@pytest.mark.parametrize(
    ("region", "message"),
    [
        (EngineRegion(-16, 16, 16, 8), r"regions\[0\]\.offset = -16 is out of range"),
        (
            EngineRegion(0, 8, 16, 8),
            r"regions\[0\]\.page_stride = 8 is smaller than its page_bytes = 16",
        ),
        (EngineRegion(0, 16, 0, 8), r"regions\[0\]\.page_bytes = 0 is out of range"),
        (EngineRegion(0, 16, 16, 0), r"regions\[0\]\.num_pages = 0 is out of range"),
        (EngineRegion(0, 1 << 61, 16, 8), r"regions\[0\] ends at byte"),
        (EngineRegion(0, 16, 16, True), r"regions\[0\]\.num_pages must be an int, got True"),
    ],
)
def test_bad_region_fields_are_refused_naming_them(region: EngineRegion, message: str) -> None:
    plan = _small_plan([0], [0])
    with pytest.raises(PageCopyError, match=message):
        plan_segments(plan, [region], arena_nbytes=128, to_host=True)


def test_engine_regions_that_overlap_are_refused_for_a_load() -> None:
    plan = _small_plan([2, 3], [0, 1], chunk=16)
    # region 1 starts 16 bytes into region 0: its page 2 is region 0's page 3
    regions = [EngineRegion(0, 16, 16, 8), EngineRegion(16, 16, 16, 8)]
    names = ["engine_bufs[0][0]", "engine_bufs[0][1]"]
    with pytest.raises(
        PageCopyError,
        match=r"engine_bufs\[0\]\[0\] page 3 and engine_bufs\[0\]\[1\] page 2 write the same "
        r"engine bytes at offset 48",
    ):
        plan_segments(plan, regions, [0, 0], arena_nbytes=1024, to_host=False, names=names)
    # a store only reads those engine bytes twice, into parts that do not overlap: allowed
    wide = PagePlan.build(np.array([2, 3]), np.array([0, 64]), 16, slot_bytes=32)
    store = plan_segments(wide, regions, [0, 16], arena_nbytes=1024, to_host=True, names=names)
    assert store.total_bytes == 64


def test_parts_that_overlap_in_a_slot_are_refused_for_a_store() -> None:
    plan = PagePlan.build(np.array([0, 1]), np.array([0, 64]), 16, slot_bytes=32)
    regions = [EngineRegion(0, 16, 16, 8), EngineRegion(512, 16, 16, 8)]
    with pytest.raises(PageCopyError, match=r"write the same arena bytes at offset"):
        plan_segments(plan, regions, [0, 8], arena_nbytes=1024, to_host=True)


def test_overlapping_or_negative_slots_are_refused_by_the_page_plan() -> None:
    with pytest.raises(
        PageCopyError, match=r"slot_offsets 0 and 8 are closer than slot_bytes = 16"
    ):
        PagePlan.build(np.array([0, 1]), np.array([0, 8]), 16)
    with pytest.raises(PageCopyError, match=r"slot_offsets\[1\] = -16 is out of range"):
        PagePlan.build(np.array([0, 1]), np.array([0, -16]), 16)


def test_counts_that_disagree_are_refused() -> None:
    plan = _small_plan([0], [0])
    with pytest.raises(PageCopyError, match="1 regions but 2 part_offsets"):
        plan_segments(plan, [EngineRegion(0, 16, 16, 8)], [0, 16], arena_nbytes=64, to_host=True)


def test_addresses_refuse_a_base_that_overflows() -> None:
    plan = _small_plan([1], [1])
    segments = plan_segments(plan, [EngineRegion(0, 16, 16, 8)], arena_nbytes=64, to_host=True)
    with pytest.raises(PageCopyError, match=r"src base .* past int64"):
        segments.addresses(engine_base=(1 << 63) - 8, host_base=0)
    with pytest.raises(PageCopyError, match="dst base must be a non-negative int"):
        segments.addresses(engine_base=0, host_base=-1)
