"""A large transfer is copied in parts by several copy threads (``daemon/transfer/transfer.py``:
``copy_part``, ``LayerGate``, ``combine``).

A layer may be announced only once every part has copied it, announcements only grow, and
the transfer's status and checksums come from all its parts. The parts' copies are checked
byte for byte against the same transfer copied whole.

A transfer over an engine's region table (one native call per layer, or one in all) moves
the same bytes and announces the same layers as one copied region by region.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from kvtier.daemon.transfer.engine_memory import RegionTable, RegionView
from kvtier.daemon.transfer.transfer import (
    Direction,
    LayerGate,
    Transfer,
    combine,
    copy_part,
    run_transfer,
)
from kvtier.ipc.completion import TransferStatus
from kvtier.kernels.guarded_copy import BUILT as STRIDED
from kvtier.kernels.host_views import EngineView

from tests.xxh3_reference import xxh3_64


class Block:
    """Records what a completion block would be told."""

    def __init__(self) -> None:
        self.shown: list[int] = []
        self.lock = threading.Lock()

    def layer_done(self, slot: int, layers: int) -> None:
        with self.lock:
            self.shown.append(layers)


def test_a_layer_is_announced_once_every_part_has_copied_it():
    block = Block()
    gate = LayerGate(block, 3)
    a, b, c = gate.part(0), gate.part(1), gate.part(2)
    a.layer_done(0, 1)
    a.layer_done(0, 2)
    b.layer_done(0, 1)
    assert block.shown == []  # part 2 has copied nothing yet
    c.layer_done(0, 3)
    assert block.shown == [1]
    b.layer_done(0, 3)
    assert block.shown == [1, 2]
    a.layer_done(0, 3)
    assert block.shown == [1, 2, 3]
    a.layer_done(0, 3)  # repeated: nothing new
    assert block.shown == [1, 2, 3]


def _transfer(n: int, direction: Direction, checksum: bool = False) -> Transfer:
    return Transfer(
        direction=direction,
        session_id=1,
        slot=0,
        seq=1,
        host_slots=list(range(n)),
        page_ids=np.arange(n, dtype=np.int64)[::-1].copy(),
        offsets=np.arange(n, dtype=np.int64) * 0,
        nbytes=0,
        checksum=checksum,
    )


@pytest.mark.parametrize(
    "results, want",
    [
        ([TransferStatus.DONE, TransferStatus.DONE], TransferStatus.DONE),
        ([TransferStatus.DONE, TransferStatus.FAILED], TransferStatus.FAILED),
        ([TransferStatus.CANCELLED, TransferStatus.DONE], TransferStatus.CANCELLED),
        ([TransferStatus.FAILED, TransferStatus.CANCELLED], TransferStatus.CANCELLED),
    ],
)
def test_the_status_is_done_only_when_every_part_is(results, want):
    t = _transfer(4, Direction.STORE, checksum=True)
    combine([(st, [1, 2] if st is TransferStatus.DONE else None) for st in results], t)
    assert t.status is want
    assert t.checksums == ([1, 2, 1, 2] if want is TransferStatus.DONE else None)


LAYERS, PAGES, ROW = 3, 40, 4096
"""An engine of 3 layers (one region each), 40 pages of 4 KiB per layer and page."""


def _engine(rng: np.random.Generator) -> tuple[np.ndarray, list[RegionView]]:
    mem = rng.integers(0, 256, (LAYERS, PAGES, ROW), dtype=np.uint8)
    regions = [
        RegionView(
            layer, layer * ROW, ROW, ROW, 0, EngineView.of(mem[layer], f"memory.regions[{layer}]")
        )
        for layer in range(LAYERS)
    ]
    return mem, regions


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
@pytest.mark.parametrize("parts", [2, 3])
def test_parts_copy_the_same_bytes_as_the_whole(direction, parts):
    rng = np.random.default_rng(parts)
    page_bytes = LAYERS * ROW
    pages = rng.permutation(PAGES)[:29].astype(np.int64)
    slots = rng.permutation(64)[:29].astype(np.int64)

    def run(split: bool) -> tuple[np.ndarray, np.ndarray, Transfer, Block]:
        mem, regions = _engine(np.random.default_rng(7))
        arena = np.random.default_rng(8).integers(0, 256, 64 * page_bytes, dtype=np.uint8)
        t = Transfer(
            direction=direction,
            session_id=1,
            slot=0,
            seq=1,
            host_slots=slots.tolist(),
            page_ids=pages,
            offsets=slots * page_bytes,
            nbytes=len(pages) * page_bytes,
            checksum=direction is Direction.STORE,
        )
        block = Block()
        if not split:
            assert run_transfer(t, arena, regions, LAYERS, page_bytes, block) is TransferStatus.DONE
            return mem, arena, t, block
        gate = LayerGate(block, parts)
        bounds = [len(pages) * i // parts for i in range(parts + 1)]
        out: list = [None] * parts

        def work(i: int) -> None:
            out[i] = copy_part(
                t, bounds[i], bounds[i + 1], arena, regions, LAYERS, page_bytes, gate.part(i)
            )

        threads = [threading.Thread(target=work, args=(i,)) for i in range(parts)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        combine(out, t)
        return mem, arena, t, block

    mem_w, arena_w, whole, _ = run(split=False)
    mem_s, arena_s, split, block = run(split=True)
    assert split.status is TransferStatus.DONE
    assert np.array_equal(mem_s, mem_w) and np.array_equal(arena_s, arena_w)
    if direction is Direction.STORE:
        assert (
            split.checksums
            == whole.checksums
            == [  # the tests' own XXH3
                xxh3_64(arena_s[s * page_bytes : (s + 1) * page_bytes].tobytes()) for s in slots
            ]
        )
    assert block.shown == sorted(block.shown) and block.shown[-1] == LAYERS


# -- the region table: one native call per announced layer ---------------------------------------


def _several_layer_engine(rng: np.random.Generator) -> tuple[np.ndarray, list[RegionView]]:
    """A region holding every layer (``layer = -1``), then per layer a K and a V region."""
    mem = rng.integers(0, 256, (1 + 2 * LAYERS, PAGES, ROW), dtype=np.uint8)
    layers = [-1] + [layer for layer in range(LAYERS) for _ in range(2)]
    regions = [
        RegionView(layer, i * ROW, ROW, ROW, 0, EngineView.of(mem[i], f"memory.regions[{i}]"))
        for i, layer in enumerate(layers)
    ]
    return mem, regions


@pytest.mark.skipif(not STRIDED, reason="kvtier.kernels._guarded was not built (no C compiler)")
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
@pytest.mark.parametrize("whole", [False, True], ids=["per-layer", "whole"])
def test_the_region_table_copies_and_announces_as_region_by_region(direction, whole):
    rng = np.random.default_rng(11)
    page_bytes = (1 + 2 * LAYERS) * ROW
    pages = rng.permutation(PAGES)[:17].astype(np.int64)
    slots = rng.permutation(32)[:17].astype(np.int64)

    def run(with_table: bool) -> tuple[np.ndarray, np.ndarray, Transfer, Block]:
        mem, regions = _several_layer_engine(np.random.default_rng(5))
        arena = np.random.default_rng(6).integers(0, 256, 32 * page_bytes, dtype=np.uint8)
        table = RegionTable.of(regions) if with_table else None
        assert (table is not None) is with_table
        t = Transfer(
            direction=direction,
            session_id=1,
            slot=0,
            seq=1,
            host_slots=slots.tolist(),
            page_ids=pages,
            offsets=slots * page_bytes,
            nbytes=len(pages) * page_bytes,
            checksum=direction is Direction.STORE,
        )
        block = Block()
        assert (
            run_transfer(
                t, arena, regions, LAYERS, page_bytes, block, table, whole=whole and with_table
            )
            is TransferStatus.DONE
        )
        return mem, arena, t, block

    mem_r, arena_r, by_region, block_r = run(with_table=False)
    mem_t, arena_t, by_table, block_t = run(with_table=True)
    assert np.array_equal(mem_t, mem_r) and np.array_equal(arena_t, arena_r)
    assert by_table.checksums == by_region.checksums
    assert block_r.shown == [1, 2, 3, 3]  # each layer once its K and V are in, then all
    assert block_t.shown == ([LAYERS] if whole else [1, 2, LAYERS])


@pytest.mark.skipif(not STRIDED, reason="kvtier.kernels._guarded was not built (no C compiler)")
def test_the_region_table_is_only_for_memory_a_native_copy_reaches():
    mem, regions = _several_layer_engine(np.random.default_rng(1))
    table = RegionTable.of(regions)
    assert table is not None and table.writable
    assert table.groups == ((0, 3, 1), (3, 5, 2), (5, 7, 3))
    assert table.table[:, 0].tolist() == [r.host_offset for r in regions]
    assert table.table[1].tolist() == [ROW, mem[1].ctypes.data, PAGES, ROW, ROW]
    unmapped = RegionView(0, 0, ROW, ROW, 0, None, fd=5, num_pages=PAGES)  # positional I/O
    assert RegionTable.of([*regions, unmapped]) is None
    assert RegionTable.of([]) is None
    frozen = mem[1].copy()
    frozen.flags.writeable = False
    ro = [regions[0], RegionView(0, ROW, ROW, ROW, 0, EngineView.of(frozen, "ro")), *regions[2:]]
    read_only = RegionTable.of(ro)
    assert read_only is not None and not read_only.writable  # a LOAD copies region by region


@pytest.mark.skipif(not STRIDED, reason="kvtier.kernels._guarded was not built (no C compiler)")
def test_a_transfer_cancelled_before_a_layer_stops_there_with_the_table():
    mem, regions = _several_layer_engine(np.random.default_rng(2))
    page_bytes = (1 + 2 * LAYERS) * ROW
    arena = np.zeros(8 * page_bytes, dtype=np.uint8)
    t = Transfer(
        direction=Direction.STORE,
        session_id=1,
        slot=0,
        seq=1,
        host_slots=[0, 1],
        page_ids=np.array([3, 4], dtype=np.int64),
        offsets=np.array([0, page_bytes], dtype=np.int64),
        nbytes=2 * page_bytes,
    )

    class CancelAfterFirst(Block):
        def layer_done(self, slot: int, layers: int) -> None:
            super().layer_done(slot, layers)
            t.cancelled = True

    block = CancelAfterFirst()
    status = run_transfer(t, arena, regions, LAYERS, page_bytes, block, RegionTable.of(regions))
    assert status is TransferStatus.CANCELLED and block.shown == [1]
    assert arena[: 3 * ROW].tobytes() == np.concatenate([mem[i][3] for i in range(3)]).tobytes()
    assert not arena[3 * ROW : page_bytes].any()  # layers 1 and 2 were never copied
