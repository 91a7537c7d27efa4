"""The engine-side L1 index: a radix tree over page-aligned token runs.

Pure and synchronous: no I/O, no locks, no threads. Each node holds a run of whole pages and,
per page, the device page id (``None`` once evicted from the device), the page key and whether
L2 holds the page. Pages are stored as parallel Python lists, never as per-page objects::

    root ─┬─ node [p0 p1 p2]  device [7, 3, None]  in_l2 [T, T, T]   n_device = 2
          │     └─ node [p3]  device [None]        in_l2 [T]
          └─ node [q0]        device [9]           in_l2 [F]

Invariants (checked by :meth:`RadixTree.check_invariants`):

- Device pages are prefix-closed: a page holds a device page only if every page before it does.
  Within a node the device pages are ``device[:n_device]``; a node with ``n_device < n_pages``
  has no descendant on the device. So the L1 hit of a match is its leading run of device pages.
- Every page in the tree is on the device or in L2; a page on neither is dropped together with
  every page after it, because a page that extends it can no longer be used.
- ``lock_ref`` of a node counts the locks taken on it or on any node below it.

Eviction frees device pages leaf first (a page leaves the device only when no page extending it
holds one), least recently used first, tail pages of a node before its head pages.

The node type and its page-wise comparison live in :mod:`kvtier.client.radix.node`, the result
records in :mod:`kvtier.client.radix.results` and the full invariant check in
:mod:`kvtier.client.radix.invariants`; this module keeps the tree and its bookkeeping.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

from kvtier.client.radix.invariants import check_tree_invariants
from kvtier.client.radix.node import TreeNode, common_pages
from kvtier.client.radix.results import EvictedPage, InsertResult, PrefixMatch
from kvtier.config.errors import KvtierError

# The node and result types are defined beside the tree and re-exported here, where callers
# import them from.
__all__ = ["EvictedPage", "InsertResult", "PrefixMatch", "RadixTree", "TreeNode"]


class RadixTree:
    """The L1 index of one engine (one TP rank) over its device KV pages.

    Args:
        page_size: Tokens per page; only whole pages are indexed.

    Raises:
        KvtierError: ``page_size`` is below 1.
    """

    __slots__ = (
        "_by_key",
        "_clock",
        "_device_count",
        "_device_leaves",
        "_evictable_count",
        "_held",
        "_next_id",
        "_page_size",
        "_root",
    )

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise KvtierError(f"page_size must be at least 1, got {page_size}")
        self._page_size = page_size
        self._root = TreeNode(0, None, [], [], [], [])
        self._next_id = 1
        self._clock = 0
        self._by_key: dict[bytes, TreeNode] = {}
        # Nodes whose last device page has no device page after it: the eviction candidates.
        self._device_leaves: set[TreeNode] = set()
        self._device_count = 0
        self._evictable_count = 0
        self._held: set[int] = set()  # the device page ids the tree holds

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def root(self) -> TreeNode:
        """The root node (holds no pages)."""
        return self._root

    @property
    def page_count(self) -> int:
        """Pages in the tree, on the device or not."""
        return len(self._by_key)

    @property
    def device_page_count(self) -> int:
        """Pages in the tree that hold a device page."""
        return self._device_count

    def holds(self, page_id: int) -> bool:
        """Whether device page ``page_id`` is one of the tree's (L1's) pages."""
        return page_id in self._held

    def first_held(self, page_ids: Iterable[int]) -> int | None:
        """The first of ``page_ids`` the tree holds (None: none of them)."""
        held = self._held
        ids = page_ids if isinstance(page_ids, (list, tuple)) else list(page_ids)
        if held.isdisjoint(ids):
            return None
        return next(p for p in ids if p in held)

    @property
    def evictable_page_count(self) -> int:
        """Device pages in nodes with no lock on them or below them."""
        return self._evictable_count

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Find the longest run of whole pages of ``tokens`` in the tree.

        A partial last page never matches. When the match ends inside a node, the node is split
        at that page boundary so that ``last_node`` covers exactly the matched pages. Every
        matched node counts a hit and takes a new logical access time.

        Args:
            tokens: The token sequence.

        Returns:
            The matched pages; see :class:`PrefixMatch`.
        """
        size = self._page_size
        n = len(tokens) // size
        toks = list(tokens[: n * size])
        tick = self._tick()
        node = self._root
        page_ids: list[int | None] = []
        keys: list[bytes] = []
        in_l2: list[bool] = []
        device_pages = 0
        page = 0
        while page < n:
            start = page * size
            child = node.children.get(tuple(toks[start : start + size]))
            if child is None:
                break
            k = common_pages(child, toks, start, size)
            if k < child.n_pages:
                child = self._split(child, k)
            child.hit_count += 1
            child.last_access = tick
            page_ids.extend(child.device)
            keys.extend(child.keys)
            in_l2.extend(child.in_l2)
            device_pages += child.n_device  # device pages are prefix-closed
            node = child
            page += k
        return PrefixMatch(page_ids, keys, in_l2, device_pages, page * size, node)

    def insert(
        self, tokens: Sequence[int], device_pages: Sequence[int], keys: Sequence[bytes]
    ) -> InsertResult:
        """Insert the whole pages of ``tokens``, each with its device page and key.

        Pages already in the tree keep their data; one that was evicted from the device takes
        the device page passed for it. Afterwards every page of ``tokens`` is on the device.

        Args:
            tokens: The token sequence; a partial last page is ignored.
            device_pages: One device page id per whole page.
            keys: One page key per whole page (the key chain of ``tokens``).

        Returns:
            The duplicates the caller must free and the last node; see :class:`InsertResult`.

        Raises:
            KvtierError: ``device_pages`` or ``keys`` does not have one entry per whole page,
                or names one device page twice, or a device page the tree holds for another
                page (nothing changed): two pages on one device page would serve one's KV
                for the other.
        """
        size = self._page_size
        n = len(tokens) // size
        if len(device_pages) != n or len(keys) != n:
            raise KvtierError(
                f"{n} whole pages need as many device pages and keys, "
                f"got {len(device_pages)} and {len(keys)}"
            )
        toks = list(tokens[: n * size])
        self._check_offered(toks, n, device_pages)
        tick = self._tick()
        node = self._root
        duplicates: list[int] = []
        new_pages = refilled = 0
        page = 0
        while page < n:
            start = page * size
            child = node.children.get(tuple(toks[start : start + size]))
            if child is None:
                child = self._add_node(node, toks[start:], device_pages[page:], keys[page:], tick)
                new_pages = n - page
                self._device_leaves.discard(node)
                node = child
                break
            k = common_pages(child, toks, start, size)
            if k < child.n_pages:
                child = self._split(child, k)
            assert child.keys == list(keys[page : page + k]), "page keys disagree with the tree"
            held = child.n_device
            offered = device_pages[page : page + held]
            if child.device[:held] != list(offered):
                duplicates.extend(o for d, o in zip(child.device, offered) if d != o)
            if held < k:
                child.device[held:k] = device_pages[page + held : page + k]
                self._held.update(device_pages[page + held : page + k])
                child.n_device = k
                refilled += k - held
                self._device_count += k - held
                if child.lock_ref == 0:
                    self._evictable_count += k - held
            child.last_access = tick
            self._device_leaves.discard(node)
            node = child
            page += k
        self._refresh_leaf(node)
        return InsertResult(duplicates, node, new_pages, refilled)

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction.

        Args:
            node: A node from :class:`PrefixMatch` or :class:`InsertResult`.
        """
        cur: TreeNode | None = node
        while cur is not None and cur is not self._root:
            if cur.lock_ref == 0:
                self._evictable_count -= cur.n_device
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: TreeNode) -> None:
        """Drop one lock taken by :meth:`lock` on ``node``.

        Args:
            node: The node passed to :meth:`lock`.

        Raises:
            AssertionError: A node on the way up holds no lock.
        """
        cur: TreeNode | None = node
        while cur is not None and cur is not self._root:
            if cur.lock_ref <= 0:
                raise AssertionError(f"unlock of node {cur.node_id} with lock_ref {cur.lock_ref}")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._evictable_count += cur.n_device
            cur = cur.parent

    def evict(self, n_pages: int) -> list[EvictedPage]:
        """Free up to ``n_pages`` unlocked device pages: leaf first, LRU first, tail first.

        A freed page that L2 holds stays in the tree without a device page; one that L2 lacks
        leaves the tree together with every page after it.

        Args:
            n_pages: The most device pages to free.

        Returns:
            The freed pages in eviction order; fewer than ``n_pages`` when no more are evictable.
        """
        out: list[EvictedPage] = []
        heap = [(n.last_access, n.node_id, n) for n in self._device_leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        while len(out) < n_pages and heap:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            assert parent is not None
            self._evict_tail(node, n_pages - len(out), out)
            if node.n_device == 0 and parent is not self._root:
                self._refresh_leaf(parent)
                if parent.lock_ref == 0 and parent in self._device_leaves:
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return out

    def mark_in_l2(self, keys: Iterable[bytes]) -> int:
        """Record that L2 now holds the pages named by ``keys``.

        Args:
            keys: Page keys; keys not in the tree are ignored.

        Returns:
            The number of pages whose flag changed.
        """
        return self.set_in_l2(keys, True)

    def set_in_l2(self, keys: Iterable[bytes], in_l2: bool) -> int:
        """Set whether L2 holds the pages named by ``keys``.

        A page that L2 no longer holds and that is not on the device leaves the tree together
        with every page after it.

        Args:
            keys: Page keys; keys not in the tree are ignored.
            in_l2: The new flag.

        Returns:
            The number of pages whose flag changed.
        """
        wanted = set(keys)
        nodes = dict.fromkeys(n for n in map(self._by_key.get, wanted) if n is not None)
        changed = 0
        cuts: list[tuple[TreeNode, int]] = []
        for node in nodes:
            flags = node.in_l2
            cut = -1
            for i, key in enumerate(node.keys):
                if key in wanted and flags[i] != in_l2:
                    flags[i] = in_l2
                    changed += 1
                    if cut < 0 and i >= node.n_device and not in_l2:
                        cut = i
            if cut >= 0:
                cuts.append((node, cut))
        for node, cut in cuts:
            if self._by_key.get(node.keys[cut]) is node:  # not already dropped with an ancestor
                self._truncate(node, cut)
        return changed

    def clear_l2_marks(self) -> int:
        """Record that L2 holds none of the tree's pages (as :meth:`set_in_l2` of every
        key: pages not on the device leave the tree). The number of flags changed."""
        return self.set_in_l2(list(self._by_key), False)

    def rekey(
        self, seed: bytes, chain: Callable[[bytes, list[int]], list[bytes]]
    ) -> dict[bytes, bytes]:
        """Name every page by a new key chain: the namespace's fingerprint changed (the
        daemon restarted with another tenant for the engine's token, or another layout
        version), and the KV in the pages did not.

        Args:
            seed: the new chain's seed (the namespace fingerprint).
            chain: ``chain(prev, tokens)``: the keys of the whole pages of ``tokens``
                continuing from ``prev`` (:func:`kvtier.client.page_keys.page_keys`).

        Returns:
            Each page's new key by its old one.
        """
        by_key: dict[bytes, TreeNode] = {}
        new_of: dict[bytes, bytes] = {}
        stack = [(child, seed) for child in self._root.children.values()]
        while stack:
            node, prev = stack.pop()
            old, node.keys = node.keys, chain(prev, node.tokens)
            new_of.update(zip(old, node.keys))
            by_key.update(zip(node.keys, repeat(node)))
            stack.extend((child, node.keys[-1]) for child in node.children.values())
        self._by_key = by_key
        return new_of

    def check_invariants(self) -> None:
        """Check every structural invariant of the tree, whatever the interpreter flags.

        Raises:
            AssertionError: An invariant does not hold; the message names it.
        """
        check_tree_invariants(
            self._root,
            self._page_size,
            self._by_key,
            self._device_count,
            self._evictable_count,
            self._device_leaves,
            self._held,
        )

    def _check_offered(self, toks: list[int], n: int, offered: Sequence[int]) -> None:
        """Refuse ``offered`` (one device page per whole page of ``toks``) when it names a
        page twice, or a page the tree holds anywhere but at that place in ``toks``."""
        if len(set(offered)) != n:
            seen: set[int] = set()
            for p in offered:
                if p in seen:
                    raise KvtierError(f"device_pages names device page {p} for two pages")
                seen.add(p)
        held = self._held
        if held.isdisjoint(offered):
            return
        size = self._page_size
        node, page, own = self._root, 0, []  # the device pages held along toks, read only
        while page < n:
            child = node.children.get(tuple(toks[page * size : (page + 1) * size]))
            if child is None:
                break
            k = common_pages(child, toks, page * size, size)
            own.extend(child.device[: min(k, child.n_device)])
            if child.n_device < k or k < child.n_pages:
                break
            node, page = child, page + k
        for i, p in enumerate(offered):
            if p in held and (i >= len(own) or own[i] != p):
                raise KvtierError(
                    f"device_pages[{i}] = {p}: the tree holds that device page for another page"
                )

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _add_node(
        self,
        parent: TreeNode,
        tokens: list[int],
        device: Sequence[int],
        keys: Sequence[bytes],
        tick: int,
    ) -> TreeNode:
        n = len(keys)
        ids: list[int | None] = list(device)
        node = TreeNode(self._next_id, parent, tokens, ids, list(keys), [False] * n, n)
        node.last_access = tick
        self._next_id += 1
        parent.children[tuple(tokens[: self._page_size])] = node
        before = len(self._by_key)
        self._by_key.update(zip(node.keys, repeat(node)))
        assert len(self._by_key) == before + n, "page key already in the tree"
        self._held.update(device)
        self._device_count += n
        self._evictable_count += n
        return node

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Split ``node`` after its first ``k`` pages; the head is a new node above it.

        ``node`` keeps the tail, so references callers hold for :meth:`unlock` stay valid; the
        head copies its lock_ref, hit count and access time.
        """
        parent = node.parent
        assert parent is not None and 0 < k < node.n_pages
        cut = k * self._page_size
        head = TreeNode(
            self._next_id,
            parent,
            node.tokens[:cut],
            node.device[:k],
            node.keys[:k],
            node.in_l2[:k],
            n_device=min(node.n_device, k),
            lock_ref=node.lock_ref,
            hit_count=node.hit_count,
            last_access=node.last_access,
        )
        self._next_id += 1
        parent.children[tuple(head.tokens[: self._page_size])] = head
        del node.tokens[:cut], node.device[:k], node.keys[:k], node.in_l2[:k]
        node.n_device = max(0, node.n_device - k)
        node.parent = head
        head.children[tuple(node.tokens[: self._page_size])] = node
        self._by_key.update(zip(head.keys, repeat(head)))
        self._refresh_leaf(head)
        self._refresh_leaf(node)
        return head

    def _evict_tail(self, node: TreeNode, budget: int, out: list[EvictedPage]) -> None:
        """Free up to ``budget`` device pages of the unlocked leaf ``node``, tail first."""
        size = self._page_size
        i = node.n_device
        stop = max(0, i - budget)
        cut = -1
        while i > stop:
            i -= 1
            page_id = node.device[i]
            assert page_id is not None
            node.device[i] = None
            self._held.discard(page_id)
            flag = node.in_l2[i]
            tokens = tuple(node.tokens[i * size : (i + 1) * size])
            above = node.parent.keys[-1] if node.parent is not None and node.parent.keys else None
            parent = node.keys[i - 1] if i else above
            out.append(EvictedPage(page_id, node.keys[i], flag, tokens, parent))
            if not flag:
                cut = i
        freed = node.n_device - stop
        node.n_device = stop
        self._device_count -= freed
        self._evictable_count -= freed
        self._refresh_leaf(node)
        if cut >= 0:
            self._truncate(node, cut)

    def _truncate(self, node: TreeNode, cut: int) -> None:
        """Drop pages ``cut:`` of ``node`` and every node below it; none is on the device.

        Dropped nodes keep their parent pointer so outstanding locks can still be released.
        """
        assert node.n_device <= cut < node.n_pages
        by_key = self._by_key
        for key in node.keys[cut:]:
            del by_key[key]
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            assert below.n_device == 0
            for key in below.keys:
                del by_key[key]
            stack.extend(below.children.values())
        node.children = {}
        if cut == 0:
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.tokens[: self._page_size])]
            self._device_leaves.discard(node)
        else:
            del node.tokens[cut * self._page_size :], node.device[cut:]
            del node.keys[cut:], node.in_l2[cut:]

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Add ``node`` to or remove it from the eviction candidates."""
        held = node.n_device
        if held and (held < node.n_pages or not any(c.n_device for c in node.children.values())):
            self._device_leaves.add(node)
        else:
            self._device_leaves.discard(node)
