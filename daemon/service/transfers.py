"""LOAD and STORE copies between engines and the host pool: start one, account for its end.

Where a copy runs depends on its size:

- up to :data:`INLINE_BYTES`, on the event loop itself, before the reply goes out: handing
  a copy of a few pages to a thread and its end back to the loop costs several times the
  copy (a thread wake-up, the GIL changing hands with the loop that answers, a wake-up of
  the loop), so such a transfer has ended, and its final status is in the completion
  block, by the time the engine reads the reply;
- larger, on a thread of the copy pool (the copy itself releases the GIL), started at once
  so the copy overlaps the reply; the threads serve users (uids) in turn
  (:class:`~kvtier.daemon.transfer.copy_threads.CopyThreads`, or
  :class:`~kvtier.daemon.transfer.fair_pool.FairExecutor` without the native queue), so no
  user's copies hold another's back for more than one copy per thread. A whole transfer
  whose regions are one native table runs on the thread in C from start to end
  (:meth:`Transfers._copy_native`): it never takes the GIL, announces its layers itself,
  and its end reaches the loop through the threads' eventfd;
- from :data:`SHARE_MIN_BYTES` (1 MiB) up to ``2 × LOOP_SHARE_BYTES`` (8 MiB), while no
  copy thread is busy, no other request waits and the daemon may use more than one CPU, in
  two halves at once: where the copy can run on the native copy threads, as a split of two
  parts there (below), the event loop free to answer; otherwise one half on a copy thread,
  the other on the event loop before the reply goes out (:meth:`Transfers._share`), as a
  Python copy thread's half moves the GIL for every layer. Otherwise an idle daemon would
  leave a transfer of a few MiB to one thread while the others sat idle, and a thread that
  was asleep starts late (a fraction of a millisecond before it moves its first byte).
  Under load each copy stays whole: halving whenever the copy threads are idle lowers the
  aggregate bandwidth of many engines;
- from ``2 × SPLIT_BYTES`` on, in parts of consecutive pages on several copy threads at
  once (one part per :data:`SPLIT_BYTES`, at most one per thread). A layer is announced
  when every part has copied it (:class:`~kvtier.daemon.transfer.transfer.LayerGate`), and
  the transfer ends when its last part does. On the native copy threads the parts run in
  C, sharing a gate there (:meth:`Transfers._copy_native`): as Python callables each part
  takes the GIL back between layers, and a copy thread that holds it while the kernel runs
  another thread on its core holds up the event loop, and every other engine, with it. A
  long-context LOAD (hundreds of MiB) then runs at the speed of several threads. Smaller transfers stay whole: inside a real engine
  (its forward threads on the same cores) a split load of a few tens of MiB is no shorter
  for the request that waits on it, and the threads serve several whole transfers at once
  instead.

The end of a copy is settled on the event loop, where the pool, the counters and the
session are updated, so nothing here takes a lock; a native copy thread adds it to the
list the loop reaps when the threads' eventfd is readable (:meth:`Transfers._reap`), any
other copy thread hands it over with one thread-safe callback (an asyncio future chained
to the thread's would cost a future, a chain of callbacks and the same wake-up: a large
share of the event loop's CPU time per small LOAD). The engine follows a copy layer by layer
through its completion block, not through a reply.

A session that closed while its copies ran is finalized by the last one to end: its memory
must stay mapped while a copy thread may still touch it.

The end of a transfer of more than ``slice_pages`` pages is settled in slices
(:mod:`~kvtier.daemon.service.slices`: its commit tail first, so that a LOOKUP sees its pages
all at once), from a task of its own, the loop answering others between the slices; the
transfer keeps its completion slot until it is settled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
from kvtier.config import DaemonConfig
from kvtier.daemon.service import slices
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.sessions import Session, SessionState
from kvtier.daemon.service.validation import RequestError
from kvtier.daemon.transfer import copy_threads
from kvtier.daemon.transfer.copy_threads import CopyThreads
from kvtier.daemon.transfer.fair_pool import FairExecutor
from kvtier.daemon.transfer.transfer import (
    STREAM_BYTES,
    Direction,
    LayerGate,
    LayerSink,
    Transfer,
    combine,
    copy_part,
    run_transfer,
)
from kvtier.ipc.completion import TransferStatus
from kvtier.kernels.host_views import ArenaView

log = logging.getLogger("kvtier.daemon")

SPLIT_BYTES = 16 << 20
"""A transfer of at least twice this many bytes (32 MiB) is split in parts of consecutive
pages, copied by several copy threads at once (one part per ``SPLIT_BYTES``, at most one
per thread); each layer is announced once every part has copied it. SGLang's 128-page
batches of 256 KiB pages (32 MiB) are split, which speeds up its prefetch through the real
controller (`kvtier bench sglang`). Smaller ones stay whole: a prefill load of a few tens
of MiB inside a real vLLM, whose own threads want the same cores, gains nothing from
being split."""
INLINE_BYTES = 256 << 10
"""Transfers of at most this many bytes are copied on the event loop: tens of microseconds
of copying, less than handing them to a thread and back costs, so the loop is never held
much longer than by a long LOOKUP. It covers a page of a tensor-parallel rank with one KV
head (16 tokens x 32 layers x K, V x 128 dims x bf16 = 256 KiB) and a few pages of smaller
ones."""

INLINE_REGIONS = 64
"""A session whose regions the native copy cannot take as one table copies region by
region in Python; with more regions than this its copies never run on the event loop
(however small): an engine that declares thousands of tiny regions slows only its own
copies, on the copy threads in its user's turns, never the loop everyone shares."""
INLINE_TABLE_ROWS = 1024
"""The same bound for a session the native copy takes as one table (a row per region):
every honest layout has a few regions per layer, far fewer than this."""

SHARE_MIN_BYTES = 1 << 20
"""The smallest transfer the event loop shares with a copy thread (:meth:`Transfers._share`):
below it the copy is shorter than a thread takes to start, so sharing it is slower than
copying it on the loop alone."""
LOOP_SHARE_BYTES = 4 << 20
"""The most the event loop copies of a shared transfer (:meth:`Transfers._share`: half of
one of at most twice this; larger ones are not shared): a fraction of a millisecond of
copying, about as long as an 8,192-key LOOKUP holds the loop."""


def copy_yield_bytes(cfg: DaemonConfig, direction: Direction, pages: int) -> int:
    """How often the copy of a transfer of ``pages`` pages gives its CPU up
    (:attr:`~kvtier.daemon.transfer.transfer.Transfer.yield_bytes`): a long STORE's (more
    than ``slice_pages`` pages) every ``copy_yield_kib`` KiB, so that the threads answering
    other engines run as soon as they wake up; any other copy never (its engine waits on a
    LOAD, and a short STORE ends within a time slice)."""
    if direction is Direction.STORE and pages > cfg.slice_pages:
        return cfg.copy_yield_kib * 1024
    return 0


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class Transfers:
    """Starts copies (on the loop or a copy thread) and settles them when they end.

    Args:
        ctx: the daemon's shared state.

    Attributes:
        inflight: futures of the copies running on the copy threads as Python callables,
            one per part (the drain at shutdown waits on them, and on the native copies:
            :meth:`wait_copies`; each is dropped once its end is settled).
        pending: the tasks of long requests (:mod:`~kvtier.daemon.service.slices`) still
            allocating, pinning or settling in slices (the drain waits on them too).
        requests_waiting: whether a request is queued, not read yet (the server sets it;
            the loop then leaves a copy to the threads rather than hold that request).
    """

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.inflight: set[Future[Any]] = set()
        self.pending: set[asyncio.Task[Any]] = set()
        self._executor: Executor | FairExecutor | CopyThreads | None = None
        self._native: CopyThreads | None = None
        # native copies running: their transfer, and the parts it is split in (or None)
        self._jobs: dict[int, tuple[Session, Transfer, _Parts | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads = 1
        self._share_ok = False
        self._arena: Any = None
        self.requests_waiting: Callable[[], bool] = lambda: False

    def open(
        self, executor: Executor | FairExecutor | CopyThreads, arena: Any, threads: int = 1
    ) -> None:
        """Start accepting copies (on the event loop, which settles them).

        Args:
            executor: the copy threads.
            arena: the host pool's arena (what copies read and write).
            threads: how many threads ``executor`` runs (a large copy is split over them).
        """
        # checked once here: each copy then finds the arena's address without numpy
        self._executor, self._arena, self._threads = executor, ArenaView.of(arena), threads
        self._share_ok = _cpus() > 1  # on one CPU the loop and a thread would take turns
        self._loop = asyncio.get_running_loop()
        if isinstance(executor, CopyThreads):
            self._native = executor
            self._loop.add_reader(executor.fd, self._reap)

    def close(self) -> None:
        """Drop the arena; call it once the copy threads have ended."""
        self._arena = None
        if self._native is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._native.fd)
        self._native = None

    @property
    def copies(self) -> int:
        """Copies running or queued on the copy threads (their parts, for a split one)."""
        return len(self.inflight) + len(self._jobs)

    async def wait_copies(self, timeout: float) -> int:
        """Wait until every copy on the copy threads has been settled, at most ``timeout``
        seconds; how many were still running then."""
        deadline = time.monotonic() + timeout
        if self.inflight:
            # each copy settles on the loop before its wrapped future wakes this wait
            await asyncio.wait({asyncio.wrap_future(f) for f in self.inflight}, timeout=timeout)
        while self._jobs and time.monotonic() < deadline:  # reaped by the loop as they end
            await asyncio.sleep(0.005)
        return self.copies

    def start(
        self,
        s: Session,
        direction: Direction,
        slot: int,
        seq: int,
        host: list[int],
        pages: Sequence[int],
        keys: Sequence[bytes],
        offsets: np.ndarray | None = None,
        deadline_ns: int = 0,
    ) -> None:
        """Copy pages between ``s``'s memory and host slots.

        A transfer of at most :data:`INLINE_BYTES` has ended, and is settled, when this
        returns (one of more than ``slice_pages`` pages is being settled, in slices); one
        this loop shares with a copy thread (:meth:`_share`) has had its first half copied,
        and may have been settled; a larger one runs on the copy threads.

        Args:
            s: the session.
            direction: STORE (engine → host) or LOAD (host → engine).
            slot: the completion slot the engine waits on; ``seq`` its sequence number.
            host: host pool slots, allocated (STORE) or pinned (LOAD) by the caller.
            pages: engine page indexes, one per host slot (a list, or a numpy array of a
                packed request).
            keys: the page keys, one per host slot (a packed request's stay packed).
            offsets: the arena offsets of ``host`` when the caller has them (a long
                request computes them slice by slice).
            deadline_ns: the request's ``deadline_ns`` (0: none). Past it the engine has
                stopped waiting for the reply and may use its pages again: the transfer fails
                at once, nothing copied (its slot shows it begun, then FAILED; begun before
                the clock is read, see :class:`~kvtier.ipc.protocol.Load`).
        """
        if offsets is None:
            offsets = self.ctx.pool.slot_offsets(host)
        g = s.geometry
        t = Transfer(
            direction=direction,
            session_id=s.session_id,
            slot=slot,
            seq=seq,
            host_slots=host,
            page_ids=np.asarray(pages, dtype=np.int64),
            offsets=offsets,
            nbytes=len(host) * g.page_bytes,
            started=time.monotonic(),
            keys=keys,
            checksum=direction is Direction.STORE and self.ctx.cfg.verify_on_adopt,
            yield_bytes=copy_yield_bytes(self.ctx.cfg, direction, len(host)),
        )
        s.completion.begin(slot, seq, g.num_layers)
        s.transfers[slot] = t
        if deadline_ns and time.monotonic_ns() > deadline_ns:
            self.ctx.counters.transfers_expired += 1
            t.status = TransferStatus.FAILED
            self._settle(s, t, False, wake=False)  # its pins drop, its pages are aborted
            return
        # a STORE's engine waits for its end only: its layers are written without waking it
        store = direction is Direction.STORE
        sink = s.completion.unannounced() if store else s.completion
        if s.cuda is not None:  # on the session's stream, from a copy thread: never inline,
            self.ctx.counters.transfers_cuda += 1  # shared or split (docs/gpu.md)
            fut = self._submit(s, self.ctx.cuda.run, t, s.memory, sink, s.cuda)
            self._watch(fut, lambda f: self._finish(s, t, f))
            return
        n_regions = len(s.memory.regions)
        cheap = n_regions <= INLINE_REGIONS or (
            s.memory.table is not None and n_regions <= INLINE_TABLE_ROWS
        )
        if t.nbytes <= INLINE_BYTES and cheap:  # ends before the reply: nobody to wake
            self.ctx.counters.transfers_inline += 1
            run_transfer(
                t,
                self._arena,
                s.memory.regions,
                g.num_layers,
                g.page_bytes,
                s.completion.unannounced(),
                s.memory.table,
                whole=True,
            )
            self._settle(s, t, t.status is TransferStatus.DONE, wake=False)
            return
        parts = self._parts(t)
        assert self._executor is not None, "open() first"
        table = s.memory.table
        native = (
            self._native is not None
            and table is not None
            and (store or table.writable)
            and not t.checksum
        )
        if (
            parts == 1
            and cheap
            and self._share_ok
            and not self.inflight
            and not self._jobs
            and SHARE_MIN_BYTES <= t.nbytes <= 2 * LOOP_SHARE_BYTES
            and len(host) > 1
            and not self.requests_waiting()
        ):
            if native:  # both halves on the copy threads, in C: the loop stays free
                self._copy_native(s, t, store, 2)
            else:
                self._share(s, t, sink)
            return
        # a short STORE in one call: no turn back to Python between its layers
        whole = store and len(host) <= self.ctx.cfg.slice_pages
        if native:  # a split STORE's parts in one call each too: nobody follows its layers
            self._copy_native(s, t, whole or (store and parts > 1), parts)
            return
        if parts == 1:
            self._watch(
                self._submit(
                    s,
                    run_transfer,
                    t,
                    self._arena,
                    s.memory.regions,
                    g.num_layers,
                    g.page_bytes,
                    sink,
                    s.memory.table,
                    whole,
                ),
                lambda f: self._finish(s, t, f),
            )
            return
        self.ctx.counters.transfers_split += 1
        gate = LayerGate(sink, parts)
        bounds = [len(host) * i // parts for i in range(parts + 1)]
        futs = [
            self._submit(
                s,
                copy_part,
                t,
                bounds[i],
                bounds[i + 1],
                self._arena,
                s.memory.regions,
                g.num_layers,
                g.page_bytes,
                gate.part(i),
                s.memory.table,
            )
            for i in range(parts)
        ]
        left = [parts]

        def part_ended(f: Future[Any]) -> None:  # on the loop
            self.inflight.discard(f)
            left[0] -= 1
            if left[0] == 0:  # the transfer ends with its last part, never before
                combine(
                    [
                        f.result()
                        if not f.cancelled() and f.exception() is None
                        else (TransferStatus.FAILED, None)
                        for f in futs
                    ],
                    t,
                )
                self._settle(s, t, t.status is TransferStatus.DONE)

        for f in futs:
            self._watch(f, part_ended)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``work`` (a long request's slices) in a task the drain at shutdown waits
        for; its failure is logged (the daemon keeps serving)."""
        task = asyncio.get_running_loop().create_task(work)
        self.pending.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self.pending.discard(task)
        err = None if task.cancelled() else task.exception()
        if err is not None and not isinstance(err, RequestError):  # a refusal is replied
            log.error("a long request failed", exc_info=(type(err), err, err.__traceback__))

    def _share(self, s: Session, t: Transfer, sink: LayerSink) -> None:
        """Copy ``t`` in two halves at once: the second on a copy thread, the first here on
        the event loop (the copy releases the GIL). Each layer is announced once both
        halves have copied it. The transfer is settled when the thread's half has ended:
        here, before the reply goes out, as an inline one is (nobody to wake), when it
        ended first; otherwise on the loop once it ends (never before the loop's half).
        Half and half, rather than less for the thread so that it ends first more often:
        the thread starts late, and a smaller share for it leaves the whole transfer
        longer. ``sink`` is where the layers are announced (the session's block, or the
        block without wake-ups for a STORE)."""
        g, n = s.geometry, len(t.host_slots)
        assert self._executor is not None, "open() first"
        self.ctx.counters.transfers_shared += 1
        gate = LayerGate(sink, 2)
        cut = n // 2
        fut = self._submit(
            s,
            copy_part,
            t,
            cut,
            n,
            self._arena,
            s.memory.regions,
            g.num_layers,
            g.page_bytes,
            gate.part(1),
            s.memory.table,
        )
        mine: list[tuple[TransferStatus, list[int] | None]] = []
        settled = [False]

        def ended(f: Future[Any], wake: bool = True) -> None:  # on the loop, after ``mine``
            self.inflight.discard(f)
            if settled[0]:
                return
            settled[0] = True
            theirs = (
                f.result()
                if not f.cancelled() and f.exception() is None
                else (TransferStatus.FAILED, None)
            )
            combine([mine[0], theirs], t)
            self._settle(s, t, t.status is TransferStatus.DONE, wake=wake)

        self._watch(fut, ended)  # runs on the loop: after this method, whenever it ends
        mine.append(
            copy_part(
                t,
                0,
                cut,
                self._arena,
                s.memory.regions,
                g.num_layers,
                g.page_bytes,
                gate.part(0),
                s.memory.table,
            )
        )
        if fut.done():
            ended(fut, wake=False)

    def _copy_native(self, s: Session, t: Transfer, whole: bool, parts: int = 1) -> None:
        """Run ``t`` on the native copy threads, in C from start to end
        (:class:`~kvtier.daemon.transfer.copy_threads.CopyThreads`), in ``parts`` parts of
        consecutive pages at once: its layers announced there as
        :func:`~kvtier.daemon.transfer.transfer.run_transfer` would (a STORE's without
        waking the engine; ``whole``: none before the end; a split one's once every part
        has copied them), its end settled by :meth:`_reap` once its last part has ended.
        A row or index the copy refuses fails it here."""
        native, table, arena = self._native, s.memory.table, self._arena
        assert native is not None and table is not None and arena is not None
        store = t.direction is Direction.STORE
        n = len(t.host_slots)
        bounds = [n * i // parts for i in range(parts + 1)]
        if parts > 1:
            self.ctx.counters.transfers_split += 1
        layers, wake = s.completion.addresses(t.slot)
        try:
            jobs = native.submit_copy(
                s.uid,
                arena.address,
                arena.nbytes,
                np.ascontiguousarray(t.offsets, dtype=np.int64),
                np.ascontiguousarray(t.page_ids, dtype=np.int64),
                table.table,
                table.whole_rows if whole else table.group_rows,
                store,
                t.nbytes >= STREAM_BYTES,
                t.yield_bytes,
                layers,
                0 if store else wake,
                s.geometry.num_layers,
                np.array(bounds, dtype=np.int64) if parts > 1 else None,
            )
        except (ValueError, RuntimeError):  # a bug, or stopping: this transfer fails
            log.exception("transfer session=%d slot=%d failed", t.session_id, t.slot)
            t.status = TransferStatus.FAILED
            self._settle(s, t, False, wake=False)  # before its reply: nobody waits yet
            return
        split = _Parts(bounds, jobs) if parts > 1 else None
        for job in jobs:
            self._jobs[job] = (s, t, split)
        t.stop = lambda: [native.cancel(job) for job in jobs]

    def _reap(self) -> None:
        """The native copy threads' eventfd is readable: settle the copies that ended."""
        native = self._native
        if native is None:
            return
        for job, status, pages in native.reap():
            entry = self._jobs.pop(job, None)
            if entry is None:
                continue
            s, t, split = entry
            if status == copy_threads.SHORT:
                at = pages + (split.first(job) if split is not None else 0)
                log.error(
                    "transfer session=%d slot=%d failed at page %d: %s",
                    t.session_id,
                    t.slot,
                    int(t.page_ids[at]) if 0 <= at < len(t.page_ids) else -1,
                    self._fault_cause(),
                )
            if split is not None:
                status = split.ended(status)
                if split.left:
                    continue  # the transfer ends with its last part, never before
            t.stop = None
            if status == copy_threads.DONE:
                t.status = TransferStatus.DONE
            elif status == copy_threads.CANCELLED:
                t.status = TransferStatus.CANCELLED
            else:
                t.status = TransferStatus.FAILED
            try:
                self._settle(s, t, t.status is TransferStatus.DONE)
            except Exception:  # a bug: the others that ended are still settled
                log.exception("settling transfer session=%d slot=%d failed", s.session_id, t.slot)

    def _fault_cause(self) -> str:
        """Why a copy faulted on a page: the host pool's file system could not back it (a
        pool not pre-faulted, or adopted sparse, whose ``pool_dir`` filled up), else the
        engine's memory is gone (only an unsealed memfd can shrink)."""
        cfg = self.ctx.cfg
        if self.ctx.pool_unbacked:
            try:
                vfs = os.statvfs(cfg.pool_dir)
            except OSError:
                vfs = None
            if vfs is not None and vfs.f_bavail * vfs.f_frsize < cfg.extent_size:
                return (
                    f"the host pool: pool_dir {str(cfg.pool_dir)!r} has no space left to back "
                    "its pages (prefault is off, or the adopted pool file was sparse)"
                )
        return "engine memory: a page of a region is gone (the engine shrank its memfd)"

    def _submit(self, s: Session, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue ``fn(*args)`` on the copy threads, in the turn of ``s``'s user when they
        take turns (:class:`~kvtier.daemon.transfer.fair_pool.FairExecutor`)."""
        ex = self._executor
        assert ex is not None, "open() first"
        if isinstance(ex, (FairExecutor, CopyThreads)):
            return ex.submit_for(s.uid, fn, *args)
        return ex.submit(fn, *args)

    def _watch(self, fut: Future[Any], on_loop: Callable[[Future[Any]], None]) -> None:
        """Track the copy ``fut`` in :attr:`inflight` and run ``on_loop(fut)`` on the event
        loop once it has ended. One thread-safe call per copy: an asyncio future chained to
        it would cost a future, a chain of callbacks and the same wake-up of the loop."""
        self.inflight.add(fut)
        loop = self._loop
        assert loop is not None, "open() first"

        def ended(f: Future[Any]) -> None:  # on the copy thread (or here, when already done)
            try:
                loop.call_soon_threadsafe(on_loop, f)
            except RuntimeError:  # the loop has closed: shutdown abandoned this copy
                pass

        fut.add_done_callback(ended)

    def _parts(self, t: Transfer) -> int:
        """How many copy threads copy ``t``: one per :data:`SPLIT_BYTES` of it, at most as
        many as there are threads."""
        return max(1, min(self._threads, t.nbytes // SPLIT_BYTES, len(t.host_slots)))

    def _finish(self, s: Session, t: Transfer, fut: Future[Any]) -> None:
        """A copy thread's transfer ended: settle it."""
        self.inflight.discard(fut)
        ok = not fut.cancelled() and fut.exception() is None and t.status is TransferStatus.DONE
        if t.extra.get("gpu_pending") and t.direction is Direction.STORE:  # a CUDA copy may
            self.ctx.counters.cuda_held_pages += len(t.host_slots)  # still write its slots:
            t.host_slots = []  # never committed nor freed, out of use for good (docs/gpu.md)
        self._settle(s, t, ok)

    def _settle(self, s: Session, t: Transfer, ok: bool, wake: bool = True) -> None:
        """Settle one copy: commit or abort (STORE), unpin (LOAD), count, tell the engine
        (``wake``: wake it too; see :meth:`CompletionBlock.finish`). One of more than
        ``slice_pages`` pages is settled in slices by a task (then always waking)."""
        pool = self.ctx.pool
        if len(t.host_slots) > self.ctx.cfg.slice_pages:
            self.spawn(self._settle_long(s, t, ok))
            return
        if t.direction is Direction.STORE:
            if ok and s.state is SessionState.OPEN and not t.detached:
                pool.commit(t.host_slots, checksums=t.checksums)
                self._stored(s, t)
            else:
                pool.abort(t.host_slots)
                self._not_stored(t)
                ok = self._discarded(t, ok)
        else:
            pool.unpin(t.host_slots)
            self._loaded(s, t, ok)
        self._end(s, t, ok, wake)

    @staticmethod
    def _discarded(t: Transfer, ok: bool) -> bool:
        """A STORE whose pages were aborted: copied whole (``ok``) but its session ended
        first, it ends CANCELLED, never DONE (DONE says its pages are in L2). False."""
        if ok:
            t.status = TransferStatus.CANCELLED
        return False

    async def _settle_long(self, s: Session, t: Transfer, ok: bool) -> None:
        """:meth:`_settle` in slices (:mod:`~kvtier.daemon.service.slices`); the transfer
        keeps its slot, and its session stays, until the last slice."""
        pool, size = self.ctx.pool, self.ctx.cfg.slice_pages
        try:
            if t.direction is Direction.STORE:
                if ok and s.state is SessionState.OPEN and not t.detached:
                    t.committing = True  # a cancel from here on lets the commit end
                    await slices.commit(pool, t.host_slots, t.checksums, size)
                    self._stored(s, t)
                else:
                    if not t.detached:  # its keys leave the index before the first slice:
                        pool.detach(t.host_slots)  # a STORE of them meanwhile writes them
                        t.detached = True
                    await slices.abort(pool, t.host_slots, size)
                    self._not_stored(t)
                    ok = self._discarded(t, ok)
            else:
                await slices.unpin(pool, t.host_slots, size)
                self._loaded(s, t, ok)
        finally:
            self._end(s, t, ok, True)

    def _end(self, s: Session, t: Transfer, ok: bool, wake: bool) -> None:
        """Tell the engine how ``t`` ended, free its slot, finalize a closing session."""
        if s.state is not SessionState.CLOSED:
            s.completion.finish(
                t.slot,
                TransferStatus.DONE
                if ok
                else (
                    t.status if t.status is not TransferStatus.RUNNING else TransferStatus.FAILED
                ),
                wake=wake,
            )
        if s.transfers.get(t.slot) is t:
            del s.transfers[t.slot]
        if s.state is SessionState.CLOSING and not s.transfers:
            self.ctx.finalize_session(s)

    def _stored(self, s: Session, t: Transfer) -> None:
        """A STORE's pages were committed: count them, pass them on (events, L3)."""
        ctx, c = self.ctx, self.ctx.counters
        if ctx.events is not None:
            ctx.events.store_ended(t.session_id, t.slot, t.seq, committed=True)
        c.store_pages += len(t.host_slots)
        c.bytes_to_host += t.nbytes
        ctx.tier.stored(s, t.keys, t.host_slots)
        if ctx.metrics is not None:
            ctx.metrics.observe_store(time.monotonic() - t.started)

    def _not_stored(self, t: Transfer) -> None:
        """A STORE failed, was cancelled or its session closed: its slots were freed."""
        ctx = self.ctx
        if ctx.events is not None:
            ctx.events.store_ended(t.session_id, t.slot, t.seq, committed=False)
        ctx.counters.store_failed_pages += len(t.host_slots)

    def _loaded(self, s: Session, t: Transfer, ok: bool) -> None:
        """A LOAD ended and its pages were unpinned: when it completed, count them as saved."""
        ctx, c, n = self.ctx, self.ctx.counters, len(t.host_slots)
        if ok:
            c.load_pages += n
            c.loaded_tokens += n * s.geometry.page_size
            ctx.tier.loaded(s, t.keys)
            c.bytes_to_engine += t.nbytes
            if ctx.metrics is not None:
                ctx.metrics.observe_load(time.monotonic() - t.started)
        else:
            c.load_failed_pages += n


class _Parts:
    """The parts of a transfer split over the native copy threads: how many are still
    running, and the transfer's status once the last ends (as :func:`combine` gives it:
    DONE when every part is; else CANCELLED when one was cancelled; else FAILED, as SHORT).

    Args:
        bounds: the parts' first pages, and the end of the last.
        jobs: the parts' job ids, in page order.
    """

    __slots__ = ("bounds", "jobs", "left", "statuses")

    def __init__(self, bounds: list[int], jobs: list[int]) -> None:
        self.bounds, self.jobs, self.left = bounds, jobs, len(jobs)
        self.statuses: list[int] = []

    def first(self, job: int) -> int:
        """The index of part ``job``'s first page in the transfer."""
        return self.bounds[self.jobs.index(job)]

    def ended(self, status: int) -> int:
        """A part ended with ``status``; the transfer's status (final once none is left)."""
        self.left -= 1
        self.statuses.append(status)
        if all(st == copy_threads.DONE for st in self.statuses):
            return copy_threads.DONE
        if copy_threads.CANCELLED in self.statuses:
            return copy_threads.CANCELLED
        return copy_threads.SHORT
