"""One Connection used by several threads at once, as engines use it.

vLLM's scheduler and worker threads, SGLang's HiCache controller threads and kvtier's own
heartbeat thread all use one :class:`~kvtier.client.connection.connection.Connection`
(docs/protocol.md, "Failure semantics": "The reference client's ``Connection`` may be
shared by threads"). Each test runs a real kvtierd (the ``daemon`` fixtures).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
from kvtier.ipc.completion import TransferStatus

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens

LONG = 200
"""Pages of a LOAD that runs on a copy thread for a while (3.2 MiB of SMALL pages)."""
HELD = 60
"""Completion slots (of 64) kept busy by LOADs in flight, so that few circulate."""
WORKERS = 4
ROUNDS = 300


@pytest.mark.timeout(240)
def test_release_of_an_abandoned_load_never_cancels_the_next_transfer_in_its_slot(daemon):
    """Forward-pass threads give up on some LOADs (``wait_layer`` with a timeout of 0, as
    under a tight latency budget), call ``until_ended()`` and recompute; their other LOADs
    go on, while a scheduler thread looks up. No LOAD waited for may end cancelled, and
    every one that succeeds has its bytes: the RELEASE that the heartbeat thread sends for
    an abandoned transfer must cancel that transfer only, never a newer transfer that took
    its completion slot once the abandoned one had ended.

    And the connection never hands out a slot in use: a thread that gives its LOAD up
    records the end late, after the slot left limbo and another LOAD took it. Counting that
    end again would free the slot under the running LOAD (the daemon answers the third LOAD
    in it BUSY, and the second's waiter, finding another transfer's number in its slot,
    never sees its own end)."""
    misses = _Misses()
    logger = logging.getLogger("kvtier.client")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(misses)
    pool, conn = engine(daemon.runtime_dir, num_pages=(WORKERS + 1) * LONG + HELD)
    held = []
    try:
        keys = conn.page_keys(tokens(LONG * 16 + 1, salt=7))[:LONG]
        for i in range(LONG):
            fill_page(pool, i, seed=1000 + i)
        assert conn.store(keys, list(range(LONG))).wait()
        want = [page_bytes(pool, p) for p in range(LONG)]
        one = conn.page_keys(tokens(17, salt=8))[:1]
        assert conn.store(one, [0]).wait()
        # requests in flight hold most completion slots: an ended transfer's slot is
        # reused at once by the next transfer
        base = (WORKERS + 1) * LONG
        held = [conn.load(one, [base + i]) for i in range(HELD)]
        assert all(h.count == 1 for h in held)
        stop = threading.Event()
        errors: list[str] = []
        abandoned = [0]

        def scheduler() -> None:
            for _ in range(1_000_000):
                if stop.is_set():
                    return
                conn.lookup(keys)

        def worker(w: int) -> None:
            dst = list(range((w + 1) * LONG, (w + 2) * LONG))
            for rnd in range(ROUNDS):
                h = conn.load(keys, dst)
                if h.count == 0:  # every slot busy: a miss, allowed
                    continue
                if rnd % 2 == 0 and not h.wait_layer(h.num_layers - 1, timeout=0):
                    abandoned[0] += 1
                    h.until_ended()
                    continue
                # what is checked is that no RELEASE cancels this transfer: a wait past
                # load_timeout_s, or a LOAD the daemon failed on a loaded machine, is a miss
                if not h.wait_loaded():
                    if h._status is not TransferStatus.CANCELLED:
                        continue
                    seq, _, status = h.block.read(h.slot)
                    errors.append(
                        f"worker {w} round {rnd}: LOAD seq {h.seq} in slot {h.slot} failed "
                        f"(slot shows seq {seq} status {status})"
                    )
                elif [page_bytes(pool, p) for p in dst] != want:
                    errors.append(f"worker {w} round {rnd}: wrong bytes")

        workers = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
        sched = threading.Thread(target=scheduler)
        sched.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join(180)
        stop.set()
        sched.join(30)
        assert not any(t.is_alive() for t in [*workers, sched])
        assert abandoned[0] > 0
        assert errors == [], f"{len(errors)} LOADs failed: {errors[:4]}"
        loads = [m for m in misses.lines if m.startswith("Load")]
        busy = [m for m in loads if "BUSY: slot" in m]
        if len(busy) == len(loads):  # a LOAD that went unanswered may be run late
            assert busy == [], f"LOADs sent into a slot in use: {busy[:4]}"
    finally:
        logger.removeHandler(misses)
        logger.setLevel(level)
        for h in held:
            h.wait()
        conn.close()
        pool.close()


class _Misses(logging.Handler):
    """The connection's "treated as a miss" log lines (why a request was one)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "treated as a miss" in text:
            self.lines.append(text)


@pytest.mark.timeout(120)
def test_a_connection_made_without_registering_registers_on_a_first_store(daemon):
    """An engine makes its Connection with ``register=False`` (it may start before
    kvtierd) and its first request is a STORE from its write-through thread.
    docs/protocol.md: "A Connection made with register=False registers on its first
    request instead": that STORE (or, at worst, the next ones) registers and stores; an
    engine that only stores must not stay unregistered with every store dropped."""
    from kvtier.client.connection.connection import Connection
    from kvtier.client.kv_pool.shared import SharedKVPool

    from tests.engines import SMALL, client_config

    pool = SharedKVPool(SMALL, 16)
    conn = Connection(pool, model_id="m", config=client_config(daemon.runtime_dir), register=False)
    try:
        counts = []
        for rnd in range(5):
            keys = [bytes([rnd + 1]) * 32]
            fill_page(pool, rnd, seed=rnd)
            h = conn.store(keys, [rnd])
            counts.append((h.count, h.wait()))
        assert conn.session_id != 0, f"never registered; stores answered {counts}"
        assert counts[0] == (1, True), counts
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(240)
def test_threads_through_a_daemon_restart_never_raise_and_never_load_wrong_bytes(
    daemon_factory,
):
    """Three engine threads store and load their own pages through one Connection while
    kvtierd is killed and restarted on the same runtime directory (the heartbeat thread
    re-registers meanwhile). No call raises into the engine ("Failure is never fatal"),
    every LOAD that reports success holds exactly the bytes stored under its keys, and
    once the new daemon is up the threads get hits again."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, num_pages=64)
    errors: list[str] = []
    hits_after = [0]
    restarted = threading.Event()
    stop = threading.Event()

    def worker(t: int) -> None:
        src, dst = list(range(16 * t, 16 * t + 4)), list(range(16 * t + 8, 16 * t + 12))
        for rnd in range(400):
            if stop.is_set():
                return
            try:
                keys = conn.page_keys(tokens(65, salt=5000 + 1000 * t + rnd))[:4]
                for i, p in enumerate(src):
                    fill_page(pool, p, seed=100_000 * t + 10 * rnd + i)
                want = [page_bytes(pool, p) for p in src]
                st = conn.store(keys, src)
                if not st.wait():
                    st.until_ended()
                    continue
                h = conn.load(keys, dst)
                if h.count == 0:
                    continue
                if not h.wait():
                    h.until_ended()
                    continue
                got = [page_bytes(pool, p) for p in dst[: h.count]]
                if got != want[: h.count]:
                    errors.append(f"thread {t} round {rnd}: wrong bytes in a LOAD of {h.count}")
                elif restarted.is_set():
                    hits_after[0] += 1
            except Exception as err:  # what escapes into the engine is the finding
                errors.append(f"thread {t} round {rnd}: {err!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    try:
        for th in threads:
            th.start()
        time.sleep(1.0)
        d.kill()
        d = daemon_factory()
        restarted.set()
        for _ in range(300):
            if hits_after[0] >= 10 or not any(th.is_alive() for th in threads):
                break
            time.sleep(0.1)
        stop.set()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert errors == [], errors[:5]
        assert hits_after[0] > 0
    finally:
        stop.set()
        conn.close()
        pool.close()


def test_a_transfer_that_raises_before_its_reply_leaves_its_slot_reusable(daemon):
    """A LOAD or STORE that raises on the way (a value the request cannot carry, an
    interrupt while it waits for the reply) gives its completion slot back: once every slot
    has been through that, transfers still run instead of being silent misses."""
    pool, conn = engine(daemon.runtime_dir)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size))
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        for _ in range(conn._slots.count + 2):
            with pytest.raises(TypeError):
                conn.load(keys[:2], [object(), -1])  # not packable: sent as a list, unencodable
        h = conn.load(keys, [4, 5, 6, 7])
        assert h.count == 4 and h.wait()
        assert conn.load(keys[:2], [np.int64(8), np.int64(9)]).wait()  # numpy pages encode
    finally:
        conn.close()
        pool.close()


def taken(lock) -> bool:
    """Whether another thread holds ``lock`` (an RLock) now."""
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


def test_the_end_of_a_load_is_recorded_without_the_connections_lock(daemon):
    """An engine's forward pass records the end of its LOAD while another thread's request
    to a stalled kvtierd holds the connection's lock: it does not wait for that request."""
    pool, conn = engine(daemon.runtime_dir, request_timeout_s=3.0)
    keys = conn.page_keys(tokens(4 * SMALL.page_size))
    try:
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        h = conn.load(keys, [4, 5, 6, 7])
        deadline = time.monotonic() + 10
        while h.block.read(h.slot)[2] == TransferStatus.RUNNING:  # until the daemon ended it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            held = threading.Event()
            t = threading.Thread(target=lambda: (held.set(), conn.lookup(keys)))
            t.start()
            assert held.wait(5)
            end = time.monotonic() + 5
            while not taken(conn._lock):  # the lookup holds it, waiting for its reply
                assert time.monotonic() < end
                time.sleep(0.005)
            assert h.wait_loaded(timeout=0)
            assert taken(conn._lock)  # the lookup still waits: the end did not wait for it
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        t.join()
    finally:
        conn.close()
        pool.close()


def test_release_names_only_slots_that_still_run_the_handles_transfer(daemon):
    """``release(handles)`` from one thread while another is between giving a LOAD up and
    recording its end: the LOAD has ended meanwhile, and its slot may be another transfer's
    by now, so the RELEASE must not name it (it would cancel that transfer). It names a
    slot only while the block shows the handle's own transfer running there."""
    pool, conn = engine(daemon.runtime_dir)
    sent: list[list[int]] = []
    real = conn._session_call

    def spy(make, kind, timeout=None):
        msg = make(conn.session_id)
        sent.append(list(msg.slots))
        return real(make, kind, timeout)

    try:
        keys = conn.page_keys(tokens(2 * SMALL.page_size))
        assert conn.store(keys, [0, 1]).wait()
        h = conn.load(keys, [2, 3])
        deadline = time.monotonic() + 10
        while h.block.read(h.slot)[2] == TransferStatus.RUNNING:  # ended in the daemon
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not h.done  # its end not recorded yet
        conn._session_call = spy
        conn.release([h])
        assert sent == [[]], sent
        assert h.wait()
    finally:
        conn.close()
        pool.close()
