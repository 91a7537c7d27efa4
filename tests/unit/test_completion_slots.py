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
    a, b = slots.take(block, 1), slots.take(block, 2)
    assert {a, b} == {0, 1}
    assert slots.take(block, 3) is None
    assert b is not None
    slots.give_back(b, 2)
    assert slots.take(block, 4) == b


def test_a_slot_in_limbo_waits_for_its_transfer_to_stop_running(block: CompletionBlock) -> None:
    slots = CompletionSlots()
    slots.reset(1)
    slot = slots.take(block, 7)
    assert slot == 0
    block.begin(0, seq=7, num_layers=2)
    slots.abandon(0, 7)
    assert slots.take(block, 8) is None, "the daemon still runs seq 7 in slot 0"
    block.finish(0, TransferStatus.DONE, wake=False)
    assert slots.take(block, 9) == 0


def test_a_slot_whose_block_shows_another_transfer_leaves_limbo(block: CompletionBlock) -> None:
    slots = CompletionSlots()
    slots.reset(1)
    slots.take(block, 2)
    block.begin(0, seq=3, num_layers=1)
    slots.abandon(0, 2)  # the daemon never started seq 2 there
    assert slots.take(block, 4) == 0


def test_done_frees_a_finished_slot_and_holds_a_running_one(block: CompletionBlock) -> None:
    slots = CompletionSlots()
    slots.reset(2)
    a, b = slots.take(block, 4), slots.take(block, 5)
    assert a is not None and b is not None
    block.begin(b, seq=5, num_layers=1)
    slots.done(a, 4, TransferStatus.DONE)
    slots.done(b, 5, TransferStatus.RUNNING)
    slots.done(a, 4, TransferStatus.DONE)  # twice: no second free entry
    assert slots.take(block, 6) == a
    assert slots.take(block, 7) is None, "slot b stays in limbo while seq 5 runs"


def test_reset_forgets_limbo_and_keep_takes_a_slot_out_of_the_new_table(
    block: CompletionBlock,
) -> None:
    slots = CompletionSlots()
    slots.reset(2)
    old = slots.take(block, 1)
    assert old is not None
    slots.abandon(old, 1)
    slots.reset(2)  # a re-registration: a new block, all free
    slots.keep(old, 1)  # ... but the transfer that re-registered now uses ``old``
    other = slots.take(block, 2)
    assert other is not None and other != old
    assert slots.take(block, 3) is None
    slots.give_back(old, 1)  # kept for seq 1: its end frees it
    assert slots.take(block, 4) == old


def test_a_late_end_of_an_abandoned_transfer_never_frees_the_slot_of_the_next(
    block: CompletionBlock,
) -> None:
    """A thread gives its transfer up (the slot goes into limbo) and records its end only
    later; meanwhile the daemon ended the transfer, the slot left limbo and a newer
    transfer took it. The late end changes nothing: freeing the slot again would hand it
    to a third transfer while the second runs in it, and the second's waiter, seeing
    another sequence number in its slot, would never see its own end."""
    slots = CompletionSlots()
    slots.reset(1)
    assert slots.take(block, 1) == 0
    block.begin(0, seq=1, num_layers=1)
    slots.abandon(0, 1)
    block.finish(0, TransferStatus.DONE, wake=False)
    assert slots.take(block, 2) == 0  # the block shows seq 1 ended: out of limbo
    block.begin(0, seq=2, num_layers=1)
    slots.done(0, 1, TransferStatus.FAILED)  # seq 1's handle, late
    slots.abandon(0, 1)
    slots.give_back(0, 1)
    assert slots.take(block, 3) is None, "seq 2 runs in slot 0"
    slots.done(0, 2, TransferStatus.RUNNING)  # seq 2's layers landed, not settled yet
    assert slots.take(block, 4) is None, "seq 2 still runs in slot 0"
    block.finish(0, TransferStatus.DONE, wake=False)
    assert slots.take(block, 5) == 0


def test_a_wait_on_a_slot_that_shows_a_newer_transfer_ends_at_once(
    block: CompletionBlock,
) -> None:
    """A transfer's slot is begun before its reply is sent, so a waiter that finds another
    sequence number there knows its transfer has ended (how, it cannot tell): a miss now,
    not a wait for the whole timeout."""
    block.begin(1, seq=4, num_layers=2)
    block.finish(1, TransferStatus.DONE, wake=False)
    block.begin(1, seq=5, num_layers=2)
    assert block.wait(1, 4, 2, 1.0) is TransferStatus.FAILED
    assert block.wait(1, 4, 2, 1.0, end=True) is TransferStatus.FAILED
