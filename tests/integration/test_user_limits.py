"""No user can starve or exhaust kvtierd: per-user bounds, with real distinct uids (root).

kvtierd runs as root with its runtime directory group-owned by GROUP, as in
test_multiuser.py; the engines and the attacker are processes of other users in that group.
Each test is one attack, or one burst, that worked before the bounds:

- a flood of silent handover connections by one user kept every other user's engines out
  (32 connections were served at once, shared by all);
- sealed sparse memfds declaring terabytes were mapped whole, until the daemon's address
  space ran out (new engines refused with ENOMEM, or the daemon wedged);
- 64 engines of one user starting at once were refused (16 handovers waiting per user; a
  full backlog failed the handover at once).

The children drop to their user after their imports (the interpreter lives under /root).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import free_port

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root: runs the daemon and engines as distinct uids"
    ),
    pytest.mark.timeout(240),
]

GROUP = 4300
ATTACKER = 4611
HONEST = 4612
BURST = 4613
REPO = Path(__file__).parents[2]
WAIT_S = 120.0
MiB = 1 << 20

CHILD = r"""
import json, os, selectors, socket, sys, threading, time
from pathlib import Path
role, uid, rdir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
args = json.loads(sys.argv[4])
if role != "flood":
    from kvtier.client.connection.connection import Connection, DaemonError, DaemonUnavailable
    from kvtier.client.kv_pool.shared import SharedKVPool
    from kvtier.client.kv_pool.regions import ControlOnly, RegionMemory
    from kvtier.ipc import protocol as P
    from kvtier.ipc.shm import seal_size
    from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens
if role == "leak":  # imported, and its descriptor limit raised, while still root
    import resource
    import zmq
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
os.setgroups([GROUP])
os.setgid(GROUP)
os.setuid(uid)
out = {"uid": os.getuid()}

def emit(**kw):
    out.update(kw)
    print(json.dumps(out), flush=True)

if role == "flood":  # silent connections, reopened as fast as the daemon drops them
    path = str(rdir / "kvtierd-mem.sock")
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    opened = again = 0
    def open_one():
        global opened, again
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            again += 1
            s.close()
            return
        opened += 1
        sel.register(s, selectors.EVENT_READ)
    for _ in range(args["n"]):
        open_one()
    emit(flooding=True)
    end = time.monotonic() + args["max_s"]
    live = lambda: len(sel.get_map()) - 1
    while time.monotonic() < end:
        for key, _ in sel.select(0.05):
            if key.fileobj is sys.stdin:
                end = 0
                continue
            sel.unregister(key.fileobj)
            key.fileobj.close()  # dropped by the daemon (busy, or its deadline): reopen
        while live() < args["n"] and time.monotonic() < end:
            before = again
            open_one()
            if again > before:
                time.sleep(0.001)
                break
    emit(opened=opened, again=again)

elif role == "leak":  # ZeroMQ connections to the control socket, one at a time, held
    ctx = zmq.Context()
    socks = []
    for _ in range(args["n"]):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect("ipc://" + str(rdir / "kvtierd.sock"))
        socks.append(s)
        time.sleep(0.002)
    emit(leaking=len(socks))
    sys.stdin.readline()
    for s in socks:
        s.close(0)
    ctx.term()

elif role == "engines":  # honest engines, one after another, each timed (after "go")
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    times, errors = [], []
    for i in range(args["n"]):
        t0 = time.monotonic()
        try:
            pool, conn = engine(rdir, request_timeout_s=args["timeout_s"])
        except (DaemonError, DaemonUnavailable) as err:
            errors.append(str(err))
            continue
        times.append(time.monotonic() - t0)
        try:
            if i:
                continue  # one round trip shows the session works; the rest only register
            keys = conn.page_keys(tokens(2 * SMALL.page_size, salt=100 * uid + i))
            fill_page(pool, 0, 7 + i)
            fill_page(pool, 1, 8 + i)
            assert conn.store(keys, [0, 1]).wait(30)
            h = conn.load(keys, [2, 3])
            assert h.count == 2 and h.wait(30)
            assert [page_bytes(pool, 2), page_bytes(pool, 3)] == [page_bytes(pool, 0), page_bytes(pool, 1)]
        finally:
            conn.close()
            pool.close()
    emit(times=times, errors=errors)

elif role == "burst":  # n engines of this user registering at the same moment
    n = args["n"]
    gate = threading.Barrier(n)
    conns, errors = [None] * n, []
    def one(i):
        pool = SharedKVPool(SMALL, 4)
        conn = Connection(pool, model_id="m", register=False, config=client_config(rdir, request_timeout_s=args["timeout_s"]))
        conns[i] = (pool, conn)
        gate.wait(60)
        try:
            conn.register()
        except (DaemonError, DaemonUnavailable) as err:
            errors.append(f"{type(err).__name__}: {err}")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads: t.start()
    for t in threads: t.join(120)
    ok = sum(1 for pc in conns if pc is not None and pc[1].session_id)
    emit(ok=ok, errors=errors[:5])
    sys.stdin.readline()
    for pc in conns:
        if pc is not None:
            pc[1].close(); pc[0].close()

else:  # sparse: sealed sparse memfds declaring far more than their regions use
    held, fds = [], []
    def sparse(size):
        fd = os.memfd_create("sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        seal_size(fd)
        fds.append(fd)
        return fd
    def attempt(declared, stride, pages=64):
        chunk = SMALL.page_bytes // (SMALL.num_layers * SMALL.components)
        regions, seg_fds = [], []
        for layer in range(SMALL.num_layers):
            for comp in range(SMALL.components):
                regions.append(P.MemoryRegion(segment=len(seg_fds), offset=0, page_stride=stride,
                                              page_bytes=chunk, layer=layer))
                seg_fds.append(sparse(declared))
        mem = RegionMemory(SMALL, pages, seg_fds, [declared] * len(seg_fds), regions)
        try:
            held.append(Connection(mem, model_id="m", config=client_config(rdir)))
            return "ok"
        except DaemonError as err:
            return str(err)
        finally:
            for fd in seg_fds:
                os.close(fd)
            fds.clear()
    chunk = SMALL.page_bytes // (SMALL.num_layers * SMALL.components)
    small = [attempt(8 << 40, chunk) for _ in range(args["small"])]
    wide = attempt(8 << 40, 16 << 20)  # 64 pages 16 MiB apart: about 1 GiB per region
    fill = []
    for _ in range(8):
        fill.append(attempt(8 << 40, 128 << 10))  # about 8 MiB per region, 64 MiB a session
        if fill[-1] != "ok":
            break
    control = []
    for _ in range(args["control"]):
        try:
            held.append(Connection(ControlOnly(SMALL), model_id="m", config=client_config(rdir)))
            control.append("ok")
        except DaemonError as err:
            control.append(str(err))
            break
    emit(small=small, wide=wide, fill=fill, control=control)
    sys.stdin.readline()
    for c in held:
        c.close()
"""


def spawn(role: str, uid: int, rdir: Path, **args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD.replace("GROUP", str(GROUP)),
            role,
            str(uid),
            str(rdir),
            json.dumps(args),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HOME": "/tmp"},
    )


def line(proc: subprocess.Popen) -> dict:
    """The next JSON line the child prints (failing with its stderr when none comes)."""
    text = proc.stdout.readline()
    if not text:
        proc.wait(timeout=WAIT_S)
        pytest.fail(f"child printed nothing: {proc.stderr.read()[-3000:]}")
    return json.loads(text)


def go(proc: subprocess.Popen) -> dict:
    """Start a ready ``engines`` child (its imports done); the JSON line it prints at the end."""
    assert line(proc) == {"ready": True}
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return line(proc)


def finish(proc: subprocess.Popen) -> dict | None:
    """Tell the child to end; the JSON line it prints then, if any."""
    proc.stdin.close()
    text = proc.stdout.readline()
    assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()[-3000:]
    return json.loads(text) if text else None


@pytest.fixture
def group_rdir(short_tmp):
    """``short_tmp/d0``, root:GROUP 0750 (the daemon fixture's runtime directory)."""
    short_tmp.chmod(0o711)
    rdir = short_tmp / "d0"
    rdir.mkdir()
    os.chown(rdir, 0, GROUP)
    rdir.chmod(0o750)
    return rdir


def stats(d) -> dict:
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.stats()


def health(d) -> str:
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.health().status


def vm_size(pid: int) -> int:
    """The process's virtual size in bytes (``VmSize`` of /proc/PID/status)."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmSize:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmSize")


@pytest.mark.parametrize(
    "flags", [(), ("--max-handover-connections", "16")], ids=["per_user_bound", "total_bound"]
)
def test_a_handover_flood_by_one_user_keeps_no_other_users_engines_out(
    group_rdir, daemon_factory, flags
):
    """With the defaults the flooder meets its own per-user bound; with a total bound below
    that, the flooder (holding the most) gives up its oldest connection to the newcomer."""
    d = daemon_factory(*flags)
    honest = spawn("engines", HONEST, d.runtime_dir, n=5, timeout_s=20.0)
    flood = spawn("flood", ATTACKER, d.runtime_dir, n=300, max_s=90)
    try:
        assert line(flood)["flooding"]
        got = go(honest)
        assert finish(honest) is None
        during = stats(d).get("limits", {})
        assert d.proc.poll() is None, d.log_tail()
    finally:
        ended = finish(flood)
    # every honest engine got in: one kept out until its deadline (request_timeout_s) is
    # refused (BUSY, or no answer) and listed in errors
    assert got["uid"] == HONEST and got["errors"] == [] and len(got["times"]) == 5, got
    bound = min(
        during["bounds"]["max_handover_connections_per_user"],
        during["bounds"]["max_handover_connections"],
    )
    assert during["users"].get(str(ATTACKER), {}).get("handover_connections", 0) <= bound
    setting = "max_handover_connections" if flags else "max_handover_connections_per_user"
    assert during["refusals"].get(setting, 0) > 0, during
    assert ended is not None and ended["opened"] > bound, ended
    assert health(d) == "ok"


def test_huge_sparse_segments_cost_the_daemon_only_what_their_regions_use(
    group_rdir, daemon_factory
):
    limit = 256 * MiB
    port = free_port()
    d = daemon_factory(
        "--max-mapped-bytes-per-user",
        str(limit),
        "--max-sessions-per-user",
        "20",
        "--metrics-port",
        str(port),
    )
    before = vm_size(d.pid)
    honest = spawn("engines", HONEST, d.runtime_dir, n=2, timeout_s=10.0)
    attack = spawn("sparse", ATTACKER, d.runtime_dir, small=12, control=20)
    try:
        got = line(attack)
        held = stats(d).get("limits", {})
        grown = vm_size(d.pid) - before
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as rep:
            series = {
                (s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(rep.read().decode())
                for s in fam.samples
            }
        ok = go(honest)
        finish(honest)
        assert health(d) == "ok"
    finally:
        finish(attack)
    # 8 segments of 8 TiB each, declared: registered, each mapping a few MiB
    assert got["small"] == ["ok"] * 12, got
    assert "max_mapped_bytes_per_user = 256.0 MiB" in got["wide"], got
    assert got["fill"][0] == "ok" and "max_mapped_bytes_per_user" in got["fill"][-1], got
    assert "max_sessions_per_user = 20 reached" in got["control"][-1], got
    mine = held["users"][str(ATTACKER)]
    assert mine["mapped_bytes"] <= limit and mine["sessions"] == 20, held
    assert grown < limit + 128 * MiB, f"the daemon's virtual size grew by {grown >> 20} MiB"
    assert ok["errors"] == [] and len(ok["times"]) == 2, ok
    assert (
        series[
            ("kvtier_user_use", frozenset({("uid", str(ATTACKER)), ("resource", "mapped_bytes")}))
        ]
        == mine["mapped_bytes"]
    )
    assert series[("kvtier_limit", frozenset({("setting", "max_mapped_bytes_per_user")}))] == limit
    assert (
        series[
            ("kvtier_limit_refusals_total", frozenset({("setting", "max_mapped_bytes_per_user")}))
        ]
        >= 2
    )


def test_64_engines_of_one_user_starting_at_once_all_register(group_rdir, daemon_factory):
    d = daemon_factory()
    burst = spawn("burst", BURST, d.runtime_dir, n=64, timeout_s=60.0)
    try:
        got = line(burst)
        assert len(stats(d)["sessions"]) == got["ok"]
    finally:
        finish(burst)
    assert got == {"uid": BURST, "ok": 64, "errors": []}, got


def test_a_user_leaking_control_connections_meets_its_share_and_keeps_no_one_out(
    group_rdir, daemon_factory
):
    """A user's process opens ZeroMQ connections to the control socket and never closes
    them (a client that makes a socket per request). Each holds one of kvtierd's
    descriptors, and at its limit libzmq aborts the process, so past half the connections
    bound (1/8 of the descriptor limit) each of that user's new connections is shut down:
    the daemon lives, and another user's engines register and store."""
    d = daemon_factory()
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (512, 512))
    leak = spawn("leak", ATTACKER, d.runtime_dir, n=600)  # more than the limit
    try:
        assert line(leak) == {"uid": ATTACKER, "leaking": 600}
        honest = spawn("engines", HONEST, d.runtime_dir, n=3, timeout_s=20.0)
        got = go(honest)
        assert finish(honest) is None
        limits = stats(d)["limits"]
        assert d.proc.poll() is None, d.log_tail()
    finally:
        finish(leak)
    total, per_user = limits["bounds"]["connections"], limits["bounds"]["connections_per_user"]
    assert (total, per_user) == (512 // 8, 512 // 16)
    assert got["uid"] == HONEST and got["errors"] == [] and len(got["times"]) == 3, got
    assert limits["refusals"]["connections_per_user"] >= 600 - per_user, limits["refusals"]
    assert limits["users"][str(ATTACKER)]["connections"] < total, limits["users"]
