"""The pool file's life across kvtierd restarts: what an adopted pool claims about L3, and
who may remove a pool file while a daemon starts on it (real kvtierd processes)."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.config.loader import pool_path
from kvtier.launch.daemon_process import DaemonStartError

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
from tests.integration.test_l3_tier import (
    counters,
    l3_flags,
    store_pages,
    wait_written,
)
from tests.servers import RedisServer, serve_redis

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


def redis_flushall(server: RedisServer) -> None:
    """FLUSHALL on the real server (RESP by hand: no client library needed)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as s:
        s.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
        assert s.recv(64).startswith(b"+OK"), "FLUSHALL refused"


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_pool_adopted_after_its_l3_store_was_emptied_is_written_to_l3_again(
    daemon_factory, short_tmp, request, backend
):
    """L3 was emptied while kvtierd was down (the file store's directory removed, Redis
    flushed): the adopted pages are in no L3, so they are written again (under
    write-through, as soon as L3 is open; a SYNC waits for what is left)."""
    if backend == "file":
        flags = l3_flags("file", prefetch_threshold="0")
    else:
        server = request.getfixturevalue("redis_server")
        flags = l3_flags("redis", {"url": server.url}, prefetch_threshold="0")
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 6)
        wait_written(d, 6)  # write-through: L3 holds the six pages
        assert d.stop() == 0
        if backend == "file":
            shutil.rmtree(short_tmp / "d0" / "state" / "l3")
        else:
            redis_flushall(server)
        d2 = daemon_factory(*flags)
        assert conn.lookup(keys).l2 == 6  # the pool was adopted
        with AdminClient(d2.endpoint, timeout_s=5.0) as admin:
            info = admin.stats()["adopt"]
            assert info["adopted"] and info["pages_adopted"] == 6, info
            rep = admin.sync(30.0)
        # L3 held none of them: all six written again, by the start's back-up or the SYNC
        assert (rep.failed, rep.left) == (0, 0) and rep.written == rep.pages <= 6, rep
        assert counters(d2)["l3_write_written_pages"] == 6
    finally:
        conn.close()
        pool.close()


def test_write_back_never_evicts_an_adopted_page_the_emptied_l3_does_not_hold(
    daemon_factory, short_tmp
):
    """Under write-back only pages in L3 may leave L2. After a restart over an emptied file
    store, the adopted pages must be written before they are evicted: a LOOKUP still finds
    each of them in L2 or in L3, never in no tier."""
    flags = (
        "--hicache-size",
        "8MiB",
        "--extent-size",
        "4MiB",
        "--hicache-write-policy",
        "write_back",
        *l3_flags("file", prefetch_threshold="0"),
    )
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 6)
        with AdminClient(d.endpoint, timeout_s=5.0) as admin:
            assert admin.sync(30.0).written == 6  # in L3, and flagged so in the pool file
        assert d.stop() == 0
        shutil.rmtree(short_tmp / "d0" / "state" / "l3")
        daemon_factory(*flags)
        r = conn.lookup(keys)
        assert (r.l2, r.l3) == (6, 0)  # adopted; L3 is empty
        # 12 more chains of 64 pages (16 KiB each: 12 MiB through an 8 MiB pool); a store
        # that finds no page to evict may store less: the pages' fate is what counts here
        for salt in range(1, 13):
            more = conn.page_keys(tokens(64 * SMALL.page_size, salt=salt))
            for p in range(64):
                fill_page(pool, p, seed=salt * 100 + p)
            conn.store(more, list(range(64))).wait()
            if conn.lookup(keys).l2 < 6:
                break
        r = conn.lookup(keys)
        assert r.l2 + r.l3 == 6, f"adopted pages in no tier: L2 {r.l2}, L3 {r.l3}"
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------- kvtier pools --remove

_UNLINK_SYSCALLS = {"87", "263"}  # x86_64: unlink, unlinkat


def _traced_child(tracer: subprocess.Popen[bytes]) -> int | None:
    """The pid of the process strace runs (its only child), once it exists."""
    try:
        kids = Path(f"/proc/{tracer.pid}/task/{tracer.pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def _in_syscall(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return None


def _maps_of(pid: int, path: Path) -> list[str]:
    """The lines of ``pid``'s mappings that name ``path`` (deleted or not)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
        return [line.strip() for line in fh if str(path) in line]


@pytest.mark.skipif(
    shutil.which("strace") is None or platform.machine() != "x86_64",
    reason="needs strace (x86_64) to hold the CLI between its check and its unlink",
)
def test_kvtier_pools_remove_never_unlinks_the_pool_of_a_daemon_that_started_meanwhile(
    daemon_factory, short_tmp
):
    """``kvtier pools --remove`` finds no holder, then a kvtierd starts on the pool's runtime
    directory and adopts it before the CLI's unlink runs (held there by strace's delay
    injection: the real CLI, only slowed). The running daemon's pool file must still be
    there afterwards (refused, or the daemon started after the removal on a new one), so that
    its next restart adopts its pages."""
    shm = short_tmp / "shm"
    shm.mkdir()
    flags = ("--pool-dir", str(shm))
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir)
    try:
        store_pages(pool, conn, 6)
        assert d.stop() == 0
        ppath = pool_path(shm, d.runtime_dir)
        assert ppath.exists()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        tracer = subprocess.Popen(
            [
                "strace", "-I", "1", "-f", "-qq", "-o", "/dev/null", "-P", str(ppath),
                "-e", "trace=unlink,unlinkat",
                "-e", "inject=unlink,unlinkat:delay_enter=60000000",
                sys.executable, "-m", "kvtier.cli.main", "pools", "--pool-dir", str(shm),
                "--remove", str(ppath),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30.0
            cli = None
            while True:  # until the CLI has checked and sits in its (delayed) unlink
                assert tracer.poll() is None, tracer.stderr.read() if tracer.stderr else ""
                cli = cli or _traced_child(tracer)
                if cli is not None and _in_syscall(cli) in _UNLINK_SYSCALLS:
                    break
                assert time.monotonic() < deadline, "the CLI never reached its unlink"
                time.sleep(0.02)
            try:
                d2 = daemon_factory(*flags)  # adopts the pool the CLI is about to remove
            except DaemonStartError:
                d2 = None  # refused while the CLI held the runtime directory: start it after
            tracer.send_signal(signal.SIGTERM)  # strace detaches: the unlink runs now
            out, err = tracer.communicate(timeout=30.0)
        finally:
            if tracer.poll() is None:
                tracer.kill()
                tracer.wait()
        if d2 is None:
            d2 = daemon_factory(*flags)
        mapped = _maps_of(d2.pid, ppath)
        assert mapped, "the daemon maps no pool file"
        assert ppath.exists() and not any(m.endswith("(deleted)") for m in mapped), (
            f"the running daemon's pool file was unlinked under it "
            f"(kvtier pools said: {out.decode().strip()!r} {err.decode().strip()!r})"
        )
        assert d2.stop() == 0
        d3 = daemon_factory(*flags)  # its next restart adopts what it served
        with AdminClient(d3.endpoint, timeout_s=5.0) as admin:
            info = admin.stats()["adopt"]
        assert info["adopted"], info
        d3.stop()
    finally:
        conn.close()
        pool.close()
        for p in shm.glob("kvtier-pool-*"):
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- damaged pool files


@pytest.mark.parametrize("damage", ["truncated", "extended", "header_zeroed", "rows_garbled"])
def test_a_damaged_pool_file_starts_the_daemon_empty_or_with_sound_pages_only(
    daemon_factory, damage
):
    """Covers the damaged pool file a restart may find (a pool file cut short or grown by
    hand, a zeroed header, garbage over the row metadata): the daemon starts, serves, and
    never serves a page whose key it cannot vouch for; a load gives the engine its own bytes."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 6)
        assert d.stop() == 0
        ppath = pool_path(Path("/dev/shm"), d.runtime_dir)
        size = ppath.stat().st_size
        with open(ppath, "r+b") as fh:
            if damage == "truncated":
                fh.truncate(size // 2)
            elif damage == "extended":
                fh.truncate(size + 4096)
            elif damage == "header_zeroed":
                fh.write(bytes(64))
            else:  # every byte past the header region: the id tables and the row columns
                fh.seek(4096)
                fh.write(bytes(range(256)) * (1 << 12))
        d2 = daemon_factory()
        with AdminClient(d2.endpoint, timeout_s=5.0) as admin:
            info = admin.stats()["adopt"]
        hit = conn.lookup(keys).l2
        if damage != "rows_garbled":
            assert not info["adopted"] and info["pages_adopted"] == 0, info
            assert hit == 0
        if hit:
            h = conn.load(keys[:hit], list(range(32, 32 + hit)))
            assert h.wait()
            assert [page_bytes(pool, 32 + i) for i in range(hit)] == expected[:hit]
        keys2, expected2 = store_pages(pool, conn, 4, salt=9, seed=9)  # serves as usual
        h = conn.load(keys2, list(range(40, 44)))
        assert h.count == 4 and h.wait()
        assert [page_bytes(pool, 40 + i) for i in range(4)] == expected2
    finally:
        conn.close()
        pool.close()


def test_a_long_chain_adopted_over_an_emptied_store_is_written_whole(daemon_factory, short_tmp):
    """The back-up of an adopted pool under write-through goes a ``write_back_queue`` of
    pages at a time: a chain longer than that is written whole, head first, over several
    windows (no page of it is left out of L3)."""
    flags = l3_flags("file", prefetch_threshold="0")
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir, num_pages=32)
    try:
        keys, _ = store_pages(pool, conn, 20)
        wait_written(d, 20)
        assert d.stop() == 0
        shutil.rmtree(short_tmp / "d0" / "state" / "l3")
        d2 = daemon_factory(*flags, "--write-back-queue", "4")
        assert conn.lookup(keys).l2 == 20  # the pool was adopted
        wait_written(d2, 20)
        assert counters(d2)["l3_write_written_pages"] == 20
    finally:
        conn.close()
        pool.close()


def test_a_store_larger_than_the_write_queue_reaches_l3_whole(daemon_factory):
    """Under write-through a STORE of more pages than ``write_back_queue`` holds is written
    to L3 whole: the pages past the queue's room wait and are queued once it has emptied,
    none dropped."""
    d = daemon_factory(*l3_flags("file", prefetch_threshold="0", write_back_queue="4"))
    pool, conn = engine(d.runtime_dir, num_pages=32)
    try:
        store_pages(pool, conn, 20)
        wait_written(d, 20)
        c = counters(d)
        assert c["l3_write_written_pages"] == 20 and c["l3_write_dropped_pages"] == 0, c
    finally:
        conn.close()
        pool.close()
