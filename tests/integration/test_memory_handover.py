"""Engine memory reaches kvtierd as sealed descriptors, never by name (a real daemon).

Each test is about one way a client could crash the daemon or reach memory not its own:
a segment truncated under the daemon's mapping (SIGBUS), a segment named by path (another
engine's), a spent or foreign handover token, a lying pid, a session whose end removes
files, and a handover peer that floods or stalls the socket.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.daemon.transfer.engine_memory import TMPFS_MAGIC, fs_type
from kvtier.ipc import fdpass
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES, MAX_HANDOVER_FDS
from kvtier.kernels import guarded_copy

from tests.engines import SMALL, client_config, engine, fill_page, handover, page_bytes, tokens
from tests.servers import RawDealer

WAIT_S = 10.0


class Raw(RawDealer):
    """A bare DEALER that sends one request and waits for its reply."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, wait_s=WAIT_S)

    def ask(self, msg: P.Request) -> P.Reply:  # type: ignore[override]
        return super().ask(P.encode(msg))


@pytest.fixture
def raw(daemon):
    r = Raw(daemon.endpoint)
    yield r
    r.close()


def register(pool: SharedKVPool, token: bytes, **over: object) -> P.Register:
    fields: dict[str, object] = {
        "req_id": 7,
        "protocol_version": P.PROTOCOL_VERSION,
        "namespace": P.NamespaceSpec("h"),
        "geometry": pool.geometry,
        "memory": pool.export(),
        "pid": os.getpid(),
        "handover": token,
    }
    fields.update(over)
    return P.Register(**fields)


def refused(rep: P.Reply, code: P.ErrorCode, *words: str) -> None:
    assert isinstance(rep, P.ErrorReply), rep
    assert rep.code == code, rep
    for w in words:
        assert w in rep.message, rep.message


def healthy(daemon) -> None:
    """The daemon process runs and answers (a SIGBUS would have ended it)."""
    assert daemon.proc.poll() is None, daemon.log_tail()
    with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
        assert admin.health().status == "ok"


def daemon_maps(daemon) -> str:
    return Path(f"/proc/{daemon.pid}/maps").read_text()


def daemon_fds(daemon) -> list[tuple[str, int]]:
    """(target, inode) of each descriptor the daemon holds now."""
    out = []
    for f in Path(f"/proc/{daemon.pid}/fd").iterdir():
        try:
            out.append((os.readlink(f), os.stat(f).st_ino))
        except OSError:  # closed while we looked
            continue
    return out


def sessions(daemon) -> list[dict]:
    with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
        return admin.stats()["sessions"]


def wait_until(cond, what: str, deadline_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def roundtrip(pool: SharedKVPool, conn, salt: int) -> None:
    """Store two pages and load them back into two others, byte-exact."""
    keys = conn.page_keys(tokens(2 * SMALL.page_size, salt=salt))
    fill_page(pool, 0, seed=salt)
    fill_page(pool, 1, seed=salt + 1)
    assert conn.store(keys, [0, 1]).wait()
    h = conn.load(keys, [2, 3])
    assert h.count == 2 and h.wait()
    assert [page_bytes(pool, 2), page_bytes(pool, 3)] == [page_bytes(pool, 0), page_bytes(pool, 1)]


def bare_memfd(size: int, name: str = "hostile") -> int:
    """A memfd of ``size`` bytes with no seal (what a hostile engine could hand over)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


# -- seals: nobody can shrink memory under the daemon --------------------------------------


def test_an_engine_cannot_truncate_its_memory_after_registering(daemon):
    """Before: the engine's segment was a plain /dev/shm file; truncating it and then
    sending STORE made the daemon copy from a page past the file's end: SIGBUS, daemon dead."""
    pool, conn = engine(daemon.runtime_dir)
    try:
        with pytest.raises(OSError) as err:
            os.ftruncate(pool.memory_fds()[0], 0)
        assert err.value.errno == errno.EPERM
        roundtrip(pool, conn, salt=1)
        healthy(daemon)
    finally:
        conn.close()
        pool.close()


@pytest.mark.parametrize("why", ["size", "read_only", "disk_file"])
def test_an_unsafe_descriptor_is_refused_and_never_mapped(daemon, raw, tmp_path, why):
    with SharedKVPool(SMALL, 4) as pool:
        size = pool.segment.size
        if why == "size":
            fd = bare_memfd(size + 4096)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            word = "declares"
        elif why == "read_only":
            fd, word = os.open(f"/proc/self/fd/{pool.memory_fds()[0]}", os.O_RDONLY), "read-write"
        else:
            path = tmp_path / "kv"
            path.write_bytes(bytes(size))
            fd, word = os.open(path, os.O_RDWR), "neither sealed"
            if fs_type(fd) == TMPFS_MAGIC:
                os.close(fd)
                pytest.skip(f"{tmp_path} is on tmpfs: a file there is accepted like a memfd")
        try:
            token = handover(daemon.runtime_dir, fds=[fd])
            refused(
                raw.ask(register(pool, token)), P.ErrorCode.BAD_MEMORY, "memory.segments[0]", word
            )
        finally:
            os.close(fd)
        assert "memfd:hostile" not in daemon_maps(daemon)
        assert str(tmp_path) not in daemon_maps(daemon)
        # refused means spent: the token cannot be tried again
        refused(raw.ask(register(pool, token)), P.ErrorCode.BAD_MEMORY, "used already")
    healthy(daemon)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded_copies", "pread_pwrite"])
@pytest.mark.parametrize("seals", [0, fcntl.F_SEAL_GROW], ids=["unsealed", "grow_only"])
def test_a_memfd_that_may_shrink_fails_only_its_own_copies(daemon_factory, seals, guarded):
    """A memfd that may shrink is accepted: mapped for guarded copies only (a SIGBUS ends
    the copy, not the daemon), or, without them, copied with pread/pwrite and never mapped.
    The engine that truncates it gets failed transfers; the daemon serves on."""
    if guarded and not guarded_copy.BUILT:
        pytest.skip("kvtier.kernels._guarded was not built (no C compiler at install time)")
    daemon = daemon_factory(env=None if guarded else {"KVTIER_NATIVE_OFF": '["guarded_copy"]'})
    with SharedKVPool(SMALL, 4) as src:
        size = src.segment.size
        fd = bare_memfd(size)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        mem = RegionMemory(SMALL, 4, [fd], [size], src.export().layout_regions(SMALL))
        conn = Connection(mem, model_id="m", config=client_config(daemon.runtime_dir))
        try:
            fill_page(src, 1, seed=3)
            os.pwrite(fd, bytes(src.segment.tensor().numpy()), 0)
            keys = conn.page_keys(tokens(SMALL.page_size, salt=5))
            h = conn.store(keys, [1])
            assert h.wait(WAIT_S) and h.ok
            assert ("memfd:hostile" in daemon_maps(daemon)) is guarded
            os.pwrite(fd, bytes(size), 0)  # the engine's page is gone; load it back from L2
            h = conn.load(keys, [1])
            assert h.wait(WAIT_S) and h.ok
            assert os.pread(fd, size, 0) == bytes(src.segment.tensor().numpy())
            os.ftruncate(fd, 0)  # the hostile part: shrink it under the daemon
            more = conn.page_keys(tokens(SMALL.page_size, salt=6))
            h = conn.store(more, [2])
            assert not h.wait(WAIT_S) and h.done and not h.ok
            # a load faults on the mapping; a pwrite past the end grows the file, unless sealed
            h = conn.load(keys, [3])
            assert h.wait(WAIT_S) is (not seals and not guarded) and h.done
            assert conn.lookup(more).l2 == 0  # a failed store leaves nothing behind
        finally:
            conn.close()
            os.close(fd)
    healthy(daemon)


BIG = P.Geometry(num_layers=4, page_size=16, kv_heads=8, head_dim=256, dtype="float32")
"""1 MiB pages: 10 of them (10 MiB) are copied whole on one copy thread (neither on the
event loop, nor shared with it, nor split)."""


@pytest.mark.parametrize("native", [True, False], ids=["native_threads", "python_threads"])
def test_a_memfd_shrunk_under_a_thread_copy_fails_it_and_the_daemon_serves_on(
    daemon_factory, native
):
    """The same hostile truncation under a copy large enough for a copy thread: in C on the
    native copy threads (the SIGBUS ends the copy there, the loop reaps it as failed), or as
    a Python callable. The failed STORE leaves nothing behind; the daemon serves on."""
    if not guarded_copy.BUILT:
        pytest.skip("kvtier.kernels._guarded was not built (no C compiler at install time)")
    assert BIG.page_bytes == 1 << 20
    daemon = daemon_factory(env=None if native else {"KVTIER_NATIVE_OFF": '["copy_threads"]'})
    n = 10
    with SharedKVPool(BIG, 2 * n) as src:
        size = src.segment.size
        fd = bare_memfd(size)
        mem = RegionMemory(BIG, 2 * n, [fd], [size], src.export().layout_regions(BIG))
        conn = Connection(mem, model_id="m", config=client_config(daemon.runtime_dir))
        try:
            for p in range(n):
                fill_page(src, p, seed=p)
            os.pwrite(fd, bytes(src.segment.tensor().numpy()), 0)
            keys = conn.page_keys(tokens(BIG.page_size * n, salt=5))
            h = conn.store(keys, list(range(n)))
            assert h.wait(WAIT_S) and h.ok
            h = conn.load(keys, list(range(n, 2 * n)))
            assert h.wait(WAIT_S) and h.ok
            want = [page_bytes(src, p) for p in range(n)]
            src.segment.tensor().numpy()[:] = np.frombuffer(os.pread(fd, size, 0), np.uint8)
            assert [page_bytes(src, n + p) for p in range(n)] == want
            os.ftruncate(fd, 0)
            more = conn.page_keys(tokens(BIG.page_size * n, salt=6))
            h = conn.store(more, list(range(n)))
            assert not h.wait(WAIT_S) and h.done and not h.ok
            h = conn.load(keys, list(range(n, 2 * n)))
            assert not h.wait(WAIT_S) and h.done and not h.ok
            assert conn.lookup(more).l2 == 0  # a failed store leaves nothing behind
            assert conn.lookup(keys).l2 == n  # nor loses what was there
        finally:
            conn.close()
            os.close(fd)
    healthy(daemon)


# -- names: the daemon opens nothing by name ----------------------------------------------


def test_register_naming_a_segment_is_refused_and_nothing_is_opened(daemon, raw):
    """Before: any /dev/shm/kvtier-engine-* name was opened with the daemon's rights, so one
    tenant could map another's live pages."""
    victim = Path("/dev/shm") / f"kvtier-engine-{os.getpid()}-{secrets.token_hex(4)}"
    with SharedKVPool(SMALL, 4) as pool:
        victim.write_bytes(bytes(pool.segment.size))
        try:
            mem = pool.export()
            by_name = P.KVMemory(
                kind="shm",
                num_pages=mem.num_pages,
                segments=[P.MemorySegment(name=str(victim), size=pool.segment.size)],
                buffer_segments=mem.buffer_segments,
                buffer_offsets=mem.buffer_offsets,
            )
            for token in (b"", handover(daemon.runtime_dir, pool)):
                refused(
                    raw.ask(register(pool, token, memory=by_name, pid=999_999)),
                    P.ErrorCode.BAD_MEMORY,
                    "by descriptor",
                )
            assert str(victim) not in daemon_maps(daemon)
            assert str(victim) not in [target for target, _ in daemon_fds(daemon)]
            assert victim.exists()
        finally:
            victim.unlink(missing_ok=True)
    healthy(daemon)


# -- tokens: one use, one process ----------------------------------------------------------


def test_a_token_is_spent_by_its_register_and_unknown_tokens_are_refused(daemon, raw):
    with SharedKVPool(SMALL, 4) as pool:
        token = handover(daemon.runtime_dir, pool)
        rep = raw.ask(register(pool, token))
        assert isinstance(rep, P.Registered), rep
        refused(raw.ask(register(pool, token)), P.ErrorCode.BAD_MEMORY, "used already")
        refused(
            raw.ask(register(pool, secrets.token_bytes(HANDOVER_TOKEN_BYTES))),
            P.ErrorCode.BAD_MEMORY,
            "hand the memory over",
        )
        refused(raw.ask(register(pool, b"")), P.ErrorCode.BAD_MEMORY, "hand the memory over")
        raw.ask(P.Unregister(req_id=8, session_id=rep.session_id))
    healthy(daemon)


HANDOVER_CHILD = """
import os, sys
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.daemon.transfer.engine_memory import TMPFS_MAGIC, fs_type
from kvtier.kernels import guarded_copy
from tests.engines import SMALL, handover
pool = SharedKVPool(SMALL, 4)
print(handover(sys.argv[1], pool).hex(), flush=True)
sys.stdin.readline()
"""


def test_another_process_cannot_register_with_a_handover_it_did_not_make(daemon, raw):
    """The daemon checks that REGISTER comes from the process that handed the memory over
    (the ipc:// transport tells it the sender's pid)."""
    child = subprocess.Popen(
        [sys.executable, "-c", HANDOVER_CHILD, str(daemon.runtime_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        token = bytes.fromhex(child.stdout.readline().strip())
        with SharedKVPool(SMALL, 4) as pool:
            refused(
                raw.ask(register(pool, token)),
                P.ErrorCode.UNAUTHORIZED,
                f"made by process {child.pid}",
            )
    finally:
        child.stdin.close()
        child.wait(timeout=WAIT_S)
    healthy(daemon)


def test_the_session_pid_is_the_engines_even_when_register_lies(daemon, raw):
    with SharedKVPool(SMALL, 4) as pool:
        rep = raw.ask(register(pool, handover(daemon.runtime_dir, pool), pid=1))
        assert isinstance(rep, P.Registered), rep
        assert [s["pid"] for s in sessions(daemon)] == [os.getpid()]
        raw.ask(P.Unregister(req_id=8, session_id=rep.session_id))


ENGINE_CHILD = """
import sys
from pathlib import Path
from tests.engines import engine, fill_page, tokens
pool, conn = engine(Path(sys.argv[1]))
keys = conn.page_keys(tokens(32))
fill_page(pool, 0, 1)
fill_page(pool, 1, 2)
assert conn.store(keys, [0, 1]).wait()
print("stored", flush=True)
sys.stdin.readline()
"""


def test_a_session_that_dies_removes_no_file(daemon):
    """Before: the reaper unlinked the segment files a dead engine's REGISTER had named, so
    a session naming a victim's file and a dead pid made the daemon remove the victim's."""
    bystander = Path("/dev/shm") / f"kvtier-engine-{os.getpid()}-{secrets.token_hex(4)}"
    bystander.write_bytes(b"x" * 4096)
    child = subprocess.Popen(
        [sys.executable, "-c", ENGINE_CHILD, str(daemon.runtime_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert child.stdout.readline().strip() == "stored"
        assert [s["pid"] for s in sessions(daemon)] == [child.pid]
        child.kill()
        child.wait(timeout=WAIT_S)
        wait_until(lambda: not sessions(daemon), "the dead engine's session was not reaped")
        assert bystander.exists()
        assert not list(Path("/dev/shm").glob(f"kvtier-engine-{child.pid}-*"))
    finally:
        if child.poll() is None:
            child.kill()
        bystander.unlink(missing_ok=True)
    healthy(daemon)


# -- the handover socket under abuse ------------------------------------------------------


def test_too_many_descriptors_are_refused_and_closed(daemon):
    with SharedKVPool(SMALL, 4) as pool:
        fd = pool.memory_fds()[0]
        with pytest.raises(fdpass.HandoverError, match="descriptors"):
            handover(daemon.runtime_dir, fds=[fd] * (MAX_HANDOVER_FDS + 1))  # client-side bound
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:  # bypass it
            s.settimeout(WAIT_S)
            s.connect(str(fdpass.handover_path(daemon.runtime_dir)))
            socket.send_fds(
                s, [fdpass.encode_request(secrets.token_bytes(16))], [fd] * (MAX_HANDOVER_FDS + 8)
            )
            reply = s.recv(fdpass.MAX_REPLY_BYTES)
        assert reply[0] == fdpass.REFUSED and b"descriptors" in reply, reply
        inode = os.fstat(fd).st_ino
        wait_until(
            lambda: inode not in [ino for _, ino in daemon_fds(daemon)],
            "the daemon kept descriptors of a refused handover",
        )
    healthy(daemon)


def test_a_silent_handover_peer_does_not_block_the_daemon(daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stall:
        stall.connect(str(fdpass.handover_path(daemon.runtime_dir)))  # and sends nothing
        pool, conn = engine(daemon.runtime_dir)  # served meanwhile
        try:
            roundtrip(pool, conn, salt=3)
        finally:
            conn.close()
            pool.close()
        stall.settimeout(WAIT_S)
        assert stall.recv(16) == b""  # the daemon gave up on it at its deadline


def test_stop_removes_the_handover_socket_only_if_it_is_still_ours(daemon_factory):
    d = daemon_factory()
    path = fdpass.handover_path(d.runtime_dir)
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o660
    path.unlink()
    path.write_text("someone else's")
    d.stop()
    assert path.read_text() == "someone else's"
    d2 = daemon_factory(name="d1")
    path2 = fdpass.handover_path(d2.runtime_dir)
    d2.stop()
    assert not path2.exists()
