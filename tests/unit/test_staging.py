"""The staging area of the engine-side copy path, and the engine's copies into and out of it.

Exact tests of slot hand-out (consecutive runs, bounded waits, slots the daemon may still
use), of the memfd handed over (sealed, regions where the parts lie), and of the copies on
CPU tensors (the code CUDA runs too: ``copy_(non_blocking)`` on a copy stream there), in the
engine layouts the vLLM connector stages, strided views included.
"""

from __future__ import annotations

import fcntl
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.client.staging.area import StagingArea, StagingPart, slot_runs
from kvtier.client.staging.copies import StagedCopier
from kvtier.ipc.protocol import Geometry

pytestmark = pytest.mark.timeout(60)

G = Geometry(
    num_layers=2, page_size=4, kv_heads=2, head_dim=8, dtype="bfloat16", layout="test_staging"
)
NHD = (G.page_size, G.kv_heads, G.head_dim)


def kv_parts(layers: int = 2) -> list[StagingPart]:
    """K and V per layer, pages ``[page_size, kv_heads, head_dim]``."""
    return [StagingPart(layer, NHD, torch.bfloat16) for layer in range(layers) for _ in "kv"]


@pytest.fixture
def area():
    a = StagingArea(kv_parts(), capacity=8)
    yield a
    a.close()


def test_slot_runs_splits_at_every_gap():
    assert slot_runs([]) == []
    assert slot_runs([3]) == [(3, 1, 0)]
    assert slot_runs([0, 1, 2, 5, 6, 9]) == [(0, 3, 0), (5, 2, 3), (9, 1, 5)]
    assert slot_runs([4, 3]) == [(4, 1, 0), (3, 1, 1)]


def test_acquire_prefers_a_run_of_consecutive_slots(area):
    a = area.acquire(3, 0)
    b = area.acquire(2, 0)
    assert a == [0, 1, 2] and b == [3, 4]
    area.release([1])
    # 1 alone does not hold 2: the first run of two free slots is 5, 6
    assert area.acquire(2, 0) == [5, 6]
    # no run of three left: the lowest free slots
    area.release([3])
    assert area.acquire(3, 0) == [1, 3, 7]
    assert area.free == 0


def test_acquire_is_bounded_and_wakes_on_release(area):
    held = area.acquire(8, 0)
    assert held is not None
    assert area.acquire(1, 0.02) is None  # full: None once the wait is over
    threading.Timer(0.05, area.release, args=([5],)).start()
    assert area.acquire(1, 10.0) == [5]
    with pytest.raises(ValueError, match="cannot take 9 slots"):
        area.acquire(9, 0)
    with pytest.raises(ValueError, match="cannot take 0 slots"):
        area.acquire(0, 0)


def test_slots_the_daemon_may_still_copy_stay_out_of_use(area):
    slots = area.acquire(8, 0)
    copying = [True]
    area.release(slots[:2], in_use=lambda: copying[0])
    assert area.free == 0 and area.acquire(1, 0.02) is None
    copying[0] = False
    assert area.free == 2
    assert area.acquire(2, 0) == [0, 1]
    area.release(slots[2:4], in_use=lambda: False)  # stopped already: back at once
    assert area.free == 2


def test_a_slot_released_twice_is_refused(area):
    area.release(area.acquire(1, 0))
    with pytest.raises(ValueError, match="released twice"):
        area.release([0])


def test_memory_is_a_sealed_memfd_with_one_region_per_part(area):
    mem = area.memory(G)
    export = mem.export()
    assert export.kind == "fd" and export.num_pages == 8
    chunk = G.chunk_bytes
    assert [(r.offset, r.page_stride, r.page_bytes, r.layer) for r in export.regions] == [
        (i * 8 * chunk, chunk, chunk, i // 2) for i in range(4)
    ]
    seals = fcntl.fcntl(mem.memory_fds()[0], fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    # the parts' views lie where the regions say
    area.views[3][5].fill_(1.5)
    raw = area.segment.tensor(0).view(torch.bfloat16)
    start = (3 * 8 * chunk + 5 * chunk) // 2
    assert torch.equal(
        raw[start : start + chunk // 2], torch.full((chunk // 2,), 1.5, dtype=torch.bfloat16)
    )
    with pytest.raises(ValueError, match="regions hold"):
        StagingArea(kv_parts(1), 2).memory(G)


def test_bad_areas_are_refused():
    with pytest.raises(ValueError, match=r"staging capacity = 0: must be an integer in \[1, "):
        StagingArea(kv_parts(), 0)
    with pytest.raises(ValueError, match="at least one part"):
        StagingArea([], 4)


def _engine_layers(
    num_blocks: int, layout: str, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(per layer KV tensors, their parts ``[num_blocks, *NHD]``) in an engine layout."""
    g = torch.Generator().manual_seed(seed)
    layers, parts = [], []
    for _ in range(G.num_layers):
        if layout == "k_v_first":  # [2, blocks, ...] (FlashAttention's)
            t = torch.randn(2, num_blocks, *NHD, generator=g).to(torch.bfloat16)
            parts += [t[0], t[1]]
        else:  # [blocks, 2, ...] (FlashInfer's): strided parts
            t = torch.randn(num_blocks, 2, *NHD, generator=g).to(torch.bfloat16)
            parts += [t[:, 0], t[:, 1]]
        layers.append(t)
    return layers, parts


@pytest.mark.parametrize("layout", ["k_v_first", "blocks_first"])
def test_pages_go_to_staging_and_back_exactly_and_nothing_else_changes(area, layout):
    _, src = _engine_layers(10, layout, seed=1)
    copier = StagedCopier(area, src)
    assert not copier.cuda and copier.layers == [0, 1] and copier.parts_of(1) == [2, 3]
    slots, blocks = [6, 7, 2], [9, 0, 4]
    copier.to_host(slots, blocks).synchronize()
    for i, part in enumerate(src):
        for s, b in zip(slots, blocks):
            assert torch.equal(area.views[i][s], part[b]), f"part {i} block {b} -> slot {s}"

    dst_layers, dst = _engine_layers(10, layout, seed=2)
    before = [t.clone() for t in dst_layers]
    into = StagedCopier(area, dst)
    targets = [3, 8, 1]
    for layer in into.layers:  # layer by layer, as a forward pass asks for them
        done = into.to_device(into.parts_of(layer), slots, targets)
        done.wait_on_compute()
        done.synchronize()
    for i, part in enumerate(dst):
        for b, t in zip(blocks, targets):
            assert torch.equal(part[t], src[i][b])
    for layer, (after, was) in enumerate(zip(dst_layers, before)):
        bdim = 1 if layout == "k_v_first" else 0
        untouched = [b for b in range(10) if b not in targets]
        assert torch.equal(
            after.index_select(bdim, torch.tensor(untouched)),
            was.index_select(bdim, torch.tensor(untouched)),
        ), f"layer {layer}"


def test_copier_refuses_tensors_that_do_not_match_the_parts(area):
    _, parts = _engine_layers(4, "k_v_first", seed=3)
    with pytest.raises(ValueError, match="3 engine tensors for 4 staging parts"):
        StagedCopier(area, parts[:3])
    bad = parts[:3] + [parts[3].float()]
    with pytest.raises(ValueError, match="engine tensor 3"):
        StagedCopier(area, bad)


def test_waiting_threads_share_a_full_area_without_losing_slots(area):
    """Several threads take and give back slots; every slot is free again at the end."""
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for _ in range(50):
                got = area.acquire(n, 5.0)
                assert got is not None and len(got) == n
                time.sleep(0)
                area.release(got)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (1, 3, 5, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and area.free == 8


def test_a_block_strided_across_memory_is_staged_in_logical_order():
    """vLLM's per-layer view on CUDA (``LBNHC``): logically ``[blocks, heads, tokens, 2*dim]``,
    tokens before heads in memory. Staged bytes are the logical block, as a CPU block's."""
    heads, toks, c = 2, 4, 16
    area = StagingArea([StagingPart(0, (heads, toks, c), torch.float32)], capacity=3)
    try:
        src = torch.randn(6, toks, heads, c).permute(0, 2, 1, 3)
        assert not src[0].is_contiguous()
        copier = StagedCopier(area, [src])
        copier.to_host([0, 1], [5, 2]).synchronize()
        assert torch.equal(area.views[0][0], src[5].contiguous())
        raw = area.segment.tensor(0, area.segment.size).view(torch.float32)
        assert torch.equal(raw[: heads * toks * c], src[5].reshape(-1))  # logical order
        dst = torch.zeros(6, toks, heads, c).permute(0, 2, 1, 3)
        StagedCopier(area, [dst]).to_device([0], [0, 1], [1, 4]).synchronize()
        assert torch.equal(dst[1], src[5]) and torch.equal(dst[4], src[2])
        assert not dst[[0, 2, 3, 5]].any()
    finally:
        area.close()


def test_runs_of_consecutive_slots_and_blocks_are_copied_directly(area):
    _, parts = _engine_layers(16, "blocks_first", seed=4)
    copier = StagedCopier(area, parts)
    # slots 2..5 hold blocks 7..10: one direct run; slots 0,1 hold 3,9: split in two
    assert copier._runs([2, 3, 4, 5], [7, 8, 9, 10]) == [(2, 4, 7)]
    assert copier._runs([0, 1, 6], [3, 9, 10]) == [(0, 1, 3), (1, 1, 9), (6, 1, 10)]
    # scattered blocks would more than double the copies: gathered through indices
    scattered = copier._runs([0, 1, 2, 3, 4, 5], [5, 1, 9, 3, 14, 0])
    assert len(scattered) == 1 and scattered[0][:2] == (0, 6)
    assert scattered[0][2].tolist() == [5, 1, 9, 3, 14, 0]
    indexed = StagedCopier(area, parts, direct=False)._runs([2, 3, 4, 5], [7, 8, 9, 10])
    assert [(s, n, i.tolist()) for s, n, i in indexed] == [(2, 4, [7, 8, 9, 10])]


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 15)), min_size=1, max_size=8).map(
        lambda ps: list({s: b for s, b in ps}.items())
    ),
    layout=st.sampled_from(["k_v_first", "blocks_first"]),
    sort=st.booleans(),
)
def test_direct_and_indexed_copies_move_the_same_bytes(pairs, layout, sort):
    """Whatever the slots and blocks (distinct blocks), both ways leave staging and the
    engine's blocks identical."""
    pairs = list({b: s for s, b in pairs}.items())  # distinct blocks too: (block, slot)
    if sort:
        pairs.sort(key=lambda p: p[1])
    blocks, slots = [b for b, _ in pairs], [s for _, s in pairs]
    results = []
    for direct in (True, False):
        a = StagingArea(kv_parts(), capacity=8)
        try:
            _, src = _engine_layers(16, layout, seed=5)
            StagedCopier(a, src, direct=direct).to_host(slots, blocks).synchronize()
            staged = [v.clone() for v in a.views]
            layers, dst = _engine_layers(16, layout, seed=6)
            back = StagedCopier(a, dst, direct=direct)
            back.to_device(range(len(dst)), slots, [15 - b for b in blocks]).synchronize()
            results.append((staged, [t.clone() for t in layers]))
        finally:
            a.close()
    (staged_d, engine_d), (staged_i, engine_i) = results
    for x, y in zip(staged_d + engine_d, staged_i + engine_i, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("direct", [True, False])
def test_a_block_outside_the_engines_tensors_is_an_index_error(area, direct):
    _, parts = _engine_layers(4, "k_v_first", seed=7)
    copier = StagedCopier(area, parts, direct=direct)
    for blocks in ([2, 3, 4], [-1, 0, 1]):  # one past the end; negative
        with pytest.raises(IndexError, match=rf"block {blocks[-1] if blocks[0] >= 0 else -1} "):
            copier.to_device(range(len(parts)), [0, 1, 2], blocks)
        with pytest.raises(IndexError, match="outside the engine's 4 blocks"):
            copier.to_host([0, 1, 2], blocks)
