"""The cache manager's pure L1 paths: match, lock, insert, release and eviction, no daemon.

A manager without a connection (``conn=None``) keys pages from the seed it is given; what it
does with L2 (loads, write policies) is tested against a real kvtierd in
tests/integration/test_cache_manager_l2.py.
"""

from __future__ import annotations

import pytest
from kvtier.client.cache.manager import CacheManager, DevicePoolExhausted
from kvtier.engine.allocator import PageAllocator, PageAllocatorError

from tests.engines import SMALL, tokens
from tests.key_chain import spec_page_keys

P = SMALL.page_size


@pytest.mark.timeout(30)
def test_l1_only_match_locks_and_keeps_the_last_token():
    alloc = PageAllocator(8)
    seed = bytes(range(32))
    cm = CacheManager(alloc, None, page_size=P, key_seed=seed)
    toks = tokens(4 * P).tolist()
    m = cm.match(toks)
    assert (m.l1_pages, m.l2_pages) == ([], 0)
    assert m.keys == spec_page_keys(seed, toks, P)
    pages = cm.alloc(4)
    assert cm.insert(m, pages) == []
    cm.release(m)
    # a page-aligned prompt hits all but its last page: the last token is always computed
    m2 = cm.match(toks)
    assert m2.l1_pages == pages[:3] and m2.keys == m.keys
    assert cm.tree.evictable_page_count == 1  # the hit is locked
    cm.release(m2)
    assert cm.tree.evictable_page_count == 4
    m3 = cm.match(toks + [1, 2, 3])
    assert m3.l1_pages == pages
    cm.release(m3)
    assert cm.counters.l1_hit_tokens == 7 * P


@pytest.mark.timeout(30)
def test_alloc_evicts_unlocked_pages_and_refuses_locked_ones():
    alloc = PageAllocator(8)
    cm = CacheManager(alloc, None, page_size=P)
    toks = tokens(6 * P + 1).tolist()
    m = cm.match(toks)
    pages = cm.alloc(6)
    cm.insert(m, pages)  # the request's lock now covers all 6 pages
    with pytest.raises(DevicePoolExhausted):
        cm.alloc(4)
    cm.release(m)
    got = cm.alloc(4)
    assert set(got) == {6, 7} | set(pages[4:])  # the two tail pages were evicted
    assert cm.counters.evicted_pages == 2
    assert cm.match(toks).l1_pages == pages[:4]
    with pytest.raises(PageAllocatorError):
        alloc.free([got[0], got[0]])
