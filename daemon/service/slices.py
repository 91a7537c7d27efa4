"""Long STOREs and LOADs in slices: the event loop answers everyone else between them.

A request's page-table work grows with its pages. A STORE of a 128K-token context (8,192
pages) into a full pool allocates 8,192 slots, evicting as many pages, and commits them
once copied; a LOAD pins as many pages and unpins them once copied. Done in one go, each
step holds the single event loop for milliseconds, and every other engine's LOOKUP (on its
time to first token) waits behind it. So a request of more than ``slice_pages`` pages (the
setting) takes each step in slices of at most that many pages, with a turn of the event
loop between two slices: another request waits for one slice at most.

What each step keeps true between its slices (the functions below take the pool's public
methods only):

- :func:`allocate`, head first: each slice's first page is parented by the previous slice's
  last (``parent_key``). New pages are WRITING: invisible to LOOKUP and LOAD, never evicted.
  A present page of the chain that ends a slice has no child yet, so it may be evicted
  before the next slice: the STORE then stops there, as an allocation stops at a page it
  cannot place (the pages after it would be useless).
- :func:`commit`, tail first, as the pool commits one call's slots: the chain's head turns
  READY last, so a LOOKUP (the leading READY run) sees the STORE's pages all at once or
  not at all, never a half, and a LOAD pins none of them before all are READY. The slices
  before the head's stay pinned until the head is READY: no other request's allocation
  evicts a page of the STORE before the STORE has ended (and been announced to KV event
  subscribers, which would otherwise hear of its removal first).
- :func:`abort`, tail first.
- :func:`pin`, head first: a pinned page is not evicted; a slice that finds fewer READY
  pages than it asks for (the chain's tail was evicted meanwhile) ends the run there.
- :func:`unpin`.

A request cancelled between two slices (its session closed, its slot released) stops at
the next turn, having undone what it did (:mod:`~kvtier.daemon.service.long_requests`
holds such a request's slot and answers it). Each step takes ``turn`` (the
event loop's turn) as an argument, so that a test can stop it at every slice boundary.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvtier.daemon.pool.host_pool import HostPool

__all__ = ["Allocated", "abort", "allocate", "commit", "pin", "turn", "unpin"]

Turn = Callable[[], Awaitable[None]]
"""Gives the event loop a turn between two slices."""


async def turn() -> None:
    """One turn of the event loop: ready callbacks run and the sockets are polled (the
    control socket's reader answers what is queued) before the caller goes on.

    First the thread offers its CPU to any thread waiting for it (``sched_yield``; it
    returns at once when none is): slices follow one another for milliseconds, and an
    engine whose thread woke up on this CPU to send its LOOKUP would otherwise wait for the
    scheduler's tick before its request even reaches the socket the loop polls."""
    os.sched_yield()
    await asyncio.sleep(0)


class Allocated:
    """What :func:`allocate` made: ``slots`` (WRITING, in key order), the index of each
    one's key in ``indexes``, their arena offsets by slice in ``offsets``, ``count``, the
    leading run of keys resident (stored before, or being stored now), and ``keys``, the
    keys of the slices it went through, as bytes objects (``keys[i]`` for each index)."""

    __slots__ = ("count", "indexes", "keys", "offsets", "slots")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.slots: list[int] = []
        self.indexes: list[int] = []
        self.offsets: list[np.ndarray] = []
        self.count = 0


async def allocate(
    pool: HostPool,
    ns_id: int,
    owner: int,
    class_id: int,
    keys: Sequence[bytes],
    parent_key: bytes | None,
    size: int,
    cancelled: Callable[[], bool],
    on_slice: Callable[[int, int], None],
    step: Turn = turn,
) -> Allocated | None:
    """Allocate WRITING slots for the keys of a chain the pool lacks, ``size`` keys at a
    time, head first (:meth:`HostPool.allocate` per slice).

    Args:
        pool: the host pool.
        ns_id / owner / class_id: as for :meth:`HostPool.allocate`.
        keys: the chain's keys, in order (a list, or a packed request's
            :class:`~kvtier.ipc.packed.PackedKeyList`).
        parent_key: the key the chain's first page extends, if any.
        size: keys per slice (at least 1).
        cancelled: asked after each turn; True stops the allocation.
        on_slice: called after each slice with (keys asked, leading keys resident).
        step: the event loop's turn between slices.

    Returns:
        What was allocated; None when cancelled, having aborted its slots.
    """
    out = Allocated()
    parent = parent_key
    n = len(keys)
    for a in range(0, n, size):
        if a:
            await step()
            if cancelled():  # its keys leave the index of pages being written at once: a
                pool.detach(out.slots)  # STORE of them during the abort's slices writes them
                await abort(pool, out.slots, size, step)
                return None
            if pool.resident_run(ns_id, [keys[a - 1]]) == 0:
                break  # the present page that ends the last slice left the pool meanwhile
        part = keys[a : a + size]
        if not isinstance(part, list):  # packed keys: the pool indexes each new one as an
            part = list(part)  # object; made slice by slice, not all before the first
        out.keys += part
        got = pool.allocate(ns_id, owner, class_id, part, parent)
        run = len(part) if len(got) == len(part) else pool.resident_run(ns_id, part)
        on_slice(len(part), run)
        if got:
            slots = [slot for _, slot in got]
            out.slots += slots
            out.indexes += [a + i for i, _ in got]
            out.offsets.append(pool.slot_offsets(slots))
        out.count = a + run
        if run < len(part):
            break  # a shortfall: the pages after it would be useless
        parent = part[-1]
    return out


async def commit(
    pool: HostPool,
    slots: list[int],
    checksums: list[int] | None,
    size: int,
    step: Turn = turn,
) -> None:
    """Commit ``slots`` (a chain's WRITING pages, in order) ``size`` at a time, tail first
    (:meth:`HostPool.commit` per slice): the head turns READY last. Each slice but the
    head's is pinned from its commit until the head's (unpinned before this returns)."""
    n = len(slots)
    held: list[int] = []
    try:
        for b in range(n, 0, -size):
            if b < n:
                await step()
            a = max(0, b - size)
            part = slots[a:b]
            pool.commit(part, None if checksums is None else checksums[a:b])
            if a:
                pool.pin_slots(part)
                held += part
    finally:
        if held:
            pool.unpin(held)


async def abort(pool: HostPool, slots: list[int], size: int, step: Turn = turn) -> None:
    """Free ``slots`` (WRITING) ``size`` at a time, tail first (:meth:`HostPool.abort`)."""
    n = len(slots)
    for b in range(n, 0, -size):
        if b < n:
            await step()
        pool.abort(slots[max(0, b - size) : b])


async def pin(
    pool: HostPool,
    ns_id: int,
    keys: Sequence[bytes],
    size: int,
    cancelled: Callable[[], bool],
    step: Turn = turn,
) -> list[int] | None:
    """Pin the leading READY run of ``keys`` ``size`` keys at a time, head first
    (:meth:`HostPool.pin`, as a LOAD uses them).

    Returns:
        The pinned slots; None when cancelled, having unpinned them.
    """
    out: list[int] = []
    for a in range(0, len(keys), size):
        if a:
            await step()
            if cancelled():
                await unpin(pool, out, size, step)
                return None
        part = keys[a : a + size]
        got = pool.pin(ns_id, part, used=True)
        out += got
        if len(got) < len(part):
            break
    return out


async def unpin(pool: HostPool, slots: list[int], size: int, step: Turn = turn) -> None:
    """Drop one pin of each of ``slots``, ``size`` at a time (:meth:`HostPool.unpin`)."""
    for a in range(0, len(slots), size):
        if a:
            await step()
        pool.unpin(slots[a : a + size])
