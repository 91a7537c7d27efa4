"""Who owns a device page in the engine-side cache (L1 radix tree and cache manager), no
daemon: what would put one device page in two places is refused, naming the page, and an
allocation that cannot succeed evicts nothing."""

from __future__ import annotations

import pytest
from kvtier.client.cache.manager import CacheManager, DevicePoolExhausted
from kvtier.config import KvtierError
from kvtier.engine.allocator import PageAllocator

P = 4


def _prompt(n_pages: int, salt: int = 0) -> list[int]:
    return [1000 * salt + i for i in range(n_pages * P + 1)]


def _cached(cm: CacheManager, toks: list[int]) -> list[int]:
    """One request that computes ``toks`` and leaves its full pages in L1; their pages."""
    m = cm.match(toks)
    n = len(toks) // P
    pages = cm.alloc(n + 1)
    assert cm.insert(m, pages[:n]) == []
    cm.release(m)
    cm.free(pages[n:])
    return pages[:n]


@pytest.mark.timeout(30)
def test_free_refuses_a_page_the_l1_tree_holds() -> None:
    """free() of a page the tree took at insert (a slip in an engine's bookkeeping of its
    own pages) is refused naming the page: handed to the next request, which writes its
    own KV there, the page would still be the cached prompt's L1 hit, serving another
    prompt's KV."""
    alloc = PageAllocator(8)
    cm = CacheManager(alloc, None, page_size=P)
    a = _prompt(3)
    held = _cached(cm, a)
    with pytest.raises(KvtierError, match=rf"\b{held[1]}\b"):
        cm.free([held[1]])


@pytest.mark.timeout(30)
def test_insert_refuses_one_device_page_given_for_two_pages() -> None:
    """insert() of a page table naming one device page twice is refused, nothing changed:
    the tree would map two prompt pages to one device page (an L1 hit serving one's KV for
    the other), and evicting them would free that page twice."""
    alloc = PageAllocator(8)
    cm = CacheManager(alloc, None, page_size=P)
    toks = _prompt(3)
    m = cm.match(toks)
    pages = cm.alloc(3)
    with pytest.raises(KvtierError, match=r"device_pages|device page"):
        cm.insert(m, [pages[0], pages[1], pages[1]])
    cm.tree.check_invariants()


@pytest.mark.timeout(30)
def test_insert_refuses_a_device_page_the_tree_holds_for_another_prompt() -> None:
    """insert() of a device page the tree holds for another prompt's page is refused:
    both prompts would hit on that one device page, and evicting both would free it
    twice."""
    alloc = PageAllocator(8)
    cm = CacheManager(alloc, None, page_size=P)
    held = _cached(cm, _prompt(2, salt=1))
    toks = _prompt(2, salt=2)
    m = cm.match(toks)
    fresh = cm.alloc(1)
    with pytest.raises(KvtierError):
        cm.insert(m, [held[0], fresh[0]])
    cm.tree.check_invariants()


@pytest.mark.timeout(30)
def test_an_allocation_that_cannot_fit_does_not_empty_l1() -> None:
    """alloc(n) of more pages than the free ones and every unlocked L1 page together raises
    DevicePoolExhausted without evicting anything: one oversized request leaves the warm
    prefix cache of every other conversation in place."""
    alloc = PageAllocator(8)
    cm = CacheManager(alloc, None, page_size=P)
    toks = _prompt(4)
    _cached(cm, toks)
    assert cm.tree.device_page_count == 4
    with pytest.raises(DevicePoolExhausted):
        cm.alloc(9)  # 4 free + 4 evictable < 9: can never succeed
    assert cm.tree.device_page_count == 4, "L1 was emptied for an allocation that could not fit"
    assert len(cm.match(toks).l1_pages) == 4
