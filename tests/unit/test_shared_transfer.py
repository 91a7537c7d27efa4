"""A transfer the event loop shares with a copy thread (``daemon/service/transfers.py``:
``Transfers._share``).

The loop copies the first half, a copy thread the second; the transfer is settled exactly
once: before ``start`` returns (the reply not sent yet: nobody to wake) when the thread's
half had ended by then, else when the thread's half ends. Everything else about the
transfer (bytes, checksums, commit or abort, unpin) is as for a copy on a thread alone.

The daemon's parts around it are stand-ins recording what they are told (the pool, the
tier, the session, the completion block), and the copy thread is one the test runs by
hand, so each order of the two ends happens on purpose; the copies themselves are real.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kvtier.daemon.counters import Counters
from kvtier.daemon.service.sessions import SessionState
from kvtier.daemon.service.transfers import (
    INLINE_BYTES,
    INLINE_REGIONS,
    LOOP_SHARE_BYTES,
    SHARE_MIN_BYTES,
    Transfers,
)
from kvtier.daemon.transfer.engine_memory import RegionView
from kvtier.daemon.transfer.transfer import Direction
from kvtier.ipc.completion import TransferStatus
from kvtier.kernels.host_views import EngineView

from tests.xxh3_reference import xxh3_64

LAYERS, ROW = 2, 64 << 10
"""Two layers of one region each: 128 KiB pages, so 16 pages make a 2 MiB transfer."""
PAGE = LAYERS * ROW
PAGES = 16
assert SHARE_MIN_BYTES <= PAGES * PAGE <= 2 * LOOP_SHARE_BYTES and PAGES * PAGE > INLINE_BYTES


class Executor:
    """A copy thread run by hand: ``run()`` does what was submitted, in order."""

    def __init__(self, at_once: bool = False, fail: bool = False) -> None:
        self.at_once, self.fail = at_once, fail
        self.queue: list[tuple[Future, Any, tuple]] = []
        self.submitted: list[Any] = []

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        self.submitted.append(fn)
        self.queue.append((fut, fn, args))
        if self.at_once:
            self.run()
        return fut

    def run(self) -> None:
        while self.queue:
            fut, fn, args = self.queue.pop(0)
            fut.set_running_or_notify_cancel()
            if self.fail:
                fut.set_exception(RuntimeError("the copy thread failed"))
            else:
                fut.set_result(fn(*args))


class Loop:
    """The event loop's thread-safe calls, kept until ``run()``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple]] = []

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        while self.calls:
            fn, args = self.calls.pop(0)
            fn(*args)


class Block:
    """The completion block: what it was told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def begin(self, slot: int, seq: int, num_layers: int) -> None:
        self.events.append(("begin", slot, seq, num_layers))

    def layer_done(self, slot: int, layers: int) -> None:
        self.events.append(("layer", layers))

    def finish(self, slot: int, status: TransferStatus, wake: bool = True) -> None:
        self.events.append(("finish", status, wake))

    def unannounced(self) -> SimpleNamespace:
        """The block as a STORE's copies see it: layers written without a wake-up."""
        return SimpleNamespace(
            layer_done=lambda slot, layers: self.events.append(("quiet", layers))
        )

    def finished(self) -> list[tuple]:
        return [e for e in self.events if e[0] == "finish"]


@dataclass
class Pool:
    committed: list[tuple[list[int], Any]] = field(default_factory=list)
    aborted: list[list[int]] = field(default_factory=list)
    unpinned: list[list[int]] = field(default_factory=list)

    def slot_offsets(self, host: list[int]) -> np.ndarray:
        return np.asarray(host, dtype=np.int64) * PAGE

    def commit(self, slots: list[int], checksums: Any = None) -> None:
        self.committed.append((list(slots), checksums))

    def abort(self, slots: list[int]) -> None:
        self.aborted.append(list(slots))

    def unpin(self, slots: list[int]) -> None:
        self.unpinned.append(list(slots))


def _setup(executor: Executor, verify: bool = False) -> tuple[Transfers, Any, Any, Loop]:
    rng = np.random.default_rng(3)
    mem = rng.integers(0, 256, (LAYERS, 2 * PAGES, ROW), dtype=np.uint8)
    regions = [
        RegionView(
            layer, layer * ROW, ROW, ROW, 0, EngineView.of(mem[layer], f"memory.regions[{layer}]")
        )
        for layer in range(LAYERS)
    ]
    pool = Pool()
    ctx = SimpleNamespace(
        pool=pool,
        counters=Counters(),
        metrics=None,
        cfg=SimpleNamespace(verify_on_adopt=verify, slice_pages=512),
        tier=SimpleNamespace(stored=lambda s, keys, slots=None: None, loaded=lambda s, keys: None),
        events=None,
        finalize_session=lambda s: None,
    )
    session = SimpleNamespace(
        session_id=1,
        geometry=SimpleNamespace(num_layers=LAYERS, page_bytes=PAGE, page_size=16),
        completion=Block(),
        transfers={},
        state=SessionState.OPEN,
        memory=SimpleNamespace(regions=regions, table=None),
        cuda=None,
        mem=mem,
    )
    tr = Transfers(ctx)  # type: ignore[arg-type]
    loop = Loop()
    arena = np.zeros(4 * PAGES * PAGE, dtype=np.uint8)
    tr._executor, tr._loop, tr._threads, tr._share_ok = executor, loop, 2, True  # type: ignore[assignment]
    tr._arena = arena
    session.arena = arena
    return tr, ctx, session, loop


def _store(tr: Transfers, s: Any) -> tuple[list[int], list[int]]:
    host = list(range(3, 3 + PAGES))
    pages = list(range(PAGES))[::-1]  # engine pages and host slots in no common order
    tr.start(s, Direction.STORE, 0, 7, host, pages, [bytes([i]) * 32 for i in range(PAGES)])
    return host, pages


def _stored_right(s: Any, host: list[int], pages: list[int]) -> bool:
    return all(
        np.array_equal(
            s.arena[h * PAGE + layer * ROW : h * PAGE + (layer + 1) * ROW], s.mem[layer, p]
        )
        for h, p in zip(host, pages)
        for layer in range(LAYERS)
    )


def test_a_thread_half_ended_first_is_settled_before_the_reply_without_a_wake():
    ex = Executor(at_once=True)  # the thread's half has ended before the loop's
    tr, ctx, s, loop = _setup(ex, verify=True)
    host, pages = _store(tr, s)
    assert ctx.counters.transfers_shared == 1
    # settled inside start(): no wake (nobody waits before the reply), pages committed
    assert s.completion.finished() == [("finish", TransferStatus.DONE, False)]
    assert len(ctx.pool.committed) == 1 and ctx.pool.committed[0][0] == host
    assert (
        ctx.pool.committed[0][1]
        == [  # the tests' own XXH3
            xxh3_64(s.arena[h * PAGE : (h + 1) * PAGE].tobytes()) for h in host
        ]
    )
    assert _stored_right(s, host, pages) and not s.transfers
    loop.run()  # the thread's end reaches the loop too: it settles nothing again
    assert len(s.completion.finished()) == 1 and len(ctx.pool.committed) == 1
    assert not tr.inflight


def test_a_thread_half_ending_last_settles_the_transfer_when_it_ends():
    ex = Executor()
    tr, ctx, s, loop = _setup(ex)
    host, pages = _store(tr, s)
    assert ctx.counters.transfers_shared == 1 and len(tr.inflight) == 1
    assert s.completion.finished() == [] and ctx.pool.committed == []
    # only the loop's half is in: no layer is announced before both halves hold it
    assert [e for e in s.completion.events if e[0] in ("layer", "quiet")] == []
    ex.run()
    assert s.completion.finished() == []  # ended on the thread: settled on the loop
    loop.run()
    assert s.completion.finished() == [("finish", TransferStatus.DONE, True)]
    # a STORE's layers are written without waking its engine (it waits for the end)
    assert [e[1] for e in s.completion.events if e[0] == "quiet"][-1] == LAYERS
    assert [e for e in s.completion.events if e[0] == "layer"] == []
    assert ctx.pool.committed == [(host, None)] and _stored_right(s, host, pages)
    assert not tr.inflight and not s.transfers


def test_a_failed_thread_half_fails_the_transfer_once():
    ex = Executor(fail=True)
    tr, ctx, s, loop = _setup(ex)
    host, _ = _store(tr, s)
    ex.run()
    loop.run()
    assert s.completion.finished() == [("finish", TransferStatus.FAILED, True)]
    assert ctx.pool.aborted == [host] and ctx.pool.committed == []
    assert ctx.counters.store_failed_pages == PAGES


def test_a_shared_load_unpins_once_and_moves_the_bytes():
    ex = Executor()
    tr, ctx, s, loop = _setup(ex)
    rng = np.random.default_rng(9)
    s.arena[:] = rng.integers(0, 256, s.arena.size, dtype=np.uint8)
    host, pages = list(range(5, 5 + PAGES)), list(range(PAGES, 2 * PAGES))
    tr.start(s, Direction.LOAD, 1, 8, host, pages, [b"k" * 32] * PAGES)
    ex.run()
    loop.run()
    assert s.completion.finished() == [("finish", TransferStatus.DONE, True)]
    assert ctx.pool.unpinned == [host] and ctx.counters.load_pages == PAGES
    assert _stored_right(s, host, pages)


@pytest.mark.parametrize(
    "why", ["a copy runs", "a request waits", "too large", "too small", "one CPU"]
)
def test_the_loop_leaves_a_transfer_to_the_threads_when(why):
    ex = Executor()
    tr, ctx, s, _ = _setup(ex)
    pages = PAGES
    if why == "a copy runs":
        tr.inflight.add(Future())
    elif why == "a request waits":
        tr.requests_waiting = lambda: True
    elif why == "too large":
        pages = 2 * LOOP_SHARE_BYTES // PAGE + 1
    elif why == "too small":
        pages = SHARE_MIN_BYTES // PAGE - 1
    else:
        tr._share_ok = False
    s.mem = np.zeros((LAYERS, pages, ROW), dtype=np.uint8)
    s.memory.regions = [
        RegionView(
            layer, layer * ROW, ROW, ROW, 0, EngineView.of(s.mem[layer], f"memory.regions[{layer}]")
        )
        for layer in range(LAYERS)
    ]
    tr._arena = s.arena = np.zeros((pages + 3) * PAGE, dtype=np.uint8)
    tr.start(
        s,
        Direction.STORE,
        0,
        7,
        list(range(pages)),
        list(range(pages)),
        [bytes([i % 256]) * 32 for i in range(pages)],
    )
    assert ctx.counters.transfers_shared == 0
    assert len(ex.submitted) == 1 and ex.submitted[0].__name__ == "run_transfer"


def test_a_session_of_many_tiny_regions_never_copies_on_the_loop():
    """An engine declaring many tiny regions (copied region by region in Python) would hold
    the event loop everyone shares for a small transfer: its copies go to the copy
    threads, in its user's turn, however small."""
    n, row, pages = INLINE_REGIONS + 1, 512, 2
    assert pages * n * row <= INLINE_BYTES  # small enough to be copied inline otherwise
    ex = Executor()
    tr, _, s, loop = _setup(ex)
    mem = np.random.default_rng(5).integers(0, 256, (n, pages, row), dtype=np.uint8)
    s.memory = SimpleNamespace(
        regions=[
            RegionView(0, i * row, row, row, 0, EngineView.of(mem[i], f"memory.regions[{i}]"))
            for i in range(n)
        ],
        table=None,
    )
    s.geometry = SimpleNamespace(num_layers=1, page_bytes=n * row, page_size=16)
    tr.start(s, Direction.STORE, 0, 7, [0, 1], [1, 0], [b"a" * 32, b"b" * 32])
    assert ex.submitted and not s.completion.finished()  # queued, not copied here
    ex.run()
    loop.run()
    assert s.completion.finished() == [("finish", TransferStatus.DONE, True)]
    page = n * row  # host slot h starts at h * PAGE (the stand-in pool's offsets)
    assert np.array_equal(s.arena[:page], mem[:, 1].reshape(-1))
    assert np.array_equal(s.arena[PAGE : PAGE + page], mem[:, 0].reshape(-1))
