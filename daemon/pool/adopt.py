"""Adoption scan: which rows of a restarted pool's metadata come back as READY pages.

A killed daemon leaves its metadata as the last store left it. Write order makes every
instant safe (a row is complete before its state byte says READY; freeing flips the state
byte first), and a seal binds each row's key, namespace and payload checksum, so a torn or
stray write is a dropped page, never a page served under the wrong key. This module
decides, in bulk with numpy, which rows pass; the pool rebuilds its private state (free
lists, LRU, child lists, index) from the result
(:meth:`~kvtier.daemon.pool.index.HostPool.adopt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from kvtier.daemon.pool.layout import HAS_CHECKSUM, KEY_BYTES, NIL
from kvtier.daemon.pool.meta import PoolMeta
from kvtier.daemon.pool.records import HostPoolError, PageState

__all__ = ["AdoptScan", "scan_rows"]


@dataclass(frozen=True, slots=True)
class AdoptScan:
    """The rows an adoption keeps (from :func:`scan_rows`).

    Attributes:
        slots: adopted slot ids, ascending (int64).
        keys: their keys, same order.
        parents: their parent slot ids after cleaning (NIL: none), same order.
        dropped: rows that were not FREE and are FREE now.
        payload_bytes: sum of the adopted pages' payload lengths.
    """

    slots: np.ndarray
    keys: list[bytes]
    parents: np.ndarray
    dropped: int
    payload_bytes: int


def scan_rows(meta: PoolMeta, usable: np.ndarray, arena: Any | None = None) -> AdoptScan:
    """Decide which rows survive an adoption, and leave only those non-FREE.

    A row is adopted when it is READY; its extent's class cuts its slot (``usable``)
    and matches its payload length; its key fits; its seal matches its key,
    namespace and checksum; with ``arena``, it has a checksum and its payload still
    hashes to it; and no more recent READY row holds the same key in the same
    namespace. Every other non-FREE row (WRITING, failed, duplicate) is set FREE, state
    byte first. Parent links are kept only to an adopted page of the same namespace, and
    cut on any cycle (which only corruption could make); the cleaned links are written
    back.

    Args:
        meta: the mapped metadata; its state, in-L3 and parent columns are rewritten.
        usable: per extent, the slots its class cuts (0: free or unusable), from
            :meth:`~kvtier.daemon.pool.slots.SlotAllocator.usable_per_extent`.
        arena: the arena (``capacity_bytes`` from the arena offset), to verify
            payloads; None trusts them.

    Returns:
        The adopted rows, in ascending slot order.

    Raises:
        HostPoolError: ``arena`` is smaller than the extents it must hold.
    """
    lay = meta.layout
    per = lay.per_extent
    state = meta.array("state")
    live = np.flatnonzero(state != PageState.FREE)
    cand = live[state[live] == PageState.READY]
    pbs = meta.array("ext_bytes")
    e = cand // per
    length = meta.array("length")[cand]
    flags = meta.array("flags")[cand]
    ok = (cand - e * per < usable[e]) & (length == pbs[e])
    ok &= meta.array("key_len")[cand] <= KEY_BYTES
    if arena is not None:
        ok &= (flags & HAS_CHECKSUM) != 0
    cand, e, length, flags = cand[ok], e[ok], length[ok], flags[ok]
    strides = lay.headroom + (pbs[e] + lay.align - 1) // lay.align * lay.align
    offsets = e * lay.span + (cand - e * per) * strides + lay.headroom
    del pbs
    view = None if arena is None else memoryview(arena).cast("B")
    try:
        if view is not None and view.nbytes < lay.n_extents * lay.span:
            raise HostPoolError(f"the arena has {view.nbytes} bytes, the pool needs "
                                f"{lay.n_extents * lay.span}")  # fmt: skip
        by_key = _verify(meta, cand, offsets, length, flags, view)
    finally:
        if view is not None:
            view.release()
    pairs = sorted((s, key) for (_, key), s in by_key.items())
    slots = np.array([s for s, _ in pairs], dtype=np.int64)
    keys = [key for _, key in pairs]
    gone = np.setdiff1d(live, slots)
    state[gone] = PageState.FREE  # first: the rows are free from here on
    in_l3 = meta.array("in_l3")  # allocate leaves it alone: no FREE row may keep it
    kept = in_l3[slots]
    in_l3[:] = 0
    in_l3[slots] = kept
    parents = _clean_parents(meta, slots)
    del state, in_l3
    return AdoptScan(slots, keys, parents, len(gone), int(meta.array("length")[slots].sum()))


def _verify(meta: PoolMeta, cand: np.ndarray, offsets: np.ndarray, length: np.ndarray,
            flags: np.ndarray, view: memoryview | None) -> dict[tuple[int, bytes], int]:  # fmt: skip
    """Seal (and payload) checks of candidate READY rows; return (ns, key) -> slot.

    The columns are gathered with numpy first, so the per-row loop only slices a key,
    hashes it (and the payload) and fills a dict.
    """
    n = len(cand)
    blob = meta.array("key").reshape(-1, KEY_BYTES)[cand].tobytes()
    key_len = meta.array("key_len")[cand].tolist()
    has = (flags & HAS_CHECKSUM) != 0
    sums = np.where(has, meta.array("checksum")[cand], 0).tolist()
    seeds = ((meta.array("checksum")[cand] * has) ^ meta.array("ns")[cand].view(np.uint64))
    seals = meta.array("seal")[cand].tolist()
    stamps = meta.array("stamp")[cand].tolist()
    digest = xxhash.xxh3_64_intdigest
    by_key: dict[tuple[int, bytes], int] = {}
    best: dict[tuple[int, bytes], int] = {}  # (ns, key) -> stamp of the row holding it
    nss = meta.array("ns")[cand].tolist()
    rows = zip(range(n), cand.tolist(), seeds.tolist(), seals, key_len, stamps,
               offsets.tolist(), length.tolist(), sums, nss)  # fmt: skip
    for j, s, seed, seal, kl, stamp, off, nbytes, csum, ns in rows:
        key = blob[j * KEY_BYTES : j * KEY_BYTES + kl]
        if digest(key, seed) != seal:
            continue
        if view is not None and digest(view[off : off + nbytes]) != csum:
            continue
        if best.get((ns, key), -1) < stamp:
            by_key[(ns, key)], best[(ns, key)] = s, stamp
    return by_key


def _clean_parents(meta: PoolMeta, slots: np.ndarray) -> np.ndarray:
    """Keep parent links to adopted pages of the same namespace, cut cycles, write
    the result back (NIL for every other row) and return it, one per slot."""
    n, m = meta.layout.n_slots, len(slots)
    col = meta.array("parent")
    ns = meta.array("ns")
    par = col[slots].astype(np.int64)
    pos = np.searchsorted(slots, np.clip(par, 0, n - 1)) if m else par
    pos = np.minimum(pos, max(m - 1, 0))
    ok = (par >= 0) & (par < n) & (par != slots)
    if m:
        ok &= slots[pos] == par
        ok &= ns[slots[pos]] == ns[slots]
    par[~ok] = NIL
    # A forest reaches the sentinel m within m steps: 2**bit_length(m) > m jumps.
    jump = np.full(m + 1, m, dtype=np.int64)
    jump[:m] = np.where(ok, pos, m)
    for _ in range(max(1, m.bit_length())):
        jump = jump[jump]
    par[jump[:m] != m] = NIL
    col[:] = NIL
    col[slots] = par
    del col, ns
    return par
