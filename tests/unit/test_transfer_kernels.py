"""The daemon's CPU copy of a transfer, native and numpy (``daemon/transfer/transfer.py``).

With the ``_guarded`` extension built, every mapped region is copied by
:func:`~kvtier.kernels.guarded_copy.copy_strided` (one C call per region); without it, by
numpy plans. Both must move exactly the bytes an independent numpy gather/scatter moves,
fail the same transfers, and never write into memory the copy may not write.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.daemon.transfer.engine_memory import RegionView
from kvtier.daemon.transfer.transfer import Direction, Transfer, run_transfer
from kvtier.ipc.completion import TransferStatus
from kvtier.kernels import guarded_copy
from kvtier.kernels.host_views import EngineView

LAYERS, PAGES, ROWS = 3, 50, (4096, 8192)
"""3 layers of two components (K 4 KiB, V 8 KiB per page), 50 engine pages."""
PAGE_BYTES = LAYERS * sum(ROWS)
SLOTS = 80

PATHS = [
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(
            not guarded_copy.BUILT, reason="kvtier.kernels._guarded was not built (no C compiler)"
        ),
    ),
    pytest.param(False, id="numpy"),
]


class Block:
    def __init__(self) -> None:
        self.shown: list[int] = []

    def layer_done(self, slot: int, layers: int) -> None:
        self.shown.append(layers)


def _engine(seed: int, writeable: bool = True) -> tuple[list[np.ndarray], list[RegionView]]:
    rng = np.random.default_rng(seed)
    bufs, regions, at = [], [], 0
    for layer in range(LAYERS):
        for row in ROWS:
            # rows further apart than they are long, like a strided engine layout
            buf = rng.integers(0, 256, (PAGES, 2 * row), dtype=np.uint8)[:, :row]
            buf.flags.writeable = writeable
            bufs.append(buf)
            regions.append(
                RegionView(layer, at, row, 2 * row, 0, EngineView.of(buf, f"region {layer}/{row}"))
            )
            at += row
    return bufs, regions


def _run(
    native: bool,
    direction: Direction,
    pages: np.ndarray,
    slots: np.ndarray,
    native_off,
    writeable: bool = True,
):
    if native:
        native_off()
    else:
        native_off("region_copy")
    assert guarded_copy.strided() == native
    bufs, regions = _engine(1, writeable)
    arena = np.random.default_rng(2).integers(0, 256, SLOTS * PAGE_BYTES, dtype=np.uint8)
    t = Transfer(
        direction=direction,
        session_id=1,
        slot=0,
        seq=1,
        host_slots=slots.tolist(),
        page_ids=pages,
        offsets=slots * PAGE_BYTES,
        nbytes=len(pages) * PAGE_BYTES,
    )
    block = Block()
    status = run_transfer(t, arena, regions, LAYERS, PAGE_BYTES, block)
    return status, bufs, arena, block


def _expected(direction: Direction, pages: np.ndarray, slots: np.ndarray):
    """What the copy must leave, computed by plain numpy indexing."""
    bufs, _ = _engine(1)
    bufs = [b.copy() for b in bufs]
    arena = np.random.default_rng(2).integers(0, 256, SLOTS * PAGE_BYTES, dtype=np.uint8)
    host = arena.reshape(SLOTS, PAGE_BYTES)
    at = 0
    for buf in bufs:
        row = buf.shape[1]
        if direction is Direction.STORE:
            host[slots, at : at + row] = buf[pages]
        else:
            buf[pages] = host[slots, at : at + row]
        at += row
    return bufs, arena


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_transfer_moves_exactly_the_pages_it_names(native, direction, native_off):
    rng = np.random.default_rng(3)
    pages = rng.permutation(PAGES)[:37].astype(np.int64)  # no order in common
    slots = rng.permutation(SLOTS)[:37].astype(np.int64)
    status, bufs, arena, block = _run(native, direction, pages, slots, native_off)
    assert status is TransferStatus.DONE
    want_bufs, want_arena = _expected(direction, pages, slots)
    assert np.array_equal(arena, want_arena)
    for got, want in zip(bufs, want_bufs):
        assert np.array_equal(got, want)
    assert block.shown == list(range(1, LAYERS + 1)) + [LAYERS]  # layer by layer, then all


@pytest.mark.parametrize("native", PATHS)
def test_a_page_outside_a_region_fails_the_transfer_and_writes_nothing(native, native_off):
    pages = np.array([1, 2, PAGES], dtype=np.int64)  # PAGES: one past the end
    slots = np.array([5, 6, 7], dtype=np.int64)
    status, bufs, _, _ = _run(native, Direction.LOAD, pages, slots, native_off)
    assert status is TransferStatus.FAILED
    before, _ = _engine(1)
    for got, want in zip(bufs, before):
        assert np.array_equal(got, want)  # not even pages 1 and 2 of the first region


@pytest.mark.parametrize("native", PATHS)
def test_a_load_never_writes_a_read_only_engine_view(native, native_off):
    pages = np.array([3, 4], dtype=np.int64)
    slots = np.array([0, 1], dtype=np.int64)
    status, bufs, _, _ = _run(native, Direction.LOAD, pages, slots, native_off, writeable=False)
    assert status is TransferStatus.FAILED
    before, _ = _engine(1)
    for got, want in zip(bufs, before):
        assert np.array_equal(got, want)
    # a store only reads the engine: fine
    status, _, _, _ = _run(native, Direction.STORE, pages, slots, native_off, writeable=False)
    assert status is TransferStatus.DONE
