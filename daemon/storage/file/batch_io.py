"""The ``file`` backend's batch I/O: pages between the arena and segment slots.

A put batch writes straight from the arena, run by run of adjacent slots: (1) the run's
old headers zeroed, if any slot held an object before (one call), (2) each payload, its
checksum computed right after the copy while the bytes are hot in cache, (3) the run's new
headers (one call). A get reads a run's headers in one call, then each payload straight into
its arena slot, checksummed while hot.

Crash safety: a header reaches the file only after its payload, and a reused slot loses its
old header before its payload is touched, so a killed process leaves each slot either
verifying or free.

These functions run in a worker thread on slots the calling batch owns; they touch no
shared bookkeeping, and report I/O faults as results, never as exceptions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvtier.daemon.storage.file.index import runs
from kvtier.daemon.storage.file.segments import HEADER_STRIDE, Slot, punch_hole
from kvtier.daemon.storage.objects import HEADER_SIZE, recorded_checksums, write_headers
from kvtier.kernels.file_io import read_pages, write_pages

__all__ = ["free_payloads", "read_runs", "wipe_headers", "write_runs"]

_ZERO_HEADER = bytes(HEADER_SIZE)


def write_runs(
    view: memoryview,
    ns: bytes,
    keys: Sequence[bytes],
    offsets: Sequence[int],
    length: int,
    plan: list[tuple[int, Slot]],
    durable: bool,
) -> dict[int, bool]:
    """Write the planned objects, run by run of adjacent slots.

    Args:
        view: the arena.
        ns, keys, offsets, length: the put batch.
        plan: (key index, slot) of each object to write; the batch owns these slots.
        durable: ``fdatasync`` the touched segments before reporting success.

    Returns:
        key index -> whether its object is on disk, for each planned key.
    """
    written = dict.fromkeys((i for i, _ in plan), False)
    for run in runs(plan):
        fd, first = run[0][1].seg.fd, run[0][1].hpos
        table = bytearray(len(run) * HEADER_STRIDE)
        try:
            if any(slot.dirty for _, slot in run):
                os.pwrite(fd, table, first)
            for _, slot in run:
                slot.dirty = False
            sums = write_pages(
                fd, view, [offsets[i] for i, _ in run], length, [slot.dpos for _, slot in run]
            )
            done = [
                (k, i, slot, checksum)
                for k, ((i, slot), checksum) in enumerate(zip(run, sums))
                if checksum is not None
            ]
            write_headers(
                table,
                [k * HEADER_STRIDE for k, _, _, _ in done],
                length,
                ns,
                [keys[i] for _, i, _, _ in done],
                [c for _, _, _, c in done],
            )
            for _, i, slot, _ in done:
                written[i] = slot.dirty = True
            if os.pwrite(fd, table, first) != len(table):
                raise OSError("short write")
        except OSError:
            written.update((i, False) for i, _ in run)
    if durable:
        for seg in {id(s.seg): s.seg for _, s in plan}.values():
            try:
                os.fdatasync(seg.fd)
            except OSError:
                written.update((i, False) for i, s in plan if s.seg is seg)
    return written


def read_runs(
    view: memoryview,
    ns: bytes,
    keys: Sequence[bytes],
    offsets: Sequence[int],
    length: int,
    plan: list[tuple[int, Slot]],
) -> tuple[list[bool], list[int], int]:
    """Read the planned objects into the arena and verify them, run by run.

    Args:
        view: the arena.
        ns, keys, offsets, length: the get batch.
        plan: (key index, slot) of each indexed object to read.

    Returns:
        ``(found, bad, errors)``: one flag per key of the batch (True: read and verified),
        the key indexes of planned objects that were read and did not verify, or whose
        payload the file no longer holds (damaged: the caller deletes them), and how many
        planned keys an I/O error kept from being read (such an object stays).
    """
    found = [False] * len(keys)
    bad: list[int] = []
    errors = 0
    for run in runs(plan):  # one header read per run
        fd, first = run[0][1].seg.fd, run[0][1].hpos
        try:
            table = memoryview(os.pread(fd, len(run) * HEADER_STRIDE, first))
        except OSError:
            errors += len(run)
            continue
        whole = run[: max(0, (len(table) - HEADER_SIZE) // HEADER_STRIDE + 1)]  # not cut short
        recorded = recorded_checksums(
            table,
            range(0, len(whole) * HEADER_STRIDE, HEADER_STRIDE),
            length,
            ns,
            [keys[i] for i, _ in whole],
        )
        # (key index, slot, payload checksum its header records)
        wanted = [
            (i, slot, expected)
            for (i, slot), expected in zip(whole, recorded)
            if expected is not None
        ]
        sums = read_pages(
            fd,
            view,
            [offsets[i] for i, _, _ in wanted],
            length,
            [slot.dpos for _, slot, _ in wanted],
        )
        unread: set[int] = set()
        size: int | None = None
        for (i, slot, expected), checksum in zip(wanted, sums):
            if checksum is None:  # a failed read: damage only where the file lost the
                if size is None:  # payload (cut short); an I/O error, or an arena that
                    size = _size(fd)  # cannot take the bytes (a full pool_dir), is a miss
                if size < slot.dpos + length:
                    continue
                unread.add(i)
            else:
                found[i] = checksum == expected
        errors += len(unread)
        bad.extend(i for i, _ in run if not found[i] and i not in unread)
    return found, bad, errors


def _size(fd: int) -> int:
    """The file's size; its largest possible one when it cannot be read (nothing it holds
    is then taken for cut short)."""
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 1 << 62


def wipe_headers(slots: list[Slot]) -> int:
    """Zero the slots' headers on disk, so their objects stay gone after a restart.

    Returns:
        How many headers could not be written (I/O errors).
    """
    errors = 0
    for slot in slots:
        try:
            os.pwrite(slot.seg.fd, _ZERO_HEADER, slot.hpos)
            slot.dirty = False
        except OSError:
            errors += 1
    return errors


def free_payloads(slots: list[Slot]) -> int:
    """Punch holes over the slots' payloads (a run of adjacent slots in one call), so
    deleted objects give their disk space back. Call it on detached slots only, before they
    are released.

    Returns:
        How many calls failed (I/O errors; a file system without hole punching is not one).
    """
    errors = 0
    for run in runs([(0, slot) for slot in slots]):
        first, seg = run[0][1], run[0][1].seg
        try:
            if not punch_hole(seg.fd, first.dpos, len(run) * seg.payload_slot):
                return errors  # not supported here: nothing more to try
        except OSError:
            errors += 1
    return errors
