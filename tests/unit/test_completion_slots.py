"""The engine side's completion slots: a slot in limbo is reused only once the block shows its
transfer no longer running (a late write of the daemon must never land in a newer transfer)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvtier.client.connection.slots import CompletionSlots
from kvtier.ipc.completion import CompletionBlock, TransferStatus


@pytest.fixture
def block() -> Iterator[CompletionBlock]:
    b = CompletionBlock.create_memfd(2)
    yield b
    b.close()


def test_slots_are_taken_until_none_is_free(block: CompletionBlock) -> None:
    slots = CompletionSlots()
    slots.reset(2)
    taken = {slots.take(block), slots.take(block)}
    assert taken == {0, 1}
    assert slots.take(block) is None
    slots.give_back(1)
    assert slots.take(block) == 1


def test_a_slot_in_limbo_waits_for_its_transfer_to_stop_running(block: CompletionBlock) -> None:
    slots = CompletionSlots()
    slots.reset(1)
    slot = slots.take(block)
    assert slot == 0
    block.begin(0, seq=7, num_layers=2)
    slots.abandon(0, 7)
    assert slots.take(block) is None, "the daemon still runs seq 7 in slot 0"
    block.finish(0, TransferStatus.DONE, wake=False)
    assert slots.take(block) == 0


def test_a_slot_whose_block_shows_another_transfer_leaves_limbo(block: CompletionBlock) -> None:
    slots = CompletionSlots()
    slots.reset(1)
    slots.take(block)
    block.begin(0, seq=3, num_layers=1)
    slots.abandon(0, 2)  # the daemon never started seq 2 there
    assert slots.take(block) == 0


def test_done_frees_a_finished_slot_and_holds_a_running_one(block: CompletionBlock) -> None:
    slots = CompletionSlots()
    slots.reset(2)
    a, b = slots.take(block), slots.take(block)
    assert a is not None and b is not None
    block.begin(b, seq=5, num_layers=1)
    slots.done(a, 4, TransferStatus.DONE)
    slots.done(b, 5, TransferStatus.RUNNING)
    slots.done(a, 4, TransferStatus.DONE)  # twice: no second free entry
    assert slots.take(block) == a
    assert slots.take(block) is None, "slot b stays in limbo while seq 5 runs"


def test_reset_forgets_limbo_and_keep_takes_a_slot_out_of_the_new_table(
    block: CompletionBlock,
) -> None:
    slots = CompletionSlots()
    slots.reset(2)
    old = slots.take(block)
    assert old is not None
    slots.abandon(old, 1)
    slots.reset(2)  # a re-registration: a new block, all free
    slots.keep(old)  # ... but the transfer that re-registered now uses ``old``
    other = slots.take(block)
    assert other is not None and other != old
    assert slots.take(block) is None
