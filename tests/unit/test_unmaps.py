"""A closed session's engine memory is unmapped on the ``kvtier-unmap`` thread, never holding
up its caller (the event loop), its prefault stopped first on the caller's thread, within the
room its caller gives for bytes waiting; at once beyond that room and after shutdown
(``daemon/service/unmaps.py``).

The memories here are small objects that record where and when they were closed: what is
tested is the hand-off, not ``munmap`` itself (``test_prefault.py`` tests the page-table
drop on a real mapping; ``tests/integration/test_engine_prefault.py`` that a real daemon
unmaps a closed session's memory).
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
from kvtier.daemon.service.unmaps import UNMAP_NICE, Unmaps

WAIT_S = 10.0


class Memory:
    """Engine memory that records its close: on which thread, after its prefault was stopped
    (and where) and its page tables dropped; ``gate`` (when given) holds the close until it
    is set; ``fail`` makes the close raise, ``fail_drop`` the drop."""

    def __init__(
        self,
        mapped_bytes: int,
        gate: threading.Event | None = None,
        fail: bool = False,
        fail_drop: bool = False,
    ) -> None:
        self.mapped_bytes = mapped_bytes
        self.gate = gate
        self.fail = fail
        self.fail_drop = fail_drop
        self.stopped_on: int | None = None
        self.closed_on: int | None = None
        self.nice: int | None = None  # the closing thread's
        self.closed = threading.Event()
        self.order: list[str] = []

    def stop_prefault(self) -> None:
        self.stopped_on = threading.get_ident()
        self.order.append("stop")

    def drop_page_tables(self) -> None:
        self.order.append("drop")
        if self.fail_drop:
            raise OSError("madvise failed")

    def close(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.order.append("close")
        self.closed_on = threading.get_ident()
        self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        self.closed.set()
        if self.fail:
            raise OSError("munmap failed")


class Bare:
    """Memory without page tables to drop (a control-only session's)."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


@pytest.fixture
def unmaps():
    made: list[Unmaps] = []

    def make(room: int = 1 << 40) -> Unmaps:
        made.append(Unmaps(lambda: room))
        return made[-1]

    yield make
    for u in made:
        u.shutdown()


def test_close_returns_before_the_memory_is_unmapped_on_its_thread(unmaps):
    u = unmaps()
    gate = threading.Event()
    m = Memory(3 << 20, gate)
    u.close(m)  # would block here until the gate opens if it ran on this thread
    assert not m.closed.is_set()
    assert m.stopped_on == threading.get_ident()  # the prefault stopped before close returned
    assert u.pending_bytes == 3 << 20 and u.queued == 1 and u.inline == 0
    assert u.unmapped == 0  # STATS' limits.unmaps.thread counts it once it is unmapped
    gate.set()
    assert m.closed.wait(WAIT_S)
    u.shutdown()
    assert m.closed_on != threading.get_ident()
    assert m.order == ["stop", "drop", "close"]  # page tables emptied: the unmap has none
    assert u.pending_bytes == 0 and u.unmapped == 1


def test_the_unmap_thread_runs_at_the_lowest_priority_and_its_caller_keeps_its_own(unmaps):
    """A waking thread (the event loop, an engine) gets the CPU from the unmap thread at
    once, instead of waiting for the end of its time slice while the kernel frees memory."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if base >= UNMAP_NICE:
        pytest.skip(f"the tests run at nice {base} already")
    u = unmaps()
    m = Memory(1 << 20)
    u.close(m)
    u.shutdown()
    assert m.closed_on != threading.get_ident() and m.nice == UNMAP_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


def test_memories_are_unmapped_one_after_another_in_order(unmaps):
    u = unmaps()
    gate = threading.Event()
    first, second = Memory(1, gate), Memory(2)
    u.close(first)
    u.close(second)
    assert not second.closed.wait(0.05)  # waits behind the first on the one thread
    assert u.pending_bytes == 3
    gate.set()
    u.shutdown()
    assert first.closed.is_set() and second.closed.is_set()
    assert u.pending_bytes == 0 and u.queued == 2


def test_beyond_the_room_a_memory_is_unmapped_at_once_on_the_caller_s_thread(unmaps):
    u = unmaps(room=10)
    gate = threading.Event()
    waiting = Memory(8, gate)
    u.close(waiting)
    exactly = Memory(2)  # 8 + 2 = the room: still queued
    u.close(exactly)
    over = Memory(1)
    u.close(over)  # 8 + 2 + 1 > 10: unmapped here, before close returns
    assert over.closed.is_set() and over.closed_on == threading.get_ident()
    assert over.order == ["stop", "drop", "close"]
    assert u.inline == 1 and u.queued == 2 and u.pending_bytes == 10
    gate.set()
    u.shutdown()
    assert exactly.closed.is_set() and u.pending_bytes == 0


def test_shutdown_waits_for_the_queue_and_later_memories_are_unmapped_at_once(unmaps):
    u = unmaps()
    gate = threading.Event()
    queued = Memory(5, gate)
    u.close(queued)
    threading.Timer(0.05, gate.set).start()
    u.shutdown()  # returns once the queued memory is unmapped
    assert queued.closed.is_set()
    late = Memory(7)
    u.close(late)
    assert late.closed.is_set() and late.closed_on == threading.get_ident()
    assert u.inline == 1 and u.pending_bytes == 0


def test_a_failed_unmap_is_logged_and_the_next_memory_is_still_unmapped(unmaps, caplog):
    u = unmaps()
    bad, good = Memory(1, fail=True), Memory(1)
    with caplog.at_level(logging.ERROR, logger="kvtier.daemon"):
        u.close(bad)
        u.close(good)
        u.shutdown()
    assert bad.closed.is_set() and good.closed.is_set()
    assert "unmapping a closed session's engine memory failed" in caplog.text
    assert u.pending_bytes == 0


def test_a_failed_drop_still_unmaps_the_memory(unmaps, caplog):
    u = unmaps()
    m = Memory(1, fail_drop=True)
    with caplog.at_level(logging.ERROR, logger="kvtier.daemon"):
        u.close(m)
        u.shutdown()
    assert m.order == ["stop", "drop", "close"] and m.closed.is_set()
    assert "unmapping a closed session's engine memory failed" in caplog.text


def test_a_memory_that_maps_nothing_is_closed_at_once_and_not_counted(unmaps):
    """A control-only session's memory: closed before close returns, on no thread."""
    u = unmaps()
    m = Bare()
    u.close(m)
    assert m.closed.is_set()
    assert u.queued == 0 and u.inline == 0 and u.pending_bytes == 0
