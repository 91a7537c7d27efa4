"""LOAD and STORE copies between engines and the host pool: start one, account for its end.

A copy runs on a thread of the copy pool (the copy itself releases the GIL); its completion
is delivered back on the event loop, where the pool, the counters and the session are
updated, so nothing here takes a lock. The engine follows a copy layer by layer through its
completion block, not through a reply.

A session that closed while its copies ran is finalized by the last one to end: its memory
must stay mapped while a copy thread may still touch it.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.sessions import Session, SessionState
from kvtier.daemon.transfer.transfer import Direction, Transfer, run_transfer
from kvtier.ipc.completion import TransferStatus


class Transfers:
    """Starts copies on the copy threads and settles them when they end.

    Args:
        ctx: the daemon's shared state.

    Attributes:
        inflight: futures of the copies not finished yet (the drain at shutdown waits on them).
    """

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.inflight: set[asyncio.Future] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._arena: Any = None

    def open(self, executor: ThreadPoolExecutor, arena: Any) -> None:
        """Start accepting copies.

        Args:
            executor: the copy threads.
            arena: the host pool's arena as a tensor (what copies read and write).
        """
        self._executor, self._arena = executor, arena

    def close(self) -> None:
        """Drop the arena; call it once the copy threads have ended."""
        self._arena = None

    def start(self, s: Session, direction: Direction, slot: int, seq: int, host: list[int],
              pages: list[int], keys: list[bytes]) -> None:
        """Copy pages between ``s``'s memory and host slots on a copy thread.

        Args:
            s: the session.
            direction: STORE (engine → host) or LOAD (host → engine).
            slot: the completion slot the engine waits on; ``seq`` its sequence number.
            host: host pool slots, allocated (STORE) or pinned (LOAD) by the caller.
            pages: engine page indexes, one per host slot.
            keys: the page keys, one per host slot.
        """
        pool = self.ctx.pool
        offsets = np.fromiter((pool.slot_offset(h) for h in host), dtype=np.int64, count=len(host))
        t = Transfer(direction=direction, session_id=s.session_id, slot=slot, seq=seq,
                     host_slots=host, page_ids=np.asarray(pages, dtype=np.int64), offsets=offsets,
                     nbytes=len(host) * s.geometry.page_bytes, started=time.monotonic(),
                     keys=keys,
                     checksum=direction is Direction.STORE and self.ctx.cfg.verify_on_adopt)
        s.completion.begin(slot, seq, s.geometry.num_layers)
        s.transfers[slot] = t
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, run_transfer, t, self._arena, s.memory.regions,
                                   s.geometry.num_layers, s.geometry.page_bytes, s.completion)
        self.inflight.add(fut)
        fut.add_done_callback(lambda f: self._finish(s, t, f))

    def _finish(self, s: Session, t: Transfer, fut: asyncio.Future) -> None:
        """Settle one copy: commit or abort (STORE), unpin (LOAD), count, tell the engine."""
        self.inflight.discard(fut)
        ok = not fut.cancelled() and fut.exception() is None and t.status is TransferStatus.DONE
        if t.direction is Direction.STORE:
            self._stored(s, t, ok)
        else:
            self._loaded(s, t, ok)
        if s.state is not SessionState.CLOSED:
            s.completion.finish(t.slot, TransferStatus.DONE if ok else (
                t.status if t.status is not TransferStatus.RUNNING else TransferStatus.FAILED))
        s.transfers.pop(t.slot, None)
        if s.state is SessionState.CLOSING and not s.transfers:
            self.ctx.finalize_session(s)

    def _stored(self, s: Session, t: Transfer, ok: bool) -> None:
        """A STORE ended: its pages become READY, or their slots are freed."""
        ctx, c, n = self.ctx, self.ctx.counters, len(t.host_slots)
        if ok and s.state is SessionState.OPEN:
            ctx.pool.commit(t.host_slots, checksums=t.checksums)
            c.store_pages += n
            c.bytes_to_host += t.nbytes
            ctx.tier.stored(s, t.keys)
            if ctx.metrics is not None:
                ctx.metrics.observe_store(time.monotonic() - t.started)
        else:
            ctx.pool.abort(t.host_slots)
            c.store_failed_pages += n

    def _loaded(self, s: Session, t: Transfer, ok: bool) -> None:
        """A LOAD ended: its pages are unpinned and, when it completed, counted as saved."""
        ctx, c, n = self.ctx, self.ctx.counters, len(t.host_slots)
        ctx.pool.unpin(t.host_slots)
        if ok:
            c.load_pages += n
            c.loaded_tokens += n * s.geometry.page_size
            ctx.tier.loaded(s, t.keys)
            c.bytes_to_engine += t.nbytes
            if ctx.metrics is not None:
                ctx.metrics.observe_load(time.monotonic() - t.started)
        else:
            c.load_failed_pages += n
