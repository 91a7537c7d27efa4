"""kvtierd's service, built off the event loop while the control socket already answers.

:class:`~kvtier.daemon.service.server.Daemon` binds its control socket first, with only
the configuration, ZeroMQ and the wire format imported, and then builds a :class:`Service`
on a worker thread (:func:`build_service`): the modules that answer requests (numpy, the
pool, the L3 tier, the copy path) are imported there, the pool file is mapped and the
pages a previous kvtierd left in it are adopted. Meanwhile the socket answers HEALTH
(``starting``) and holds every other request
(:class:`~kvtier.daemon.service.dispatch.StartGate`); nothing on the loop touches the
pool until the build has returned, so the worker needs no lock. The rest is opened on
the loop (:meth:`Service.open`): the L3 tier, the copy threads, the memory-handover
socket and the metrics endpoint. Then the held requests are answered, in arrival order,
and the daemon tells systemd it is ready.

The pool file of a restart is mapped without ``MAP_POPULATE``: its pages are resident
already, and building the page tables of a large pool would delay the start. With ``prefault``
they are built after READY=1 instead, by :meth:`Service.prefault` on a thread, 64 MiB
per ``madvise`` (the copies fault in what it has not reached yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kvtier.config import DaemonConfig
from kvtier.daemon.counters import Counters
from kvtier.daemon.pool.host_pool import HostPool
from kvtier.daemon.pool.layout import map_pool_file
from kvtier.daemon.pool.poolfile import populate, remove_pool_file_of, reserve_pool_file
from kvtier.daemon.service.admin import Admin
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.dispatch import Dispatcher
from kvtier.daemon.service.handlers import Handlers
from kvtier.daemon.service.sdnotify import SystemdNotifier
from kvtier.daemon.service.transfers import Transfers
from kvtier.daemon.service.runtime import last_pool_file, record_pool_file
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.registry import slot_headroom
from kvtier.daemon.tier.tier import TierStore
from kvtier.daemon.transfer.cpu_priority import lower_this_thread
from kvtier.daemon.transfer.copy_threads import CopyThreads
from kvtier.daemon.transfer.fair_pool import FairExecutor
from kvtier.ipc.shm import SharedMemorySegment
from kvtier.kernels import native

__all__ = ["Service", "build_service"]

log = logging.getLogger("kvtier.daemon")


class Service:
    """The parts that answer requests: pool, tier, handlers, copy threads.

    Build it with :func:`build_service` (on a worker thread), then :meth:`open` it on the
    event loop. The constructor maps the pool file and builds the pool over it, adopting
    the pages a previous kvtierd left in it (unless it does not fit this configuration, or
    ``cold_start``); ``stack`` closes both. A new file is reserved and pre-faulted when
    ``prefault`` is set; an existing one is mapped as it is (see :meth:`prefault`). The
    file outlives the daemon unless ``keep_pool_on_stop`` is off.

    Args:
        cfg: the configuration.
        rdir: the runtime directory.
        epoch: the daemon's boot epoch.
        notifier: tells systemd about reloads.
        reload: re-reads the configuration (SIGHUP); None when there is nothing to re-read.
        ppath: the pool file.
        stack: unmaps the pool file (and releases the pool's views of it first).

    Attributes:
        pool, counters, tier, ctx, transfers, handlers, admin, dispatcher: the parts.
        seg: the mapped pool file.
        serving: set once requests reach the service (the start succeeded); until then a
            pool file this start created is removed when the service is unmapped.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        rdir: Path,
        epoch: int,
        notifier: SystemdNotifier,
        reload: Callable[[], DaemonConfig] | None,
        ppath: Path,
        stack: contextlib.ExitStack,
    ) -> None:
        headroom = slot_headroom(cfg.hicache_storage_backend)
        layout = HostPool.layout_of(cfg, headroom)
        self._rdir, self._ppath = rdir, ppath
        # the daemon served from another pool file since (pool_dir changed): one here is
        # older than that one's pages (flushed, overwritten since), never adopted
        last = last_pool_file(rdir)
        self._left = last if last is not None and last != ppath.absolute() else None
        if self._left is not None and remove_pool_file_of(ppath, rdir):
            log.warning(
                "pool file %s discarded: older than %s, which kvtierd served from since "
                "(pool_dir changed)",
                ppath,
                self._left,
            )
        seg, why_new = map_pool_file(
            ppath, layout, prefault=cfg.prefault, populate_existing=False, runtime_dir=rdir
        )
        self._created = why_new is not None  # made by this start (pre-faulted then)
        self.serving = False
        stack.callback(self._unmap, seg, cfg)
        self.seg: SharedMemorySegment = seg
        arena_view = seg.view[layout.arena_offset : layout.arena_offset + layout.capacity_bytes]
        stack.callback(arena_view.release)
        self._arena_view = arena_view
        # a numpy array: the CPU copy path imports no torch (a CUDA back end would take a
        # torch view of it, ``torch.from_numpy``, when the first CUDA session needs one)
        self._arena: np.ndarray | None = seg.array(
            np.uint8, layout.arena_offset, layout.capacity_bytes
        )
        stack.callback(setattr, self, "_arena", None)  # before the mapping closes
        self.pool = HostPool.from_config(
            cfg,
            headroom,
            meta=seg.view[: layout.meta_bytes],
            arena=arena_view if cfg.verify_on_adopt else None,
            cold_start="cold start requested (cold_start)" if cfg.cold_start else why_new,
        )
        stack.callback(self.pool.close)  # its views of the metadata go before the mapping
        adopted = self.pool.adopted
        assert adopted is not None, "a pool over a file has adopted it or started empty"
        log.info("%s", adopted.summary)
        for name, t in cfg.tenants.items():  # owner ids come from the adopted table
            if t.quota_pages is not None:
                self.pool.set_quota(self.pool.owner_id(name), t.quota_pages)
        self.counters = Counters()
        self.tier = TierStore(cfg, self.pool, self.counters, rdir)
        self.ctx = ServiceContext(cfg, self.pool, self.tier, self.counters, rdir, epoch=epoch)
        self.ctx.adopt = adopted
        self.transfers = Transfers(self.ctx)
        self.handlers = Handlers(self.ctx, self.transfers)
        self.admin = Admin(self.ctx, notifier, reload)
        self.dispatcher = Dispatcher(self.ctx, {**self.handlers.table(), **self.admin.table()})
        self._stop_prefault = threading.Event()

    def start_serving(self) -> None:
        """Requests reach the service from now on (:attr:`serving`): the pool file stays,
        and it is recorded as the one served from (:func:`record_pool_file`); a pool file
        left in the ``pool_dir`` used before is removed (its pages are this daemon's no
        more, and a later start there must not adopt them)."""
        self.serving = True
        try:
            record_pool_file(self._rdir, self._ppath)
        except OSError as err:
            log.warning("cannot record the pool file in %s: %s", self._rdir, err.strerror)
        if self._left is not None and remove_pool_file_of(self._left, self._rdir):
            log.info("removed the pool file %s left in the pool_dir used before", self._left)

    def _unmap(self, seg: SharedMemorySegment, cfg: DaemonConfig) -> None:
        """Unmap the pool file; remove it unless ``keep_pool_on_stop`` (as configured now:
        a reload may have changed it; ``cfg`` when the service was never built). A file this
        start created is removed when the start failed (:attr:`serving` never set): it holds
        no page, and a daemon that does not start again (a bad setting) would leave memory
        of the size of the pool in its file system for nobody."""
        ctx: ServiceContext | None = getattr(self, "ctx", None)
        keep = (ctx.cfg if ctx is not None else cfg).keep_pool_on_stop
        seg.close(unlink=not keep or (self._created and not self.serving))

    async def open(
        self, stack: contextlib.AsyncExitStack, finalize_remaining: Callable[[], None]
    ) -> None:
        """Open the L3 tier, start the prefault and copy threads and bind the handover socket.

        Args:
            stack: closes them, in reverse order.
            finalize_remaining: run once the copy threads have ended (finalizes the
                sessions whose copies outlived the drain).
        """
        seg, arena_view, layout = self.seg, self._arena_view, self.pool.layout
        await self.tier.open(
            HostArena(
                view=arena_view,
                size=layout.capacity_bytes,
                address=seg.address + layout.arena_offset,
                headroom=layout.headroom,
            )
        )
        stack.push_async_callback(self.tier.close)
        self.ctx.prefaults.start()
        stack.callback(self.ctx.prefaults.close)  # after every session's memory is unmapped
        # the unmaps queued by the sessions finalized up to then, waited for off the loop
        stack.push_async_callback(asyncio.to_thread, self.ctx.unmaps.shutdown)
        nice = self.ctx.cfg.copy_nice
        threads = CopyThreads if CopyThreads.available() else FairExecutor
        executor = threads(
            self.ctx.cfg.copy_threads, "kvtier-copy", lambda: lower_this_thread(nice)
        )
        self.transfers.open(executor, self._arena, self.ctx.cfg.copy_threads)
        stack.callback(self.transfers.close)
        assert self._arena is not None, "the pool file is mapped until the stack closes"
        self.ctx.cuda.attach(self._arena)  # unpinned once every session is finalized:
        stack.push_async_callback(asyncio.to_thread, self.ctx.cuda.close)  # before the unmap
        stack.callback(finalize_remaining)  # runs once the copy threads have ended
        # waited for off the loop, so a second SIGTERM can still end the process at once
        stack.push_async_callback(
            asyncio.to_thread, executor.shutdown, wait=True, cancel_futures=True
        )
        self.ctx.handovers.bind()
        stack.callback(self.ctx.handovers.close)

    async def prefault(self) -> None:
        """Reserve the holes of an adopted pool file (one a start with ``prefault = false``
        left sparse), then build the page tables of its mapping, on a thread (with
        ``prefault``; a new file was reserved and pre-faulted when it was created).
        Cancelling it stops the thread at its next step (1 GiB reserved, 64 MiB mapped)
        and waits for it, so the mapping outlives it."""
        seg = self.seg
        if self._created or not self.ctx.cfg.prefault:
            return
        t0 = time.perf_counter()
        stopped = self._stop_prefault.is_set

        def reserve_and_populate() -> tuple[str | None, bool]:
            short = reserve_pool_file(seg, stopped)
            if short is not None:  # before the copies that fault are explained
                self.ctx.pool_unbacked = True
            return short, populate(seg, stopped)

        work = asyncio.ensure_future(asyncio.to_thread(reserve_and_populate))
        try:
            short, done = await asyncio.shield(work)
        except asyncio.CancelledError:
            self._stop_prefault.set()
            await asyncio.wait([work])
            raise
        if short is not None:
            log.warning(
                "pool_dir %s cannot back the whole adopted pool file (%s): storing into "
                "its unbacked pages fails until space is freed there",
                self.ctx.cfg.pool_dir,
                short,
            )
        log.debug(
            "pool mapping pre-faulted %s in %.3fs",
            "whole" if done else "in part",
            time.perf_counter() - t0,
        )


def build_service(
    cfg: DaemonConfig,
    rdir: Path,
    ppath: Path,
    epoch: int,
    notifier: SystemdNotifier,
    reload: Callable[[], DaemonConfig] | None,
) -> tuple[Service, contextlib.ExitStack]:
    """Turn the C kernels ``cfg.native_off`` names off, build the service, and map and
    adopt the pool (runs on a worker thread).

    Returns:
        The service, and the stack that unmaps the pool (the caller closes it at the end).

    Raises:
        KvtierError: the pool file cannot be used, or the configuration does not fit it;
            nothing stays mapped then.
    """
    native.configure(cfg.native_off)  # the process's C kernels, before anything is copied
    if cfg.native_off:
        log.info("C kernels turned off (native_off): %s", ", ".join(cfg.native_off))
    with contextlib.ExitStack() as stack:
        service = Service(cfg, rdir, epoch, notifier, reload, ppath, stack)
        return service, stack.pop_all()
