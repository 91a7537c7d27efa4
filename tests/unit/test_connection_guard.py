"""The connection guard over real ZeroMQ sockets in-process: connections counted per user,
those past the per-user bound shut down, the counts back to nothing once every connection
closed, and a listener no longer watched counting nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq
from kvtier.daemon.service.connections import ConnectionGuard

from tests.unit.test_tier_store import until

pytestmark = pytest.mark.timeout(30)


async def test_a_users_connections_past_its_share_are_shut_down_and_counted_out(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    guard = ConnectionGuard(notes.append, limit=lambda: 512)  # 64 in all, 32 per user
    assert guard.bounds() == (64, 32)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/c.sock")
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:0")
    stop_router, stop_pub = guard.watch(router), guard.watch(pub)
    dealers = []
    try:
        for _ in range(40):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RECONNECT_IVL, 60_000)  # a refused one stays away meanwhile
            d.connect(f"ipc://{tmp_path}/c.sock")
            dealers.append(d)
        subs = []
        for _ in range(3):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.getsockopt(zmq.LAST_ENDPOINT).decode())
            subs.append(s)
        await until(lambda: guard.refusals["connections_per_user"] >= 8, "8 refusals")
        await until(lambda: guard.use().get(os.getuid()) == 32, "the refused ones closed")
        assert guard.use()[-1] == 3  # the tcp peers: one user of their own
        assert notes == []  # a user's bound is not a shortage of the daemon's
        stop_pub()
        assert -1 not in guard.use() and guard.connections == 32
        for s in subs + dealers:
            s.close(0)
        dealers = []
        await until(lambda: guard.connections == 0, "every connection counted out")
        assert guard.use() == {}
    finally:
        for d in dealers:
            d.close(0)
        stop_router()
        stop_pub()
        router.close(0)
        pub.close(0)
        ctx.term()
