"""DONE in the completion block means "visible": a transfer's final status is written only
after the daemon committed a store's pages (READY) or dropped a load's pins.

An engine that sees DONE may tell another engine at once that the pages are there, or reuse
its own device pages. If DONE came first (the copy thread writing it, or the event loop
writing it before the commit), another session's LOOKUP right after DONE could miss pages
that were stored.

The window between a copy's end and its settling only exists for copies that run on a copy
thread: those above ``INLINE_BYTES`` (a smaller one is copied and settled on the event loop
before the reply goes out). So the transfers here are the three sizes that use a copy
thread: halved (1 to 8 MiB: two parts on the native copy threads, or one half on the event
loop and one on a Python copy thread), whole on one thread (8 to 32 MiB), and split over
several (32 MiB and more).

The window is opened on purpose rather than waited for: the daemon (the real one, in this
process, on uvloop) runs its copies behind a gate the test opens only once it holds the
daemon's event loop in a callback. The copy then ends while the loop cannot settle it, and
the engine's completion block must not say DONE until the test lets the loop go. A whole
copy on one thread runs in C on the native copy threads (where they are built): its gate
is a job of the same user on every thread, queued before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import select
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvloop
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.transfer_handle import TransferHandle
from kvtier.config import DaemonConfig
from kvtier.config.loader import load_config
from kvtier.daemon.service.server import Daemon
from kvtier.daemon.transfer.copy_threads import CopyThreads
from kvtier.daemon.service.transfers import (
    INLINE_BYTES,
    LOOP_SHARE_BYTES,
    SHARE_MIN_BYTES,
    SPLIT_BYTES,
)
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import TransferStatus

from tests.engines import engine, fill_page, page_bytes, tokens
from tests.key_chain import spec_page_keys

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
BIG = P.Geometry(num_layers=4, page_size=16, kv_heads=8, head_dim=256, dtype="float32")
"""1 MiB pages: a transfer's size in MiB is its page count."""
assert BIG.page_bytes == MIB

SIZES = {
    "shared": 2,  # in two halves at once (see the module docstring)
    "thread": 10,  # whole on one copy thread
    "split": 34,  # in parts on both copy threads
}
assert INLINE_BYTES < SHARE_MIN_BYTES <= SIZES["shared"] * MIB <= 2 * LOOP_SHARE_BYTES
assert 2 * LOOP_SHARE_BYTES < SIZES["thread"] * MIB < 2 * SPLIT_BYTES <= SIZES["split"] * MIB
PAGES = max(SIZES.values())


@dataclass
class InProcess:
    """A kvtierd in this process: its event loop, and a gate in front of its copy threads."""

    daemon: Daemon
    loop: asyncio.AbstractEventLoop
    runtime_dir: Path
    gate: threading.Event

    @contextlib.contextmanager
    def loop_held(self) -> Iterator[None]:
        """Hold the daemon's event loop in a callback until the block ends."""
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            release.wait(60)

        self.loop.call_soon_threadsafe(hold)
        assert held.wait(30), "the daemon's loop did not take the callback"
        try:
            yield
        finally:
            release.set()

    def copies_in_flight(self) -> list[concurrent.futures.Future]:
        """The copy threads' futures (read while the loop is held: nothing changes them)."""
        return list(self.daemon.svc.transfers.inflight)

    def native_copies(self) -> int:
        """Copies running in C on the native copy threads, not reaped yet."""
        return len(self.daemon.svc.transfers._jobs)

    def native_ended(self, copies: int, timeout: float) -> bool:
        """Whether the native copy threads report ``copies`` ended copies within ``timeout``
        (not reaped here: the daemon's loop does)."""
        executor = self.daemon.svc.transfers._executor
        assert isinstance(executor, CopyThreads)
        deadline = time.monotonic() + timeout
        while executor.ended() < copies:
            if time.monotonic() > deadline:
                return False
            select.select([executor.fd], [], [], 0.01)
        return True

    def paths_taken(self) -> tuple[int, int]:
        """(transfers split, transfers shared) so far, by the daemon's counters."""
        c = self.daemon.svc.counters
        return c.transfers_split, c.transfers_shared


@pytest.fixture
def kvtierd(short_tmp: Path) -> Iterator[InProcess]:
    """A kvtierd in this process, two copy threads, its copies held until ``gate`` is set
    (then each runs as it would; a test clears the gate again to hold the next ones)."""
    cfg: DaemonConfig = load_config(
        DaemonConfig,
        env={},
        cli={
            "runtime_dir": str(short_tmp / "rt"),
            "state_dir": str(short_tmp / "state"),
            "pool_dir": str(short_tmp / "pool"),
            "hicache_size": 96 << 20,
            "extent_size": 4 << 20,
            "hicache_storage_backend": "none",
            "prefault": False,
            "log_level": "warning",
            "copy_threads": 2,
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
    try:
        while not ready.wait(0.1):
            assert server.is_alive(), "the in-process daemon did not start"
        gate = threading.Event()
        gate.set()
        executor = daemon.svc.transfers._executor
        assert executor is not None
        # Copies reach the threads through submit_for (users take turns) or submit.
        submit_for = executor.submit_for

        def gated_submit_for(
            user: int, fn: Callable[..., Any], *args: Any
        ) -> concurrent.futures.Future:
            def behind_the_gate() -> Any:
                assert gate.wait(60), "the test never opened the copy gate"
                return fn(*args)

            return submit_for(user, behind_the_gate)

        def gated_submit(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
            return gated_submit_for(-1, fn, *args)

        executor.submit_for = gated_submit_for  # type: ignore[method-assign]
        executor.submit = gated_submit  # type: ignore[method-assign]
        if isinstance(executor, CopyThreads):  # a native copy waits behind the gate on every
            submit_copy = executor.submit_copy  # thread: jobs of its user, queued before it

            def gated_submit_copy(user: int, *args: Any) -> int:
                for _ in range(cfg.copy_threads):
                    submit_for(user, gate.wait, 60)
                return submit_copy(user, *args)

            executor.submit_copy = gated_submit_copy  # type: ignore[method-assign]
        yield InProcess(daemon, loops[0], daemon.rdir, gate)
    finally:
        if server.is_alive() and loops:
            loops[0].call_soon_threadsafe(daemon.request_stop)
        server.join(60)
        assert not server.is_alive()


def seen(h: TransferHandle) -> tuple[int, TransferStatus]:
    """(layers done, status) of ``h`` as the engine's completion block shows them now."""
    block = h._block
    assert block is not None
    seq, layers, status = block.read(h.slot)
    assert seq == h.seq
    return layers, TransferStatus(status)


def copy_ended_unsettled(
    d: InProcess, h: TransferHandle, n: int, path: str, before: tuple[int, int]
) -> None:
    """Let ``h``'s copy run to its end while the daemon's loop is held; check that the
    engine sees every layer in place but not DONE (the pages are not settled yet).
    ``before``: :meth:`InProcess.paths_taken` before ``h`` was started."""
    with d.loop_held():
        futs, native = d.copies_in_flight(), d.native_copies()
        assert futs or native, "the copy runs on a copy thread"
        split, shared = (now - was for now, was in zip(d.paths_taken(), before))
        halves = (1, 0) if isinstance(d.daemon.svc.transfers._executor, CopyThreads) else (0, 1)
        assert (split, shared) == {"split": (1, 0), "shared": halves, "thread": (0, 0)}[path]
        d.gate.set()
        done, _ = concurrent.futures.wait(futs, timeout=30)
        assert len(done) == len(futs), "the copy did not end"
        assert not native or d.native_ended(native, 30), "the copy did not end"
        layers, status = seen(h)
        assert layers == BIG.num_layers, "every layer is copied"
        assert status is TransferStatus.RUNNING, (
            f"{n} pages ({path}): the engine sees {status.name} before the daemon settled it"
        )


@pytest.mark.parametrize("path", list(SIZES))
def test_a_store_seen_done_is_visible_to_another_session_at_once(
    kvtierd: InProcess, path: str
) -> None:
    d, n = kvtierd, SIZES[path]
    if path == "shared" and not d.daemon.svc.transfers._share_ok:
        pytest.skip("one CPU: the daemon halves no copy of a few MiB")
    wpool, writer = engine(d.runtime_dir, BIG, num_pages=PAGES, model="visible")
    rpool, reader = engine(d.runtime_dir, BIG, num_pages=1, model="visible")
    try:
        assert reader.ns_fingerprint == writer.ns_fingerprint
        for p in range(n):
            fill_page(wpool, p, seed=p + 1)
        keys = spec_page_keys(
            writer.ns_fingerprint, tokens(n * BIG.page_size, salt=n), BIG.page_size
        )
        d.gate.clear()
        before = d.paths_taken()
        h = writer.store(keys, list(range(n)))
        assert h.count == n and h.writing == n
        copy_ended_unsettled(d, h, n, path, before)
        assert h.wait(), "the store failed"
        assert reader.lookup(keys).l2 == n  # DONE seen: another session finds every page
    finally:
        for conn, pool in ((writer, wpool), (reader, rpool)):
            conn.close()
            pool.close()


@pytest.mark.parametrize("path", list(SIZES))
def test_a_load_seen_done_holds_no_pin(kvtierd: InProcess, path: str) -> None:
    d, n = kvtierd, SIZES[path]
    if path == "shared" and not d.daemon.svc.transfers._share_ok:
        pytest.skip("one CPU: the daemon halves no copy of a few MiB")
    pool, conn = engine(d.runtime_dir, BIG, num_pages=2 * PAGES, model="unpinned")
    try:
        keys = spec_page_keys(conn.ns_fingerprint, tokens(n * BIG.page_size, salt=3), BIG.page_size)
        for p in range(n):
            fill_page(pool, p, seed=p + 1)
        assert conn.store(keys, list(range(n))).wait()
        d.gate.clear()
        before = d.paths_taken()
        h = conn.load(keys, list(range(PAGES, PAGES + n)))
        assert h.count == n
        copy_ended_unsettled(d, h, n, path, before)
        assert h.wait(), "the load failed"
        with AdminClient(d.daemon.endpoint, timeout_s=5.0) as admin:
            assert admin.stats()["pool"]["pages_pinned"] == 0
        assert all(page_bytes(pool, PAGES + p) == page_bytes(pool, p) for p in range(n))
    finally:
        conn.close()
        pool.close()
