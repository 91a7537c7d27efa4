"""The slots of a session's completion block, as the engine's side tracks them.

Each STORE or LOAD the connection starts reports its progress in one slot of the completion
block (:mod:`kvtier.ipc.completion`), under a sequence number of its own. A slot is *free*,
*in use* by a running transfer, or *in limbo*: its transfer was abandoned (a wait timed out,
or the request's reply never came) and the daemon may still be writing to it. A slot in limbo
is reused only once the block shows that transfer no longer running (another sequence number
there, or a final status), so a late write never lands in a newer transfer's slot.

Each slot in use is owned by its transfer's sequence number, and every call that ends a use
names it: a thread that gave its transfer up and reports the end late (after the slot left
limbo and another transfer took it) changes nothing, instead of freeing the slot a second
time while the newer transfer runs in it.

Locked by its own lock, held for a few dictionary and list steps: an engine's thread that
gives a transfer up marks its slot without waiting for the connection's lock, which a
request to a daemon that does not answer may hold for ``request_timeout_s``.
"""

from __future__ import annotations

import threading

from kvtier.ipc.completion import CompletionBlock, TransferStatus

__all__ = ["CompletionSlots"]


class CompletionSlots:
    """Which slots of a session's completion block a new transfer may take."""

    def __init__(self) -> None:
        self.count = 0
        """Slots of the current registration's block."""
        self._free: list[int] = []
        self._limbo: dict[int, int] = {}  # slot -> seq of an abandoned transfer
        self._owner: dict[int, int] = {}  # slot -> seq of the transfer using it
        self._lock = threading.Lock()

    def reset(self, count: int) -> None:
        """A new registration: ``count`` slots, all free (the daemon's block is new)."""
        with self._lock:
            self.count = count
            self._free = list(range(count - 1, -1, -1))
            self._limbo.clear()
            self._owner.clear()

    def take(self, block: CompletionBlock | None, seq: int) -> int | None:
        """A free slot for the new transfer ``seq``, or None when every slot is busy.

        When none is free, the slots in limbo whose transfer ``block`` shows ended are freed
        first.
        """
        with self._lock:
            if not self._free and self._limbo and block is not None:
                for slot, gone in list(self._limbo.items()):
                    if not block.runs(slot, gone):
                        del self._limbo[slot]
                        self._free.append(slot)
            if not self._free:
                return None
            slot = self._free.pop()
            self._owner[slot] = seq
            return slot

    def give_back(self, slot: int, seq: int) -> None:
        """Transfer ``seq`` took ``slot`` but nothing runs in it: free again."""
        with self._lock:
            if self._owner.get(slot) == seq:
                del self._owner[slot]
                self._free.append(slot)

    def keep(self, slot: int, seq: int) -> None:
        """Transfer ``seq`` took ``slot`` before a re-registration reset the table: take it
        out of the new table's free slots, since the transfer runs in the new session."""
        with self._lock:
            if slot in self._free:
                self._free.remove(slot)
                self._owner[slot] = seq

    def abandon(self, slot: int, seq: int) -> None:
        """The transfer ``seq`` in ``slot`` was given up on; the daemon may still run it.
        Nothing changes unless ``seq`` still owns the slot: the table was reset by a
        re-registration since the transfer began (its slot number means another block's
        now), or the transfer's end was recorded already."""
        with self._lock:
            if self._owner.get(slot) == seq:
                del self._owner[slot]
                self._limbo[slot] = seq

    def done(self, slot: int, seq: int, status: TransferStatus) -> None:
        """The transfer ``seq`` in ``slot`` ended with ``status`` as its handle saw it: the
        slot is free, or in limbo while the block still shows it running. Nothing changes
        unless ``seq`` still owns the slot (see :meth:`abandon`)."""
        with self._lock:
            if self._owner.get(slot) != seq:
                return
            del self._owner[slot]
            if status is TransferStatus.RUNNING:
                self._limbo[slot] = seq
            else:
                self._free.append(slot)
