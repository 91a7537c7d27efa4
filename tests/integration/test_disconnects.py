"""Connections that misbehave at the transport cannot hurt kvtierd or its other clients: a
frame past the protocol's ceiling is dropped with its connection before it is buffered,
and a burst of connects and disconnects does not stall an engine's lookups."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import limits as L
from kvtier.ipc import protocol as P
from zmq.utils.monitor import recv_monitor_message

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens

WAIT_S = 20.0
BURST_CYCLES = 2000
SPAN = 200
"""Burst cycles in which the engine must get at least one lookup answered."""


def proc_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def health(endpoint: str) -> str:
    with AdminClient(endpoint, timeout_s=WAIT_S) as admin:
        return admin.health().status


def test_a_64_mib_frame_is_dropped_without_being_buffered(daemon):
    pool, conn = engine(daemon.runtime_dir)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)  # dropped means dropped: no second attempt
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(daemon.endpoint)
        sock.send(P.encode(P.Health(req_id=1)))
        assert sock.poll(int(WAIT_S * 1000)), "no HEALTH reply"
        sock.recv()  # connected and served
        keys = conn.page_keys(tokens(2 * SMALL.page_size))
        fill_page(pool, 0, seed=1)
        fill_page(pool, 1, seed=2)
        assert conn.store(keys, [0, 1]).wait()  # the daemon's steady state, before the frame
        peak, rss = proc_kib(daemon.pid, "VmHWM"), proc_kib(daemon.pid, "VmRSS")
        frame = bytes(64 << 20)
        assert len(frame) > L.MAX_MESSAGE_BYTES
        sock.send(frame, copy=False)
        poller = zmq.Poller()
        poller.register(mon, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        events = dict(poller.poll(int(WAIT_S * 1000)))
        assert sock not in events, "the daemon read the frame whole and answered it"
        assert mon in events, "the daemon kept the connection"
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
        # not buffered: the daemon's peak memory did not grow by anything like the frame
        assert proc_kib(daemon.pid, "VmHWM") - peak < (16 << 10), (peak, rss)
        assert proc_kib(daemon.pid, "VmRSS") - rss < (16 << 10)
        assert health(daemon.endpoint) == "ok"
        h = conn.load(keys, [8, 9])
        assert h.count == 2 and h.wait()
        assert page_bytes(pool, 8) == page_bytes(pool, 0)
        assert page_bytes(pool, 9) == page_bytes(pool, 1)
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()
        conn.close()
        pool.close()


def burst(endpoint: str, cycles: int, progress: list[int]) -> None:
    """``cycles`` connections: each sends HEALTH, then half wait for the reply and half
    hang up before it comes. ``progress[0]`` is the cycle under way, ``cycles`` once done."""
    ctx = zmq.Context()
    try:
        for i in range(cycles):
            progress[0] = i
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send(P.encode(P.Health(req_id=i + 1)))
            if i % 2 == 0:
                assert s.poll(int(WAIT_S * 1000)), f"cycle {i}: no HEALTH reply"
                assert isinstance(P.decode_reply(s.recv()), P.HealthReply)
            s.close(0)
        progress[0] = cycles
    finally:
        ctx.term()


@pytest.mark.timeout(240)
def test_a_connect_disconnect_burst_does_not_stall_an_engine(daemon):
    pool, conn = engine(daemon.runtime_dir)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size))
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        # The engine looks up in a loop while the burst runs; each answer notes how far the
        # burst had got. The engine must be answered all along, in every stretch of SPAN
        # cycles, not kept waiting until the burst is over. Progress is counted in burst
        # cycles, so a slow machine slows both sides alike and changes nothing.
        progress = [-1]  # the burst's cycle under way (-1: not begun)
        answered_at: list[int] = []
        done = threading.Event()

        def engine_loop() -> None:
            while not done.is_set():
                n = conn.lookup(keys).l2  # no answer within request_timeout_s reads 0
                assert n == 4, f"a lookup was not answered (l2 = {n})"
                answered_at.append(progress[0])

        with ThreadPoolExecutor(1, thread_name_prefix="engine-lookups") as lookups:
            looker = lookups.submit(engine_loop)
            try:
                burst(daemon.endpoint, BURST_CYCLES, progress)
            finally:
                done.set()
            looker.result(WAIT_S)  # re-raises a failed lookup
        stretches = {at // SPAN for at in answered_at if at >= 0}
        starved = [k * SPAN for k in range(BURST_CYCLES // SPAN) if k not in stretches]
        assert not starved, f"no lookup answered in the {SPAN} cycles from {starved}"
        assert health(daemon.endpoint) == "ok"
        with AdminClient(daemon.endpoint) as admin:
            sessions = admin.stats()["sessions"]
        assert [s["session_id"] for s in sessions] == [conn.session_id]
    finally:
        conn.close()
        pool.close()
