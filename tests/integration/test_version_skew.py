"""Version skew: kvtierd and the engines' client library upgraded at different times.

README promises that an engine that restarts or is upgraded finds its cache warm and that a
restarted kvtierd adopts the pool file the previous one left. In a real node the daemon and
the engines' client library are upgraded separately, so these tests run real kvtierd
processes of an OLDER commit of this repository beside the current client (and the other
way round), and the current daemon over pool files it did not write.

An older commit is checked out as a git worktree (``git worktree add --detach``, never
touching the main checkout's branches), its C extensions built in place, and run with
``PYTHONPATH`` naming a directory whose ``kvtier`` symlink points at the worktree. Tests that
need one skip, saying why, where git, a C compiler or the commit is missing.

What is expected across versions: the same answers as with matching versions, or a clear
refusal that names both versions; never a silent wrong result (an engine page overwritten
after it was told "miss", a reply field read as something it does not say) and never
"the daemon is unavailable" for a daemon that is running and answering.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.replies import DaemonError, DaemonUnavailable
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config.loader import pool_path
from kvtier.daemon.pool.layout import FORMAT_VERSION, MAGIC
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

from tests.conftest import _daemon_flags
from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens

REPO = Path(__file__).resolve().parents[2]

# e91aaa8 (the vLLM AMX fix): the last commit before STORE/LOAD carried ``deadline_ns``
# (8658a67) and PREFETCH's reply said what is ``coming`` (18c5421); same pool format.
OLD_COMMIT = "e91aaa8"
# c042804 (the service/ restructure): the last commit before engine memory was handed over
# as descriptors on a handover socket (b50ddb1); it speaks protocol_version 1 as well.
PRE_HANDOVER_COMMIT = "c042804"

VERSION_OFFSET = len(MAGIC)  # the header: magic (8 bytes), then the uint32 format version


class _Worktree:
    """An older commit checked out and built; ``pythonpath`` imports it as ``kvtier``."""

    def __init__(self, commit: str) -> None:
        self.commit = commit
        self.root = Path(tempfile.mkdtemp(prefix="kvt-old-", dir="/tmp"))
        self.tree = self.root / "tree"
        self.pythonpath = self.root / "py"
        self.added = False

    def create(self) -> None:
        if shutil.which("git") is None:
            pytest.skip("git is not installed: no older worktree to run")
        if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
            pytest.skip("no C compiler: an older worktree's C extensions cannot be built")
        probe = subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{self.commit}^{{commit}}"],
            capture_output=True,
        )
        if probe.returncode != 0:
            pytest.skip(f"commit {self.commit} is not in this repository's history")
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(self.tree), self.commit],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.added = True
        build = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=self.tree,
            capture_output=True,
            text=True,
            timeout=90,
        )
        if build.returncode != 0:
            pytest.skip(f"the C extensions of {self.commit} do not build:\n{build.stderr[-1500:]}")
        self.pythonpath.mkdir()
        (self.pythonpath / "kvtier").symlink_to(self.tree)

    def remove(self) -> None:
        if self.added:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(self.tree)],
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(self.root, ignore_errors=True)


def _worktree(commit: str) -> Iterator[_Worktree]:
    wt = _Worktree(commit)
    try:
        wt.create()
        yield wt
    finally:
        wt.remove()


@pytest.fixture(scope="module")
def old_tree() -> Iterator[_Worktree]:
    """The worktree of :data:`OLD_COMMIT`, built."""
    yield from _worktree(OLD_COMMIT)


@pytest.fixture(scope="module")
def pre_handover_tree() -> Iterator[_Worktree]:
    """The worktree of :data:`PRE_HANDOVER_COMMIT`, built."""
    yield from _worktree(PRE_HANDOVER_COMMIT)


class _OldDaemonProcess(DaemonProcess):
    """A kvtierd of an older commit: it may predate the runtime dir's lock file, so being
    healthy and alive is what tells it started."""

    def _holds_dir(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def versions(short_tmp: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """``versions(tree_or_None, *flags, name="d0")``: a started kvtierd of that worktree (None:
    this checkout), as the ``daemon_factory`` fixture flags it; every one stopped and its pool
    removed at teardown."""
    started: list[DaemonProcess] = []

    def make(tree: _Worktree | None, *args: str, name: str = "d0") -> DaemonProcess:
        flags = _daemon_flags(short_tmp, name, *args)
        if tree is None:
            d = DaemonProcess(short_tmp / name, flags)
        else:
            d = _OldDaemonProcess(short_tmp / name, flags, env={"PYTHONPATH": str(tree.pythonpath)})
        started.append(d)
        return d.start()

    yield make
    for d in started:
        if d.proc is not None:
            d.stop()
        d.remove_pool()


def _imports_old(d: DaemonProcess, tree: _Worktree) -> None:
    """The daemon runs the worktree's code (not this checkout's)."""
    with open(f"/proc/{d.pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    assert f"PYTHONPATH={tree.pythonpath}".encode() in env


# ----------------------------------------------------------------- current client, old daemon


@pytest.mark.timeout(120)
def test_older_daemon_is_refused_by_version_before_any_transfer(old_tree, versions):
    """The current client counts on what protocol 2 added: the daemon honours LOAD's and
    STORE's ``deadline_ns`` (an unanswered LOAD's pages are the engine's again: a daemon
    that ignored it would copy into them after the engine was told "miss") and PREFETCH's
    reply says what is ``coming``. A kvtierd of protocol 1 (e91aaa8, before both) ignores
    the first and leaves the second out, so the client never registers with it: it is
    refused with a DaemonError (PROTOCOL_VERSION) naming both versions, and no transfer
    ever reaches that daemon."""
    d = versions(old_tree)
    _imports_old(d, old_tree)
    pool = SharedKVPool(SMALL, 16)
    try:
        with pytest.raises(DaemonError) as err:
            Connection(pool, model_id="m", config=client_config(d.runtime_dir))
        assert err.value.code == P.ErrorCode.PROTOCOL_VERSION, err.value
        assert "1" in str(err.value) and str(P.PROTOCOL_VERSION) in str(err.value), err.value
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_daemon_of_incompatible_protocol_is_refused_by_version_not_called_unavailable(
    pre_handover_tree, versions
):
    """A client that cannot talk to a running kvtierd because the protocol changed says so
    — a refusal naming both protocol versions (docs/protocol.md: error PROTOCOL_VERSION) —
    rather than ``DaemonUnavailable``, which engines treat as "kvtierd is away, run
    uncached and retry later". A kvtierd of c042804 (before the memory handover socket,
    b50ddb1) has no handover socket and answers HEALTH with protocol version 1."""
    d = versions(pre_handover_tree)
    _imports_old(d, pre_handover_tree)
    with AdminClient(d.endpoint) as admin:
        health = admin.health()
    assert health.status == "ok"
    pool = SharedKVPool(SMALL, 16)
    try:
        try:
            conn = Connection(pool, model_id="m", config=client_config(d.runtime_dir))
        except DaemonUnavailable as err:
            pytest.fail(
                f"a running kvtierd (HEALTH ok, protocol_version {health.protocol_version}) "
                f"was reported unavailable: {err}"
            )
        except DaemonError as err:  # a refusal: it must name the versions
            assert err.code == P.ErrorCode.PROTOCOL_VERSION, err
            assert "protocol 1" in str(err) and str(P.PROTOCOL_VERSION) in str(err), err
        else:
            conn.close()
            pytest.fail("registered with a daemon that predates the memory handover")
    finally:
        pool.close()


# ----------------------------------------------------------------- old client, current daemon


_OLD_CLIENT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import kvtier.ipc.protocol as P
    assert "deadline_ns" not in P.Load.__struct_fields__, "this is not the older client"
    from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
    pool, conn = engine(Path(sys.argv[1]), request_timeout_s=5.0)
    keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=21))
    for p in range(8):
        fill_page(pool, p, 300 + p)
    h = conn.store(keys, list(range(8)))
    assert h.count == 8 and h.wait(), h.count
    assert conn.lookup(keys).l2 == 8
    h = conn.load(keys, list(range(16, 24)))
    assert h.count == 8 and h.wait()
    assert all(page_bytes(pool, 16 + i) == page_bytes(pool, i) for i in range(8))
    conn.close()
    pool.close()
    print("OLD CLIENT OK")
    """
)


def _run_old_client(tree: _Worktree, runtime_dir: Path) -> None:
    """Run :data:`_OLD_CLIENT` with ``tree``'s client library against ``runtime_dir``."""
    run = subprocess.run(
        [sys.executable, "-c", _OLD_CLIENT, str(runtime_dir)],
        env={**os.environ, "PYTHONPATH": f"{tree.pythonpath}:{tree.tree}"},
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert run.returncode == 0 and "OLD CLIENT OK" in run.stdout, run.stderr[-3000:]


def _loads_what_the_old_client_stored(runtime_dir: Path) -> None:
    """This client library loads, byte for byte, the pages :data:`_OLD_CLIENT` stored."""
    pool, conn = engine(runtime_dir)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=21))
        for p in range(8):
            fill_page(pool, p, 300 + p)
        h = conn.load(keys, list(range(16, 24)))
        assert h.count == 8 and h.wait()
        assert all(page_bytes(pool, 16 + i) == page_bytes(pool, i) for i in range(8))
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_older_client_library_stores_and_loads_exactly_through_current_daemon(old_tree, versions):
    """An engine still on the client library of e91aaa8 registers with the
    current kvtierd, stores and loads its pages byte for byte (newer reply fields are
    ignored, the optional request fields it lacks take their defaults); the engine upgraded
    to the current library then finds those pages warm (README: "an engine that ... is
    upgraded finds its cache warm")."""
    d = versions(None)
    _run_old_client(old_tree, d.runtime_dir)
    # the engine upgraded to this client library finds what the older one stored
    _loads_what_the_old_client_stored(d.runtime_dir)


# ----------------------------------------------------------------- pool files across versions


@pytest.mark.timeout(120)
def test_older_daemons_pool_file_is_adopted_exactly_by_current_daemon(old_tree, versions):
    """kvtierd upgraded from e91aaa8 (same pool format version) adopts the pool file the
    old one left, pages an engine of that version stored through it, and they load byte
    for byte into an engine of this version."""
    old = versions(old_tree)
    _imports_old(old, old_tree)
    _run_old_client(old_tree, old.runtime_dir)
    old.stop()
    assert pool_path(Path("/dev/shm"), old.runtime_dir).exists()
    new = versions(None)  # the same runtime dir, so the same pool file
    assert "host pool adopted" in new.log_path.read_text()
    _loads_what_the_old_client_stored(new.runtime_dir)


@pytest.mark.timeout(120)
def test_pool_file_of_another_format_version_is_discarded_with_a_log_line(
    daemon_factory,
):
    """(docs/architecture.md, "Restart survival") A pool file whose format
    version is older, newer or garbage is never read: kvtierd logs why (naming both
    versions), formats the file afresh, serves no page of it and keeps serving."""
    for version in (FORMAT_VERSION - 1, FORMAT_VERSION + 1, 0xFFFFFFFF):
        d = daemon_factory()
        pool, conn = engine(d.runtime_dir)
        try:
            keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=version & 0xFFFF))
            h = conn.store(keys, [0, 1, 2, 3])
            assert h.count == 4 and h.wait()
        finally:
            conn.close()
        d.stop()
        path = pool_path(Path("/dev/shm"), d.runtime_dir)
        with open(path, "r+b") as f:
            f.seek(VERSION_OFFSET)
            f.write(struct.pack("<I", version))
        d.log_path.write_text("")
        d.start()
        log = d.log_path.read_text()
        assert f"format version {version}, this build reads {FORMAT_VERSION}" in log, log
        try:
            conn = Connection(pool, model_id="m", config=client_config(d.runtime_dir))
            assert conn.lookup(keys).l2 == 0
            h = conn.store(keys, [0, 1, 2, 3])
            assert h.count == 4 and h.wait()
            assert conn.lookup(keys).l2 == 4
        finally:
            conn.close()
            pool.close()
        with open(path, "rb") as f:
            f.seek(VERSION_OFFSET)
            assert struct.unpack("<I", f.read(4))[0] == FORMAT_VERSION
        d.stop()
        d.remove_pool()
