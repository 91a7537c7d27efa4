"""Registered memory where a Mooncake job puts its batch's object headers.

When a page cannot carry its header in its slot's headroom (no headroom, or one batch
names a slot twice), the header goes to a block of this scratch memory, registered with
Mooncake like the arena, and the object moves as two buffers.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap

from kvtier.daemon.storage.objects import HEADER_SIZE

__all__ = ["Scratch"]


class Scratch:
    """Registered memory for headers: ``blocks`` blocks of ``keys_per_block`` × 96 bytes.

    Attributes:
        block_bytes, size: bytes of one block, of the whole mapping.
        memory, address, view: the anonymous mapping, its address, a view of it.
        free: offsets of the blocks no job holds (a job takes one for its batch).
    """

    def __init__(self, blocks: int, keys_per_block: int) -> None:
        self.block_bytes = keys_per_block * HEADER_SIZE
        self.size = max(mmap.PAGESIZE, blocks * self.block_bytes)
        self.memory = mmap.mmap(-1, self.size)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self.memory)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self.memory)
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for block in range(blocks):
            self.free.put_nowait(block * self.block_bytes)

    def release(self) -> None:
        """Unmap the memory (after the store has unregistered it)."""
        self.view.release()
        self._anchor = None
        self.memory.close()
