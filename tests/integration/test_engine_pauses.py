"""Engine processes paused (SIGSTOP/SIGCONT) while they hold things in kvtierd.

The engines here are real processes running the client library, driven line by line over
their stdin (as in test_paused_processes.py), stopped and continued by the test; kvtierd is
a real daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool

from tests.driven_engine import Child
from tests.engines import SMALL, client_config, fill_page, tokens


def _stats(d) -> dict:  # type: ignore[no-untyped-def]
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.stats()


def _sids(d) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(int(s["session_id"]) for s in _stats(d)["sessions"])


def _until(cond, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _starve_zmq_io(pid: int) -> None:
    """Starve the ZeroMQ I/O threads of engine process ``pid``: all its threads share one
    CPU and those run only when no other thread of it wants the CPU (SCHED_IDLE), as on a
    node whose cores the engine's own work keeps busy."""
    cpu = min(os.sched_getaffinity(0))
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), {cpu})
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            if comm.startswith("ZMQbg"):
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _in_thread(fn):  # type: ignore[no-untyped-def]
    """Run ``fn()`` on a thread; a function returning its result (bounded wait)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()

    def result(timeout: float = 30.0) -> object:
        t.join(timeout)
        assert out, "the call did not return"
        return out[0]

    return result


# ---------------------------------------------------------------------------- TP groups
@pytest.mark.timeout(120)
def test_tp_rank_paused_past_its_lease_falls_back_into_step(daemon_factory):
    """A tensor-parallel rank that is stopped for longer than its lease loses its session
    and, once continued, re-registers. While it was away its peer's LOOKUP was answered 0
    after ``tp_group_timeout_s`` (documented). After that, the ranks' k-th LOOKUPs must meet
    again (docs: "every rank's k-th request meets the others' k-th"): the late rank's
    request for a round that already ended is answered at once, and the following LOOKUPs,
    asked by both ranks, are answered with the pages both ranks hold, not 0 forever."""
    d = daemon_factory("--lease-s", "1", "--tp-group-timeout-s", "1")
    pool0 = SharedKVPool(SMALL, 32)
    conn0 = Connection(
        pool0,
        model_id="tp-paused",
        config=client_config(d.runtime_dir, heartbeat_interval_s=0.2, request_timeout_s=2.0),
        tp_rank=0,
        tp_size=2,
    )
    r1 = Child(d.runtime_dir, "tp-paused", rank=1, tp=2)
    try:
        keys0 = conn0.page_keys(tokens(4 * SMALL.page_size, salt=5))
        for p in range(4):
            fill_page(pool0, p, p + 1)
        assert conn0.store(keys0, list(range(4))).wait()
        r1.ask("fill 5 0 4")
        assert r1.ask("store 5 0 4") == ["4", "True"]

        def both() -> tuple[int, int]:
            mine = _in_thread(lambda: conn0.lookup(keys0).l2)
            theirs = int(r1.ask("lookup 5 4")[0])
            return int(mine()), theirs  # type: ignore[arg-type]

        assert both() == (4, 4)  # LOOKUP #1: the round completes
        os.kill(r1.pid, signal.SIGSTOP)
        try:
            assert _until(lambda: _sids(d) == [conn0.session_id])  # its lease ran out
            assert conn0.lookup(keys0).l2 == 0  # LOOKUP #2 of rank 0: rank 1 never asked
        finally:
            os.kill(r1.pid, signal.SIGCONT)
        t0 = time.monotonic()
        late = int(r1.ask("lookup 5 4")[0])  # rank 1's LOOKUP #2 (re-registers first)
        waited = time.monotonic() - t0
        assert late == 0
        answers = [both() for _ in range(3)]  # LOOKUPs #3, #4, #5 of both ranks
        assert answers == [(4, 4)] * 3, (answers, f"late LOOKUP #2 waited {waited:.2f}s")
    finally:
        r1.stop()
        conn0.close()
        pool0.close()


@pytest.mark.timeout(180)
def test_tp_rank_paused_while_its_lookup_waits_gets_the_groups_answer(daemon_factory):
    """The ranks of a tensor-parallel engine always get the same LOOKUP answer (the minimum
    over the ranks). When one rank's process is stopped while its LOOKUP waits in kvtierd
    for the other rank, and the other rank then asks (the round completes, kvtierd answers
    both at once), the stopped rank must, once continued, use the answer that is waiting in
    its socket: the same number of pages its peer got, not a miss of its own (its engine
    would then compute a prefix its peer loads)."""
    d = daemon_factory("--tp-group-timeout-s", "2")  # below the ranks' request_timeout_s
    pool0 = SharedKVPool(SMALL, 32)
    conn0 = Connection(
        pool0,
        model_id="tp-stop-wait",
        config=client_config(d.runtime_dir, heartbeat_interval_s=0.2, request_timeout_s=2.0),
        tp_rank=0,
        tp_size=2,
    )
    r1 = Child(d.runtime_dir, "tp-stop-wait", rank=1, tp=2, cfg=dict(request_timeout_s=3.0))
    try:
        keys0 = conn0.page_keys(tokens(4 * SMALL.page_size, salt=6))
        for p in range(4):
            fill_page(pool0, p, p + 1)
        assert conn0.store(keys0, list(range(4))).wait()
        r1.ask("fill 6 0 4")
        assert r1.ask("store 6 0 4") == ["4", "True"]
        _starve_zmq_io(r1.pid)
        answers = []
        for _ in range(8):  # where in its wait the stop lands is a race: several tries
            r1.send("lookup 6 4")  # waits in kvtierd for rank 0 (up to tp_group_timeout_s)
            time.sleep(0.5)
            os.kill(r1.pid, signal.SIGSTOP)
            try:
                mine = conn0.lookup(keys0).l2  # completes the round: rank 1 already asked
                assert mine == 4, "the round did not complete: rank 1's LOOKUP was not in time"
                time.sleep(3.5)  # rank 1 stays stopped past its request_timeout_s
            finally:
                os.kill(r1.pid, signal.SIGCONT)
            answers.append((mine, int(r1._line())))
            if answers[-1] != (4, 4):
                break
            time.sleep(1.2)  # past the client's down window, had there been one
        assert answers[-1] == (4, 4), answers
    finally:
        r1.stop()
        conn0.close()
        pool0.close()
