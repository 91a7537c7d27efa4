"""SGLang's own HiCache classes move pages through kvtierd byte for byte, in every host layout.

Each instance is a process of its own (SGLang 0.5.23's host pool and ``HiCacheController``,
backend loaded by SGLang's dynamic loader from the extra config of README.md ("Using kvtier with SGLang")). Pages
are written into SGLang's host pool, backed up by the controller's backup thread, and
prefetched by its prefetch threads into host pages that were scribbled over first; every
prefetched page is compared with what was stored (as int16: bf16 bits include NaNs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_harness import extra_config, flush_l2

from tests.integration.test_kv_bytes import PoolFile

pytestmark = pytest.mark.timeout(600)

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
PAGE = 16


@pytest.fixture(scope="module")
def daemon(daemons):
    """kvtierd with the file L3 store (in its own state dir), prefetching runs of >= 1 page."""
    return daemons("pages", "--hicache-storage-backend", "file", "--prefetch-threshold", "16")


@pytest.fixture(scope="module")
def extra(daemon):
    return extra_config(daemon.runtime_dir, model_id="pages")


@pytest.fixture(scope="module")
def by_layout(instances, extra):
    """One instance per host layout, started together."""
    return {layout: instances(f"pages-{layout}", layout, extra) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_the_controller(by_layout, layout: str) -> None:
    inst = by_layout[layout]
    stats = inst.call("stats")
    assert stats["backend"] == "KvtierHiCacheStorage" and not stats["wrapped"]
    assert stats["registrations"] == 1

    assert inst.call("store", seq=1, pages=8)["tokens"] == 8 * PAGE
    got = inst.call("prefetch", seq=1, pages=8)
    assert (got["hit"], got["done"], got["bad"]) == (8 * PAGE, 8 * PAGE, 0)
    assert inst.call("stats")["counters"]["loaded_pages"] >= 8
    # a longer request: its stored head is found, the rest is not
    got = inst.call("prefetch", seq=1, pages=12)
    assert (got["hit"], got["done"], got["bad"]) == (8 * PAGE, 8 * PAGE, 0)
    assert inst.call("prefetch", seq=77, pages=4)["hit"] == 0


def test_layouts_do_not_share_pages(by_layout) -> None:
    """The layout enters kvtier's namespace: another layout's bytes are never served."""
    assert by_layout["layer_first"].call("store", seq=5, pages=4)["tokens"] == 4 * PAGE
    assert by_layout["page_head"].call("prefetch", seq=5, pages=4)["hit"] == 0
    assert by_layout["layer_first"].call("prefetch", seq=5, pages=4)["done"] == 4 * PAGE


def test_a_later_process_prefetches_from_l2_and_l3(by_layout, instances, extra, daemon) -> None:
    """Instance A stores; B, started afterwards, prefetches A's pages: from L2, then (L2
    flushed) from L3; a page corrupted in kvtierd's pool comes back corrupted, only it."""
    a = by_layout["page_first"]
    assert a.call("store", seq=2, pages=16)["tokens"] == 16 * PAGE
    b = instances("pages-b", "page_first", extra)
    got = b.call("prefetch", seq=2, pages=16)
    assert (got["hit"], got["done"], got["bad"]) == (16 * PAGE, 16 * PAGE, 0)

    assert flush_l2(daemon) >= 16
    got = b.call("prefetch", seq=2, pages=16)
    assert (got["hit"], got["done"], got["bad"]) == (16 * PAGE, 16 * PAGE, 0)
    assert b.call("stats")["counters"]["prefetches"] >= 1  # the L3 run was prefetched

    keys = b.call("keys_of", seq=2, pages=16)["keys"]
    pool = PoolFile(Path(daemon.runtime_dir))
    try:
        key = bytes.fromhex(keys[5])
        pool.write(key, bytes(b ^ 0x5A for b in pool.read(key)))
    finally:
        pool.close()
    got = b.call("prefetch", seq=2, pages=16)
    assert (got["done"], got["bad"]) == (16 * PAGE, 1)


def test_a_killed_instance_finds_its_pages_again(instances, extra) -> None:
    k = instances("pages-k", "page_first_direct", extra)
    assert k.call("store", seq=3, pages=8)["tokens"] == 8 * PAGE
    k.kill()
    again = instances("pages-k2", "page_first_direct", extra)
    got = again.call("prefetch", seq=3, pages=8)
    assert (got["hit"], got["done"], got["bad"]) == (8 * PAGE, 8 * PAGE, 0)


def test_an_l3_run_no_prefetch_brings_is_not_offered(daemons, instances) -> None:
    """Pages only in L3, fewer than kvtierd's ``prefetch_threshold``: no prefetch will read
    them, so SGLang is not offered them as a hit (it would allocate host pages for them and
    then log their load as failed)."""
    d = daemons("threshold", "--hicache-storage-backend", "file", "--prefetch-threshold", "64")
    inst = instances("pages-threshold", "page_first", extra_config(d.runtime_dir, model_id="t"))
    assert inst.call("store", seq=4, pages=3)["tokens"] == 3 * PAGE  # 48 tokens < 64
    assert flush_l2(d) >= 3
    got = inst.call("prefetch", seq=4, pages=3)
    assert (got["hit"], got["done"], got["bad"]) == (0, 0, 0)
    assert inst.call("store", seq=6, pages=5)["tokens"] == 5 * PAGE  # 80 tokens: read
    assert flush_l2(d) >= 5
    got = inst.call("prefetch", seq=6, pages=5)
    assert (got["hit"], got["done"], got["bad"]) == (5 * PAGE, 5 * PAGE, 0)
