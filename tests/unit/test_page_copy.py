"""Page copies (kvtier.kernels.page_copy) against a per-page reference on a small grid."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from kvtier.kernels.page_copy import (
    CopyPlan,
    PageCopyError,
    copy_layer_from_host,
    copy_layer_kv_from_host,
    copy_layer_kv_to_host,
    copy_layer_to_host,
    copy_layers_from_host,
    copy_layers_to_host,
)

N_LAYERS = 3
NUM_PAGES = 12
NUM_SLOTS = 14
ARENA_BASE = 5  # slots start at an odd byte: nothing may assume aligned offsets

# (dtype, page_size, kv_heads, head_dim): fp8 is raw bytes; several chunks are odd sizes.
GEOMETRIES = [
    pytest.param(torch.float32, 2, 2, 8, id="fp32-128B"),
    pytest.param(torch.float16, 3, 1, 5, id="fp16-30B"),
    pytest.param(torch.bfloat16, 4, 2, 4, id="bf16-64B"),
    pytest.param(torch.uint8, 3, 1, 7, id="fp8-21B"),
    pytest.param(torch.uint8, 1, 1, 1, id="fp8-1B"),
]

ORDERS = ["consecutive", "reversed", "random", "mixed", "slots_descending", "single", "empty"]


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (compared as bytes, so NaNs are harmless)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = int(np.prod(shape)) * itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _indices(order: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Page ids and slot indices for one ordering case."""
    if order == "consecutive":
        pages, slots = np.arange(2, 10), np.arange(3, 11)
    elif order == "reversed":
        pages, slots = np.arange(9, 1, -1), np.arange(10, 2, -1)
    elif order == "random":
        pages, slots = rng.permutation(NUM_PAGES)[:9], rng.permutation(NUM_SLOTS)[:9]
    elif order == "mixed":
        # a run of four, a run of two, three singles, given shuffled
        pages = np.array([0, 1, 2, 3, 6, 7, 9, 11, 5])
        slots = np.array([4, 5, 6, 7, 0, 1, 13, 2, 9])
        perm = rng.permutation(pages.size)
        pages, slots = pages[perm], slots[perm]
    elif order == "slots_descending":
        pages, slots = np.arange(1, 8), np.arange(12, 5, -1)
    elif order == "single":
        pages, slots = np.array([NUM_PAGES - 1]), np.array([NUM_SLOTS - 1])
    elif order == "empty":
        pages, slots = np.array([], dtype=np.int64), np.array([], dtype=np.int64)
    else:
        raise AssertionError(order)
    return pages.astype(np.int64), slots.astype(np.int64)


class Case:
    """Engine buffers, an arena and one transfer's index arrays."""

    def __init__(
        self, dtype: torch.dtype, geometry: tuple[int, int, int], n_comp: int, order: str, seed: int
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        shape = (NUM_PAGES, *geometry)
        self.bufs = [
            [_random_bytes(shape, dtype, gen) for _ in range(n_comp)] for _ in range(N_LAYERS)
        ]
        self.n_comp = n_comp
        self.chunk = self.bufs[0][0][0].numel() * self.bufs[0][0].element_size()
        self.slot_bytes = N_LAYERS * n_comp * self.chunk
        arena_bytes = ARENA_BASE + NUM_SLOTS * self.slot_bytes + 3
        self.arena = _random_bytes((arena_bytes,), torch.uint8, gen)
        self.page_ids, slots = _indices(order, rng)
        self.slot_offsets = ARENA_BASE + slots * self.slot_bytes

    def chunk_offset(self, layer: int, comp: int) -> int:
        """Byte offset of (layer, comp) inside a slot."""
        return (layer * self.n_comp + comp) * self.chunk

    def reference_store(self, layers: range | list[int] | None = None) -> torch.Tensor:
        """What the arena must hold after storing ``layers`` (all by default), page by page."""
        arena = self.arena.clone()
        for layer in range(N_LAYERS) if layers is None else layers:
            for comp, buf in enumerate(self.bufs[layer]):
                rows = buf.reshape(NUM_PAGES, -1).view(torch.uint8)
                for page, off in zip(self.page_ids.tolist(), self.slot_offsets.tolist()):
                    start = off + self.chunk_offset(layer, comp)
                    arena[start : start + self.chunk] = rows[page]
        return arena

    def reference_load(self, layers: range | list[int] | None = None) -> list[list[torch.Tensor]]:
        """What the engine buffers must hold after loading ``layers``, page by page."""
        out = [[b.clone() for b in row] for row in self.bufs]
        for layer in range(N_LAYERS) if layers is None else layers:
            for comp, buf in enumerate(out[layer]):
                rows = buf.view(NUM_PAGES, -1).view(torch.uint8)
                for page, off in zip(self.page_ids.tolist(), self.slot_offsets.tolist()):
                    start = off + self.chunk_offset(layer, comp)
                    rows[page] = self.arena[start : start + self.chunk]
        return out


def _assert_bufs_equal(
    actual: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]
) -> None:
    for row_a, row_e in zip(actual, expected):
        for a, e in zip(row_a, row_e):
            assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))


@pytest.fixture(params=[2, 1], ids=["mha", "mla"])
def n_comp(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dtype", "page_size", "heads", "dim"), GEOMETRIES)
def test_single_buffer_store_and_load_match_reference(
    dtype: torch.dtype, page_size: int, heads: int, dim: int, n_comp: int, order: str
) -> None:
    case = Case(dtype, (page_size, heads, dim), n_comp, order, seed=1)
    expected_arena = case.reference_store()
    expected_bufs = case.reference_load()
    arena = case.arena.clone()
    for layer in range(N_LAYERS):
        for comp in range(n_comp):
            copy_layer_to_host(
                arena,
                case.slot_offsets,
                case.bufs[layer][comp],
                case.page_ids,
                case.chunk_offset(layer, comp),
            )
    assert torch.equal(arena, expected_arena)

    bufs = [[b.clone() for b in row] for row in case.bufs]
    for layer in range(N_LAYERS):
        for comp in range(n_comp):
            copy_layer_from_host(
                case.arena,
                case.slot_offsets,
                bufs[layer][comp],
                case.page_ids,
                case.chunk_offset(layer, comp),
            )
    _assert_bufs_equal(bufs, expected_bufs)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dtype", "page_size", "heads", "dim"), GEOMETRIES)
def test_whole_page_helpers_match_reference(
    dtype: torch.dtype, page_size: int, heads: int, dim: int, n_comp: int, order: str
) -> None:
    case = Case(dtype, (page_size, heads, dim), n_comp, order, seed=2)
    arena = case.arena.clone()
    copy_layers_to_host(arena, case.slot_offsets, case.bufs, case.page_ids)
    assert torch.equal(arena, case.reference_store())

    bufs = [[b.clone() for b in row] for row in case.bufs]
    copy_layers_from_host(case.arena, case.slot_offsets, bufs, case.page_ids)
    _assert_bufs_equal(bufs, case.reference_load())


@pytest.mark.parametrize("order", ["consecutive", "random", "mixed"])
def test_layer_helpers_copy_one_layer_only(n_comp: int, order: str) -> None:
    case = Case(torch.bfloat16, (4, 2, 8), n_comp, order, seed=3)
    arena = case.arena.clone()
    copy_layer_kv_to_host(arena, case.slot_offsets, case.bufs[1], case.page_ids, 1, N_LAYERS)
    assert torch.equal(arena, case.reference_store([1]))

    bufs = [[b.clone() for b in row] for row in case.bufs]
    copy_layer_kv_from_host(case.arena, case.slot_offsets, bufs[2], case.page_ids, 2, N_LAYERS)
    _assert_bufs_equal(bufs, case.reference_load([2]))


@pytest.mark.parametrize("order", ["consecutive", "random", "mixed", "slots_descending"])
def test_plan_is_reused_for_every_layer(n_comp: int, order: str) -> None:
    case = Case(torch.float16, (4, 2, 8), n_comp, order, seed=4)
    plan = CopyPlan.build(
        torch.from_numpy(case.page_ids),
        torch.from_numpy(case.slot_offsets),
        case.chunk,
        slot_bytes=case.slot_bytes,
    )
    assert len(plan) == case.page_ids.size
    arena = case.arena.clone()
    for layer in reversed(range(N_LAYERS)):
        plan.layer_to_host(arena, case.bufs[layer], layer)
    assert torch.equal(arena, case.reference_store())

    bufs = [[b.clone() for b in row] for row in case.bufs]
    plan.layers_from_host(case.arena, bufs, layers=[2, 0])
    _assert_bufs_equal(bufs, case.reference_load([0, 2]))


def test_plan_coalesces_runs_on_both_sides() -> None:
    stride = 1000
    consecutive = CopyPlan.build(np.arange(5, 21), np.arange(16) * stride, 100, slot_bytes=stride)
    assert (consecutive.num_runs, consecutive.num_singles, consecutive.stride) == (1, 0, stride)
    assert consecutive.runs == ((5, 0, 16),)

    reversed_order = CopyPlan.build(np.arange(20, 4, -1), np.arange(15, -1, -1) * stride, 100)
    assert reversed_order.runs == ((5, 0, 16),)

    descending = CopyPlan.build(np.arange(4), np.array([3, 2, 1, 0]) * stride, 100)
    assert descending.stride == -stride
    assert descending.runs == ((0, 3 * stride, 4),)

    # runs of 4 and 3 (coalesced); a run of 2 and two strays stay single copies
    pages = np.array([0, 1, 2, 3, 10, 11, 12, 20, 21, 30, 40])
    slots = np.array([0, 1, 2, 3, 7, 8, 9, 20, 21, 5, 4]) * stride
    mixed = CopyPlan.build(pages, slots, 100, slot_bytes=stride)
    assert mixed.runs == ((0, 0, 4), (10, 7 * stride, 3))
    assert mixed.single_page_ids.tolist() == [20, 21, 30, 40]
    assert mixed.single_slot_offsets.tolist() == [20 * stride, 21 * stride, 5 * stride, 4 * stride]

    scattered = CopyPlan.build(np.array([7, 3, 5]), np.array([0, 4000, 2000]), 100)
    assert (scattered.num_runs, scattered.num_singles) == (0, 3)


def test_plan_keeps_a_private_copy_of_the_indices() -> None:
    case = Case(torch.float32, (2, 2, 8), 2, "random", seed=5)
    pages = case.page_ids.copy()
    plan = CopyPlan.build(pages, case.slot_offsets, case.chunk, slot_bytes=case.slot_bytes)
    pages[:] = 0
    arena = case.arena.clone()
    plan.layers_to_host(arena, case.bufs)
    assert torch.equal(arena, case.reference_store())


def test_copies_in_threads_give_the_same_bytes() -> None:
    """Disjoint layers copied from several threads at once with one shared plan."""
    case = Case(torch.float32, (8, 4, 16), 2, "mixed", seed=6)
    plan = CopyPlan.build(case.page_ids, case.slot_offsets, case.chunk, slot_bytes=case.slot_bytes)
    arena = case.arena.clone()
    threads = [
        threading.Thread(target=plan.layer_to_host, args=(arena, case.bufs[layer], layer))
        for layer in range(N_LAYERS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert torch.equal(arena, case.reference_store())


# -- bad input: a PageCopyError (a ValueError) naming the argument, and nothing written ----------


def _bad_calls(case: Case) -> dict[str, tuple[tuple[object, object], str]]:
    """Callables that must raise, with a fragment of their message."""
    pids, offs = case.page_ids, case.slot_offsets
    last = case.slot_bytes * (NUM_SLOTS - 1) + ARENA_BASE

    def with_page(page: int) -> np.ndarray:
        return np.concatenate([pids, [page]]).astype(np.int64)

    def with_off(off: int) -> np.ndarray:
        return np.concatenate([offs, [off]]).astype(np.int64)

    spare_page = int(np.setdiff1d(np.arange(NUM_PAGES), pids)[0])
    free_slot = (
        ARENA_BASE
        + int(np.setdiff1d(np.arange(NUM_SLOTS), (offs - ARENA_BASE) // case.slot_bytes)[0])
        * case.slot_bytes
    )
    return {
        "page_out_of_range": (
            (with_page(NUM_PAGES), with_off(free_slot)),
            rf"page_ids\[{pids.size}\] = {NUM_PAGES} is out of range",
        ),
        "page_negative": ((with_page(-1), with_off(free_slot)), "page_ids"),
        "offset_past_arena": (
            (with_page(spare_page), with_off(last + case.slot_bytes)),
            "slot_offsets",
        ),
        "offset_negative": ((with_page(spare_page), with_off(-7)), "slot_offsets"),
        "duplicate_page": (
            (with_page(int(pids[0])), with_off(free_slot)),
            f"page id {int(pids[0])} twice",
        ),
        "overlapping_slots": ((with_page(spare_page), with_off(int(offs[0]) + 1)), "overlap"),
        "length_mismatch": ((pids, offs[:-1]), "same length"),
        "int32_pages": ((pids.astype(np.int32), offs), "page_ids must have dtype int64"),
        "float_offsets": ((pids, offs.astype(np.float64)), "slot_offsets must have dtype int64"),
        "list_pages": ((pids.tolist(), offs), "page_ids must be a numpy array"),
        "2d_offsets": ((pids, offs.reshape(1, -1)), "slot_offsets must be 1-D"),
    }


@pytest.mark.parametrize(
    "bad",
    [
        "page_out_of_range",
        "page_negative",
        "offset_past_arena",
        "offset_negative",
        "duplicate_page",
        "overlapping_slots",
        "length_mismatch",
        "int32_pages",
        "float_offsets",
        "list_pages",
        "2d_offsets",
    ],
)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_bad_indices_raise_and_write_nothing(bad: str, direction: str) -> None:
    case = Case(torch.float16, (2, 2, 4), 2, "mixed", seed=7)
    (pages, offsets), message = _bad_calls(case)[bad]
    arena = case.arena.clone()
    bufs = [[b.clone() for b in row] for row in case.bufs]
    fn = copy_layers_to_host if direction == "store" else copy_layers_from_host
    with pytest.raises(ValueError, match=message) as info:
        fn(arena, offsets, bufs, pages)  # type: ignore[arg-type]
    assert isinstance(info.value, PageCopyError)
    assert torch.equal(arena, case.arena)
    _assert_bufs_equal(bufs, case.bufs)


def test_single_buffer_bounds_use_the_chunk_offset() -> None:
    case = Case(torch.uint8, (3, 1, 7), 1, "single", seed=8)
    arena = case.arena.clone()
    # the last slot fits at chunk offset 0 but its last layer would end past the arena
    short = arena[: ARENA_BASE + NUM_SLOTS * case.slot_bytes - 1]
    last_layer = case.chunk_offset(N_LAYERS - 1, 0)
    with pytest.raises(ValueError, match=r"slot_offsets\[0\] = .* past the end"):
        copy_layer_to_host(short, case.slot_offsets, case.bufs[-1][0], case.page_ids, last_layer)
    copy_layer_to_host(short, case.slot_offsets, case.bufs[0][0], case.page_ids, 0)
    assert torch.equal(arena, case.reference_store([0]))


def test_bad_buffers_raise_and_write_nothing() -> None:
    case = Case(torch.float32, (2, 2, 4), 2, "consecutive", seed=9)
    arena = case.arena.clone()
    pids, offs = case.page_ids, case.slot_offsets

    def fails(match: str, fn: object, *args: object) -> None:
        with pytest.raises(PageCopyError, match=match):
            fn(*args)  # type: ignore[operator]
        assert torch.equal(arena, case.arena)

    fails(
        "arena must be a 1-D contiguous uint8",
        copy_layers_to_host,
        arena.view(torch.int8),
        offs,
        case.bufs,
        pids,
    )
    fails(
        "arena must be a 1-D contiguous uint8",
        copy_layers_to_host,
        arena[::2],
        offs,
        case.bufs,
        pids,
    )
    fails(
        "arena must be a numpy array or a torch.Tensor",
        copy_layers_to_host,
        bytearray(16),
        offs,
        case.bufs,
        pids,
    )
    transposed = case.bufs[0][0].transpose(0, 1)
    fails("engine_buf must be contiguous", copy_layer_to_host, arena, offs, transposed, pids, 0)
    # the last layer has fewer pages: caught before the first layer is written
    short = [list(row) for row in case.bufs]
    short[-1][1] = short[-1][1][:4]
    fails(
        r"page_ids\[\d\] = \d+ is out of range for engine_bufs\[2\]\[1\] with 4 pages",
        copy_layers_to_host,
        arena,
        offs,
        short,
        pids,
    )
    wide = [list(row) for row in case.bufs]
    wide[1][0] = torch.zeros((NUM_PAGES, 3, 2, 4), dtype=torch.float32)
    fails(
        "engine_bufs\\[1\\]\\[0\\] holds 96 bytes per page",
        copy_layers_to_host,
        arena,
        offs,
        wide,
        pids,
    )
    ragged = [list(row) for row in case.bufs]
    ragged[2] = ragged[2][:1]
    fails("engine_bufs\\[2\\] has 1 components", copy_layers_to_host, arena, offs, ragged, pids)

    plan = CopyPlan.build(pids, offs, case.chunk, slot_bytes=case.slot_bytes)
    fails("chunk_offset = .* outside", plan.to_host, arena, case.bufs[0][0], case.slot_bytes)
    fails("chunk_offset = .* outside", plan.to_host, arena, case.bufs[0][0], -1)
    fails("layer 3 is out of range", plan.layers_to_host, arena, case.bufs, [0, 3])
    fails("layer must be a non-negative int", plan.layer_to_host, arena, case.bufs[0], -1)
    fails("chunk_bytes must be a positive int", CopyPlan.build, pids, offs, 0)
    fails(
        "slot_bytes = 4 is smaller than chunk_bytes",
        lambda: CopyPlan.build(pids, offs, 8, slot_bytes=4),
    )


def test_empty_transfer_writes_nothing() -> None:
    case = Case(torch.float16, (2, 2, 4), 2, "empty", seed=10)
    arena = case.arena.clone()
    plan = CopyPlan.build(case.page_ids, case.slot_offsets, case.chunk)
    assert (len(plan), plan.num_runs, plan.num_singles) == (0, 0, 0)
    copy_layers_to_host(arena, case.slot_offsets, case.bufs, case.page_ids)
    copy_layers_from_host(arena, case.slot_offsets, case.bufs, case.page_ids)
    assert torch.equal(arena, case.arena)
