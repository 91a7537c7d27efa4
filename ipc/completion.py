"""Per-session completion blocks: how the daemon tells an engine that a layer has landed.

The daemon creates one block per session as an anonymous memfd, sealed against shrinking
and growing, and hands the engine a read-only descriptor of it in the reply to the
engine's memory handover (:mod:`kvtier.ipc.fdpass`); the engine maps it read-only. No file
name exists, so no other process can open it, and the engine cannot shrink it under the
daemon's mapping (nor, where the kernel has F_SEAL_FUTURE_WRITE, map it writable). A
block is an array of transfer slots, one cache line each::

    slot i:  [ seq | layers_done | status | num_layers | pad ... ]   (8 × int64)

For a transfer the client picks a free slot and a new ``seq`` and sends them with the
request. The daemon writes ``layers_done``, ``status`` and ``num_layers`` first and ``seq``
last, then bumps ``layers_done`` after each layer's bytes are in place and finally sets
``status``. The client trusts a slot only once ``seq`` equals its own, so a stale slot is
never mistaken for progress. Each field is one aligned 8-byte store (atomic on the
platforms kvtier runs on; on x86-64 stores are not reordered with earlier stores, so the
page bytes are visible before the counter that announces them).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kvtier.ipc.shm import SharedMemoryError, SharedMemorySegment

SLOT_WORDS = 8
SEQ, LAYERS_DONE, STATUS, NUM_LAYERS = 0, 1, 2, 3


class TransferStatus(enum.IntEnum):
    """The state of one transfer slot."""

    IDLE = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


class CompletionTimeout(TimeoutError):
    """A layer did not complete within the deadline."""


class CompletionBlock:
    """A mapped completion block (daemon: writable owner; client: read-only peer)."""

    __slots__ = ("_a", "segment", "slots")

    def __init__(self, segment: SharedMemorySegment, slots: int) -> None:
        self.segment = segment
        self.slots = slots
        self._a = segment.array(np.int64, count=slots * SLOT_WORDS).reshape(slots, SLOT_WORDS)

    @classmethod
    def create(cls, path: str | Path, slots: int) -> CompletionBlock:
        """Create a block with ``slots`` transfer slots in a named file (mode 0640).

        For tools and tests that need a block without a daemon; kvtierd uses
        :meth:`create_memfd`.
        """
        seg = SharedMemorySegment.create(path, slots * SLOT_WORDS * 8, prefault=True, mode=0o640,
                                         exist_ok=True)
        return cls(seg, slots)

    @classmethod
    def create_memfd(cls, slots: int, label: str = "kvtier-completion") -> CompletionBlock:
        """Create a block as a sealed memfd (daemon side); see :meth:`reader_fd`."""
        seg = SharedMemorySegment.create_memfd(label, slots * SLOT_WORDS * 8, prefault=True,
                                               future_write=True)
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
        """Announce that layers ``[0, layers_done)`` are complete."""
        self._a[slot, LAYERS_DONE] = layers_done

    def finish(self, slot: int, status: TransferStatus) -> None:
        """Set the final status of the transfer in ``slot``."""
        self._a[slot, STATUS] = status

    # -- client side ---------------------------------------------------------------------
    def read(self, slot: int) -> tuple[int, int, int]:
        """Return (seq, layers_done, status) of ``slot``."""
        row = self._a[slot]
        seq = int(row[SEQ])
        return seq, int(row[LAYERS_DONE]), int(row[STATUS])

    def wait(self, slot: int, seq: int, layers: int, timeout: float,
             alive: Callable[[], bool] | None = None) -> TransferStatus:
        """Wait until ``layers`` layers of transfer ``seq`` are done, or it ends.

        Args:
            slot / seq: the transfer.
            layers: how many leading layers must be complete.
            timeout: seconds before :class:`CompletionTimeout`.
            alive: called now and then; returning False ends the wait early as FAILED
                (e.g. the daemon process is gone).

        Returns:
            RUNNING when the layers are done but the transfer is not finished, DONE,
            FAILED or CANCELLED.
        """
        row = self._a[slot]
        deadline = time.monotonic() + timeout
        spins = 0
        while True:
            if int(row[SEQ]) == seq:
                status = int(row[STATUS])
                if status != TransferStatus.RUNNING:
                    if status == TransferStatus.DONE and int(row[LAYERS_DONE]) < layers:
                        return TransferStatus.FAILED
                    return TransferStatus(status)
                if int(row[LAYERS_DONE]) >= layers:
                    return TransferStatus.RUNNING
            spins += 1
            if spins < 64:
                os.sched_yield()
                continue
            now = time.monotonic()
            if now >= deadline:
                raise CompletionTimeout(f"slot {slot} seq {seq}: {layers} layers not done in {timeout}s")
            if spins % 256 == 0 and alive is not None and not alive():
                return TransferStatus.FAILED
            time.sleep(0.00005 if spins < 4096 else 0.0005)

    def close(self) -> None:
        """Unmap (and close the memfd, or remove the named file, of the daemon's block)."""
        self._a = None  # type: ignore[assignment]
        self.segment.close()
