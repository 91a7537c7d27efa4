"""kvtier as SGLang's HiCache storage backend, against SGLang 0.5.23's own classes: TP ranks
whose caches drifted apart, a long backup's chain, and an L3 read that fails.

Every instance is a process of its own (``sglang_instance.py``): SGLang's host pool and
``HiCacheController`` with the kvtier backend loaded by SGLang's dynamic loader, against
real kvtierd processes. What SGLang's hit query (``batch_exists``) offers is what its page
reads (``batch_get_v1``) then deliver, on every TP rank.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from sglang_harness import admin_stats, both_ranks, extra_config, flush_l2

pytestmark = pytest.mark.timeout(300)

PAGE = 16


def test_tp_ranks_are_offered_only_what_each_ranks_prefetch_brings(daemons, instances) -> None:
    """Two TP ranks whose caches have drifted apart (as they do when one rank's backup was
    dropped or its pages were evicted first): rank 0 holds the first 4 pages of a request
    in L2 only, rank 1 holds all 8 pages in L3 only. kvtierd's ``prefetch_threshold`` is
    96 tokens. Whatever hit the ranks agree on, every page offered by the hit query is
    delivered by the page reads on every rank (the hit equals the prefetched tokens): a
    page offered and never delivered costs SGLang host memory and a failed prefetch, and
    SGLang's MIN over the ranks then turns the whole offered hit into a miss."""
    d = daemons("tp-drift", "--hicache-storage-backend", "file", "--prefetch-threshold", "96")
    extra = extra_config(d.runtime_dir, model_id="tp-drift")
    ranks = [instances(f"tp-drift-{r}", "page_first", extra, tp_rank=r, tp_size=2) for r in (0, 1)]
    for r in ranks:
        r.wait_ready()
    assert ranks[1].call("store", seq=7, pages=8)["tokens"] == 8 * PAGE
    assert flush_l2(d) >= 8  # rank 1's pages: in L3 only
    assert ranks[0].call("store", seq=7, pages=4)["tokens"] == 4 * PAGE  # rank 0: L2
    got = both_ranks(ranks, "prefetch", seq=7, pages=8)
    assert all(g["bad"] == 0 for g in got), got
    assert [g["done"] for g in got] == [g["hit"] for g in got], got


@pytest.mark.timeout(600)
def test_a_long_backup_announces_every_page_under_its_parent(
    daemons, instances, module_tmp
) -> None:
    """SGLang backs a long sequence up in batches of 128 pages (its ``STORAGE_BATCH_SIZE``),
    without prefix keys unless ``hicache_storage_pass_prefix_keys`` is set. kvtierd's L2
    ``BlockStored`` events name the pages by SGLang's own block hashes *with the parent
    hash* (docs/events.md): page 128's parent is page 127, as in SGLang's own events, not
    None (which a router reads as a new root chain)."""
    from kvtier.client.connection.events import EventSubscriber
    from kvtier.ipc import kv_events as E

    ev, replay = f"ipc://{module_tmp}/ev2.sock", f"ipc://{module_tmp}/evr2.sock"
    d = daemons(
        "events-long",
        "--hicache-size",
        "128MiB",
        "--kv-events-endpoint",
        ev,
        "--kv-events-replay-endpoint",
        replay,
    )
    inst = instances(
        "events-long", "page_first", extra_config(d.runtime_dir, model_id="evl"), host_tokens=4096
    )
    inst.wait_ready()
    pages = 130
    parent: dict[int, int | None] = {}
    with EventSubscriber(ev, replay=replay) as sub:
        assert inst.call("store", seq=5, pages=pages)["tokens"] == pages * PAGE
        deadline = time.monotonic() + 60
        while len(parent) < pages:
            assert time.monotonic() < deadline, f"{pages} pages stored, events for {len(parent)}"
            for m in sub.iter(0.5, start_seq=sub.next_seq or 0):
                for e in m.batch.events:
                    if isinstance(e, E.BlockStored) and e.medium == E.MEDIUM_L2:
                        prev = e.parent_block_hash
                        for h in e.block_hashes:
                            parent[h] = prev
                            prev = h
    want = inst.call("event_hashes", seq=5, pages=pages)["hashes"]
    assert len(want) == pages
    wrong = [
        (i, parent.get(want[i]), want[i - 1])
        for i in range(1, pages)
        if parent.get(want[i]) != want[i - 1]
    ]
    assert not wrong, f"pages announced under another parent than their previous page: {wrong}"


@pytest.mark.timeout(300)
def test_pages_whose_l3_read_failed_are_missed_without_waiting_out_the_prefetch_timeout(
    daemons, instances, module_tmp
) -> None:
    """20 pages in L3 only; their objects on disk are then damaged (a torn write, a bad
    disk). The hit query offers them (kvtierd checks objects when it reads them), kvtierd's
    read finds every one damaged at once and drops it. SGLang's single prefetch I/O thread
    then gets its misses promptly (no wrong byte, and well before the 40 s prefetch timeout
    of this server): it is not held for the whole timeout waiting for pages kvtierd already
    knows will never come, while every other request's prefetch queues behind it."""
    l3 = module_tmp / "damaged-l3"
    d = daemons(
        "damaged",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        json.dumps({"path": str(l3)}),
        "--prefetch-threshold",
        "16",
    )
    extra = extra_config(d.runtime_dir, model_id="damaged", prefetch_timeout_base=40)
    inst = instances("damaged", "page_first", extra)
    assert inst.call("store", seq=1, pages=20)["tokens"] == 20 * PAGE
    assert flush_l2(d) >= 20
    segments = [p for p in l3.rglob("*.kvt") if p.is_file()]
    assert segments
    for p in segments:  # every byte past the first 4 KiB: garbage
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.seek(4096)
            f.write(os.urandom(size - 4096))
    got = inst.call("prefetch", seq=1, pages=20)
    assert got["bad"] == 0 and got["done"] == 0, got
    l3_stats = admin_stats(d)["l3"]
    assert l3_stats["corrupt"] >= 1, l3_stats  # kvtierd knew the pages would not come
    assert got["seconds"] < 20, got  # not held until SGLang's 40 s prefetch deadline
