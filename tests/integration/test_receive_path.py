"""kvtierd reads requests from a reader callback on its socket's descriptor, and ZeroMQ's
descriptor only signals a change: a reply sent from a task (an answer that waited on L3)
may take the signal of a request that arrived meanwhile. These tests interleave replies
sent from the reader with replies sent from tasks, from several engines at once, and
check that every request is answered, and answered right.

A lost request would come back to its engine as a miss (a timed-out LOOKUP counts as
one), so each engine checks the hit count of every reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import threading
import time

import uvloop
import zmq
from kvtier.config import DaemonConfig
from kvtier.config.loader import load_config
from kvtier.daemon.service.server import Daemon
from kvtier.ipc import protocol as P

from tests.engines import engine, fill_page, tokens

ENGINES = 4
ROUNDS = 300
STORED = 4


def test_replies_from_tasks_and_from_the_reader_lose_no_request(daemon_factory, short_tmp):
    d = daemon_factory(
        "--hicache-storage-backend", "file", "--state-dir", str(short_tmp / "d0" / "state")
    )
    engines = [engine(d.runtime_dir, model="m", request_timeout_s=30) for _ in range(ENGINES)]
    try:
        pool, conn = engines[0]
        keys = conn.page_keys(tokens((STORED + 4) * 16))
        for page in range(STORED):
            fill_page(pool, page, seed=page)
        assert conn.store(keys[:STORED], list(range(STORED))).wait()
        errors: list[str] = []

        def run(index: int) -> None:
            c = engines[index][1]
            for i in range(ROUNDS):
                # a full L2 hit is answered by the reader; a run that stops short of the
                # keys asks L3 for the rest, and that answer is sent from a task
                whole = (i + index) % 2 == 0
                got = c.lookup(keys[:STORED] if whole else keys).l2
                if got != STORED:
                    errors.append(f"engine {index}, round {i}: l2 = {got}, not {STORED}")
                    return

        threads = [threading.Thread(target=run, args=(i,)) for i in range(ENGINES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
    finally:
        for pool, conn in engines:
            conn.close()
            pool.close()


def signalled(fd: int, timeout_s: float) -> bool:
    """Whether ZeroMQ's descriptor ``fd`` is readable within ``timeout_s`` (polling it does
    not consume the signal: only the socket's owner processing its commands does)."""
    readable, _, _ = select.select([fd], [], [], timeout_s)
    return bool(readable)


def test_a_request_whose_signal_a_task_reply_took_is_still_answered(short_tmp):
    """Made to happen, not waited for: the daemon (in this process, on uvloop) is held in a
    callback while a request reaches its socket, then sends a reply the way a task does
    (``Receiver.reply_later``). That send processes ZeroMQ's pending commands and clears the
    descriptor's signal of the request; unless the daemon checks its queue after sending,
    the request waits until some other message arrives. The daemon is released once its
    descriptor is seen to signal (quiet before the request, readable after it), and replies
    as a task does until one of its replies is seen to have taken that signal, so the
    situation is reached whatever the timing."""
    cfg = load_config(
        DaemonConfig,
        env={},
        cli={
            "runtime_dir": str(short_tmp / "rt"),
            "state_dir": str(short_tmp / "state"),
            "pool_dir": str(short_tmp / "pool"),
            "hicache_size": 16 << 20,
            "extent_size": 4 << 20,
            "hicache_storage_backend": "none",
            "prefault": False,
            "log_level": "warning",
        },
    )
    (short_tmp / "pool").mkdir()
    daemon = Daemon(cfg)
    ready = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    def serve() -> None:
        loop = uvloop.new_event_loop()
        loops.append(loop)
        try:
            loop.run_until_complete(daemon.run(on_ready=lambda _d: ready.set()))
        finally:
            loop.close()

    server = threading.Thread(target=serve, name="in-process-kvtierd")
    server.start()
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        while not ready.wait(0.1):
            assert server.is_alive(), "the in-process daemon did not start"
        loop = loops[0]
        client.connect(daemon.endpoint)
        client.send(P.encode(P.Health(req_id=1)))
        assert client.poll(30_000), "no reply to the first HEALTH"
        client.recv()
        held, release = threading.Event(), threading.Event()
        descriptor: list[int] = []
        replies: list[bool] = []  # per task reply: whether the signal was still there after it

        def hold_then_reply_as_a_task_does() -> None:
            receiver = daemon.receiver
            assert receiver is not None
            descriptor.append(receiver.sock.getsockopt(zmq.FD))
            held.set()
            release.wait(30)
            # a send processes ZeroMQ's pending commands only if it has not done so within
            # the last max_command_delay CPU clock ticks: reply until one has taken the
            # signal, which the first does if the daemon then checks its queue
            deadline = time.monotonic() + 30
            while not replies or replies[-1]:
                if time.monotonic() > deadline:
                    return
                # reply_later of a reply already made: it runs to its end in one step
                step = receiver.reply_later(
                    b"a-peer-that-left", P.Ack(req_id=9, epoch=daemon.epoch)
                )
                with contextlib.suppress(StopIteration):
                    step.send(None)
                replies.append(signalled(descriptor[0], 0))

        loop.call_soon_threadsafe(hold_then_reply_as_a_task_does)
        assert held.wait(30)
        (fd,) = descriptor
        assert not signalled(fd, 0), "the descriptor signalled before the request was sent"
        client.send(P.encode(P.Health(req_id=2)))
        assert signalled(fd, 30), "the request never signalled the daemon's descriptor"
        release.set()
        assert client.poll(30_000), "the request stayed unanswered after the task's reply"
        assert P.decode_reply(client.recv()).req_id == 2
        assert replies and not replies[-1], f"no task reply took the signal ({len(replies)})"
    finally:
        client.close()
        ctx.term()
        if server.is_alive():
            loops[0].call_soon_threadsafe(daemon.request_stop)
        server.join(60)
        assert not server.is_alive()
