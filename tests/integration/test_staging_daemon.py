"""The engine-side copy path against a real kvtierd: pages of KV tensors kvtierd cannot map
go through a staging area both ways, layer by layer, byte exact; and they are the same
pages an engine whose memory kvtierd maps directly stores and loads (same layout label)."""

from __future__ import annotations

import pytest
import torch
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.client.staging.area import StagingArea, StagingPart
from kvtier.client.staging.copies import StagedCopier
from kvtier.ipc import protocol as P
from kvtier.ipc.shm import SharedMemorySegment

from tests.engines import client_config, tokens

pytestmark = pytest.mark.timeout(120)

WAIT_S = 10.0
G = P.Geometry(
    num_layers=3, page_size=16, kv_heads=2, head_dim=32, dtype="bfloat16", layout="vllm_cpu"
)
BLOCKS = 12
PAGE = (G.kv_heads, G.page_size, 2 * G.head_dim)  # vLLM's CPU block


def layers(seed: int) -> list[torch.Tensor]:
    """An engine's own KV tensors (plain memory), vLLM's CPU layout."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, *PAGE, generator=g).to(torch.bfloat16) for _ in range(3)]


@pytest.fixture
def staged(daemon):
    made: list[tuple[Connection, StagingArea]] = []

    def make(kv: list[torch.Tensor], capacity: int = 4) -> tuple[Connection, StagedCopier]:
        area = StagingArea([StagingPart(i, PAGE, torch.bfloat16) for i in range(3)], capacity)
        conn = Connection(
            area.memory(G), model_id="staged", config=client_config(daemon.runtime_dir)
        )
        made.append((conn, area))
        return conn, StagedCopier(area, kv)

    yield make
    for conn, area in made:
        conn.close()
        area.close()


def test_pages_round_trip_through_staging_layer_by_layer(staged, daemon):
    src = layers(1)
    conn, copier = staged(src)
    keys = conn.page_keys(tokens(3 * G.page_size, salt=1))
    slots = copier.area.acquire(3, 0)
    copier.to_host(slots, [7, 0, 11]).synchronize()
    h = conn.store(keys, slots)
    assert h.wait(WAIT_S) and h.ok and h.count == 3
    copier.area.release(slots)

    dst = layers(2)
    before = [t.clone() for t in dst]
    conn2, copier2 = staged(dst)
    slots = copier2.area.acquire(3, 0)
    h = conn2.load(keys, slots)
    assert h.count == 3
    for layer in range(G.num_layers):
        assert h.wait_layer(layer, WAIT_S)
        copier2.to_device(copier2.parts_of(layer), slots, [1, 2, 3]).synchronize()
    assert h.wait_loaded(WAIT_S)
    copier2.area.release(slots)
    for layer in range(G.num_layers):
        for b, t in ((7, 1), (0, 2), (11, 3)):
            assert torch.equal(dst[layer][t], src[layer][b]), f"layer {layer} block {b}"
        for t in set(range(BLOCKS)) - {1, 2, 3}:
            assert torch.equal(dst[layer][t], before[layer][t])

    # an engine whose KV memory kvtierd maps (the daemon copy mode) gets the same pages
    layer_bytes = BLOCKS * src[0][0].numel() * 2
    seg = SharedMemorySegment.create_memfd("kvtier-test-direct", 3 * layer_bytes)
    try:
        chunk = layer_bytes // BLOCKS
        regions = [
            P.MemoryRegion(
                segment=0, offset=i * layer_bytes, page_stride=chunk, page_bytes=chunk, layer=i
            )
            for i in range(3)
        ]
        direct = Connection(
            RegionMemory(G, BLOCKS, [seg.fd], [seg.size], regions),
            model_id="staged",
            config=client_config(daemon.runtime_dir),
        )
        try:
            h = direct.load(keys, [4, 5, 6])
            assert h.wait(WAIT_S) and h.ok
            mem = [
                seg.tensor(i * layer_bytes, layer_bytes).view(torch.bfloat16).view(BLOCKS, *PAGE)
                for i in range(3)
            ]
            for layer in range(3):
                for b, t in ((7, 4), (0, 5), (11, 6)):
                    assert torch.equal(mem[layer][t], src[layer][b])
            del mem
        finally:
            direct.close()
    finally:
        seg.close()


def test_a_handle_says_which_layers_are_in_place_and_whether_the_daemon_still_copies(
    staged, daemon
):
    conn, copier = staged(layers(3))
    keys = conn.page_keys(tokens(2 * G.page_size, salt=4))
    slots = copier.area.acquire(2, 0)
    h = conn.store(keys, slots)
    assert h.wait(WAIT_S)
    assert not h.copying() and h.layers_ready() == G.num_layers
    h = conn.load(keys, slots)
    assert h.count == 2 and 0 <= h.layers_ready() <= G.num_layers
    assert h.wait(WAIT_S) and h.layers_ready() == G.num_layers and not h.copying()
    h = conn.load(keys, slots)
    daemon.kill()  # whatever it was doing, a dead daemon copies nothing
    assert not h.copying()
    copier.area.release(slots, in_use=h.copying)
    assert copier.area.free == copier.area.capacity
