"""The multi-user setup with real, distinct user ids (needs root; skipped otherwise).

kvtierd runs as root with its runtime directory group-owned by GROUP (mode 0750), as the
systemd unit sets it up for group ``kvtier``; its sockets (0660) take that group. Engines
run as other users:

- ENGINE_A (in GROUP) registers, stores and loads byte-exact: its memory reaches the
  daemon as a descriptor, so the daemon needs no access to any file of the engine's
  (before, it opened the engine's /dev/shm file by name and got "permission denied");
- OUTSIDER (not in GROUP) cannot reach the daemon at all;
- SNOOP (in GROUP, another user) cannot reach ENGINE_A's pages by any name or token it
  can learn: not through /proc, not by naming a path in REGISTER, not with a made-up
  token.

The engine processes start as root and drop to their user after their imports: the test
interpreter lives under /root (mode 0700), which the engine users could not read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.integration.test_tp_groups import Ranks, runs

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: runs the daemon and engines as distinct uids"
)

GROUP = 4300
ENGINE_A = 4343
SNOOP = 4444
OUTSIDER = 4545
REPO = Path(__file__).parents[2]
WAIT_S = 60.0

CHILD = r"""
import json, os, secrets, sys
from pathlib import Path
import zmq
from kvtier.client.connection.connection import Connection, DaemonError, DaemonUnavailable
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P
from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens

role, uid, groups, rdir = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4])
os.setgroups(groups)
os.setgid(groups[0] if groups else uid)
os.setuid(uid)
out = {"uid": os.getuid(), "pid": os.getpid()}

def ask(msg):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{rdir}/kvtierd.sock")
    sock.send(P.encode(msg))
    try:
        if not sock.poll(10000):
            return "no reply"
        rep = P.decode_reply(sock.recv())
        return P.ErrorCode(rep.code).name if isinstance(rep, P.ErrorReply) else type(rep).__name__
    finally:
        sock.close(0)
        ctx.term()

if role == "engine":
    pool, conn = engine(rdir)
    keys = conn.page_keys(tokens(2 * SMALL.page_size))
    fill_page(pool, 0, 7)
    fill_page(pool, 1, 8)
    assert conn.store(keys, [0, 1]).wait()
    h = conn.load(keys, [2, 3])
    assert h.count == 2 and h.wait()
    out["exact"] = [page_bytes(pool, 2), page_bytes(pool, 3)] == [page_bytes(pool, 0), page_bytes(pool, 1)]
    out["fd"] = pool.memory_fds()[0]
    print(json.dumps(out), flush=True)
    sys.stdin.readline()
    conn.close()
    pool.close()
elif role == "outsider":
    try:
        pool, conn = engine(rdir)
        out["error"] = None
    except (DaemonUnavailable, DaemonError, PermissionError) as err:
        out["error"] = type(err).__name__
    print(json.dumps(out), flush=True)
elif role == "tp_rank":  # rank 1 of a TP engine of another user's model, never asking
    pool = SharedKVPool(SMALL, 4)
    conn = Connection(pool, model_id=sys.argv[5], config=client_config(rdir), tp_rank=1, tp_size=2)
    out["registered"] = conn.session_id != 0
    print(json.dumps(out), flush=True)
    out["l2"] = conn.lookup(conn.page_keys(tokens(4 * SMALL.page_size))).l2  # nothing stored
    print(json.dumps(out), flush=True)
    sys.stdin.readline()
    conn.close()
    pool.close()
else:  # snoop: victim pid and descriptor number in argv
    victim, fd = int(sys.argv[5]), int(sys.argv[6])
    try:
        os.open(f"/proc/{victim}/fd/{fd}", os.O_RDONLY)
        out["proc"] = "opened"
    except OSError as err:
        out["proc"] = type(err).__name__
    with SharedKVPool(SMALL, 4) as pool:
        mem = pool.export()
        def reg(**over):
            f = dict(req_id=1, protocol_version=P.PROTOCOL_VERSION, namespace=P.NamespaceSpec("m"),
                     geometry=SMALL, memory=mem, pid=victim)
            f.update(over)
            return ask(P.Register(**f))
        named = P.KVMemory(kind="shm", num_pages=64, segments=[P.MemorySegment(
            name=f"/proc/{victim}/fd/{fd}", size=64 * SMALL.page_bytes)],
            buffer_segments=mem.buffer_segments, buffer_offsets=mem.buffer_offsets)
        out["by_name"] = reg(memory=named)
        out["by_token"] = reg(handover=secrets.token_bytes(16))
    print(json.dumps(out), flush=True)
"""


def child(
    role: str, uid: int, groups: list[int], rdir: Path, *extra: object, wait: bool = True
) -> tuple[subprocess.Popen, dict]:
    """Run CHILD as ``uid`` in ``groups``; return it and the JSON line it printed."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            role,
            str(uid),
            json.dumps(groups),
            str(rdir),
            *map(str, extra),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HOME": "/tmp"},
    )
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=WAIT_S)
        pytest.fail(f"{role} printed nothing: {proc.stderr.read()[-3000:]}")
    if wait:
        proc.stdin.close()
        proc.wait(timeout=WAIT_S)
    return proc, json.loads(line)


@pytest.fixture
def group_daemon(short_tmp, daemon_factory):
    """kvtierd as root, its runtime directory root:GROUP 0750."""
    short_tmp.chmod(0o711)
    rdir = short_tmp / "d0"
    rdir.mkdir()
    os.chown(rdir, 0, GROUP)
    rdir.chmod(0o750)
    return daemon_factory()


def test_engines_in_the_daemons_group_register_and_others_cannot_reach_them(group_daemon):
    rdir = group_daemon.runtime_dir
    for name in ("kvtierd.sock", "kvtierd-mem.sock"):
        st = (rdir / name).stat()
        assert (st.st_gid, st.st_mode & 0o777) == (GROUP, 0o660), name

    a, seen = child("engine", ENGINE_A, [GROUP], rdir, wait=False)
    try:
        assert seen["uid"] == ENGINE_A and seen["exact"] is True, seen
        _, outsider = child("outsider", OUTSIDER, [OUTSIDER], rdir)
        assert outsider["error"] == "DaemonUnavailable", outsider
        _, snoop = child("snoop", SNOOP, [GROUP], rdir, seen["pid"], seen["fd"])
        assert snoop == {
            "uid": SNOOP,
            "pid": snoop["pid"],
            "proc": "PermissionError",
            "by_name": "BAD_MEMORY",
            "by_token": "BAD_MEMORY",
        }, snoop
    finally:
        a.stdin.close()
        assert a.wait(timeout=WAIT_S) == 0, a.stderr.read()[-3000:]


def test_another_user_cannot_take_a_rank_of_an_engines_tp_group(group_daemon):
    """A TP engine's ranks agree on every LOOKUP (the minimum over the ranks). A session of
    another user that registers as rank 1 of the same model and TP size, and asks a LOOKUP
    of pages it does not have, joins a group of its own: the engine's ranks still answer
    each other with their full run (its own round times out, answering 0)."""
    rdir = group_daemon.runtime_dir
    ranks = Ranks(rdir, model="tp-shared")  # this process's user (root), ranks 0 and 1
    try:
        keys = ranks.keys(4)
        ranks.each(lambda r: ranks.store(r, keys[r]))
        with AdminClient(group_daemon.endpoint, timeout_s=10.0) as admin:
            asked = admin.stats()["counters"]["lookups"]
            intruder, seen = child("tp_rank", SNOOP, [GROUP], rdir, "tp-shared", wait=False)
            try:
                assert seen == {"uid": SNOOP, "pid": seen["pid"], "registered": True}, seen
                deadline = time.monotonic() + WAIT_S  # its LOOKUP is in: a round is open
                while admin.stats()["counters"]["lookups"] == asked:
                    assert time.monotonic() < deadline, "the other user's LOOKUP never came"
                    time.sleep(0.01)
                assert ranks.each(lambda r: runs(ranks.conns[r], keys[r])) == [(4, 0), (4, 0)]
                assert json.loads(intruder.stdout.readline())["l2"] == 0
            finally:
                intruder.stdin.close()
                assert intruder.wait(timeout=WAIT_S) == 0, intruder.stderr.read()[-3000:]
    finally:
        ranks.close()
