"""``StagedConnection`` (the engine-side copy path for any engine) against a real kvtierd.

The engine's KV tensors are plain CPU tensors here; on a GPU the same calls copy by DMA on a
copy stream (tests/cuda/test_cuda_engine.py runs them through the reference engine).
"""

from __future__ import annotations

import pytest
import torch
from kvtier.client.cache.staged import StagedConnection
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool

from tests.engines import SMALL, client_config

pytestmark = [pytest.mark.timeout(60)]

PAGES = 12


def kv_tensors(seed: int | None) -> list[torch.Tensor]:
    """Per layer K then V of SMALL; random with a seed, else zeros."""
    g = SMALL
    shape = (PAGES, g.page_size, g.kv_heads, g.head_dim)
    if seed is None:
        return [torch.zeros(shape) for _ in range(g.num_layers * 2)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(g.num_layers * 2)]


def test_store_then_load_round_trips_the_bytes_and_matches_the_shared_pool(daemon) -> None:
    cfg = client_config(daemon.runtime_dir)
    src = kv_tensors(1)
    with StagedConnection.over(src, SMALL, "staged", staging_pages=4, config=cfg) as conn:
        keys = [bytes([i]) * 32 for i in range(6)]
        st = conn.store(keys, [7, 2, 9, 4, 0, 11])
        assert st.wait() and st.count == 4  # at most the staging area's 4 pages
        dst = kv_tensors(None)
    with StagedConnection.over(dst, SMALL, "staged", staging_pages=8, config=cfg) as conn:
        assert conn.lookup(keys).l2 == 4
        ld = conn.load(keys, [1, 3, 5, 6])
        assert ld.count == 4
        assert all(ld.wait_layer(layer) for layer in range(SMALL.num_layers)) and ld.wait()
        assert conn.area.free == conn.area.capacity
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[1, 3, 5, 6]], s[[7, 2, 9, 4]])
        assert not d[[0, 2, 4, 7, 8, 9, 10, 11]].any()  # pages not loaded stay untouched
    # a daemon-mode engine reads the same page bytes
    with (
        SharedKVPool(SMALL, PAGES) as pool,
        Connection(pool, "staged", config=cfg) as plain,
    ):
        assert plain.load(keys[:4], [0, 1, 2, 3]).wait()
        for layer in range(SMALL.num_layers):
            assert torch.equal(pool.k[layer][:4], src[2 * layer][[7, 2, 9, 4]])
            assert torch.equal(pool.v[layer][:4], src[2 * layer + 1][[7, 2, 9, 4]])


def test_tensors_that_do_not_match_the_geometry_are_refused(daemon) -> None:
    cfg = client_config(daemon.runtime_dir)
    kv = kv_tensors(None)
    with pytest.raises(ValueError, match="7 KV tensors; the geometry has 4 layers of 2 buffers"):
        StagedConnection.over(kv[:7], SMALL, "staged", config=cfg)
    bad = [*kv[:-1], torch.zeros(PAGES, SMALL.page_size, 1, SMALL.head_dim)]
    with pytest.raises(ValueError, match=r"kv\[7\]: .* shape \(12, 16, 1, 32\)"):
        StagedConnection.over(bad, SMALL, "staged", config=cfg)


def test_a_device_copy_that_raises_is_a_miss_and_gives_every_slot_back(daemon) -> None:
    """A copy between the engine's memory and the staging area that raises (a GPU out of
    memory, a CUDA error) ends that load as a miss and that store as dropped, never as an
    exception in the engine's forward pass, and leaves no staging slot in use."""
    cfg = client_config(daemon.runtime_dir)
    src = kv_tensors(3)
    keys = [bytes([40 + i]) * 32 for i in range(4)]
    with StagedConnection.over(src, SMALL, "staged", staging_pages=4, config=cfg) as conn:
        real_to_host, real_to_device = conn.copier.to_host, conn.copier.to_device

        def boom(*args: object, **kwargs: object) -> None:
            raise RuntimeError("CUDA out of memory (raised by the test)")

        conn.copier.to_host = boom  # type: ignore[method-assign,assignment]
        st = conn.store(keys, [0, 1, 2, 3])
        assert st.count == 0 and st.wait()  # dropped
        assert conn.area.free == conn.area.capacity and conn.lookup(keys).l2 == 0
        conn.copier.to_host = real_to_host  # type: ignore[method-assign]
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        conn.copier.to_device = boom  # type: ignore[method-assign,assignment]
        ld = conn.load(keys, [4, 5, 6, 7])
        assert ld.count == 4
        assert not ld.wait_layer(0) and not ld.wait()  # a miss: the engine recomputes
        assert conn.area.free == conn.area.capacity
        conn.copier.to_device = real_to_device  # type: ignore[method-assign]
        ld = conn.load(keys, [4, 5, 6, 7])  # and the next load is served
        assert ld.count == 4 and ld.wait()
        assert all(torch.equal(t[4:8], t[0:4]) for t in src)


def test_a_write_back_of_more_chains_than_the_staging_area_holds_stores_them_all(daemon) -> None:
    """Evicting many chains writes each back through a staging area that holds a few pages
    at a time: the manager waits for earlier STOREs instead of having later ones dropped,
    and a chain longer than the area goes in pieces, each chained to the one before."""
    from kvtier.client.cache.manager import CacheManager
    from kvtier.engine.allocator import PageAllocator

    cfg = client_config(daemon.runtime_dir, hicache_write_policy="write_back")
    src = kv_tensors(5)
    lengths = [2, 2, 2, 6]  # 12 pages to write back, 4 staging slots
    with StagedConnection.over(src, SMALL, "staged-wb", staging_pages=4, config=cfg) as conn:
        cm = CacheManager(PageAllocator(PAGES), conn)
        try:
            keys = []
            for c, n in enumerate(lengths):
                toks = [1000 * c + t for t in range(n * SMALL.page_size)]
                m = cm.match(toks)
                cm.insert(m, cm.alloc(n))
                cm.release(m)
                keys.append(m.keys)
            assert cm.counters.stores_issued == 0  # write_back: nothing stored on insert
            assert cm.flush_l1() == sum(lengths)
            assert cm.counters.store_dropped_pages == 0 and cm.counters.store_failures == 0
            assert cm.counters.written_back_pages == sum(lengths)
            for chain, n in zip(keys, lengths, strict=True):
                assert conn.lookup(chain).l2 == n
            assert conn.area.free == conn.area.capacity
        finally:
            cm.close()
