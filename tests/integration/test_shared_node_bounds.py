"""Per-user bounds and multi-user isolation against a real kvtierd, with real distinct uids.

kvtierd runs as root with its runtime directory group-owned by GROUP (mode 0750), as in
test_multiuser.py and test_user_limits.py; the engines are processes of other users in
that group, dropping to their uid after their imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root: runs the daemon and engines as distinct uids"
    ),
    pytest.mark.timeout(120),
]

GROUP = 4300
ATTACKER = 4721
HONEST = 4722
REPO = Path(__file__).parents[2]
WAIT_S = 60.0

CHILD = r"""
import json, os, sys, time
from pathlib import Path
from kvtier.client.connection.connection import Connection, DaemonError, DaemonUnavailable
from kvtier.client.kv_pool.regions import ControlOnly
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P
from tests.engines import SMALL, client_config, engine, fill_page, handover, page_bytes, tokens
from tests.servers import RawDealer

role, uid, rdir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
args = json.loads(sys.argv[4])
os.setgroups([GROUP])
os.setgid(GROUP)
os.setuid(uid)
out = {"uid": os.getuid()}

def emit(**kw):
    out.update(kw)
    print(json.dumps(out), flush=True)

if role == "namespaces":  # control-only sessions, one new model id each, closed at once
    raw = RawDealer(f"ipc://{rdir}/kvtierd.sock", wait_s=10.0)
    memory = ControlOnly(SMALL).export()
    opened, refusal, deadline = 0, None, time.monotonic() + args["max_s"]
    for i in range(args["n"]):
        if time.monotonic() > deadline:
            refusal = "out of time"
            break
        rep = raw.ask(P.encode(P.Register(
            req_id=2 * i + 1, protocol_version=P.PROTOCOL_VERSION,
            namespace=P.NamespaceSpec(f"junk-{i}"), geometry=SMALL, memory=memory,
            pid=os.getpid(), handover=handover(rdir, fds=[]))))
        if isinstance(rep, P.ErrorReply):
            refusal = f"{P.ErrorCode(rep.code).name}: {rep.message}"
            break
        opened += 1
        rep = raw.ask(P.encode(P.Unregister(req_id=2 * i + 2, session_id=rep.session_id)))
        assert isinstance(rep, P.Ack), rep
    raw.close()
    emit(opened=opened, refusal=refusal)

elif role == "engine":  # one engine of a model nobody registered before: store and load
    try:
        pool, conn = engine(rdir, model=args["model"], request_timeout_s=5.0)
    except (DaemonError, DaemonUnavailable) as err:
        emit(error=f"{type(err).__name__}: {err}")
        sys.exit(0)
    try:
        keys = conn.page_keys(tokens(2 * SMALL.page_size, salt=uid))
        fill_page(pool, 0, 11)
        fill_page(pool, 1, 12)
        stored = conn.store(keys, [0, 1]).wait(30)
        h = conn.load(keys, [2, 3])
        loaded = h.count == 2 and h.wait(30)
        exact = [page_bytes(pool, 2), page_bytes(pool, 3)] == [page_bytes(pool, 0), page_bytes(pool, 1)]
        emit(error=None, stored=bool(stored), loaded=bool(loaded), exact=exact)
    finally:
        conn.close()
        pool.close()

elif role == "hugetlb":  # its KV memory in a sealed hugetlb memfd the node has no pages for
    import fcntl
    from kvtier.client.kv_pool.regions import RegionMemory
    size = 2 << 20
    fd = os.memfd_create("kv", os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    parts = SMALL.num_layers * SMALL.components
    chunk = SMALL.page_bytes // parts
    pages = size // SMALL.page_bytes
    regions = [P.MemoryRegion(segment=0, offset=i * pages * chunk, page_stride=chunk,
                              page_bytes=chunk, layer=i // SMALL.components) for i in range(parts)]
    mem = RegionMemory(SMALL, pages, [fd], [size], regions)
    try:
        conn = Connection(mem, model_id="m", config=client_config(rdir, request_timeout_s=5.0))
        conn.close()
        emit(error=None)
    except (DaemonError, DaemonUnavailable) as err:
        emit(error=f"{type(err).__name__}: {err}")
"""


def run_child(
    role: str,
    uid: int,
    rdir: Path,
    child: str = CHILD,
    wait_s: float = WAIT_S,
    **args: object,
) -> dict:
    """Run ``child`` (a script: its role, uid, runtime directory and JSON arguments on its
    command line) as ``uid`` (in GROUP) to its end; the last JSON line it printed."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            child.replace("GROUP", str(GROUP)),
            role,
            str(uid),
            str(rdir),
            json.dumps(args),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=wait_s,
        env={**os.environ, "HOME": "/tmp"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{role} child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


@pytest.fixture
def group_rdir(short_tmp):
    """``short_tmp/d0``, root:GROUP 0750 (the daemon fixture's runtime directory)."""
    short_tmp.chmod(0o711)
    rdir = short_tmp / "d0"
    rdir.mkdir()
    os.chown(rdir, 0, GROUP)
    rdir.chmod(0o750)
    return rdir


def test_one_users_short_lived_sessions_do_not_keep_other_users_models_out(
    group_rdir, daemon_factory
):
    """A user that opens and closes thousands of sessions, each naming a new model, never
    holds more than one session at a time; another user's engine of a new model still
    registers, stores and loads afterwards."""
    d = daemon_factory()
    churn = run_child("namespaces", ATTACKER, d.runtime_dir, n=4200, max_s=45.0)
    assert churn["uid"] == ATTACKER and churn["opened"] > 0, churn
    honest = run_child("engine", HONEST, d.runtime_dir, model="honest-model")
    assert d.proc.poll() is None, d.log_tail()
    assert honest == {
        "uid": HONEST,
        "error": None,
        "stored": True,
        "loaded": True,
        "exact": True,
    }, (honest, churn)


def test_an_engines_unmappable_memory_leaves_the_daemons_health_ok(group_rdir, daemon_factory):
    """A REGISTER of memory the node cannot back (a sealed hugetlb memfd while no huge pages
    are reserved) is refused for that engine alone; the daemon is short of nothing, so its
    HEALTH stays ``ok`` for every other user and operator."""
    if int(Path("/proc/sys/vm/nr_hugepages").read_text()) != 0:
        pytest.skip("needs a node with no huge pages reserved")
    d = daemon_factory()
    got = run_child("hugetlb", ATTACKER, d.runtime_dir)
    assert got["uid"] == ATTACKER and "BAD_MEMORY" in (got["error"] or ""), got
    with AdminClient(d.endpoint, timeout_s=10.0) as a:
        status = a.health().status
    assert status == "ok", (status, got)
