"""Map an engine's exported KV memory into the daemon (shared-memory tensors on a CPU).

Only files that look like kvtier engine segments are opened: regular files (no symlinks)
under the shared-memory directory whose names start with ``kvtier-``, of exactly the size
the export declares. So a client cannot make the daemon write into an arbitrary file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from kvtier.config.errors import KvtierError
from kvtier.ipc.protocol import Geometry, KVMemory
from kvtier.ipc.shm import SharedMemoryError, SharedMemorySegment

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "kvtier-engine-"
MAX_PAGES = 1 << 26


class EngineMemoryError(KvtierError):
    """The exported memory does not match the geometry or cannot be opened."""


class EngineMemory:
    """An engine's KV pool as the daemon sees it: one uint8 ``[num_pages, chunk_bytes]``
    tensor per (layer, component), indexed ``buffers[layer][component]``."""

    __slots__ = ("buffers", "geometry", "num_pages", "paths", "segments")

    def __init__(self, geometry: Geometry, memory: KVMemory, shm_dir: Path = SHM_DIR) -> None:
        self.geometry = geometry
        self.num_pages = memory.num_pages
        self.segments: list[SharedMemorySegment] = []
        self.buffers: list[list[torch.Tensor]] = []
        self.paths = [seg.name for seg in memory.segments]
        try:
            self._map(memory, shm_dir)
        except BaseException:
            self.close()
            raise

    def _map(self, memory: KVMemory, shm_dir: Path) -> None:
        g = self.geometry
        if memory.kind != "shm":
            raise EngineMemoryError(
                f"memory.kind = {memory.kind!r}: this daemon maps 'shm' exports (CUDA IPC needs a GPU build)"
            )
        if not 1 <= memory.num_pages <= MAX_PAGES:
            raise EngineMemoryError(f"memory.num_pages = {memory.num_pages!r} is out of range")
        n_buf = g.num_layers * g.components
        if len(memory.buffer_offsets) != n_buf or len(memory.buffer_segments) != n_buf:
            raise EngineMemoryError(
                f"memory declares {len(memory.buffer_offsets)} buffers; geometry needs "
                f"{n_buf} ({g.num_layers} layers x {g.components} components)"
            )
        if not 1 <= len(memory.segments) <= n_buf:
            raise EngineMemoryError(f"memory.segments has {len(memory.segments)} entries")
        for seg in memory.segments:
            path = Path(seg.name)
            if (path.parent != shm_dir or not path.name.startswith(SEGMENT_PREFIX)
                    or os.path.islink(path)):
                raise EngineMemoryError(
                    f"memory segment {seg.name!r} is not a kvtier segment under {str(shm_dir)!r}"
                )
            try:
                self.segments.append(SharedMemorySegment.open(path, seg.size, writable=True))
            except SharedMemoryError as err:
                raise EngineMemoryError(str(err)) from err
        buf_bytes = memory.num_pages * g.chunk_bytes
        for layer in range(g.num_layers):
            row = []
            for comp in range(g.components):
                i = layer * g.components + comp
                s_idx, off = memory.buffer_segments[i], memory.buffer_offsets[i]
                if not 0 <= s_idx < len(self.segments):
                    raise EngineMemoryError(f"memory.buffer_segments[{i}] = {s_idx!r} is out of range")
                seg = self.segments[s_idx]
                if off < 0 or off + buf_bytes > seg.size:
                    raise EngineMemoryError(
                        f"memory.buffer_offsets[{i}] = {off!r}: {buf_bytes} bytes do not fit in "
                        f"segment {seg.path!r} of {seg.size} bytes"
                    )
                row.append(seg.tensor(off, buf_bytes).view(memory.num_pages, g.chunk_bytes))
            self.buffers.append(row)

    def close(self) -> None:
        """Drop the tensors and unmap every segment (the engine owns and removes the files)."""
        self.buffers = []
        for seg in self.segments:
            seg.close(unlink=False)
        self.segments = []

    def unlink_segments(self) -> None:
        """Remove the engine's segment files (used when the engine process is gone)."""
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
