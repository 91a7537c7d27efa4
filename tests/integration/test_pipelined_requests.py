"""Requests an engine sends back to back, before reading the replies, against a real kvtierd.

Two long STOREs or LOADs on one completion slot read in one burst: the second finds the
slot busy (a long request takes its slot when it is read, not when its task first runs),
so no copy runs untracked and the session's memory is never unmapped under one. CUDA
REGISTERs sent together cannot open more sessions than ``max_sessions`` or
``max_sessions_per_user`` allow (their memory is opened off the loop, between the check and
the session). The CUDA ones use the fake CUDA backend (tests/fake_cuda.py): no GPU here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from kvtier.client.connection.admin import AdminClient
from kvtier.client.kv_pool.cuda import CudaKVPool
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

from tests.conftest import _daemon_flags
from tests.engines import SMALL, handover
from tests.fake_cuda import FakeCuda

pytestmark = pytest.mark.timeout(120)

WAIT_S = 10.0


class Dealer:
    """A bare DEALER that may send several requests before reading the replies."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: P.Request) -> None:
        self.sock.send(P.encode(msg))

    def recv(self) -> P.Reply:
        assert self.sock.poll(int(WAIT_S * 1000)), "kvtierd did not answer"
        return P.decode_reply(self.sock.recv())

    def ask(self, msg: P.Request) -> P.Reply:
        self.send(msg)
        return self.recv()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def stats(d: DaemonProcess) -> dict:
    with AdminClient(d.endpoint, timeout_s=WAIT_S) as admin:
        return admin.stats()


def settled(d: DaemonProcess, deadline_s: float = 10.0) -> dict:
    end = time.monotonic() + deadline_s
    while True:
        pool = stats(d)["pool"]
        if pool["pages_pinned"] == 0 and pool["pages_writing"] == 0:
            return pool
        assert time.monotonic() < end, f"pages left pinned or writing: {pool}"
        time.sleep(0.05)


def register_msg(pool, token: bytes, req_id: int = 7, model: str = "m", **over) -> P.Register:
    fields: dict[str, object] = {
        "req_id": req_id,
        "protocol_version": P.PROTOCOL_VERSION,
        "namespace": P.NamespaceSpec(model),
        "geometry": pool.geometry,
        "memory": pool.export(),
        "pid": os.getpid(),
        "handover": token,
    }
    fields.update(over)
    return P.Register(**fields)


# --------------------------------------------------------------------------- CUDA quotas

G = P.Geometry(num_layers=2, page_size=16, kv_heads=2, head_dim=64, dtype="bfloat16")


@pytest.fixture
def fake(short_tmp: Path) -> FakeCuda:
    return FakeCuda(short_tmp / "fc")


def fake_daemon(short_tmp: Path, fake: FakeCuda, *flags: str) -> DaemonProcess:
    d = DaemonProcess(
        short_tmp / "d0",
        _daemon_flags(short_tmp, "d0", *flags),
        env={"FAKE_CUDA_DIR": str(fake.root)},
        module="tests.fake_cuda_kvtierd",
    )
    return d.start()


@pytest.fixture(params=["--max-sessions-per-user", "--max-sessions"])
def quota_daemon(request, short_tmp: Path, fake: FakeCuda) -> Iterator[DaemonProcess]:
    d = fake_daemon(short_tmp, fake, request.param, "1")
    try:
        yield d
    finally:
        if d.proc is not None:
            d.stop()
        d.remove_pool()


def test_concurrent_cuda_registers_cannot_exceed_the_session_bounds(quota_daemon, fake):
    """CUDA REGISTERs sent back to back, each opening its memory off the loop: the bound
    of 1 admits one of them; the others are refused BUSY."""
    pools = [CudaKVPool(G, 8, backend=fake) for _ in range(3)]
    raw = Dealer(quota_daemon.endpoint)
    try:
        msgs = [
            register_msg(p, handover(quota_daemon.runtime_dir, p, fds=[]), req_id=10 + i)
            for i, p in enumerate(pools)
        ]
        for m in msgs:
            raw.send(m)
        replies = [raw.recv() for _ in msgs]
        ok = [r for r in replies if isinstance(r, P.Registered)]
        assert len(ok) == 1, (
            f"the bound is 1 but {len(ok)} CUDA sessions were opened: "
            f"{[type(r).__name__ for r in replies]}"
        )
        st = stats(quota_daemon)
        assert len(st["sessions"]) == 1, st["sessions"]
    finally:
        raw.close()
        for p in pools:
            p.close()


# --------------------------------------------------------------------------- raw sessions


class RawEngine:
    """A SharedKVPool registered over a bare DEALER: every later request is sent raw."""

    def __init__(
        self, d: DaemonProcess, num_pages: int = 64, model: str = "m", geometry=SMALL
    ) -> None:
        self.pool = SharedKVPool(geometry, num_pages)
        self.raw = Dealer(d.endpoint)
        self._req = 100
        reg = self.raw.ask(register_msg(self.pool, handover(d.runtime_dir, self.pool), model=model))
        assert isinstance(reg, P.Registered), reg
        self.sid = reg.session_id

    def req(self) -> int:
        self._req += 1
        return self._req

    def store(self, keys, pages, slot=0, seq=1) -> P.Reply:
        """A packed STORE of ``keys`` from ``pages``, answered."""
        return self.raw.ask(
            P.Store(
                req_id=self.req(),
                session_id=self.sid,
                packed_keys=P.pack_keys(keys),
                packed_pages=P.pack_pages(pages),
                slot=slot,
                seq=seq,
            )
        )

    def close(self) -> None:
        self.raw.close()
        self.pool.close()


def key(i: int, salt: int = 0) -> bytes:
    return (i + 1000 * salt).to_bytes(8, "little") * 4


BIG = P.Geometry(num_layers=4, page_size=16, kv_heads=8, head_dim=128, dtype="float32")
"""512 KiB pages."""


@pytest.fixture
def sliced(daemon_factory) -> DaemonProcess:
    return daemon_factory("--slice-pages", "4")


@pytest.mark.parametrize("packed", [False, True])
def test_two_long_stores_pipelined_on_one_slot_one_is_busy(sliced, packed):
    """Two long STOREs on one slot read in the same burst: the second finds the slot busy
    (refused), never two copies in one slot. Each copies 24 MiB in 12 slices, so the second
    finds the first still running even when it is read a little later."""
    n = 48
    e = RawEngine(sliced, num_pages=2 * n, geometry=BIG)
    try:
        both = []
        for attempt in range(8):  # the two must be read in one burst: retry, bounded
            msgs = []
            for j in range(2):
                keys = [key(i, salt=100 * attempt + j) for i in range(n)]
                pages = list(range(j * n, (j + 1) * n))
                if packed:
                    extra = {"packed_keys": P.pack_keys(keys), "packed_pages": P.pack_pages(pages)}
                else:
                    extra = {"keys": keys, "pages": pages}
                msgs.append(
                    P.Store(req_id=e.req(), session_id=e.sid, slot=attempt, seq=j + 1, **extra)
                )
            for m in msgs:
                e.raw.send(m)
            replies = [e.raw.recv() for _ in msgs]
            if all(isinstance(r, P.StoreAccepted) and r.writing for r in replies):
                both.append(replies)
                break
        assert not both, f"two transfers accepted in one slot at once: {both}"
    finally:
        e.close()


def test_a_copy_orphaned_by_slot_reuse_outlives_its_sessions_memory(daemon_factory):
    """Two long LOADs pipelined on one slot, the second past its deadline (it would copy
    nothing and end at once): it is refused, so the first stays the slot's transfer, and
    an UNREGISTER right after waits for the first's copy before the session's memory is
    unmapped (kvtierd keeps running)."""
    d = daemon_factory("--slice-pages", "8", "--hicache-size", "640MiB", "--copy-threads", "1")
    n_a, n_b = 400, 440
    e = RawEngine(d, num_pages=n_b, geometry=BIG)
    try:
        keys = [key(i, salt=40) for i in range(n_b)]
        rep = e.store(keys, list(range(n_b)), slot=0, seq=1)
        assert isinstance(rep, P.StoreAccepted) and rep.count == n_b, rep
        settled(d, 60)
        both = []
        for attempt in range(8):  # the two must be read in one burst: retry, bounded
            slot = 1 + attempt
            a = P.Load(
                req_id=e.req(),
                session_id=e.sid,
                packed_keys=P.pack_keys(keys[:n_a]),
                packed_pages=P.pack_pages(list(range(n_a))),
                slot=slot,
                seq=2,
            )
            b = P.Load(
                req_id=e.req(),
                session_id=e.sid,
                packed_keys=P.pack_keys(keys),
                packed_pages=P.pack_pages(list(range(n_b))),
                slot=slot,
                seq=3,
                deadline_ns=1,
            )
            e.raw.send(a)
            e.raw.send(b)
            replies = [e.raw.recv(), e.raw.recv()]
            if all(isinstance(r, P.LoadAccepted) for r in replies):
                both.append(replies)
                break
            settled(d, 30)
        e.raw.send(P.Unregister(req_id=e.req(), session_id=e.sid))
        e.raw.recv()
        time.sleep(1.0)
        assert d.proc.poll() is None, f"kvtierd died ({d.proc.returncode}): {d.log_tail()}"
        assert not both, f"two LOADs accepted in one slot at once: {both}"
    finally:
        e.close()
