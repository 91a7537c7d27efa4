"""The engines' requests: one method per request type, from REGISTER to UNREGISTER.

A handler checks its request (:mod:`~kvtier.daemon.service.validation`), then acts on the
pool, the tier or the copy threads. It answers at once with a reply, or, when it must wait
(L3 I/O, a CLAIM waiting for its prefetch, the other ranks of a group), returns a
:class:`~kvtier.daemon.service.answers.Deferred` one that the server answers from its own
task while the loop keeps serving everyone else (its return type says which it may do). A
session whose request waits so does not expire meanwhile (:meth:`Handlers.later`).

The latency histograms are fed here (LOOKUP, CLAIM) and in
:mod:`~kvtier.daemon.service.transfers` (LOAD, STORE): a LOOKUP or CLAIM is timed from its
arrival to its reply, the deferred part included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from kvtier.daemon.service.answers import Answer, Deferred, Handler
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.sessions import Session
from kvtier.daemon.service.long_requests import LongRequests
from kvtier.daemon.service.registration import Registration
from kvtier.daemon.service.transfers import Transfers
from kvtier.daemon.service.validation import (
    RequestError,
    check_engine_blocks,
    check_keys,
    check_lookup_keys,
    check_slot,
    transfer_keys,
)
from kvtier.daemon.transfer.transfer import Direction, Transfer
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import PeerCred

log = logging.getLogger("kvtier.daemon")


class Handlers:
    """The engine-facing request handlers.

    Each takes the connection's ZeroMQ identity and the decoded request, and returns a
    reply, or (those declared ``-> Answer``) a deferred one; it raises
    :class:`RequestError` to refuse.

    Args:
        ctx: the daemon's shared state.
        transfers: where LOAD and STORE start their copies.
    """

    def __init__(self, ctx: ServiceContext, transfers: Transfers) -> None:
        self.ctx = ctx
        self.transfers = transfers
        self.long = LongRequests(ctx, transfers)
        self.registration = Registration(ctx)

    def table(self) -> dict[type, Handler]:
        """The handler of each engine request type."""
        return {
            P.Register: self.register,
            P.Heartbeat: self.heartbeat,
            P.Lookup: self.lookup,
            P.Store: self.store,
            P.Load: self.load,
            P.Release: self.release,
            P.Unregister: self.unregister,
            P.Prefetch: self.prefetch,
            P.Claim: self.claim,
        }

    def later(self, s: Session, pending: Coroutine[Any, Any, P.Reply]) -> Deferred:
        """Answer ``pending`` for ``s`` later; its lease does not run out meanwhile."""
        return Deferred(self._waiting(s, pending))

    @staticmethod
    async def _waiting(s: Session, pending: Coroutine[Any, Any, P.Reply]) -> P.Reply:
        s.waiting += 1
        try:
            return await pending
        finally:
            s.waiting -= 1
            s.renew(time.monotonic())

    # ------------------------------------------------------------------ sessions
    def register(self, identity: bytes, m: P.Register, peer: PeerCred | None = None) -> Answer:
        """REGISTER: see :meth:`Registration.register
        <kvtier.daemon.service.registration.Registration.register>`."""
        return self.registration.register(identity, m, peer)

    def heartbeat(self, identity: bytes, m: P.Heartbeat) -> P.Reply:
        """HEARTBEAT: renew the session's lease."""
        self.ctx.session(identity, m.session_id)
        return P.Ack(req_id=m.req_id, epoch=self.ctx.epoch)

    def unregister(self, identity: bytes, m: P.Unregister) -> P.Reply:
        """UNREGISTER: close the session (its running transfers are cancelled)."""
        s = self.ctx.session(identity, m.session_id)
        self.ctx.close_session(s, "unregistered")
        return P.Ack(req_id=m.req_id, epoch=self.ctx.epoch)

    # ------------------------------------------------------------------ lookups
    def lookup(self, identity: bytes, m: P.Lookup) -> Answer:
        """LOOKUP: the leading run of keys in L2, then (when asked) the run after it in L3.

        Keys come packed (``packed_keys``, as every kvtier client sends them), answered by the
        pool's key table without a Python object per key (:meth:`HostPool.lookup_packed`),
        or as a list (older and other clients).
        """
        start = time.perf_counter()
        ctx = self.ctx
        s = ctx.session(identity, m.session_id)
        check_lookup_keys(m, ctx.cfg.max_keys_per_request)
        if m.packed_keys:
            n = ctx.pool.lookup_packed(s.ns_id, m.packed_keys)
        else:
            n = ctx.pool.lookup(s.ns_id, m.keys)
        count = m.key_count()
        if s.member is None:  # a TP rank's hits are counted as agreed (_lookup_more)
            self._count_lookup(s, count, n)
            if n == count or not ctx.tier.available:
                self._observe_lookup(start)
                return P.LookupResult(req_id=m.req_id, epoch=ctx.epoch, l2=n, l3=0)
        return self.later(s, self._lookup_more(s, m, n, count, start))

    def _count_lookup(self, s: Session, count: int, n: int) -> None:
        """Count a LOOKUP of ``count`` keys answered with an L2 run of ``n``."""
        c = self.ctx.counters
        c.lookup_tokens += count * s.geometry.page_size
        c.lookup_hit_tokens += n * s.geometry.page_size
        c.lookups += 1
        c.lookup_keys += count
        c.lookup_hit_keys += n
        c.lookup_hits += n > 0
        self.ctx.hit_window.add(count, n)

    @staticmethod
    def _needs_memory(s: Session, op: str) -> None:
        """Refuse ``op`` on a control-only session."""
        if s.control_only:
            raise RequestError(
                P.ErrorCode.BAD_MEMORY,
                f"session {s.session_id} registered no memory (memory.kind = "
                f"'none'): it may LOOKUP, not {op}",
            )

    async def _lookup_more(
        self, s: Session, m: P.Lookup, n: int, count: int, start: float
    ) -> P.Reply:
        """The L3 part of a LOOKUP (and the rank group's agreement: a TP rank's LOOKUP is
        counted with the run every rank was answered, not its own)."""
        l2, l3 = await self.ctx.tier.lookup_l3(s, m.key_list(), n, m.round)
        if s.member is not None:
            self._count_lookup(s, count, l2)
        self._observe_lookup(start)
        return P.LookupResult(req_id=m.req_id, epoch=self.ctx.epoch, l2=l2, l3=l3)

    def _observe_lookup(self, start: float) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.observe_lookup(time.perf_counter() - start)

    def prefetch(self, identity: bytes, m: P.Prefetch) -> Answer:
        """PREFETCH: start reading the L3 run after ``skip`` keys into L2."""
        ctx = self.ctx
        s = ctx.session(identity, m.session_id)
        self._needs_memory(s, "PREFETCH")
        check_keys(m.keys, ctx.cfg.max_keys_per_request)
        if m.skip > len(m.keys):
            raise RequestError(
                P.ErrorCode.BAD_MESSAGE, f"skip = {m.skip!r} is outside [0, {len(m.keys)}]"
            )
        if not m.keys or not ctx.tier.available:  # nothing to read: what L2 holds comes
            ctx.counters.prefetches += 1
            coming = ctx.tier.coming(s.ns_id, m.keys[m.skip :]) if m.keys else 0
            return P.PrefetchReply(req_id=m.req_id, epoch=ctx.epoch, started=0, coming=coming)
        return self.later(s, self._prefetch_async(s, m))

    async def _prefetch_async(self, s: Session, m: P.Prefetch) -> P.Reply:
        tier = self.ctx.tier
        started = await tier.prefetch(s, m.keys, m.request_id, skip=m.skip)
        # the leading run in L2 now or being filled (WRITING: this prefetch's pages, another
        # prefetch's or a STORE's); pages another prefetch has still to allocate, or has
        # given up, are not promised
        coming = tier.coming(s.ns_id, m.keys[m.skip :])
        return P.PrefetchReply(
            req_id=m.req_id, epoch=self.ctx.epoch, started=started, coming=coming
        )

    def claim(self, identity: bytes, m: P.Claim) -> Answer:
        """CLAIM: the L2 run, once the session's prefetch is done (per its policy)."""
        start = time.perf_counter()
        ctx = self.ctx
        s = ctx.session(identity, m.session_id)
        self._needs_memory(s, "CLAIM")
        check_keys(m.keys, ctx.cfg.max_keys_per_request)
        if s.member is None and not s.prefetches:  # nothing to wait for: answer now
            n = ctx.pool.lookup(s.ns_id, m.keys)
            ctx.counters.claims += 1
            ctx.counters.claim_pages += n
            self._observe_claim(start)
            return P.ClaimReply(req_id=m.req_id, epoch=ctx.epoch, l2=n)
        return self.later(s, self._claim_async(s, m, start))

    async def _claim_async(self, s: Session, m: P.Claim, start: float) -> P.Reply:
        n = await self.ctx.tier.claim(s, m.keys, m.request_id, m.policy, m.round)
        self._observe_claim(start)
        return P.ClaimReply(req_id=m.req_id, epoch=self.ctx.epoch, l2=n)

    def _observe_claim(self, start: float) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.observe_claim(time.perf_counter() - start)

    # ------------------------------------------------------------------ transfers
    def store(self, identity: bytes, m: P.Store) -> Answer:
        """STORE: allocate host slots for the keys not there yet and copy them in (one of
        more than ``slice_pages`` pages in slices: :mod:`~kvtier.daemon.service.slices`)."""
        ctx = self.ctx
        s = ctx.session(identity, m.session_id)
        self._needs_memory(s, "STORE")
        keys, pages = transfer_keys(m, ctx.cfg.max_keys_per_request, s.memory.num_pages)
        check_slot(s, m.slot)
        if m.parent_key is not None and len(m.parent_key) != P.KEY_BYTES:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"parent_key has {len(m.parent_key)} bytes")
        if m.engine is not None:
            check_engine_blocks(m.engine, len(pages), s.geometry.page_size)
        ctx.counters.stores += 1
        if s.geometry.attention == "mla" and s.tp_rank > 0:
            # MLA pages are the same on every rank: rank 0 stores them for all
            return P.StoreAccepted(req_id=m.req_id, epoch=ctx.epoch, count=len(keys), writing=0)
        if self.long.wanted(len(keys)):  # packed keys are split slice by slice there
            hold = self.long.reserve(s, Direction.STORE, m.slot, m.seq)  # busy from now on
            return self._long(s, hold, self.long.store(s, m, keys, pages, hold))
        if m.packed_keys:  # the pool indexes each new key: the store needs them as objects
            keys = P.split_keys(m.packed_keys)
        allocated = ctx.pool.allocate(s.ns_id, s.owner, s.class_id, keys, m.parent_key)
        every = len(allocated) == len(keys)  # all new (WRITING now): the usual long STORE
        count = stored = len(keys)
        if not every:  # present, or being written by another transfer: not failed
            count = ctx.pool.resident_run(s.ns_id, keys)
            # reported: a key another transfer writes is stored only once that one ends
            stored = ctx.pool.stored_run(s.ns_id, keys[:count], {slot for _, slot in allocated})
        ctx.counters.store_skipped_pages += count - len(allocated)
        ctx.counters.store_failed_pages += len(keys) - count
        ctx.tier.allocated(len(keys), count, s.owner)
        if not allocated:
            return P.StoreAccepted(req_id=m.req_id, epoch=ctx.epoch, count=stored, writing=0)
        host = [slot for _, slot in allocated]
        if ctx.events is not None:  # what the BlockStored of the committed pages will say
            ctx.events.store_of(s, m, keys, None if every else [i for i, _ in allocated])
        if every:
            self.transfers.start(
                s, Direction.STORE, m.slot, m.seq, host, pages, keys, deadline_ns=m.deadline_ns
            )
        else:
            idx = [i for i, _ in allocated]
            self.transfers.start(
                s,
                Direction.STORE,
                m.slot,
                m.seq,
                host,
                [pages[i] for i in idx],
                [keys[i] for i in idx],
                deadline_ns=m.deadline_ns,
            )
        return P.StoreAccepted(req_id=m.req_id, epoch=ctx.epoch, count=stored, writing=len(host))

    def load(self, identity: bytes, m: P.Load) -> Answer:
        """LOAD: pin the leading run of keys in L2 and copy it to the engine's pages (a run
        of more than ``slice_pages`` pages pinned in slices)."""
        ctx = self.ctx
        s = ctx.session(identity, m.session_id)
        self._needs_memory(s, "LOAD")
        keys, pages = transfer_keys(m, ctx.cfg.max_keys_per_request, s.memory.num_pages)
        check_slot(s, m.slot)
        ctx.counters.loads += 1
        if self.long.wanted(len(keys)):
            hold = self.long.reserve(s, Direction.LOAD, m.slot, m.seq)  # busy from now on
            return self._long(s, hold, self.long.load(s, m, keys, pages, hold))
        host = ctx.pool.pin(
            s.ns_id, keys, used=True
        )  # packed keys: the key table probes them as they came
        if host:
            self.transfers.start(
                s,
                Direction.LOAD,
                m.slot,
                m.seq,
                host,
                pages[: len(host)],
                keys[: len(host)],
                deadline_ns=m.deadline_ns,
            )
        return P.LoadAccepted(req_id=m.req_id, epoch=ctx.epoch, count=len(host))

    def _long(self, s: Session, hold: Transfer, work: Coroutine[Any, Any, P.Reply]) -> Deferred:
        """Answer a long request once its slices are done: ``work`` runs in a task the
        daemon's drain waits for, whatever becomes of the reply's own task.

        Its completion slot was taken (``hold``) before this returns, so that a request
        read right after it finds the slot busy; a task cancelled before it ran gives the
        slot back here, as does one that raised past its own handling; ``work`` gives it
        back itself otherwise, or hands it to the copy it started."""
        task = self.transfers.spawn(work)

        def ended(t: asyncio.Task[P.Reply]) -> None:
            if (t.cancelled() or t.exception() is not None) and s.transfers.get(hold.slot) is hold:
                self.long.unreserve(s, hold)

        task.add_done_callback(ended)
        return self.later(s, _shielded(task))

    def release(self, identity: bytes, m: P.Release) -> P.Reply:
        """RELEASE: cancel the session's transfers in the given slots (OUT_OF_RANGE, nothing
        cancelled, when one is not a slot of the session's completion block)."""
        s = self.ctx.session(identity, m.session_id)
        n = s.completion.slots
        bad = next((i for i, slot in enumerate(m.slots) if not 0 <= slot < n), None)
        if bad is not None:
            raise RequestError(
                P.ErrorCode.OUT_OF_RANGE, f"slots[{bad}] = {m.slots[bad]!r} is outside [0, {n})"
            )
        for slot in m.slots:
            t = s.transfers.get(slot)
            if t is not None:
                self.ctx.cancel_transfer(t)
        return P.Ack(req_id=m.req_id, epoch=self.ctx.epoch)


async def _shielded(task: asyncio.Task[P.Reply]) -> P.Reply:
    """``task``'s reply; cancelling the waiter leaves ``task`` running."""
    return await asyncio.shield(task)
