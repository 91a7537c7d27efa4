"""Per-session completion blocks: how the daemon tells an engine that a layer has landed.

The daemon creates one block per session as an anonymous memfd, sealed against shrinking
and growing, and hands the engine a read-only descriptor of it in the reply to the
engine's memory handover (:mod:`kvtier.ipc.fdpass`); the engine maps it read-only. No file
name exists, so no other process can open it, and the engine cannot shrink it under the
daemon's mapping (nor, where the kernel has F_SEAL_FUTURE_WRITE, map it writable). A
block is an array of transfer slots, one cache line each::

    slot i:  [ seq | layers_done | status | num_layers | wakes | pad ... ]   (8 × int64)

For a transfer the client picks a free slot and a new ``seq`` and sends them with the
request. The daemon writes ``layers_done``, ``status`` and ``num_layers`` first and ``seq``
last, then bumps ``layers_done`` after each layer's bytes are in place and finally sets
``status``. The client trusts a slot only once ``seq`` equals its own, so a stale slot is
never mistaken for progress. Each field is one aligned 8-byte store (atomic on the
platforms kvtier runs on; on x86-64 stores are not reordered with earlier stores, so the
page bytes are visible before the counter that announces them).

After each ``layers_done`` store of a LOAD, and after the final ``status`` store of any
transfer, the daemon also bumps the low 32 bits of ``wakes`` and wakes the futex on that
word (:mod:`kvtier.ipc.futex`); a STORE's layers are written without a wake-up, as its
engine waits for its end only. A waiting client reads
``wakes``, checks the slot, and sleeps on the futex only while ``wakes`` is unchanged, so it
wakes as soon as the slot moves and never misses a change; it still re-checks the slot at
least every :data:`POLL_S`, so a daemon that does not wake is only slower to notice.
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kvtier.ipc import futex
from kvtier.ipc.shm import SharedMemoryError, SharedMemorySegment

SLOT_WORDS = 8
SEQ, LAYERS_DONE, STATUS, NUM_LAYERS, WAKES = 0, 1, 2, 3, 4
POLL_S = 0.02
"""The longest a waiting client sleeps without looking at its slot (and, with ``alive``,
between two checks that the daemon still lives)."""
SPINS = 16
"""Looks at the slot, yielding the CPU in between, before a wait goes to sleep: a transfer
about to end is seen without the cost of a sleep and a wake-up."""


class TransferStatus(enum.IntEnum):
    """The state of one transfer slot."""

    IDLE = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


class CompletionTimeout(TimeoutError):
    """A layer did not complete within the deadline."""


def check_timeout(value: object, name: str = "timeout") -> float:
    """``value`` as a wait in seconds: a finite number, 0 or more (0: do not wait);
    otherwise ValueError naming ``name`` and the value (a NaN deadline is never reached)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} = {value!r}: must be a finite number of seconds, 0 or more")
    return float(value)


class CompletionBlock:
    """A mapped completion block (daemon: writable owner; client: read-only peer)."""

    __slots__ = ("_a", "_w", "_wbase", "segment", "slots")

    def __init__(self, segment: SharedMemorySegment, slots: int) -> None:
        self.segment = segment
        self.slots = slots
        self._a = segment.array(np.int64, count=slots * SLOT_WORDS).reshape(slots, SLOT_WORDS)
        # the same memory as 32-bit words: the futex of slot i is the low half of its WAKES
        # word (little-endian), word 2 * (i * SLOT_WORDS + WAKES)
        self._w = segment.array(np.uint32, count=2 * slots * SLOT_WORDS)
        self._wbase = self._w.ctypes.data

    @classmethod
    def create(cls, path: str | Path, slots: int) -> CompletionBlock:
        """Create a block with ``slots`` transfer slots in a named file (mode 0640).

        For tools and tests that need a block without a daemon; kvtierd uses
        :meth:`create_memfd`.
        """
        seg = SharedMemorySegment.create(
            path, slots * SLOT_WORDS * 8, prefault=True, mode=0o640, exist_ok=True
        )
        return cls(seg, slots)

    @classmethod
    def create_memfd(cls, slots: int, label: str = "kvtier-completion") -> CompletionBlock:
        """Create a block as a sealed memfd (daemon side); see :meth:`reader_fd`."""
        seg = SharedMemorySegment.create_memfd(
            label, slots * SLOT_WORDS * 8, prefault=True, future_write=True
        )
        return cls(seg, slots)

    def reader_fd(self) -> int:
        """A new read-only descriptor of this memfd block, for the engine (caller closes it).

        Opened afresh through ``/proc/self/fd`` with ``O_RDONLY``, so the engine cannot
        map it writable through this descriptor.

        Raises:
            OSError: the block has no descriptor (a named block), or it could not be opened.
        """
        fd = self.segment.fd
        if fd is None:
            raise OSError(f"completion block {self.segment.path!r} is not a memfd")
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)

    @classmethod
    def open(cls, path: str | Path, slots: int) -> CompletionBlock:
        """Map an existing named block read-only (client side)."""
        seg = SharedMemorySegment.open(path, slots * SLOT_WORDS * 8, writable=False)
        return cls(seg, slots)

    @classmethod
    def from_fd(cls, fd: int, slots: int) -> CompletionBlock:
        """Map a block read-only from the descriptor the daemon handed over (client side).

        The caller keeps (and closes) ``fd``.

        Raises:
            SharedMemoryError: the descriptor is not a block of ``slots`` slots.
        """
        size = slots * SLOT_WORDS * 8
        st = os.fstat(fd)
        if st.st_size != size:
            raise SharedMemoryError(f"completion block has {st.st_size} bytes, expected {size}")
        return cls(SharedMemorySegment.from_fd(fd, size, writable=False, label="completion"), slots)

    # -- daemon side ---------------------------------------------------------------------
    def begin(self, slot: int, seq: int, num_layers: int) -> None:
        """Start a transfer in ``slot``; ``seq`` is written last."""
        row = self._a[slot]
        row[LAYERS_DONE] = 0
        row[STATUS] = TransferStatus.RUNNING
        row[NUM_LAYERS] = num_layers
        row[SEQ] = seq

    def layer_done(self, slot: int, layers_done: int) -> None:
        """Announce that layers ``[0, layers_done)`` are complete (and wake the waiter)."""
        self._a[slot, LAYERS_DONE] = layers_done
        self._wake(slot)

    def finish(self, slot: int, status: TransferStatus, wake: bool = True) -> None:
        """Set the final status of the transfer in ``slot`` (and wake the waiter).

        ``wake=False`` for a transfer that ends before its reply is sent: nobody waits on it
        yet (a waiter would see the status at its first look).
        """
        self._a[slot, STATUS] = status
        if wake:
            self._wake(slot)

    def addresses(self, slot: int) -> tuple[int, int]:
        """The addresses of ``slot``'s ``layers_done`` word and of its 32-bit wake counter,
        for a copy thread that announces layers itself (:meth:`layer_done`'s stores, in C)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside the block's {self.slots} slots")
        row = self._wbase + 8 * SLOT_WORDS * slot
        return row + 8 * LAYERS_DONE, row + 8 * WAKES

    def unannounced(self) -> CompletionBlock:
        """This block for a transfer whose layers nobody waits on (one that ends before its
        reply is sent, or a STORE, whose engine waits for its end only): its layers are
        written without waking anyone, saving a system call each."""
        return _Unannounced(self)  # type: ignore[return-value]

    def _wake(self, slot: int) -> None:
        """Bump ``slot``'s wake counter, then wake whoever sleeps on it."""
        i = 2 * (slot * SLOT_WORDS + WAKES)
        w = self._w
        w[i] = (int(w[i]) + 1) & 0xFFFFFFFF
        futex.wake(self._wbase + 4 * i)

    # -- client side ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a wait that began before goes on over its own
        reference to the mapping, so its ``alive`` callback asks this)."""
        return self._a is None

    def runs(self, slot: int, seq: int) -> bool:
        """Whether ``slot`` shows transfer ``seq`` running (False once the block is closed:
        a re-registration's, whose daemon writes it no more)."""
        try:
            s, _, status = self.read(slot)
        except (TypeError, ValueError, AttributeError):  # closed
            return False
        return s == seq and status == TransferStatus.RUNNING

    def read(self, slot: int) -> tuple[int, int, int]:
        """Return (seq, layers_done, status) of ``slot``."""
        row = self._a[slot]
        seq = int(row[SEQ])
        return seq, int(row[LAYERS_DONE]), int(row[STATUS])

    def wait(
        self,
        slot: int,
        seq: int,
        layers: int,
        timeout: float,
        alive: Callable[[], bool] | None = None,
        end: bool = False,
    ) -> TransferStatus:
        """Wait until ``layers`` layers of transfer ``seq`` are done, or it ends.

        Looks :data:`SPINS` times, then sleeps on the slot's futex between looks (polls
        where futexes are unavailable).

        Args:
            slot / seq: the transfer.
            layers: how many leading layers must be complete.
            timeout: seconds before :class:`CompletionTimeout`.
            alive: called now and then; returning False ends the wait early as FAILED
                (e.g. the daemon process is gone).
            end: wait for the transfer's final status, not only for its layers.

        Returns:
            RUNNING when the layers are done but the transfer is not finished (never with
            ``end``), DONE, FAILED or CANCELLED.
        """
        row = self._a[slot]
        words = self._w  # held: the mapping stays while this wait may sleep on it
        i = 2 * (slot * SLOT_WORDS + WAKES)
        address = self._wbase + 4 * i
        now = time.monotonic()
        deadline = now + check_timeout(timeout)
        next_alive = now + POLL_S
        polls = 0
        while True:
            ticket = int(words[i])
            if int(row[SEQ]) != seq:  # begun before its reply came: the slot was reused
                return TransferStatus.FAILED
            status = int(row[STATUS])
            if status != TransferStatus.RUNNING:
                if status == TransferStatus.DONE and int(row[LAYERS_DONE]) < layers:
                    return TransferStatus.FAILED
                return TransferStatus(status)
            if not end and int(row[LAYERS_DONE]) >= layers:
                return TransferStatus.RUNNING
            now = time.monotonic()
            if now >= deadline:
                raise CompletionTimeout(
                    f"slot {slot} seq {seq}: {layers} layers not done in {timeout}s"
                )
            if now >= next_alive:
                if alive is not None and not alive():
                    return TransferStatus.FAILED
                next_alive = now + POLL_S
            polls += 1
            if polls <= SPINS:
                os.sched_yield()
            elif futex.AVAILABLE:
                futex.wait(address, ticket, min(deadline, next_alive) - now)
            else:
                time.sleep(0.00005 if polls < 4096 else 0.0005)

    def close(self) -> None:
        """Unmap (and close the memfd, or remove the named file, of the daemon's block)."""
        self._a = self._w = None  # type: ignore[assignment]
        self.segment.close()


class _Unannounced:
    """A :class:`CompletionBlock` seen by a copy whose layers nobody waits on: writes them
    without waking (see :meth:`CompletionBlock.unannounced`)."""

    __slots__ = ("_block",)

    def __init__(self, block: CompletionBlock) -> None:
        self._block = block

    def layer_done(self, slot: int, layers_done: int) -> None:
        """Record that layers ``[0, layers_done)`` are complete."""
        self._block._a[slot, LAYERS_DONE] = layers_done
