"""The cache manager's STOREs: which L1 pages L2 lacks, the write policy, and STOREs in flight.

HiCache's write policies decide when an L1 page is copied to L2: ``write_through`` on its first
insert, ``write_through_selective`` once ``write_through_threshold`` requests have inserted it
(the request that computed it counts), ``write_back`` only when L1 evicts it. To apply them the
tracker remembers, per page key L2 is not known to hold, its chain parent and how many requests
used it; to keep device pages safe it remembers which STORE reads which page, so a page goes
back to the allocator only after every STORE reading it has completed.

STOREs in flight hold the link's slots (completion slots; staging slots in the engine copy
mode) until they are reaped, and a STORE that finds none free is dropped. So the tracker
keeps its STOREs within the link's ``store_room``: before it issues one that would not fit,
it waits for its oldest. An eviction that writes back many chains thus issues them as
earlier ones complete instead of dropping most of them.

Not thread-safe: the manager calls it from the engine's scheduler thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.client.cache.counters import CacheCounters
from kvtier.client.cache.link import CacheLink, Transfer
from kvtier.client.radix.tree import RadixTree

__all__ = ["StoreTracker"]


@dataclass(slots=True)
class _Unbacked:
    """A device page L2 is not known to hold: its chain parent and the requests that used it."""

    parent: bytes | None
    uses: int = 0


@dataclass(slots=True, eq=False)
class _Store:
    """A STORE in flight: its handle, the keys and device pages it reads, and the daemon
    epoch it went to (pages a restarted daemon lost are not marked as in L2)."""

    handle: Transfer
    keys: list[bytes]
    pages: list[int]
    epoch: int = 0


class StoreTracker:
    """STOREs of one cache manager, from the write policy's decision to the reaped result.

    Args:
        connection: the daemon connection STOREs go to (None: nothing is ever stored, but
            pages are still tracked so that eviction knows their chain parents).
        tree: the manager's L1 index; pages a STORE placed are marked as held by L2 there.
        counters: the manager's counters (STOREs issued, pages stored, failures, write-backs).
        store_threshold: inserts after which a page is stored (1: write_through; 0: never on
            insert, i.e. write_back).
    """

    __slots__ = (
        "_conn",
        "_counters",
        "_held",
        "_page_stores",
        "_pending",
        "_pending_pages",
        "_storing",
        "_threshold",
        "_tree",
        "_unbacked",
    )

    def __init__(
        self,
        connection: CacheLink | None,
        tree: RadixTree,
        counters: CacheCounters,
        store_threshold: int,
    ) -> None:
        self._conn = connection
        self._tree = tree
        self._counters = counters
        self._threshold = store_threshold
        self._unbacked: dict[bytes, _Unbacked] = {}
        self._pending: dict[_Store, None] = {}  # in issue order
        self._pending_pages = 0
        self._page_stores: dict[int, _Store] = {}
        self._storing: set[bytes] = set()
        self._held: dict[int, Transfer] = {}  # pages of failed STOREs kvtierd may still read

    def rekey(self, new_of: dict[bytes, bytes]) -> None:
        """The tree's pages were named anew (:meth:`RadixTree.rekey`): the pages L2 lacks
        are tracked under their new keys, those the tree no longer holds forgotten."""
        self._unbacked = {
            new_of[key]: _Unbacked(new_of.get(u.parent, u.parent) if u.parent else None, u.uses)
            for key, u in self._unbacked.items()
            if key in new_of
        }

    @property
    def pending(self) -> int:
        """STOREs issued and not yet reaped."""
        return len(self._pending)

    def inserted(
        self,
        keys: Sequence[bytes],
        pages: Sequence[int],
        l1: int,
        l1_in_l2: Sequence[bool],
        loaded: int,
    ) -> None:
        """Count one request's insert of ``keys`` and STORE the pages the write policy picks.

        Args:
            keys: the key of every full page of the prompt, in chain order.
            pages: the device page of each key (what a STORE would read).
            l1: pages of the request's L1 hit (the first ``l1`` keys).
            l1_in_l2: per page of the L1 hit, whether L2 holds it.
            loaded: pages right after the L1 hit that the request loaded from L2.
        """
        todo: list[int] = []
        unbacked = self._unbacked
        for i, key in enumerate(keys):
            if (i < l1 and l1_in_l2[i]) or l1 <= i < l1 + loaded:
                unbacked.pop(key, None)
                continue
            rec = unbacked.get(key)
            if rec is None:
                rec = unbacked[key] = _Unbacked(keys[i - 1] if i else None)
            rec.uses += 1
            if self._threshold and rec.uses >= self._threshold and key not in self._storing:
                todo.append(i)
        if todo and self._conn is not None:
            self._store_runs(list(keys), list(pages), todo)

    def forget(self, key: bytes) -> None:
        """Stop tracking an evicted page.

        Args:
            key: the evicted page's key.
        """
        self._unbacked.pop(key, None)

    def reap_pages(self, pages: Iterable[int]) -> None:
        """Wait for every STORE that reads one of ``pages`` (before the pages are reused)."""
        for st in {self._page_stores[p] for p in pages if p in self._page_stores}:
            self._reap(st)

    def sync(self) -> None:
        """Wait for every STORE in flight and record what L2 now holds."""
        for st in list(self._pending):
            self._reap(st)

    def write_back(self, backup: list[tuple[bytes, int, bytes | None]]) -> None:
        """STORE evicted pages as chains, parent first, and wait before their pages are reused.

        Eviction runs leaf first and tail first, so the reversed list has every parent before
        its children; consecutive pages whose parent is the page before form one STORE.

        Args:
            backup: ``(key, device page, parent key)`` of each evicted page L2 lacks, in
                eviction order.
        """
        if not backup or self._conn is None:
            return
        stores = []
        run_keys: list[bytes] = []
        run_pages: list[int] = []
        run_parent: bytes | None = None
        for key, page, parent in reversed(backup):
            if run_keys and parent == run_keys[-1]:
                run_keys.append(key)
                run_pages.append(page)
                continue
            if run_keys:
                stores += self._issue(run_keys, run_pages, run_parent)
            run_keys, run_pages, run_parent = [key], [page], parent
        stores += self._issue(run_keys, run_pages, run_parent)
        for st in stores:
            if self._reap(st):
                self._counters.written_back_pages += st.handle.writing

    # ------------------------------------------------------------------ internals
    def _store_runs(self, keys: list[bytes], pages: list[int], todo: list[int]) -> None:
        """STORE each run of consecutive page indexes in ``todo``, chained to its parent."""
        start = 0
        while start < len(todo):
            end = start + 1
            while end < len(todo) and todo[end] == todo[end - 1] + 1:
                end += 1
            a, b = todo[start], todo[end - 1] + 1
            self._issue(keys[a:b], pages[a:b], keys[a - 1] if a else None)
            start = end

    def _issue(self, keys: list[bytes], pages: list[int], parent: bytes | None) -> list[_Store]:
        """STORE a chain run, one STORE per ``room`` pages of it (each chained to the piece
        before: a link in the engine copy mode takes at most its staging area's pages in
        one), and remember the keys and pages each reads."""
        assert self._conn is not None
        room = self._conn.store_room[1]
        return [
            self._issue_one(keys[a : a + room], pages[a : a + room], keys[a - 1] if a else parent)
            for a in range(0, len(keys), room)
        ]

    def _issue_one(self, keys: list[bytes], pages: list[int], parent: bytes | None) -> _Store:
        """Send one STORE (of at most ``room`` pages) once it fits the link's room."""
        assert self._conn is not None
        stores, room = self._conn.store_room
        while self._pending and (
            len(self._pending) >= stores or self._pending_pages + len(keys) > room
        ):
            self._reap(next(iter(self._pending)))  # the oldest: its slots are needed
        st = _Store(self._conn.store(keys, pages, parent_key=parent), keys, pages, self._conn.epoch)
        self._counters.stores_issued += 1
        self._pending[st] = None
        self._pending_pages += len(keys)
        self._storing.update(keys)
        for p in pages:
            self._page_stores[p] = st
        return st

    def _reap(self, st: _Store) -> bool:
        """Wait for ``st``, record the pages L2 now holds; True when it succeeded."""
        if st not in self._pending:
            return st.handle.ok
        ok = st.handle.wait()
        del self._pending[st]
        self._pending_pages -= len(st.keys)
        self._storing.difference_update(st.keys)
        for p in st.pages:
            if self._page_stores.get(p) is st:
                del self._page_stores[p]
        # a STORE to a daemon since replaced: the new one's L2 may not hold its pages
        stale = self._conn is not None and self._conn.epoch != st.epoch
        if ok and not stale:
            done = st.keys[: st.handle.count]
            self._tree.mark_in_l2(done)
            for key in done:
                self._unbacked.pop(key, None)
            self._counters.pages_stored += st.handle.writing
            self._counters.store_dropped_pages += len(st.keys) - st.handle.count
        elif not ok:
            self._counters.store_failures += 1
            if st.handle.copying():  # a stalled daemon may still read them, and would store
                for p in st.pages:  # what another request wrote there under these keys
                    self._held[p] = st.handle
        return ok

    def still_read(self, pages: Iterable[int]) -> set[int]:
        """Of ``pages``, those kvtierd may still read for a STORE whose wait failed (they
        must not be reused yet); each such STORE is asked once."""
        held = self._held
        if not held:
            return set()
        copying: dict[int, bool] = {}
        out: set[int] = set()
        for page in pages:
            handle = held.get(page)
            if handle is None:
                continue
            busy = copying.get(id(handle))
            if busy is None:
                busy = copying[id(handle)] = handle.copying()
            if busy:
                out.add(page)
            else:
                del held[page]
        return out
