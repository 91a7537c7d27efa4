"""A bounded staging area in host memory for engines whose KV cache kvtierd cannot map.

The engine-side copy path (``copy_mode = "engine"``): the engine keeps its KV cache where it
wants it (GPU memory, or CPU memory it allocated itself) and copies pages between it and a
:class:`StagingArea`, a sealed memfd it hands to kvtierd exactly as CPU engine memory is
handed over (:class:`~kvtier.client.kv_pool.regions.RegionMemory`, one descriptor through
:func:`kvtier.ipc.fdpass.hand_over`). kvtierd copies staging ↔ pool on the CPU as it does for
any engine memory; it needs no CUDA context. The engine's device copies are
:class:`~kvtier.client.staging.copies.StagedCopier`'s.

The area holds ``capacity`` staging pages, one *part* after another (a part is what one
engine tensor holds of a page: vLLM's CPU layout has one per layer, a K/V-split layout two)::

    memfd: | part 0: capacity × part 0 bytes | part 1: capacity × part 1 bytes | ... |
    staging page s = the bytes of slot s in every part, in part order (one kvtier page)

On CUDA the mapping is page-locked with ``cudaHostRegister`` so the engine's copies are DMA.
Slots are handed out by :meth:`StagingArea.acquire`, which waits at most a given time and
otherwise returns None (the caller then treats the transfer as a miss or drops the store:
memory never grows). A transfer the daemon may still be copying (it timed out or was
abandoned) gives its slots back only once it has stopped (:meth:`StagingArea.release`'s
``in_use``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.ipc.limits import MAX_PAGES
from kvtier.ipc.protocol import Geometry, MemoryRegion
from kvtier.ipc.shm import SharedMemorySegment, available_memory

__all__ = ["StagingArea", "StagingPart", "slot_runs"]


@dataclass(frozen=True, slots=True)
class StagingPart:
    """What one engine tensor holds of a page.

    Attributes:
        layer: the model layer (the daemon announces loads layer by layer).
        shape: one page of the part, in the engine tensor's logical order (without the
            page dimension).
        dtype: its element type.
    """

    layer: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one page of this part."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


MAX_WAIT_S = 60.0
"""Longest wait for free staging slots a setting may ask for."""


def check_staging_pages(value: object, name: str = "staging_pages") -> int:
    """``value`` as a staging capacity: an int in ``[1, MAX_PAGES]`` (a REGISTER's most
    pages); otherwise ValueError naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PAGES:
        raise ValueError(f"{name} = {value!r}: must be an integer in [1, {MAX_PAGES}]")
    return value


def check_wait_s(value: object, name: str = "wait_s") -> float:
    """``value`` as a wait for free slots: a finite number of seconds in
    ``[0, MAX_WAIT_S]``; otherwise ValueError naming ``name`` and the value."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_WAIT_S
    ):
        raise ValueError(f"{name} = {value!r}: must be a number of seconds in [0, {MAX_WAIT_S:g}]")
    return float(value)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``slots`` into runs of consecutive slot numbers.

    Returns:
        ``(first slot, count, index of the run's first entry in slots)`` per run, in order.
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((slots[start], i - start, start))
            start = i
    return runs


class StagingArea:
    """``capacity`` staging pages in one sealed memfd, handed out as slots.

    Args:
        parts: what a page holds, part by part (their bytes add up to a kvtier page).
        capacity: staging pages (> 0).
        pin: page-lock the mapping for CUDA copies (``cudaHostRegister``); False on a
            machine without CUDA.

    Attributes:
        parts / capacity: as given.
        views: per part, a tensor ``[capacity, *part.shape]`` over the memfd.
        pinned: whether the mapping is page-locked.

    Raises:
        ValueError: no parts, a capacity that is not an int in ``[1, MAX_PAGES]``, or an
            area larger than the memory available now (it is allocated and touched at once:
            an area past it would have the kernel kill a process for memory).
    """

    def __init__(self, parts: Sequence[StagingPart], capacity: int, pin: bool = False) -> None:
        if not parts:
            raise ValueError("a staging area needs at least one part")
        check_staging_pages(capacity, "staging capacity")
        self.parts = list(parts)
        self.capacity = capacity
        self._offsets: list[int] = []
        total = 0
        for p in self.parts:
            self._offsets.append(total)
            total += capacity * p.nbytes
        available = available_memory()
        if available is not None and total > available:
            raise ValueError(
                f"staging capacity = {capacity}: {total} bytes of staging area, more than the "
                f"{available} bytes of memory available"
            )
        self.segment = SharedMemorySegment.create_memfd(
            f"kvtier-staging-{os.getpid()}", total, prefault=True
        )
        self.views = [
            self.segment.tensor(off, capacity * p.nbytes).view(p.dtype).view(capacity, *p.shape)
            for off, p in zip(self._offsets, self.parts)
        ]
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.segment.address, total, 0)
            if int(err) != 0:
                self.close()
                raise OSError(
                    f"cudaHostRegister of the {total}-byte staging area failed (error {int(err)})"
                )
            self.pinned = True
        self._free = np.ones(capacity, dtype=bool)
        self._held: list[tuple[list[int], Callable[[], bool]]] = []  # still used by the daemon
        self._cv = threading.Condition()

    # ------------------------------------------------------------------ handover
    def memory(self, geometry: Geometry, label: str = "staging") -> RegionMemory:
        """Describe the area for REGISTER (one region per part, layer by layer).

        Raises:
            ValueError: the parts' bytes do not add up to ``geometry.page_bytes``.
        """
        fd = self.segment.fd
        if fd is None:
            raise ValueError("the staging area is closed")
        regions = [
            MemoryRegion(
                segment=0, offset=off, page_stride=p.nbytes, page_bytes=p.nbytes, layer=p.layer
            )
            for off, p in zip(self._offsets, self.parts)
        ]
        return RegionMemory(
            geometry, self.capacity, [fd], [self.segment.size], regions, labels=[label]
        )

    # ------------------------------------------------------------------ slots
    @property
    def free(self) -> int:
        """Slots free now (slots the daemon may still use are not)."""
        with self._cv:
            self._reclaim()
            return int(self._free.sum())

    @property
    def held(self) -> int:
        """Slots given back while the daemon may still copy them (a failed transfer's), not
        free until it stops."""
        with self._cv:
            self._reclaim()
            return sum(len(slots) for slots, _ in self._held)

    def acquire(self, n: int, timeout: float) -> list[int] | None:
        """Take ``n`` slots, waiting at most ``timeout`` seconds for them.

        Consecutive slots are preferred (one copy per run of them).

        Returns:
            The slots in increasing order, or None when ``n`` were not free in time.

        Raises:
            ValueError: ``n`` is below 1 or above the capacity.
        """
        if not 1 <= n <= self.capacity:
            raise ValueError(f"cannot take {n} slots of a {self.capacity}-page staging area")
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                self._reclaim()
                got = self._take(n)
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                # a slot held by the daemon is given back by nobody's release: look again soon
                self._cv.wait(min(left, 0.01) if self._held else left)

    def _take(self, n: int) -> list[int] | None:
        free = self._free
        idx = np.flatnonzero(free)
        if len(idx) < n:
            return None
        # first run of n consecutive free slots: idx[i + n - 1] - idx[i] == n - 1
        if n > 1:
            spans = np.flatnonzero(idx[n - 1 :] - idx[: len(idx) - n + 1] == n - 1)
            chosen = idx[spans[0] : spans[0] + n] if len(spans) else idx[:n]
        else:
            chosen = idx[:1]
        free[chosen] = False
        return [int(s) for s in chosen]

    def release(self, slots: Sequence[int], in_use: Callable[[], bool] | None = None) -> None:
        """Give slots back.

        Args:
            slots: slots from :meth:`acquire`.
            in_use: for a transfer the daemon may still be copying: returns True while it
                does; the slots stay out of use until it returns False.

        Raises:
            ValueError: a slot that is free already (released twice).
        """
        if not slots:
            return
        with self._cv:
            if in_use is not None and in_use():
                self._held.append((list(slots), in_use))
                return
            self._give(slots)

    def _give(self, slots: Sequence[int]) -> None:
        arr = np.asarray(slots, dtype=np.int64)
        if self._free[arr].any():  # checked always: a slot handed out twice mixes two copies
            raise ValueError(f"staging slots released twice: {list(slots)}")
        self._free[arr] = True
        self._cv.notify_all()

    def _reclaim(self) -> None:
        """Give back the slots of held transfers that have stopped."""
        if not self._held:
            return
        still = []
        for slots, in_use in self._held:
            if in_use():
                still.append((slots, in_use))
            else:
                self._give(slots)
        self._held = still

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unpin and close the memfd (close the session that uses it first). Idempotent."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.segment.address)
            self.pinned = False
        self.views = []
        if not self.segment.closed:
            self.segment.close()
