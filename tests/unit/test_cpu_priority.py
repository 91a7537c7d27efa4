"""The copy threads yield the CPU to the threads that answer requests: their nice value is
raised (theirs only), and the event loop's and ZeroMQ I/O threads' time slice shortened.
Checked on real threads through the kernel's own view of them (``/proc``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import zmq
from kvtier.daemon.transfer.cpu_priority import (
    SCHED_SETATTR,
    ask_short_slice,
    lower_this_thread,
    zmq_io_threads,
)
from kvtier.daemon.transfer.fair_pool import FairExecutor

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _slice_ns(tid: int) -> int | None:
    """The thread's time slice as the scheduler's debug view shows it (None where the
    kernel does not show it)."""
    try:
        text = Path(f"/proc/self/task/{tid}/sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


def _in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append((fn(), threading.get_native_id())))
    t.start()
    t.join(10)
    return out[0]


def test_lowering_a_thread_leaves_the_others_alone():
    base = _nice(threading.get_native_id())
    if base >= 15:
        pytest.skip(f"this test runs at nice {base} already")

    def lower() -> tuple[bool, int]:
        return lower_this_thread(15), _nice(threading.get_native_id())

    (ok, nice), _tid = _in_thread(lower)
    assert ok and nice == 15
    assert _nice(threading.get_native_id()) == base


def test_the_copy_threads_run_their_initializer_before_any_copy():
    base = _nice(threading.get_native_id())
    if base >= 12:
        pytest.skip(f"this test runs at nice {base} already")
    ex = FairExecutor(2, "test-copy", initializer=lambda: lower_this_thread(12))
    try:
        seen = [
            ex.submit_for(user, lambda: _nice(threading.get_native_id())).result(10)
            for user in (1, 2, 3, 4)
        ]
    finally:
        ex.shutdown()
    assert seen == [12] * 4
    assert _nice(threading.get_native_id()) == base


def test_a_short_slice_is_asked_for_one_thread_only():
    if SCHED_SETATTR.get(os.uname().machine) is None:
        pytest.skip(f"sched_setattr's number is not known on {os.uname().machine}")
    me = threading.get_native_id()
    before = _slice_ns(me)

    def ask() -> int | None:
        tid = threading.get_native_id()
        assert ask_short_slice(tid, 150)
        return _slice_ns(tid)

    got, _ = _in_thread(ask)
    if before is None or got is None:
        pytest.skip("this kernel does not show a thread's slice (/proc/<tid>/sched)")
    assert got == 150_000
    assert _slice_ns(me) == before


def test_zmq_io_threads_are_found_once_a_socket_exists(tmp_path):
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PAIR)
        try:
            sock.bind(f"ipc://{tmp_path}/s")  # a transport its I/O thread serves
            end = time.monotonic() + 10
            while not (tids := zmq_io_threads()) and time.monotonic() < end:
                time.sleep(0.01)  # started with the first socket, it names itself soon after
            assert tids, "libzmq's I/O thread was not found"
            names = {Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tids}
            assert all(n.startswith("ZMQbg/IO/") for n in names), names
        finally:
            sock.close(linger=0)
    finally:
        ctx.term()


def test_nothing_is_found_without_proc(tmp_path):
    assert zmq_io_threads(tmp_path / "missing") == []
