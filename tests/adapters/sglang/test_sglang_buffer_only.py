"""``--hicache-host-memory-mode buffer_only``: SGLang's host pool is a staging buffer only, and
kvtierd's pool is the L2.

One instance process runs SGLang 0.5.23's ``HiCacheController`` with ``host_memory_mode =
"buffer_only"`` and a host buffer of 8 pages; the kvtier backend comes from SGLang's dynamic
loader. Writes go as SGLang's buffer pipeline makes them: staged in host slots, backed up,
the slots overwritten (last page first) and given back at the storage ack. Four sequences of
6 pages (24 pages, three times the buffer) pass through it; then each is prefetched into a
hit-sized host bounce (scribbled over first) and compared byte for byte. The buffer no
longer holds any of them, so every byte comes from kvtierd: a page corrupted in kvtierd's
pool comes back corrupted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_harness import admin_stats, extra_config

from tests.integration.test_kv_bytes import PoolFile

pytestmark = pytest.mark.timeout(600)

PAGE = 16
BUFFER_PAGES = 8
SEQS, PAGES = 4, 6
GEOMETRY = {"layers": 16, "heads": 8, "head_dim": 128}
"""1 MiB pages: a backup's copy takes long enough that a backend answering before it ends
(while SGLang overwrites the staging slots at the ack) is likely to fail the comparison."""


def test_kvtierd_is_the_only_l2(instances, daemons) -> None:
    daemon = daemons("buffer")
    inst = instances(
        "buffer",
        "page_first",
        extra_config(daemon.runtime_dir, model_id="buffer"),
        host_memory_mode="buffer_only",
        host_tokens=BUFFER_PAGES * PAGE,
        **GEOMETRY,
    )
    mode = inst.call("mode")
    assert mode["host_memory_mode"] == "buffer_only"
    assert mode["host_pages"] == BUFFER_PAGES
    # cache mode keeps half the host pool for writes; buffer mode lends prefetches more of it
    assert mode["prefetch_limit_tokens"] > BUFFER_PAGES * PAGE // 2

    slots = []
    for seq in range(SEQS):
        got = inst.call("stage", seq=seq, pages=PAGES)
        assert got["tokens"] == PAGES * PAGE
        slots.append(set(got["slots"]))
    assert all(slots[i] & slots[i + 1] for i in range(SEQS - 1))  # the buffer was reused
    assert admin_stats(daemon)["counters"]["store_pages"] == SEQS * PAGES

    for seq in range(SEQS):
        got = inst.call("prefetch", seq=seq, pages=PAGES)
        assert (got["hit"], got["done"], got["bad"]) == (PAGES * PAGE, PAGES * PAGE, 0), seq
    assert admin_stats(daemon)["counters"]["load_pages"] >= SEQS * PAGES

    key = bytes.fromhex(inst.call("keys_of", seq=0, pages=PAGES)["keys"][2])
    pool = PoolFile(Path(daemon.runtime_dir))
    try:
        pool.write(key, bytes(b ^ 0x5A for b in pool.read(key)))
    finally:
        pool.close()
    got = inst.call("prefetch", seq=0, pages=PAGES)
    assert (got["done"], got["bad"]) == (PAGES * PAGE, 1)
