"""Adoption scan: which rows of a restarted pool's metadata come back as READY pages.

A killed daemon leaves its metadata as the last store left it. Write order makes every
instant safe (a row is complete before its state byte says READY; freeing flips the state
byte first), and a seal binds each row's key, namespace and payload checksum, so a torn or
stray write is a dropped page, never a page served under the wrong key. This module
decides, in bulk with numpy, which rows pass, and builds their index (key -> slot); the
pool rebuilds the rest of its private state (free lists, LRU, child lists) from the result
(a :class:`~kvtier.daemon.pool.host_pool.HostPool` built over the pool file's metadata).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import xxhash
from kvtier.daemon.pool.layout import HAS_CHECKSUM, KEY_BYTES, NIL
from kvtier.daemon.pool.meta import PoolMeta
from kvtier.daemon.pool.records import HostPoolError, PageState
from kvtier.daemon.pool.seals import seals

from kvtier.daemon.pool.native import _keyprobe

__all__ = ["STAMP_LIMIT", "AdoptScan", "scan_rows"]

STAMP_LIMIT = 1 << 62
"""Access stamps an adopted row may hold: the pool's clock counts accesses from 0 and never
comes near it; a larger one is damage, and a clock continued from it would overflow."""


@dataclass(frozen=True, slots=True)
class AdoptScan:
    """The rows an adoption keeps (from :func:`scan_rows`).

    Attributes:
        slots: adopted slot ids, ascending (int64).
        ready: their index, per namespace id: key -> slot (each key's bytes object is also
            in the ``by_slot`` list given to :func:`scan_rows`, at its slot).
        parents: their parent slot ids after cleaning (NIL: none), same order as ``slots``.
        dropped: rows that were not FREE and are FREE now.
        payload_bytes: sum of the adopted pages' payload lengths.
        unchecked: READY rows dropped only for having no checksum to verify (stored while
            ``verify_on_adopt`` was off; adopted with verification asked for).
    """

    slots: np.ndarray
    ready: dict[int, dict[bytes, int]]
    parents: np.ndarray
    dropped: int
    payload_bytes: int
    unchecked: int = 0


def scan_rows(
    meta: PoolMeta, usable: np.ndarray, by_slot: list[bytes | None], arena: Any | None = None
) -> AdoptScan:
    """Decide which rows survive an adoption, leave only those non-FREE, and index them.

    A row is adopted when it is READY; its extent's class cuts its slot (``usable``)
    and matches its payload length; its key fits; its access stamp is in ``[0,
    STAMP_LIMIT)`` (the pool's clock continues from the largest); its seal matches its key,
    namespace and checksum; with ``arena``, it has a checksum and its payload still
    hashes to it; and no more recent READY row holds the same key in the same
    namespace (of equally recent ones, the lowest slot). Every other non-FREE row
    (WRITING, failed, duplicate) is set FREE, state byte first. Parent links are kept
    only to an adopted page of the same namespace, and cut on any cycle (which only
    corruption could make); the cleaned links are written back, and each adopted row's
    key bytes past its length are zeroed (as allocation writes them).

    The checks run as numpy columns (:func:`~kvtier.daemon.pool.seals.seals`, in C, for
    the seals); only the payload hashes (with ``arena``) are a Python loop over every row.
    Duplicates: the index is built first, in C, and that finds them at no extra cost (a
    dict that does not grow); only when it does are they resolved, by a 64-bit hash of
    each (namespace, key) (rows whose hashes collide are then compared whole, one by one),
    and the index built again.

    Args:
        meta: the mapped metadata; its state, in-L3 (cleared) and parent columns are rewritten.
        usable: per extent, the slots its class cuts (0: free or unusable), from
            :meth:`~kvtier.daemon.pool.slots.SlotAllocator.usable_per_extent`.
        by_slot: the pool's slot -> key list, None throughout: each adopted key is put
            at its slot.
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
    flags = meta.array("flags")[cand]
    ok = (cand - e * per < usable[e]) & (meta.array("length")[cand] == pbs[e])
    ok &= meta.array("key_len")[cand] <= KEY_BYTES
    stamp = meta.array("stamp")[cand]
    ok &= (stamp >= 0) & (stamp < STAMP_LIMIT)
    del stamp
    unchecked = 0
    if arena is not None:  # a page stored without a checksum cannot be verified: dropped
        summed = (flags & HAS_CHECKSUM) != 0
        unchecked = int(np.count_nonzero(ok & ~summed))
        ok &= summed
    cand, flags = cand[ok], flags[ok]
    rows = meta.array("key").reshape(-1, KEY_BYTES)[cand]  # a copy, (n, KEY_BYTES)
    key_len = meta.array("key_len")[cand]
    sums = np.where((flags & HAS_CHECKSUM) != 0, meta.array("checksum")[cand], np.uint64(0))
    sealed = seals(rows, key_len, sums ^ meta.array("ns")[cand].view(np.uint64))
    ok = sealed == meta.array("seal")[cand]
    cand, rows, key_len, sums = cand[ok], rows[ok], key_len[ok], sums[ok]
    if arena is not None:
        ok = _payloads_match(meta, arena, cand, sums)
        cand, rows, key_len = cand[ok], rows[ok], key_len[ok]
    del pbs
    ready = _index(meta.array("ns")[cand], cand, rows, key_len, by_slot)
    if ready is None:  # a key comes twice
        latest = _latest_per_key(meta, cand, rows, key_len)
        if not latest.all():
            cand, rows, key_len = cand[latest], rows[latest], key_len[latest]
        ready = _index(meta.array("ns")[cand], cand, rows, key_len, by_slot)
        if ready is None:
            raise HostPoolError("adopted rows still hold a key twice after deduplication")
    slots = cand
    gone = np.ones(len(state), dtype=bool)
    gone[slots] = False
    gone[state == PageState.FREE] = False
    n_gone = int(np.count_nonzero(gone))
    state[gone] = PageState.FREE  # first: the rows are free from here on
    # No row keeps its in-L3 mark: the store may have been emptied, replaced or reconfigured
    # while no daemon ran, and a page marked in L3 that is not there would be evicted by
    # write-back into no tier (or skipped by SYNC). The writer asks L3 what it holds
    # (``exists``) before it writes, so a page L3 still has is marked again for the cost of
    # that question. Allocation leaves the column alone, so FREE rows must not keep it either.
    in_l3 = meta.array("in_l3")
    in_l3[:] = 0
    _clear_past_lengths(meta, slots)
    parents = _clean_parents(meta, slots)
    del state, in_l3
    return AdoptScan(
        slots, ready, parents, n_gone, int(meta.array("length")[slots].sum()), unchecked
    )


def _clear_past_lengths(meta: PoolMeta, slots: np.ndarray) -> None:
    """Zero the key column past each adopted key's length, as allocation leaves it: the key
    table (:mod:`~kvtier.daemon.pool.keytable`) hashes and compares whole 32-byte rows.
    Those bytes are part of neither the key nor its seal, so this changes no page."""
    key_len = meta.array("key_len")[slots]
    short = slots[key_len < KEY_BYTES]
    if len(short):
        col = meta.array("key").reshape(-1, KEY_BYTES)
        rows = col[short]
        rows[np.arange(KEY_BYTES) >= key_len[key_len < KEY_BYTES][:, None]] = 0
        col[short] = rows
        del col


def _payloads_match(meta: PoolMeta, arena: Any, cand: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """Hash each candidate's payload in ``arena``; True where it matches its checksum."""
    lay = meta.layout
    pbs = meta.array("ext_bytes")
    e = cand // lay.per_extent
    length = meta.array("length")[cand]
    strides = lay.headroom + (pbs[e] + lay.align - 1) // lay.align * lay.align
    offsets = e * lay.span + (cand - e * lay.per_extent) * strides + lay.headroom
    del pbs
    digest = xxhash.xxh3_64_intdigest
    with memoryview(arena) as raw, raw.cast("B") as view:
        if view.nbytes < lay.n_extents * lay.span:
            raise HostPoolError(
                f"the arena has {view.nbytes} bytes, the pool needs {lay.n_extents * lay.span}"
            )
        got = [
            digest(view[off : off + nbytes])
            for off, nbytes in zip(offsets.tolist(), length.tolist())
        ]
    return cast("np.ndarray", np.array(got, dtype=np.uint64).reshape(-1) == sums)


def _index(
    nss: np.ndarray,
    slots: np.ndarray,
    rows: np.ndarray,
    key_len: np.ndarray,
    by_slot: list[bytes | None],
) -> dict[int, dict[bytes, int]] | None:
    """The index of the rows: per namespace id, key -> slot; None when a key comes twice
    in a namespace (``by_slot`` then as it was).

    Each key (its row's first ``key_len`` bytes) becomes one bytes object, shared by the
    index and ``by_slot`` (slot -> key), where it is put at its slot. C makes the objects
    and the dicts in one pass per namespace (``index_keys``, hashing each key as it is
    made), and finds a key that comes twice in a namespace.

    Args:
        nss / slots / rows / key_len: the rows' namespaces, slots (ascending), key rows
            (``(n, KEY_BYTES)`` uint8) and key lengths (each at most ``KEY_BYTES``).
        by_slot: one entry per slot of the pool, None at every slot of ``slots``.
    """
    n = len(slots)
    if not n:
        return {}
    lengths = key_len.astype(np.uint8)
    if (nss == nss[0]).all():  # one namespace: the usual case
        try:
            return {int(nss[0]): _keyprobe.index_keys(rows, lengths, slots, by_slot)}
        except ValueError:
            return None  # a key twice; by_slot is as it was
    order = np.argsort(nss, kind="stable")
    parts = np.split(order, np.flatnonzero(nss[order][1:] != nss[order][:-1]) + 1)
    ready: dict[int, dict[bytes, int]] = {}
    for p in parts:
        try:
            ready[int(nss[p[0]])] = _keyprobe.index_keys(rows[p], lengths[p], slots[p], by_slot)
        except ValueError:
            for s in slots.tolist():  # the namespaces indexed already give theirs back
                by_slot[s] = None
            return None
    return ready


def _latest_per_key(
    meta: PoolMeta, cand: np.ndarray, rows: np.ndarray, key_len: np.ndarray
) -> np.ndarray:
    """Mask of the candidates that hold their (namespace, key) most recently: of rows
    with the same namespace and key, the one with the largest stamp, the lowest slot of
    a tie.

    Each row's (namespace, key) is hashed to 64 bits (:func:`_fingerprints`); only rows
    sharing a hash (a duplicate, or a collision) are compared whole.

    Args:
        cand: candidate slots, ascending; ``rows`` their key rows and ``key_len`` their
            key lengths, same order.
    """
    nss = meta.array("ns")[cand]
    hashes = _fingerprints(rows, key_len, nss)
    order = np.argsort(hashes)
    same = hashes[order][1:] == hashes[order][:-1]
    keep = np.ones(len(cand), dtype=bool)
    if not same.any():
        return keep
    shared = np.zeros(len(cand), dtype=bool)
    shared[1:] |= same
    shared[:-1] |= same
    suspects = np.sort(order[shared])  # positions, in ascending slot order
    stamps = meta.array("stamp")[cand[suspects]].tolist()
    best: dict[tuple[int, bytes], tuple[int, int]] = {}  # (ns, key) -> (stamp, position)
    for j, stamp in zip(suspects.tolist(), stamps):
        who = (int(nss[j]), rows[j, : key_len[j]].tobytes())
        held = best.get(who)
        if held is None or held[0] < stamp:
            best[who] = (stamp, j)
    keep[suspects] = False
    keep[[j for _, j in best.values()]] = True
    return keep


_MULTIPLIERS = np.array(
    [
        0x9E3779B185EBCA87,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0x85EBCA77C2B2AE63,
        0x27D4EB2F165667C5,
        0xFF51AFD7ED558CCD,
    ],
    dtype=np.uint64,
)  # odd 64-bit constants (xxHash's primes)


def _fingerprints(rows: np.ndarray, key_len: np.ndarray, nss: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row's namespace and key (its first ``key_len`` bytes).

    Equal (namespace, key) pairs hash equal; unequal ones rarely do, and
    :func:`_latest_per_key` compares rows that do whole, so a collision (even one a
    client made on purpose) costs time, never a wrong answer.
    """
    if len(key_len) and not (key_len == KEY_BYTES).all():
        rows = np.where(np.arange(KEY_BYTES) < key_len[:, None], rows, np.uint8(0))
    words = np.ascontiguousarray(rows).view("<u8")
    m = _MULTIPLIERS
    h = key_len.astype(np.uint64) * m[5] + nss.view(np.uint64) * m[4]
    for i in range(KEY_BYTES // 8):
        h += (words[:, i] ^ (words[:, i] >> np.uint64(29))) * m[i]
    return cast("np.ndarray", h)


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
        if (jump == m).all():  # every chain reached its root: no cycle left to find
            break
    par[jump[:m] != m] = NIL
    col[:] = NIL
    col[slots] = par
    del col, ns
    return cast("np.ndarray", par)
