"""What a Mooncake worker thread runs: one put or get of a (sub-)batch.

A job seals (put) or checks (get) all its headers in one call of
:func:`~kvtier.daemon.storage.objects.seal_headers` /
:func:`~kvtier.daemon.storage.objects.check_headers`, which hash with the GIL released, so
hashing in one worker does not stall the event loop or the other workers. Each page's
header goes into its slot's headroom (one buffer per object) or, failing that, into the
job's scratch block (two buffers); see the package docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.mooncake.scratch import Scratch
from kvtier.daemon.storage.objects import HEADER_SIZE, check_headers, seal_headers

__all__ = ["Jobs", "one_buffer"]


def one_buffer(arena: HostArena, offsets: Sequence[int]) -> bool:
    """Whether a batch's headers can go in its slots' headroom: the arena has room for one
    and no slot appears twice (two headers in one headroom would overwrite each other)."""
    return arena.headroom >= HEADER_SIZE and len(set(offsets)) == len(offsets)


@dataclass(frozen=True, slots=True)
class Jobs:
    """The jobs of one open backend; they keep what they use alive until the pool is done.

    Attributes:
        store: the ``MooncakeDistributedStore``.
        arena: the registered arena.
        scratch: the registered header scratch memory.
    """

    store: Any
    arena: HostArena
    scratch: Scratch

    def put(
        self,
        names: list[str],
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
        block: int,
    ) -> list[tuple[int, bool]]:
        """Hash each slot into its header, then one put: of one buffer per page (header in
        the slot's headroom) or of two (header in scratch ``block``).

        Returns:
            ``(code, stored)`` per key: Mooncake's return code and whether it is 0.
        """
        arena = self.arena
        in_place, hview, hbase, hpos = self._header_room(offsets, block)
        seal_headers(hview, hpos, arena.view, offsets, length, ns, keys)
        if in_place:
            codes = self.store.batch_put_from(
                names, [hbase + at for at in hpos], [HEADER_SIZE + length] * len(hpos)
            )
        else:
            codes = self.store.batch_put_from_multi_buffers(
                names,
                [[hbase + at, arena.address + off] for at, off in zip(hpos, offsets)],
                [[HEADER_SIZE, length]] * len(hpos),
            )
        return [(int(code), code == 0) for code in codes]

    def get(
        self,
        names: list[str],
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
        block: int,
    ) -> list[tuple[int, bool]]:
        """One get of each object into its slot (header into the slot's headroom) or into
        a scratch header and the slot; then verify each.

        Returns:
            ``(code, verified)`` per key: Mooncake's return code (bytes read, or negative)
            and whether the object landed whole and verified.
        """
        arena = self.arena
        whole = HEADER_SIZE + length
        in_place, hview, hbase, hpos = self._header_room(offsets, block)
        if in_place:
            codes = self.store.batch_get_into(
                names, [hbase + at for at in hpos], [whole] * len(hpos)
            )
        else:
            codes = self.store.batch_get_into_multi_buffers(
                names,
                [[hbase + at, arena.address + off] for at, off in zip(hpos, offsets)],
                [[HEADER_SIZE, length]] * len(hpos),
            )
        landed = [i for i, code in enumerate(codes) if code == whole]
        verified = check_headers(
            hview,
            [hpos[i] for i in landed],
            arena.view,
            [offsets[i] for i in landed],
            length,
            ns,
            [keys[i] for i in landed],
        )
        ok = [False] * len(codes)
        for i, good in zip(landed, verified):
            ok[i] = good
        return [(int(code), flag) for code, flag in zip(codes, ok)]

    def _header_room(
        self, offsets: Sequence[int], block: int
    ) -> tuple[bool, memoryview, int, list[int]]:
        """Where a batch's headers go: ``(in_place, view, base address, positions)``, in
        the slots' headroom right before each payload when :func:`one_buffer` allows,
        else in the scratch ``block``, one after another."""
        arena, scratch = self.arena, self.scratch
        if one_buffer(arena, offsets):
            return True, arena.view, arena.address, [off - HEADER_SIZE for off in offsets]
        positions = [block + i * HEADER_SIZE for i in range(len(offsets))]
        return False, scratch.view, scratch.address, positions
