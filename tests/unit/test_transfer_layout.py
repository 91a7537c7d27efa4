"""``run_transfer`` puts K and V where the documented host page layout says, both ways.

The host page layout (docs/protocol.md "Geometry and exported memory",
kernels/page_copy.py)::

    slot: | L0.K | L0.V | L1.K | L1.V | ... |     each chunk = chunk_bytes (MHA)
    slot: | L0   | L1   | ...              |     (MLA: one latent per layer)

A restarted daemon, another engine, or an L3 object reads these bytes by that layout, so a
store and a load that agree with each other but not with the layout (K and V swapped, layers
reversed) are bugs a round trip cannot see. The expected bytes here are built from the
layout by hand, never by the copy plan under test.

``run_transfer`` never writes the final status: the event loop does that after it commits
the pages (a store) or drops the pins (a load), so DONE means "visible".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier.daemon.transfer.engine_memory import RegionView
from kvtier.daemon.transfer.transfer import Direction, Transfer
from kvtier.daemon.transfer.transfer import run_transfer as run_regions
from kvtier.ipc.completion import CompletionBlock, TransferStatus

LAYERS = 3
CHUNK = 48  # bytes of one page of one (layer, component) buffer
NUM_PAGES = 8
SLOT_GAP = 16  # slots lie further apart than a page: the gaps must stay untouched
# engine page -> host slot index; given shuffled, with a run of three (copied by one strided
# copy) and single pages (copied one memmove each)
PAGES = [5, 0, 1, 2, 7]
SLOTS = [0, 3, 4, 5, 1]


@pytest.fixture
def block(tmp_path: Path) -> Iterator[CompletionBlock]:
    """A completion block with 4 transfer slots, in a temp file."""
    b = CompletionBlock.create(tmp_path / "completion", 4)
    yield b
    b.close()


def engine_buffers(components: int, seed: int) -> list[list[torch.Tensor]]:
    """``[layer][component]`` uint8 buffers of ``[NUM_PAGES, CHUNK]`` with random bytes."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randint(0, 256, (NUM_PAGES, CHUNK), dtype=torch.uint8, generator=g)
            for _ in range(components)
        ]
        for _ in range(LAYERS)
    ]


def run_transfer(
    t: Transfer,
    arena: torch.Tensor,
    buffers: list[list[torch.Tensor]],
    chunk: int,
    block: CompletionBlock,
) -> TransferStatus:
    """Run ``t`` over ``buffers`` described as the per-buffer layout's regions."""
    regions, off = [], 0
    for layer, row in enumerate(buffers):
        for buf in row:
            regions.append(RegionView(layer, off, chunk, chunk, 0, buf, -1, NUM_PAGES))
            off += chunk
    return run_regions(t, arena, regions, LAYERS, off, block)


def slot_bytes(components: int) -> int:
    return LAYERS * components * CHUNK


def slot_offset(i: int, components: int) -> int:
    return SLOT_GAP + i * (slot_bytes(components) + SLOT_GAP)


def arena_for(components: int) -> torch.Tensor:
    return torch.zeros(slot_offset(max(SLOTS) + 1, components), dtype=torch.uint8)


def transfer(direction: Direction, components: int) -> Transfer:
    offsets = np.array([slot_offset(s, components) for s in SLOTS], dtype=np.int64)
    return Transfer(
        direction=direction,
        session_id=1,
        slot=2,
        seq=9,
        host_slots=list(SLOTS),
        page_ids=np.array(PAGES, dtype=np.int64),
        offsets=offsets,
        nbytes=len(SLOTS) * slot_bytes(components),
    )


def layout_of(buffers: list[list[torch.Tensor]], page: int) -> bytes:
    """The documented slot bytes of engine page ``page``: per layer, K then V."""
    out = b""
    for layer in range(LAYERS):
        k = buffers[layer][0]
        out += bytes(k[page].numpy())
        if len(buffers[layer]) == 2:
            v = buffers[layer][1]
            out += bytes(v[page].numpy())
    return out


@pytest.mark.parametrize("components", [2, 1], ids=["mha", "mla"])
def test_a_store_writes_each_page_in_the_documented_slot_layout(block, components):
    buffers = engine_buffers(components, seed=1)
    arena = arena_for(components)
    t = transfer(Direction.STORE, components)
    block.begin(t.slot, t.seq, LAYERS)
    assert run_transfer(t, arena, buffers, CHUNK, block) is TransferStatus.DONE
    raw = bytes(arena.numpy())
    size = slot_bytes(components)
    for page, slot in zip(PAGES, SLOTS):
        off = slot_offset(slot, components)
        assert raw[off : off + size] == layout_of(buffers, page), f"page {page} in slot {slot}"
    # nothing outside the transfer's slots was written (the gaps, the unused slot 2)
    written = np.zeros(arena.numel(), dtype=bool)
    for slot in SLOTS:
        off = slot_offset(slot, components)
        written[off : off + size] = True
    assert not arena.numpy()[~written].any()


@pytest.mark.parametrize("components", [2, 1], ids=["mha", "mla"])
def test_a_load_puts_each_chunk_of_a_slot_into_its_layer_and_component(block, components):
    arena = arena_for(components)
    g = torch.Generator().manual_seed(2)
    arena.copy_(torch.randint(0, 256, (arena.numel(),), dtype=torch.uint8, generator=g))
    buffers = [
        [torch.zeros(NUM_PAGES, CHUNK, dtype=torch.uint8) for _ in range(components)]
        for _ in range(LAYERS)
    ]
    t = transfer(Direction.LOAD, components)
    block.begin(t.slot, t.seq, LAYERS)
    assert run_transfer(t, arena, buffers, CHUNK, block) is TransferStatus.DONE
    raw = bytes(arena.numpy())
    for page, slot in zip(PAGES, SLOTS):
        base = slot_offset(slot, components)
        for layer in range(LAYERS):
            k_at = base + layer * components * CHUNK  # K first in each layer
            assert bytes(buffers[layer][0][page].numpy()) == raw[k_at : k_at + CHUNK], (
                f"K of layer {layer}, page {page}"
            )
            if components == 2:
                v_at = k_at + CHUNK  # V right after K
                assert bytes(buffers[layer][1][page].numpy()) == raw[v_at : v_at + CHUNK], (
                    f"V of layer {layer}, page {page}"
                )
    untouched = sorted(set(range(NUM_PAGES)) - set(PAGES))
    for row in buffers:
        for buf in row:
            assert not buf[untouched].any()


def test_a_store_into_a_layout_and_a_load_back_are_inverse(block):
    """Store then load into other pages gives the same bytes (the round trip, for contrast:
    it holds even with K and V swapped, which is why the two tests above exist)."""
    src = engine_buffers(2, seed=3)
    arena = arena_for(2)
    t = transfer(Direction.STORE, 2)
    block.begin(t.slot, t.seq, LAYERS)
    assert run_transfer(t, arena, src, CHUNK, block) is TransferStatus.DONE
    dst = [
        [torch.zeros(NUM_PAGES, CHUNK, dtype=torch.uint8) for _ in range(2)] for _ in range(LAYERS)
    ]
    t = transfer(Direction.LOAD, 2)
    block.begin(t.slot, t.seq + 1, LAYERS)
    assert run_transfer(t, arena, dst, CHUNK, block) is TransferStatus.DONE
    for page in PAGES:
        assert layout_of(dst, page) == layout_of(src, page)


@pytest.mark.parametrize("direction", list(Direction))
def test_the_worker_announces_layers_but_never_the_final_status(block, direction):
    """DONE is the event loop's to write, after the commit (store) or unpin (load): a worker
    that wrote it would let an engine see DONE before another session can see the pages."""
    arena = arena_for(2)
    t = transfer(direction, 2)
    block.begin(t.slot, t.seq, LAYERS)
    assert run_transfer(t, arena, engine_buffers(2, seed=4), CHUNK, block) is TransferStatus.DONE
    assert t.status is TransferStatus.DONE
    assert block.read(t.slot) == (t.seq, LAYERS, TransferStatus.RUNNING)


def test_a_cancelled_transfer_stops_before_the_next_layer(block):
    arena = arena_for(2)
    t = transfer(Direction.STORE, 2)
    t.cancelled = True
    block.begin(t.slot, t.seq, LAYERS)
    assert (
        run_transfer(t, arena, engine_buffers(2, seed=5), CHUNK, block) is TransferStatus.CANCELLED
    )
    assert block.read(t.slot) == (t.seq, 0, TransferStatus.RUNNING)
    assert not arena.any()
