"""Long uptime and churn: kvtierd runs for months while engines come and go thousands of
times and local clients connect, register and vanish. Nothing a finished session leaves
behind may pile up, lock later engines out, make a counter run backwards, or spoil what
the daemon keeps across a restart; and after the churn it still serves byte-exact.

Every client here talks the wire protocol itself (``Raw``: a memfd handed over on the
handover socket, REGISTER over a DEALER), as a hostile or simply busy local client would.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import DaemonError
from kvtier.ipc import fdpass
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import handover_path

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
from tests.integration.test_kv_events import event_flags, events, subscriber, wait_for

REPO = Path(__file__).parents[2]
GROUP = 4300
"""The daemon's runtime directory group (engine users are in it)."""
CHURNER = 4343
"""Another user, in GROUP, whose engines come and go."""
WAIT_S = 30.0


# --------------------------------------------------------------------------- raw client
def memfd(nbytes: int) -> int:
    """A sealed memfd of ``nbytes`` (what the reference client hands over)."""
    fd = os.memfd_create("kvt-churn", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def raw_handover(rdir: Path, fds: list[int]) -> tuple[bytes, bytes]:
    """One handover try (no retry on busy): ``(token, reply bytes)``."""
    token = secrets.token_bytes(16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(WAIT_S)
        s.connect(str(handover_path(rdir)))
        socket.send_fds(s, [fdpass.encode_request(token)], fds)
        data, got, _, _ = socket.recv_fds(s, 512, 1)
    for f in got:
        os.close(f)
    return token, data


class Raw:
    """A DEALER speaking the protocol by hand."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(12))
        self.sock.connect(endpoint)
        self.rid = 0

    def call(self, msg: P.Request) -> P.Reply:
        self.rid += 1
        msg.req_id = self.rid
        self.sock.send(P.encode(msg))
        while True:
            assert self.sock.poll(int(WAIT_S * 1000)), f"no reply to {type(msg).__name__}"
            rep = P.decode_reply(self.sock.recv())
            if rep.req_id == self.rid:
                return rep

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def control_session(r: Raw, rdir: Path, geometry: P.Geometry, model: str) -> P.Reply:
    """REGISTER a control-only session (``memory.kind = "none"``): no memory at all."""
    token, data = raw_handover(rdir, [])
    assert data[:1] == b"\x00", data
    return r.call(
        P.Register(
            req_id=0,
            protocol_version=P.PROTOCOL_VERSION,
            namespace=P.NamespaceSpec(model_id=model),
            geometry=geometry,
            memory=P.KVMemory(kind="none", num_pages=1, segments=[]),
            handover=token,
        )
    )


def stats(endpoint: str) -> dict:
    with AdminClient(endpoint, timeout_s=WAIT_S) as admin:
        return admin.stats()


def proc_counts(pid: int) -> dict[str, int]:
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "maps": len(Path(f"/proc/{pid}/maps").read_text().splitlines()),
    }


# --------------------------------------------------------------------------- tests
@pytest.mark.timeout(90)
def test_register_and_vanish_churn_leaves_nothing_behind(daemon_factory):
    """Guard. Hundreds of engines register, store, and leave (UNREGISTER, or a connection
    dropped without a word and its lease run out): afterwards the daemon holds no session,
    no user's use, no extra descriptor, thread or mapping (compared with after a warm-up
    round of the same churn), and an engine still loads byte-exact what it stored."""
    d = daemon_factory("--lease-s", "0.5")
    pool, conn = engine(d.runtime_dir, num_pages=8, heartbeat_interval_s=0.1)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=9))
        for i in range(4):
            fill_page(pool, i, seed=100 + i)
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        G = SMALL
        nb = G.num_layers * G.components
        size = nb * 8 * G.chunk_bytes
        fd = memfd(size)

        def churn(n: int) -> None:
            for i in range(n):
                r = Raw(d.endpoint)
                token, data = raw_handover(d.runtime_dir, [fd])
                assert data[:1] == b"\x00", data
                rep = r.call(
                    P.Register(
                        req_id=0,
                        protocol_version=P.PROTOCOL_VERSION,
                        namespace=P.NamespaceSpec(model_id=f"churn-{i % 7}"),
                        geometry=G,
                        memory=P.KVMemory(
                            kind="fd",
                            num_pages=8,
                            segments=[P.MemorySegment(name="x", size=size)],
                            buffer_segments=[0] * nb,
                            buffer_offsets=[b * 8 * G.chunk_bytes for b in range(nb)],
                        ),
                        handover=token,
                    )
                )
                assert isinstance(rep, P.Registered), rep
                k = [secrets.token_bytes(32)]
                assert isinstance(
                    r.call(
                        P.Store(
                            req_id=0,
                            session_id=rep.session_id,
                            keys=k,
                            pages=[i % 8],
                            slot=0,
                            seq=i + 1,
                        )
                    ),
                    P.StoreAccepted,
                )
                if i % 2 == 0:
                    assert isinstance(
                        r.call(P.Unregister(req_id=0, session_id=rep.session_id)), P.Ack
                    )
                r.close()  # the odd ones just hang up: their lease ends them
                if i % 40 == 39:  # those waiting for their lease stay below the user's bound
                    settled()

        def settled() -> dict:
            deadline = time.monotonic() + WAIT_S
            while True:
                st = stats(d.endpoint)
                if len(st["sessions"]) == 1 or time.monotonic() > deadline:
                    return st
                time.sleep(0.2)

        churn(60)
        st = settled()
        before = proc_counts(d.pid)
        churn(300)
        st = settled()
        after = proc_counts(d.pid)
        assert len(st["sessions"]) == 1, st["sessions"]
        assert st["limits"]["users"]["0"]["sessions"] == 1, st["limits"]
        assert st["pool"]["pages_writing"] == 0 and st["pool"]["pages_pinned"] == 0
        assert after["fds"] <= before["fds"], (before, after)
        assert after["threads"] <= before["threads"] + 1, (before, after)
        assert after["maps"] <= before["maps"] + 8, (before, after)
        h = conn.load(keys, [4, 5, 6, 7])
        assert h.count == 4 and h.wait()
        for i in range(4):
            assert page_bytes(pool, 4 + i) == page_bytes(pool, i)
        os.close(fd)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_descriptor_refusals_counter_never_runs_backwards(daemon_factory):
    """STATS ``limits.refusals`` (and the ``kvtier_limit_refusals_total{setting}`` counter
    built from it) counts, per setting, the requests refused because a bound was reached.
    A counter only grows: after 3 handovers refused for ``descriptors`` and then one
    REGISTER refused for ``descriptors``, it must say 4 (at the very least not less than
    the 3 it said before)."""
    d = daemon_factory()
    # the daemon's descriptor limit, as a `LimitNOFILE=` would set it: half (40) for
    # the waiting handovers, half for the sessions' mappings
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (80, 80))
    junk = memfd(4096)
    try:
        for _ in range(3):  # 39 descriptors + the completion block's 2 > 40
            _, data = raw_handover(d.runtime_dir, [junk] * 39)
            assert data[:1] == b"\x02" and b"RLIMIT_NOFILE" in data, data
        seen = stats(d.endpoint)["limits"]["refusals"].get("descriptors", 0)
        assert seen == 3
        # one memfd, 48 buffers 4 MiB apart: 48 mappings > 40
        g = P.Geometry(num_layers=24, page_size=16, kv_heads=2, head_dim=32, dtype="float32")
        nb, span = g.num_layers * g.components, 4 << 20
        fd = memfd(nb * span)
        token, data = raw_handover(d.runtime_dir, [fd])
        os.close(fd)
        assert data[:1] == b"\x00", data
        r = Raw(d.endpoint)
        try:
            rep = r.call(
                P.Register(
                    req_id=0,
                    protocol_version=P.PROTOCOL_VERSION,
                    namespace=P.NamespaceSpec(model_id="m"),
                    geometry=g,
                    memory=P.KVMemory(
                        kind="fd",
                        num_pages=8,
                        segments=[P.MemorySegment(name="x", size=nb * span)],
                        buffer_segments=[0] * nb,
                        buffer_offsets=[i * span for i in range(nb)],
                    ),
                    handover=token,
                )
            )
        finally:
            r.close()
        assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.BUSY, rep
        assert "RLIMIT_NOFILE" in rep.message, rep.message
        now = stats(d.endpoint)["limits"]["refusals"].get("descriptors", 0)
        assert now >= seen, f"refusals['descriptors'] went from {seen} back to {now}"
        assert now == 4, now
    finally:
        os.close(junk)


CHURN_CHILD = r"""
import json, os, secrets, socket, sys
import zmq
from kvtier.ipc import fdpass, protocol as P
from kvtier.ipc.fdpass import handover_path
uid, gid, rdir, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
os.setgroups([gid]); os.setgid(gid); os.setuid(uid)
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
s.connect(f"ipc://{rdir}/kvtierd.sock")
out = {"uid": os.getuid(), "registered": 0, "refused": None}
for k in range(1, n + 1):
    token = secrets.token_bytes(16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as h:
        h.connect(str(handover_path(rdir)))
        socket.send_fds(h, [fdpass.encode_request(token)], [])
        data, fds, _, _ = socket.recv_fds(h, 512, 1)
    for f in fds:
        os.close(f)
    # a new model each time: its page is 2k bytes
    g = P.Geometry(num_layers=1, page_size=k, kv_heads=1, head_dim=1, dtype="uint8")
    s.send(P.encode(P.Register(req_id=2 * k, protocol_version=P.PROTOCOL_VERSION,
        namespace=P.NamespaceSpec(model_id=f"model-{k}"), geometry=g,
        memory=P.KVMemory(kind="none", num_pages=1, segments=[]), handover=token)))
    assert s.poll(30000)
    rep = P.decode_reply(s.recv())
    if not isinstance(rep, P.Registered):
        out["refused"] = rep.message
        break
    out["registered"] += 1
    s.send(P.encode(P.Unregister(req_id=2 * k + 1, session_id=rep.session_id)))
    assert s.poll(30000)
    assert isinstance(P.decode_reply(s.recv()), P.Ack)
s.close(0); ctx.term()
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(90)
def test_page_sizes_of_sessions_long_gone_do_not_lock_new_models_out(short_tmp, daemon_factory):
    """Engines of many models come and go over a daemon's months of uptime (each model's
    page size is its own: layers x heads x head_dim x page_size x dtype). Once a session
    has ended it holds nothing, and README promises that what one client makes the daemon
    hold is bounded per user and that a bound reached refuses that user's request only,
    "nobody else's requests are affected". So after another user's 256 control-only
    sessions (no memory, no page stored) of 256 models have each registered and
    unregistered, a new engine of yet another model must register."""
    short_tmp.chmod(0o711)
    rdir = short_tmp / "d0"
    rdir.mkdir()
    os.chown(rdir, 0, GROUP)
    rdir.chmod(0o750)
    d = daemon_factory()
    proc = subprocess.run(
        [sys.executable, "-c", CHURN_CHILD, str(CHURNER), str(GROUP), str(d.runtime_dir), "256"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": "/tmp"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"uid": CHURNER, "registered": 256, "refused": None}, out
    st = stats(d.endpoint)
    users = st["limits"]["users"]  # the churner holds nothing; only STATS's own connection
    assert st["sessions"] == [] and str(CHURNER) not in users, st["limits"]
    assert all(set(use) == {"connections"} for use in users.values()), users
    try:
        pool, conn = engine(d.runtime_dir, num_pages=8)
    except DaemonError as err:
        pytest.fail(f"a new engine, after the other user's sessions all ended, is refused: {err}")
    try:
        keys = conn.page_keys(tokens(SMALL.page_size))
        fill_page(pool, 0, seed=5)
        assert conn.store(keys, [0]).wait()
        h = conn.load(keys, [1])
        assert h.count == 1 and h.wait()
        assert page_bytes(pool, 1) == page_bytes(pool, 0)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_namespaces_that_came_and_went_do_not_cost_the_saved_engine_hashes(
    daemon_factory, short_tmp
):
    """With KV events on, a restarted daemon announces the pages it kept under the engines'
    own block hashes, saved at the stop (docs/events.md). The state file is bounded by the
    hashes it may hold (``kv_events_max_hashes``); whatever else it keeps must stay
    bounded too, or the file outgrows that bound and is refused whole at the next start.

    Here one engine stores 8 pages with its hashes; then 400 short-lived control-only
    sessions of 400 other models (4 KiB model ids: allowed up to 4,096 characters)
    register and unregister. After a restart the 8 pages must still be announced by the
    engine's hashes."""
    flags = (*event_flags(short_tmp), "--kv-events-max-hashes", "1000")
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir, num_pages=16)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=1))
        eng = P.EngineBlocks(hashes=[1000 + i for i in range(8)])
        assert conn.store(keys, list(range(8)), engine=eng).wait()
    finally:
        conn.close()
        pool.close()
    r = Raw(d.endpoint)
    try:
        for k in range(400):
            rep = control_session(r, d.runtime_dir, SMALL, f"{k:06d}-" + "x" * 4089)
            assert isinstance(rep, P.Registered), rep
            assert isinstance(r.call(P.Unregister(req_id=0, session_id=rep.session_id)), P.Ack)
    finally:
        r.close()
    assert stats(d.endpoint)["sessions"] == []
    assert d.stop() == 0
    d = daemon_factory(*flags)
    with subscriber(short_tmp) as sub:
        got = wait_for(lambda s=sub: events(s.replay(0), E.BlockStored, "CPU"), what="announce")
    announced = [h for e in got for h in e.block_hashes]
    ignored = [line for line in d.log_tail(400).splitlines() if "KV events: ignoring" in line]
    assert announced == eng.hashes, (announced[:2], ignored)
