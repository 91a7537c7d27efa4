"""Test helpers: a host-pool arena over anonymous memory, and pages to fill it with."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
from collections.abc import Iterator

import pytest
from kvtier.daemon.storage.base import HostArena

NS = hashlib.sha256(b"namespace").digest()
OTHER_NS = hashlib.sha256(b"other namespace").digest()
PAGE = 64 * 1024
SLOTS = 64


def key(i: int) -> bytes:
    """The ``i``-th test page key."""
    return hashlib.sha256(b"page %d" % i).digest()


def make_arena() -> tuple[HostArena, mmap.mmap]:
    """An arena of ``SLOTS`` pages of ``PAGE`` bytes, and the mapping behind it."""
    memory = mmap.mmap(-1, SLOTS * PAGE)
    anchor = ctypes.c_char.from_buffer(memory)
    address = ctypes.addressof(anchor)
    del anchor  # a live ctypes export would keep the mmap from closing
    return HostArena(view=memoryview(memory), address=address, size=len(memory)), memory


@pytest.fixture
def arena() -> Iterator[HostArena]:
    """A fresh arena, released after the test."""
    arena, memory = make_arena()
    yield arena
    arena.view.release()
    memory.close()


def fill(arena: HostArena, slot: int) -> bytes:
    """Write random bytes into ``slot`` and return them."""
    data = os.urandom(PAGE)
    arena.view[slot * PAGE : (slot + 1) * PAGE] = data
    return data


def page(arena: HostArena, slot: int) -> bytes:
    """The bytes of ``slot``."""
    return bytes(arena.view[slot * PAGE : (slot + 1) * PAGE])


def offsets(slots: range | list[int]) -> list[int]:
    """Arena offsets of ``slots``."""
    return [s * PAGE for s in slots]
