"""The STOREs and LOADs of more than ``slice_pages`` pages: their page-table work in slices
(:mod:`~kvtier.daemon.service.slices`), the event loop answering others in between.

Such a request holds its completion slot from the moment it is read (a placeholder
transfer in the session's ``transfers``, :meth:`LongRequests.reserve`, taken by the handler
before its task is spawned): the slot is busy for other requests, even those read in the
same burst,
a RELEASE of it or the session's end cancels it at the next slice, and a closing session is
finalized only once it has given the slot back. It is answered once its copy has started,
with the reply a short one gets; its copy's end is settled in slices too
(:meth:`~kvtier.daemon.service.transfers.Transfers.start`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
from kvtier.daemon.service.sessions import Session, SessionState
from kvtier.daemon.service.slices import allocate, pin
from kvtier.daemon.service.validation import RequestError
from kvtier.daemon.transfer.transfer import Direction, Transfer
from kvtier.ipc import protocol as P

if TYPE_CHECKING:
    from kvtier.daemon.service.context import ServiceContext
    from kvtier.daemon.service.transfers import Transfers

__all__ = ["LongRequests"]


class LongRequests:
    """The STOREs and LOADs of more than ``slice_pages`` pages, in slices.

    Each holds its completion slot from its start (a placeholder transfer in the
    session's ``transfers``), so that the slot is busy for other requests and a closing
    session waits for it, and is answered once its copy has started, as a short one is.

    Args:
        ctx: the daemon's shared state.
        transfers: where the copies start (and the long tasks are tracked).
    """

    def __init__(self, ctx: ServiceContext, transfers: Transfers) -> None:
        self.ctx = ctx
        self.transfers = transfers

    def wanted(self, pages: int) -> bool:
        """Whether a request of ``pages`` pages goes in slices."""
        return pages > self.ctx.cfg.slice_pages

    async def store(
        self, s: Session, m: P.Store, keys: Sequence[bytes], pages: Sequence[int], hold: Transfer
    ) -> P.Reply:
        """A checked STORE (``keys`` a list, or packed: split slice by slice), allocated in
        slices, its copy started: the reply :meth:`Handlers.store` would give. ``hold``:
        its slot, taken by :meth:`reserve` when the request was read."""
        ctx, pool = self.ctx, self.ctx.pool
        ctx.counters.requests_sliced += 1
        try:
            got = await allocate(
                pool,
                s.ns_id,
                s.owner,
                s.class_id,
                keys,
                m.parent_key,
                ctx.cfg.slice_pages,
                lambda: _stopped(s, hold),
                ctx.tier.allocated,
            )
        except BaseException:
            self.unreserve(s, hold)
            raise
        if got is None:  # stopped between slices: every page it named is not stored
            self.unreserve(s, hold)
            ctx.counters.store_failed_pages += len(keys)
            return self._cancelled(s, m, P.Store)
        n, host = len(keys), got.slots
        keys = got.keys  # as objects, as far as the allocation went (every index is in it)
        c = ctx.counters
        c.store_skipped_pages += got.count - len(host)
        c.store_failed_pages += n - got.count
        # reported: a key another transfer writes is stored only once that one ends
        stored = (
            got.count
            if len(host) == got.count
            else pool.stored_run(s.ns_id, keys[: got.count], set(host))
        )
        if not host:
            self.unreserve(s, hold)
            return P.StoreAccepted(req_id=m.req_id, epoch=ctx.epoch, count=stored, writing=0)
        every = len(host) == n
        if ctx.events is not None:  # what the BlockStored of the committed pages will say
            ctx.events.store_of(s, m, keys, None if every else got.indexes)
        if not every:
            idx = got.indexes
            pages = cast("Sequence[int]", np.asarray(pages)[idx])  # an array serves as one
            keys = [keys[i] for i in idx]
        self.transfers.start(
            s,
            Direction.STORE,
            m.slot,
            m.seq,
            host,
            pages,
            keys,
            np.concatenate(got.offsets),
            deadline_ns=m.deadline_ns,
        )
        return P.StoreAccepted(req_id=m.req_id, epoch=ctx.epoch, count=stored, writing=len(host))

    async def load(
        self, s: Session, m: P.Load, keys: Sequence[bytes], pages: Sequence[int], hold: Transfer
    ) -> P.Reply:
        """A checked LOAD, its run pinned in slices, its copy started: the reply
        :meth:`Handlers.load` would give. ``hold``: its slot, taken by :meth:`reserve` when
        the request was read."""
        ctx = self.ctx
        ctx.counters.requests_sliced += 1
        try:
            host = await pin(
                ctx.pool, s.ns_id, keys, ctx.cfg.slice_pages, lambda: _stopped(s, hold)
            )
        except BaseException:
            self.unreserve(s, hold)
            raise
        if host is None:
            self.unreserve(s, hold)
            return self._cancelled(s, m, P.Load)
        if not host:
            self.unreserve(s, hold)
        else:
            n = len(host)
            self.transfers.start(
                s,
                Direction.LOAD,
                m.slot,
                m.seq,
                host,
                pages[:n],
                keys[:n],
                deadline_ns=m.deadline_ns,
            )
        return P.LoadAccepted(req_id=m.req_id, epoch=ctx.epoch, count=len(host))

    def reserve(self, s: Session, direction: Direction, slot: int, seq: int) -> Transfer:
        """Hold ``s``'s completion ``slot`` for a long request before its copy starts: a
        transfer of no pages yet, which :meth:`Transfers.start` replaces. Meanwhile the slot is busy,
        a closing session waits for it, and a RELEASE or the session's end cancels it."""
        t = Transfer(
            direction=direction,
            session_id=s.session_id,
            slot=slot,
            seq=seq,
            host_slots=[],
            page_ids=np.empty(0, dtype=np.int64),
            offsets=np.empty(0, dtype=np.int64),
            nbytes=0,
            started=time.monotonic(),
        )
        s.transfers[slot] = t
        return t

    def unreserve(self, s: Session, t: Transfer) -> None:
        """Give back a slot :meth:`reserve` held (no copy started); a session that closed
        meanwhile is finalized if nothing else of it runs."""
        if s.transfers.get(t.slot) is t:
            del s.transfers[t.slot]
        if s.state is SessionState.CLOSING and not s.transfers:
            self.ctx.finalize_session(s)

    def _cancelled(self, s: Session, m: P.Store | P.Load, kind: type) -> P.Reply:
        """The reply to a request its session's end or a RELEASE of its slot stopped."""
        if s.state is not SessionState.OPEN:
            raise RequestError(
                P.ErrorCode.UNKNOWN_SESSION,
                f"session {s.session_id} closed during its {kind.__name__.upper()}",
            )
        if kind is P.Store:
            return P.StoreAccepted(req_id=m.req_id, epoch=self.ctx.epoch, count=0, writing=0)
        return P.LoadAccepted(req_id=m.req_id, epoch=self.ctx.epoch, count=0)


def _stopped(s: Session, hold: Transfer) -> bool:
    """Whether a long request must stop: its session is closing, or its slot released."""
    return hold.cancelled or s.state is not SessionState.OPEN
