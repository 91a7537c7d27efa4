"""The monotonic counters of one cache manager (what the engine and the benchmarks report)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheCounters"]


@dataclass(slots=True)
class CacheCounters:
    """Monotonic counters of one manager (tokens unless named pages).

    Attributes:
        requests / prompt_tokens: matches made and the prompt tokens they covered.
        l1_hit_tokens / l2_hit_tokens / l3_hit_tokens: usable prefix found per tier at match.
        l3_claimed_tokens: tokens a prefetch brought from L3 into L2 by the time the load
            claimed them (loaded with the L2 run).
        loaded_tokens: tokens whose L2 load completed (used by the prefill).
        load_failures: loads that failed part-way (the engine recomputed).
        computed_tokens: prompt tokens the engine computed (:meth:`CacheManager.record_computed`).
        stores_issued / pages_stored / store_failures: STOREs sent, pages copied by successful
            ones, and STOREs that failed.
        store_dropped_pages: pages a STORE could not place (daemon away, L2 full and pinned).
        evicted_pages / written_back_pages: L1 evictions, and pages stored by them (write_back).
    """

    requests: int = 0
    prompt_tokens: int = 0
    l1_hit_tokens: int = 0
    l2_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    l3_claimed_tokens: int = 0
    loaded_tokens: int = 0
    load_failures: int = 0
    computed_tokens: int = 0
    stores_issued: int = 0
    pages_stored: int = 0
    store_failures: int = 0
    store_dropped_pages: int = 0
    evicted_pages: int = 0
    written_back_pages: int = 0
