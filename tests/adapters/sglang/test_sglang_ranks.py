"""Tensor-parallel ranks (one process each): the same hit count on every rank; MLA pages,
the same on every rank, are stored once (by SGLang's storage writer) and served to all."""

from __future__ import annotations

import pytest
from sglang_harness import admin_stats, both_ranks, extra_config

pytestmark = pytest.mark.timeout(600)

PAGE = 16


def test_ranks_get_the_same_hit_count(instances, daemons) -> None:
    daemon = daemons("tp")
    extra = extra_config(daemon.runtime_dir, model_id="tp")
    r0, r1 = (instances(f"tp-{r}", "page_first", extra, tp_rank=r, tp_size=2) for r in (0, 1))
    assert r0.call("store", seq=1, pages=8)["tokens"] == 8 * PAGE
    assert r1.call("store", seq=1, pages=6)["tokens"] == 6 * PAGE  # rank 1 holds less
    got = both_ranks([r0, r1], "prefetch", seq=1, pages=8)
    assert [(g["hit"], g["done"], g["bad"]) for g in got] == [(6 * PAGE, 6 * PAGE, 0)] * 2


def test_mla_pages_are_stored_once(instances, daemons) -> None:
    daemon = daemons("mla")
    extra = extra_config(daemon.runtime_dir, model_id="mla")
    m0, m1 = (
        instances(f"mla-{r}", "page_first", extra, tp_rank=r, tp_size=2, mla=True) for r in (0, 1)
    )
    both_ranks([m0, m1], "store", seq=1, pages=8)
    assert admin_stats(daemon)["counters"]["store_pages"] == 8
    assert m1.call("stats")["counters"].get("stored_pages", 0) == 0
    got = both_ranks([m0, m1], "prefetch", seq=1, pages=8)
    assert [(g["hit"], g["done"], g["bad"]) for g in got] == [(8 * PAGE, 8 * PAGE, 0)] * 2
