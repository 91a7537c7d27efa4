"""A FAKE CUDA backend, for the daemon's CUDA session lifecycle on machines without a GPU.

This is not CUDA. It stands in for the one thing that cannot run here (a GPU) behind the
interfaces kvtier's GPU path uses (:class:`kvtier.ipc.cuda_backend.EngineCudaBackend` and
``DaemonCudaBackend``), so that the real kvtierd, the real ``Connection`` and everything around
the CUDA calls run unchanged:

- "device memory" is a file in the fake's directory, named in the fake IPC handle; both
  processes map it (numpy views), so the daemon's copies land in the engine's pages;
- an interprocess event is a small file too: ``[records, creator pid]`` (u64 each). Recording
  increments the counter (the event keeps its latest record); a stream wait on an event whose
  file is gone (destroyed) or whose creator is dead raises :class:`FakeCudaError` and writes a
  ``BAD`` line to the journal: on a GPU that is undefined behaviour (a hang in practice);
- copies are numpy copies done at once, in order, so every "stream" is always complete;
- faults are asked for by writing one word to the file ``fault`` in the fake's directory:
  ``copy_error`` (copies raise as they are enqueued), ``gpu_fault`` (waiting for the GPU reports
  an error: the copies' fate is unknown), ``hold`` (the copies of transfers enqueued meanwhile
  "run on the GPU" until the word changes: their layers are recorded, their end is not) or
  ``pause`` (each layer's copy waits, as it is enqueued, until the word changes);
- every operation that matters to the lifecycle is appended to ``journal``
  (``<pid> <thread> <op> <what>``), so a test can check the order of what the daemon did, and
  on which of its threads.

The daemon runs with it through :mod:`tests.fake_cuda_kvtierd`; the engine side passes a
:class:`FakeCuda` to ``CudaKVPool(..., backend=...)``.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvtier.ipc.cuda_ipc import CudaIpcError
from kvtier.ipc.protocol import MemorySegment

FAKE_UUID = "GPU-fa4ec0da-0000-4000-8000-000000000000"
"""The one fake GPU's UUID."""
HANDLE_BYTES = 64
_MEM, _EVT = b"FAKEMEM\x00", b"FAKEEVT\xff"  # 0x00 and 0xff inside every handle
_EVENT = struct.Struct("<QQ")


class FakeCudaError(RuntimeError):
    """What the fake raises where a GPU would fault or hang."""


def _handle(tag: bytes, path: Path) -> bytes:
    raw = os.fsencode(path)
    if len(tag) + len(raw) > HANDLE_BYTES:
        raise AssertionError(f"fake handle path too long: {path}")
    return (tag + raw).ljust(HANDLE_BYTES, b"\x00")


def _path(handle: bytes, tag: bytes) -> Path:
    if len(handle) != HANDLE_BYTES or not handle.startswith(tag):
        raise CudaIpcError(f"not a fake handle: {handle[:8]!r}")
    return Path(os.fsdecode(handle[len(tag) :].rstrip(b"\x00")))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


class _Event:
    """An opened or created fake event."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, _EVENT.size)
        finally:
            os.close(fd)

    @property
    def creator(self) -> int:
        return _EVENT.unpack_from(self.map)[1]

    @property
    def records(self) -> int:
        return _EVENT.unpack_from(self.map)[0]


class _Stream:
    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.alive = True


class FakeCuda:
    """The fake backend (engine and daemon sides); ``root``: the directory both processes share."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._ids = itertools.count(1)
        self._maps: dict[int, tuple[Path, mmap.mmap, np.ndarray]] = {}
        self._next_ptr = itertools.count(1)

    # ------------------------------------------------------------------ journal and faults
    def log(self, op: str, what: object = "") -> None:
        """Append ``<pid> <thread> <op> <what>`` to the journal."""
        thread = threading.current_thread().name.replace(" ", "_")
        with open(self.root / "journal", "a") as fh:
            fh.write(f"{os.getpid()} {thread} {op} {what}\n")

    def journal(self) -> list[tuple[int, str, str, str]]:
        """The journal's lines as ``(pid, op, what, thread)``."""
        path = self.root / "journal"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            pid, thread, op, what = (line.split(" ", 3) + [""])[:4]
            out.append((int(pid), op, what, thread))
        return out

    def set_fault(self, fault: str | None) -> None:
        """Ask for ``copy_error`` or ``gpu_fault`` from now on (None: no fault)."""
        path = self.root / "fault"
        if fault is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(fault)

    def _fault(self) -> str:
        try:
            return (self.root / "fault").read_text().strip()
        except FileNotFoundError:
            return ""

    # ------------------------------------------------------------------ both sides
    def unavailable_reason(self) -> str | None:
        """The fake is always available."""
        return None

    def ordinal_of(self, device: Any) -> int:
        """Every device is the one fake GPU, 0."""
        return 0

    def record(self, event: _Event, stream: Any) -> None:
        """Count one more record (refused on a destroyed event)."""
        if not event.path.exists():
            self.log("BAD", f"record on destroyed {event.path.name}")
            raise FakeCudaError(f"record on a destroyed event {event.path.name}")
        records, creator = _EVENT.unpack_from(event.map)
        _EVENT.pack_into(event.map, 0, records + 1, creator)

    def stream_wait(self, stream: Any, event: _Event) -> None:
        """Nothing to wait for (copies are done at once), but never on a dead event."""
        if not event.path.exists() or not _pid_alive(event.creator):
            self.log("BAD", f"stream wait on dead {event.path.name}")
            raise FakeCudaError(
                f"stream wait on event {event.path.name} of a dead daemon (on a GPU: a hang)"
            )
        self.log("stream_wait", event.path.name)

    # ------------------------------------------------------------------ engine side
    def allocate(self, nbytes: int, ordinal: int) -> tuple[torch.Tensor, Path]:
        """A file of ``nbytes`` zeros as fake device memory, as a flat uint8 tensor."""
        path = self.root / f"m{os.getpid()}-{next(self._ids)}"
        with open(path, "wb") as fh:
            fh.truncate(nbytes)
        arr = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
        return torch.from_numpy(np.asarray(arr)), path

    def export(self, flat: torch.Tensor, known: Path) -> tuple[MemorySegment, int]:
        """The fake IPC handle of the file."""
        seg = MemorySegment(
            name=f"fake-cuda:{known.name}",
            size=flat.numel(),
            handle=_handle(_MEM, known),
            device_uuid=FAKE_UUID,
        )
        return seg, 0

    def open_ipc_event(self, handle: bytes, ordinal: int) -> _Event:
        """Map an event file (CudaIpcError when it is gone)."""
        path = _path(handle, _EVT)
        try:
            return _Event(path)
        except FileNotFoundError as err:
            raise CudaIpcError(f"cannot open fake event {path.name}: {err}") from err

    def close_event(self, event: _Event) -> None:
        """Unmap an opened event."""
        self.log("close_event", event.path.name)

    def current_stream(self, ordinal: int) -> None:
        """The fake has no streams on the engine side."""
        return None

    def synchronize(self, ordinal: int) -> None:
        """Nothing queued on a fake GPU; journaled (the order of a close matters)."""
        self.log("synchronize", ordinal)

    # ------------------------------------------------------------------ daemon side
    def device_ordinal(self, uuid: str) -> int:
        """0 for the fake GPU; others are not visible."""
        if uuid != FAKE_UUID:
            raise CudaIpcError(f"GPU {uuid} is not visible to this daemon (it sees {FAKE_UUID})")
        return 0

    def use_device(self, ordinal: int) -> None:
        """One fake GPU: nothing to select."""

    def pin_host(self, arena: np.ndarray, ordinal: int) -> bool:
        """Nothing to pin; journaled."""
        self.log("pin_host", arena.nbytes)
        return True

    def unpin_host(self, arena: np.ndarray, ordinal: int) -> None:
        """Journaled."""
        self.log("unpin_host", arena.nbytes)

    def open_mem(self, handle: bytes, ordinal: int) -> int:
        """Map the file named in the handle; a fake address."""
        path = _path(handle, _MEM)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as err:
            raise CudaIpcError(f"fake cudaIpcOpenMemHandle: {err}") from err
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ptr = next(self._next_ptr) << 32
        self._maps[ptr] = (path, mm, np.frombuffer(mm, dtype=np.uint8))
        self.log("open_mem", path.name)
        return ptr

    def mapped_size(self, ptr: int) -> int | None:
        """The file's size."""
        return self._maps[ptr][2].size

    def close_mem(self, ptr: int, ordinal: int) -> None:
        """Forget the mapping (numpy views keep it alive until dropped)."""
        path, _, _ = self._maps.pop(ptr)
        self.log("close_mem", path.name)

    def device_bytes(self, ptr: int, nbytes: int, ordinal: int) -> np.ndarray:
        """The mapped bytes."""
        return self._maps[ptr][2][:nbytes]

    def host_arena(self, arena: np.ndarray) -> np.ndarray:
        """The pool as it is."""
        return arena

    def create_stream(self, ordinal: int) -> _Stream:
        """A fake stream, journaled."""
        s = _Stream(next(self._ids))
        self.log("create_stream", s.sid)
        return s

    def destroy_stream(self, stream: _Stream) -> None:
        """Journaled."""
        stream.alive = False
        self.log("destroy_stream", stream.sid)

    def create_ipc_event(self, ordinal: int) -> tuple[_Event, bytes]:
        """A new event file ``[0 records, this pid]``."""
        path = self.root / f"e{os.getpid()}-{next(self._ids)}"
        path.write_bytes(_EVENT.pack(0, os.getpid()))
        return _Event(path), _handle(_EVT, path)

    def destroy_event(self, event: _Event) -> None:
        """Remove the event's file (a later wait on it is refused)."""
        event.path.unlink(missing_ok=True)
        self.log("destroy_event", event.path.name)

    def marker(self, stream: _Stream) -> str:
        """What a wait for the GPU will report (the fault asked for now)."""
        return self._fault()

    def query(self, event: str) -> bool:
        """Complete, unless a GPU fault was asked for, or a hold still is."""
        if event == "gpu_fault":
            raise FakeCudaError("fake GPU fault while waiting for the copies")
        if event == "hold" and self._fault() == "hold":
            time.sleep(0.01)  # the caller polls: keep that cheap
            return False
        return True

    def copy_plan(
        self,
        page_ids: np.ndarray,
        offsets: np.ndarray,
        chunk_bytes: int,
        slot_bytes: int,
        ordinal: int,
        stream: _Stream,
        mode: str = "dma",
    ) -> _Plan:
        """Numpy copies of whole chunks (``mode`` is journaled: the copies are the same)."""
        if not stream.alive:
            raise FakeCudaError("copy on a destroyed stream")
        self.log("copy_plan", mode)
        return _Plan(self, np.asarray(page_ids), np.asarray(offsets), chunk_bytes)


class _Plan:
    def __init__(self, fake: FakeCuda, pages: np.ndarray, offsets: np.ndarray, chunk: int) -> None:
        self.fake, self.pages, self.chunk = fake, pages.astype(np.int64), chunk
        self.offsets = offsets.astype(np.int64)

    def _index(self, layer: int, comp: int, n_comp: int) -> np.ndarray:
        base = self.offsets + (layer * n_comp + comp) * self.chunk
        return base[:, None] + np.arange(self.chunk, dtype=np.int64)[None, :]

    def _check(self) -> None:
        fault = self.fake._fault()
        if fault == "copy_error":
            raise FakeCudaError("fake copy error")
        while fault == "pause":
            time.sleep(0.01)
            fault = self.fake._fault()

    def layer_to_host(
        self, arena: np.ndarray, row: Sequence[np.ndarray], layer: int, *, stream: Any
    ) -> None:
        self._check()
        for c, buf in enumerate(row):
            arena[self._index(layer, c, len(row))] = buf[self.pages]

    def layer_from_host(
        self, arena: np.ndarray, row: Sequence[np.ndarray], layer: int, *, stream: Any
    ) -> None:
        self._check()
        for c, buf in enumerate(row):
            buf[self.pages] = arena[self._index(layer, c, len(row))]
