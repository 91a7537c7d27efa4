"""A STORE's page-table steps in one C call each: allocating its slots, committing them.

A STORE allocates a WRITING slot per key the pool lacks and, once the copy has landed,
commits them READY. Page by page in Python, into a full pool (where every new page first
evicts a cold one), that costs microseconds of event-loop time a page: an 8,192-page STORE
of a long context would hold the loop for a large fraction of a second, during which no
other engine is answered.

Where the C extension is built (``kvtier.daemon.pool.native._alloc``), :func:`allocate_run` and
:func:`commit_run` do the same steps in the same order, from :data:`RUN_PAGES` pages on, so
the pool's metadata, indexes, evictable lists, counters and eviction log end up exactly as
page by page (``tests/unit/test_pool_alloc.py`` holds them to it). What they leave to the
page-by-page path: an allocation for an owner with a quota, in a pool whose evictions
require L3 or under the ``arc`` eviction policy (all of it), and each key whose slot needs a free extent cut or a page of another
class evicted (that key alone; C goes on after it); a commit whose slots or checksums the
Python path would refuse (all of it, so that path names what is wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.daemon.pool.layout import NIL
from kvtier.daemon.pool.records import EvictedPage, PageState

from kvtier.daemon.pool.native import _alloc

__all__ = ["NATIVE", "RUN_PAGES", "allocate_run", "commit_run"]

NATIVE = _alloc is not None
"""Whether STOREs are allocated and committed in C (``daemon/pool/native/_alloc.c``)."""
RUN_PAGES = 8
"""Allocations and commits of at least this many pages go to C (when built)."""


def _cols(table: Any) -> tuple[Any, ...]:
    """The 21 columns ``_alloc`` works on, in its order."""
    meta, kids, lru, slots = table._meta, table._kids, table._lru, table._slots
    return (
        meta.stamp,
        meta.ns,
        meta.owner,
        meta.length,
        meta.parent,
        meta.key,
        meta.state,
        meta.in_l3,
        meta.key_len,
        table._pins,
        kids.count,
        kids.first,
        kids.sib_prev,
        kids.sib_next,
        lru.prev,
        lru.next,
        lru.oprev,
        lru.onext,
        slots.ext_class,
        slots.ext_used,
        slots.ext_bump,
    )


def allocate_run(table: Any, ns_id: int, owner: int, class_id: int, keys: Sequence[bytes],
                 parent_key: bytes | None) -> list[tuple[int, int]] | None:  # fmt: skip
    """:meth:`~kvtier.daemon.pool.pages.PageTable.allocate` of ``table`` in C, for a
    registered ``class_id``; None, having changed nothing, where it does not apply: the
    extension is not built, the owner has a quota, evictions require L3, or a key is not
    ``bytes`` of at most 32 bytes (the page-by-page path then names it); under the ``arc``
    eviction policy (its ghost lists and T1/T2 split are kept in Python)."""
    ev = table._ev
    if _alloc is None or owner in ev.quota or ev.requires_l3 or ev.arc is not None:
        return None
    keys = keys if type(keys) is list else list(keys)
    ready = table._ready.get(ns_id, {})  # read only: a namespace's first commit makes it
    writing = table._writing.setdefault(ns_id, {})
    prev = NIL
    if parent_key is not None:
        p = ready.get(parent_key, writing.get(parent_key))
        prev = NIL if p is None else p
    cols, lru, cls = _cols(table), table._lru, table._classes[class_id]
    out: list[tuple[int, int]] = []
    i, n = 0, len(keys)
    while i < n:
        done = _alloc.run(
            cols,
            keys,
            i,
            prev,
            table._clock,
            ns_id,
            owner,
            class_id,
            cls.page_bytes,
            table._per_extent,
            bool(table._slots.free_extents),
            cls,
            ready,
            writing,
            table._ready,
            table._key,
            table._owned,
            lru.ends,
            lru.own_ends,
            ev._log,
            ev.max_log,
            EvictedPage,
            out,
            i > 0,
        )  # the first call checked every key
        if done is None:  # only ever before the first change: every key is checked first
            return None
        i, prev, table._clock, evictions, unlogged = done
        ev.evictions += evictions
        ev.unlogged += unlogged
        if i == n:
            break
        # key i needs a free extent cut or another class's page evicted: the Python path
        one = table._allocate(
            ns_id, owner, class_id, [keys[i]], None if prev == NIL else table._key[prev]
        )
        if not one:  # a shortfall: later pages are useless without this one
            break
        prev = one[0][1]
        out.append((i, prev))
        i += 1
    return out


def commit_run(table: Any, slots: Sequence[int], checksums: Sequence[int] | None) -> bool:
    """:meth:`~kvtier.daemon.pool.pages.PageTable.commit` of ``table`` in C; False, having
    changed nothing, where it does not apply (not built, the ``arc`` eviction policy, or
    something the Python path refuses: it names it). Raises as that path does for a slot listed twice."""
    if _alloc is None or table._ev.arc is not None or type(slots) is not list or (
            checksums is not None and type(checksums) is not list):  # fmt: skip
        return False
    meta = table._meta
    done = _alloc.commit(
        _cols(table),
        (meta.checksum, meta.seal, meta.flags),
        slots,
        checksums,
        table._clock,
        table._per_extent,
        table._writing,
        table._ready,
        table._key,
        table._classes,
        table._lru.ends,
        table._lru.own_ends,
    )
    if done is None:
        return False
    stop, table._clock = done
    if stop:  # listed twice: no longer WRITING
        table._expect(slots[stop - 1], PageState.WRITING, "commit")
    return True
