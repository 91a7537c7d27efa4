"""Exact tests of the L1 radix tree: splits, eviction order, locks, refills, L2 flags."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier.client.radix.tree import PrefixMatch, RadixTree, TreeNode
from kvtier.config.errors import KvtierError

NS = b"test-namespace-fingerprint"


def chain(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The page-key chain of the whole pages of ``tokens`` (SHA-256 over uint32 LE tokens)."""
    keys: list[bytes] = []
    prev = hashlib.sha256(NS).digest()
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
        prev = hashlib.sha256(prev + page).digest()
        keys.append(prev)
    return keys


def put(tree: RadixTree, tokens: Sequence[int], ids: Sequence[int]) -> TreeNode:
    """Insert ``tokens`` with device pages ``ids``; expect no duplicates."""
    result = tree.insert(tokens, ids, chain(tokens, tree.page_size))
    assert result.duplicate_page_ids == []
    tree.check_invariants()
    return result.last_node


def match(tree: RadixTree, tokens: Sequence[int]) -> PrefixMatch:
    """Match ``tokens`` and check the tree afterwards."""
    m = tree.match_prefix(tokens)
    tree.check_invariants()
    return m


def runs(node: TreeNode) -> list[list[int]]:
    """Token runs of the nodes below ``node``, depth first, children in token order."""
    out: list[list[int]] = []
    for first in sorted(node.children):
        child = node.children[first]
        out.append(list(child.tokens))
        out.extend(runs(child))
    return out


A = list(range(12))  # three pages of four tokens


def test_match_ending_mid_node_splits_at_page_boundary() -> None:
    tree = RadixTree(4)
    put(tree, A, [10, 11, 12])
    m = match(tree, A[:8] + [99, 98, 97, 96])
    assert m.page_ids == [10, 11]
    assert m.keys == chain(A, 4)[:2]
    assert m.device_pages == 2 and m.matched_tokens == 8
    assert list(m.last_node.tokens) == A[:8]
    assert runs(tree.root) == [A[:8], A[8:]]
    assert tree.page_count == 3 and tree.device_page_count == 3


def test_mismatch_inside_a_page_ends_the_match_before_that_page() -> None:
    tree = RadixTree(4)
    put(tree, A, [10, 11, 12])
    m = match(tree, A[:6] + [99, 99, 99, 99])
    assert m.page_ids == [10]
    assert runs(tree.root) == [A[:4], A[4:]]


def _last_token_changed(tokens: Sequence[int], page: int, size: int = 4) -> list[int]:
    """``tokens`` with only the last token of page ``page`` changed."""
    out = list(tokens)
    out[(page + 1) * size - 1] += 1000
    return out


@pytest.mark.parametrize(
    ("page", "extra", "cut"),
    [
        (0, [], 0),  # the first page: the child lookup itself must miss
        (1, [], None),  # a middle page
        (2, [], None),  # the node's last page, a query of the node's length
        (2, [7, 7, 7, 7, 8], None),  # the node's last page, a longer query
        (1, "short", None),  # a query that ends inside the node, at the changed page
    ],
    ids=["first-page", "middle-page", "last-page", "last-page-longer-query", "shorter-query"],
)
def test_a_page_differing_only_in_its_last_token_ends_the_match(page, extra, cut) -> None:
    tree = RadixTree(4)
    put(tree, A, [10, 11, 12])
    query = _last_token_changed(A, page)
    query = query[: (page + 1) * 4] if extra == "short" else query + list(extra)
    m = match(tree, query)
    assert m.n_pages == page and m.matched_tokens == 4 * page
    assert m.page_ids == [10, 11, 12][:page]
    assert m.keys == chain(A, 4)[:page] == chain(query, 4)[:page]
    assert tree.page_count == 3  # matching adds no page
    if page:
        assert list(m.last_node.tokens) == A[: 4 * page]


def test_a_page_differing_only_in_its_last_token_in_a_child_node_ends_the_match() -> None:
    tree = RadixTree(4)
    b = A[:4] + [50, 51, 52, 53, 54, 55, 56, 57]
    put(tree, A, [10, 11, 12])
    put(tree, b, [10, 20, 21])  # node [A0] with children [A1 A2] and [B1 B2]
    for branch, ids in ((A, [10, 11, 12]), (b, [10, 20, 21])):
        for page in (1, 2):
            m = match(tree, _last_token_changed(branch, page))
            assert m.page_ids == ids[:page], (branch, page)
            assert m.keys == chain(branch, 4)[:page]


def test_inserting_a_page_differing_only_in_its_last_token_adds_a_new_page() -> None:
    tree = RadixTree(4)
    put(tree, A, [10, 11, 12])
    other = _last_token_changed(A, 1)
    result = tree.insert(other, [10, 20, 21], chain(other, 4))
    tree.check_invariants()
    assert result.duplicate_page_ids == [] and result.new_pages == 2
    assert tree.page_count == 5
    assert match(tree, other).page_ids == [10, 20, 21]
    assert match(tree, A).page_ids == [10, 11, 12]


def test_matches_equal_the_longest_common_run_of_whole_pages() -> None:
    """Against a reference computed from the inserted sequences alone: near-misses (two
    tokens, three per page) end the match exactly at the first page that differs."""
    size = 3
    rng = np.random.default_rng(7)
    tree = RadixTree(size)
    inserted: list[list[int]] = []
    next_id = 0
    for _ in range(40):
        seq = rng.integers(0, 2, int(rng.integers(0, 16))).tolist()
        n = len(seq) // size
        m = tree.match_prefix(seq)
        ids = m.device_page_ids + list(range(next_id, next_id + n - m.device_pages))
        next_id += n - m.device_pages
        tree.insert(seq, ids, chain(seq, size))
        tree.check_invariants()
        inserted.append(seq)
    for _ in range(300):
        query = rng.integers(0, 2, int(rng.integers(0, 16))).tolist()
        want = 0
        for seq in inserted:
            common = 0
            while (common + 1) * size <= min(len(seq), len(query)) and seq[
                common * size : (common + 1) * size
            ] == query[common * size : (common + 1) * size]:
                common += 1
            want = max(want, common)
        m = match(tree, query)
        assert m.n_pages == want, (query, m.n_pages, want)
        assert m.keys == chain(query, size)[:want]


def test_partial_last_page_is_ignored() -> None:
    tree = RadixTree(4)
    result = tree.insert(A[:10], [10, 11], chain(A, 4)[:2])
    assert result.new_pages == 2 and tree.page_count == 2
    assert match(tree, A[:11]).page_ids == [10, 11]
    m = match(tree, A[:7])
    assert m.page_ids == [10] and m.matched_tokens == 4
    assert runs(tree.root) == [A[:4], A[4:8]]
    assert match(tree, A[:3]).n_pages == 0


def test_insert_needs_one_device_page_and_key_per_whole_page() -> None:
    tree = RadixTree(4)
    with pytest.raises(KvtierError):
        tree.insert(A[:10], [10, 11, 12], chain(A, 4)[:3])
    with pytest.raises(KvtierError):
        tree.insert(A, [10, 11, 12], chain(A, 4)[:2])
    with pytest.raises(KvtierError):
        RadixTree(0)


def test_match_counts_hits_and_advances_the_logical_clock() -> None:
    tree = RadixTree(2)
    node = put(tree, [1, 2, 3, 4], [0, 1])
    first = node.last_access
    m = match(tree, [1, 2, 3, 4])
    assert m.last_node is node and node.hit_count == 1
    assert node.last_access > first
    match(tree, [1, 2])
    head = tree.root.children[(1, 2)]
    assert head is not node and head.hit_count == 2 and node.hit_count == 1
    assert head.last_access > node.last_access


def _three_branches() -> tuple[RadixTree, list[int], list[int]]:
    """Common pages [0..3] (ids 1, 2), branch x [4..7] (ids 3, 4), branch y [9, 9] (id 5)."""
    tree = RadixTree(2)
    x = [0, 1, 2, 3, 4, 5, 6, 7]
    y = [0, 1, 2, 3, 9, 9]
    put(tree, x, [1, 2, 3, 4])
    put(tree, y, [1, 2, 5])
    match(tree, x)  # x is now the most recently used leaf
    return tree, x, y


def test_eviction_is_lru_leaf_first_tail_first() -> None:
    tree, x, _y = _three_branches()
    assert tree.evictable_page_count == 5
    assert [p.page_id for p in tree.evict(1)] == [5]
    assert [p.page_id for p in tree.evict(2)] == [4, 3]
    evicted = tree.evict(10)
    assert [p.page_id for p in evicted] == [2, 1]
    assert [p.tokens for p in evicted] == [(2, 3), (0, 1)]
    assert [p.key for p in evicted] == chain(x, 2)[1::-1]
    assert not any(p.in_l2 for p in evicted)
    tree.check_invariants()
    assert tree.page_count == 0 and tree.device_page_count == 0 and tree.root.children == {}


def test_eviction_frees_only_the_tail_of_a_node_within_budget() -> None:
    tree = RadixTree(2)
    put(tree, [1, 2, 3, 4, 5, 6], [7, 8, 9])
    assert [p.page_id for p in tree.evict(1)] == [9]
    tree.check_invariants()
    m = match(tree, [1, 2, 3, 4, 5, 6])
    assert m.page_ids == [7, 8] and m.device_pages == 2
    assert tree.device_page_count == 2 and tree.page_count == 2


def test_recently_matched_leaf_is_evicted_last() -> None:
    tree, _x, y = _three_branches()
    match(tree, y)
    assert [p.page_id for p in tree.evict(3)] == [4, 3, 5]


def test_locks_block_eviction_of_the_node_and_its_ancestors() -> None:
    tree, x, _y = _three_branches()
    m = match(tree, x[:6])  # splits branch x after its first page
    tree.lock(m.last_node)
    assert tree.evictable_page_count == 2  # the tail of x and page y
    assert [p.page_id for p in tree.evict(10)] == [5, 4]  # y is older than the tail of x
    tree.check_invariants()
    assert tree.evictable_page_count == 0 and tree.evict(10) == []
    tree.unlock(m.last_node)
    tree.check_invariants()
    assert tree.evictable_page_count == 3
    assert [p.page_id for p in tree.evict(10)] == [3, 2, 1]


def test_lock_survives_a_later_split_of_the_locked_node() -> None:
    tree = RadixTree(2)
    node = put(tree, [1, 2, 3, 4, 5, 6], [7, 8, 9])
    tree.lock(node)
    match(tree, [1, 2, 3, 4])  # splits the locked node
    assert tree.evict(10) == []
    tree.unlock(node)
    tree.check_invariants()
    assert [p.page_id for p in tree.evict(10)] == [9, 8, 7]


def test_unlock_below_zero_is_an_assertion_error() -> None:
    tree = RadixTree(2)
    node = put(tree, [1, 2], [7])
    tree.lock(node)
    tree.unlock(node)
    with pytest.raises(AssertionError):
        tree.unlock(node)


def test_in_l2_pages_stay_matchable_after_device_eviction() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    keys = chain(tokens, 2)
    put(tree, tokens, [10, 11, 12, 13])
    assert tree.mark_in_l2(keys) == 4
    evicted = tree.evict(2)
    assert [(p.page_id, p.in_l2) for p in evicted] == [(13, True), (12, True)]
    tree.check_invariants()
    m = match(tree, tokens)
    assert m.page_ids == [10, 11, None, None]
    assert m.device_pages == 2 and m.device_page_ids == [10, 11]
    assert m.in_l2 == [True] * 4 and m.keys == keys
    assert tree.page_count == 4 and tree.device_page_count == 2
    assert tree.evictable_page_count == 2


def test_evicted_pages_not_in_l2_leave_the_tree() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    put(tree, tokens, [10, 11, 12, 13])
    assert [p.page_id for p in tree.evict(2)] == [13, 12]
    tree.check_invariants()
    assert match(tree, tokens).page_ids == [10, 11]
    assert tree.page_count == 2


def test_page_not_in_l2_takes_the_in_l2_pages_after_it_out_of_the_tree() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    keys = chain(tokens, 2)
    put(tree, tokens, [10, 11, 12, 13])
    tree.mark_in_l2([keys[1], keys[3]])
    evicted = tree.evict(2)
    assert [(p.page_id, p.in_l2) for p in evicted] == [(13, True), (12, False)]
    tree.check_invariants()
    assert match(tree, tokens).page_ids == [10, 11]
    assert tree.page_count == 2


def test_insert_refills_evicted_pages_and_returns_duplicates() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6]
    keys = chain(tokens, 2)
    put(tree, tokens, [10, 11, 12])
    tree.mark_in_l2(keys)
    tree.evict(2)
    longer = [*tokens, 7, 8]
    result = tree.insert(longer, [20, 21, 22, 23], chain(longer, 2))
    tree.check_invariants()
    assert result.duplicate_page_ids == [20]
    assert result.refilled_pages == 2 and result.new_pages == 1
    m = match(tree, longer)
    assert m.page_ids == [10, 21, 22, 23] and m.device_pages == 4
    assert m.in_l2 == [True, True, True, False]
    assert tree.device_page_count == 4 and tree.evictable_page_count == 4


def test_insert_with_the_matched_device_pages_returns_no_duplicates() -> None:
    tree = RadixTree(2)
    put(tree, [1, 2, 3, 4], [10, 11])
    result = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 30], chain([1, 2, 3, 4, 5, 6], 2))
    assert result.duplicate_page_ids == [] and result.new_pages == 1
    assert match(tree, [1, 2, 3, 4, 5, 6]).page_ids == [10, 11, 30]


def test_insert_refills_a_locked_node_without_making_it_evictable() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4]
    put(tree, tokens, [10, 11])
    tree.mark_in_l2(chain(tokens, 2))
    tree.evict(1)
    m = match(tree, tokens)
    tree.lock(m.last_node)
    tree.insert(tokens, [10, 40], chain(tokens, 2))
    tree.check_invariants()
    assert tree.device_page_count == 2 and tree.evictable_page_count == 0


def test_l2_losing_an_evicted_page_drops_it_and_the_pages_after_it() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    keys = chain(tokens, 2)
    put(tree, tokens, [10, 11, 12, 13])
    tree.mark_in_l2(keys)
    tree.evict(2)
    assert tree.set_in_l2([keys[1], keys[2]], False) == 2
    tree.check_invariants()
    m = match(tree, tokens)
    assert m.page_ids == [10, 11] and m.in_l2 == [True, False]
    assert tree.page_count == 2
    assert tree.set_in_l2([b"\x00" * 32], True) == 0


def test_l2_loss_below_a_locked_node_keeps_the_lock_releasable() -> None:
    tree = RadixTree(2)
    tokens = [1, 2, 3, 4, 5, 6]
    keys = chain(tokens, 2)
    put(tree, tokens, [10, 11, 12])
    tree.mark_in_l2(keys)
    tree.evict(2)
    match(tree, tokens[:2])  # node [1, 2] | node [3, 4, 5, 6]
    tail = match(tree, tokens).last_node
    tree.lock(tail)
    tree.set_in_l2([keys[1]], False)  # drops the locked tail node
    tree.check_invariants()
    assert tree.page_count == 1 and tree.evictable_page_count == 0
    tree.unlock(tail)
    tree.check_invariants()
    assert [p.page_id for p in tree.evict(10)] == [10]


# ---------------------------------------------------------------- property test

PAGE = 2
N_IDS = 64


class TreeMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, evictions and L2 updates against a free-id pool."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(PAGE)
        self.free: list[int] = list(range(N_IDS))
        self.locked: list[tuple[TreeNode, list[int]]] = []
        self.seen: list[list[int]] = []

    def _held(self) -> list[int]:
        ids: list[int] = []
        stack = [self.tree.root]
        while stack:
            node = stack.pop()
            ids.extend(i for i in node.device if i is not None)
            stack.extend(node.children.values())
        return ids

    @rule(
        tokens=st.lists(st.integers(0, 2), max_size=13),
        reuse=st.booleans(),
    )
    def insert(self, tokens: list[int], reuse: bool) -> None:
        n = len(tokens) // PAGE
        m = self.tree.match_prefix(tokens)
        reused = m.device_page_ids if reuse else []
        if n - len(reused) > len(self.free):
            return
        fresh = [self.free.pop() for _ in range(n - len(reused))]
        result = self.tree.insert(tokens, reused + fresh, chain(tokens, PAGE))
        assert set(result.duplicate_page_ids) <= set(fresh)
        self.free.extend(result.duplicate_page_ids)
        after = self.tree.match_prefix(tokens)
        assert after.n_pages == n and after.device_pages == n
        assert after.page_ids[: len(reused)] == reused
        self.seen.append(tokens)

    @rule(tokens=st.lists(st.integers(0, 2), max_size=13))
    def match(self, tokens: list[int]) -> None:
        m = self.tree.match_prefix(tokens)
        assert m.matched_tokens == m.n_pages * PAGE <= len(tokens)
        assert m.keys == chain(tokens, PAGE)[: m.n_pages]
        lead = next((i for i, d in enumerate(m.page_ids) if d is None), m.n_pages)
        assert m.device_pages == lead
        assert all(d is None for d in m.page_ids[lead:])

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(self.seen))
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.last_node)
        self.locked.append((m.last_node, m.device_page_ids))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locked) - 1))
        node, _ = self.locked.pop(i)
        self.tree.unlock(node)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        before = self.tree.evictable_page_count
        evicted = self.tree.evict(n)
        ids = [p.page_id for p in evicted]
        assert len(ids) == min(n, before)
        assert self.tree.evictable_page_count == before - len(ids)
        protected = {i for _, held in self.locked for i in held}
        assert protected.isdisjoint(ids)
        self.free.extend(ids)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), flag=st.booleans())
    def set_in_l2(self, data: st.DataObject, flag: bool) -> None:
        tokens = data.draw(st.sampled_from(self.seen))
        keys = chain(tokens, PAGE)
        chosen = data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
        self.tree.set_in_l2(chosen, flag)
        m = self.tree.match_prefix(tokens)
        flags = dict(zip(m.keys, m.in_l2))
        assert all(flags[k] == flag for k in chosen if k in flags)

    @invariant()
    def consistent(self) -> None:
        self.tree.check_invariants()
        held = self._held()
        assert len(held) == self.tree.device_page_count
        assert sorted(held + self.free) == list(range(N_IDS))  # no id twice, none leaked


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_rekey_names_every_page_by_the_new_chain_and_forgets_the_old_keys() -> None:
    """After :meth:`RadixTree.rekey`, every page's key is the new seed's chain over its
    prefix (across node boundaries), lookups by key see the new keys only, and the tree's
    pages and structure are unchanged."""
    from kvtier.client.page_keys import page_keys

    tree = RadixTree(4)
    put(tree, A, [1, 2, 3])
    put(tree, A[:4] + [90, 91, 92, 93, 94, 95, 96, 97], [1, 4, 5])  # splits after page 0
    old = chain(A, 4)
    seed = bytes(range(32))
    tree.rekey(seed, lambda prev, toks: page_keys(prev, toks, 4))
    tree.check_invariants()
    b = A[:4] + [90, 91, 92, 93, 94, 95, 96, 97]
    for toks in (A, b):
        m = match(tree, toks)
        assert m.keys == page_keys(seed, toks, 4) and m.device_pages == 3
    assert tree.set_in_l2(old, True) == 0  # the old keys name nothing now
    assert tree.set_in_l2(page_keys(seed, A, 4), True) == 3
    assert match(tree, A).in_l2 == [True] * 3


def test_the_store_tracker_follows_a_rekey_and_forgets_pages_the_tree_dropped() -> None:
    """After the tree's pages are named anew, the store tracker tracks the pages L2 lacks
    under the new keys (their chain parents too) and drops entries of keys the tree no
    longer holds: none is left under an old key, where nothing would ever remove it."""
    from kvtier.client.cache.counters import CacheCounters
    from kvtier.client.cache.store_tracker import StoreTracker
    from kvtier.client.page_keys import page_keys

    tree = RadixTree(4)
    keys = chain(A, 4)
    tree.insert(A, [1, 2, 3], keys)
    tracker = StoreTracker(None, tree, CacheCounters(), store_threshold=2)
    tracker.inserted(keys, [1, 2, 3], 0, [], 0)
    tracker.inserted([b"gone" * 8], [9], 0, [], 0)  # a page the tree does not hold
    new_of = tree.rekey(bytes(32), lambda prev, toks: page_keys(prev, toks, 4))
    tracker.rekey(new_of)
    new = page_keys(bytes(32), A, 4)
    got = tracker._unbacked  # the tracker's own record of pages L2 lacks
    assert list(got) == new and [u.parent for u in got.values()] == [None, new[0], new[1]]
    assert all(u.uses == 1 for u in got.values())
    for key in new:
        tracker.forget(key)
    assert not tracker._unbacked
