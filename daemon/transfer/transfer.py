"""Page transfers between an engine's KV memory and the host pool, run off the event loop.

A transfer copies the same set of pages for every layer, layer by layer, and announces
each finished layer in the session's completion block, so the engine's forward pass can
start layer ``i`` as soon as its pages are in place. The copies themselves are the
kernels in :mod:`kvtier.kernels` (the CPU reference here; a CUDA executor on a GPU), and
they release the GIL, so worker threads copy while the event loop keeps answering.

State machine: PENDING → RUNNING → (DONE | FAILED | CANCELLED). Cancellation is checked
between layers; the event loop commits a store's pages (DONE) or frees them (anything
else), and drops a load's pins whatever the outcome.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from kvtier.daemon.pool.layout import page_checksums
from kvtier.ipc.completion import CompletionBlock, TransferStatus
from kvtier.kernels.page_copy import CopyPlan

log = logging.getLogger("kvtier.daemon.transfer.transfer")


class Direction(enum.Enum):
    """Which way the bytes go."""

    STORE = "store"  # engine → host
    LOAD = "load"  # host → engine


@dataclass(slots=True, eq=False)
class Transfer:
    """One STORE or LOAD in flight.

    Attributes:
        direction: STORE or LOAD.
        session_id / slot / seq: where completion is signalled.
        host_slots: host-pool slot ids (pinned for a load, WRITING for a store).
        page_ids: engine page ids, same order.
        offsets: byte offsets of the host slots in the arena.
        nbytes: bytes moved (pages x page bytes).
        cancelled: set by the event loop; the worker stops before the next layer.
        status: the outcome, set by the worker.
        started: monotonic start time (load latency).
        keys: the page keys of ``host_slots``, same order (write-through after a store,
            prefetched-page accounting after a load).
        checksums: a finished store's page checksums (the pool records them, so a restart
            can verify the pages it adopts); None otherwise.
    """

    direction: Direction
    session_id: int
    slot: int
    seq: int
    host_slots: list[int]
    page_ids: np.ndarray
    offsets: np.ndarray
    nbytes: int
    cancelled: bool = False
    status: TransferStatus = TransferStatus.RUNNING
    started: float = 0.0
    keys: list[bytes] = field(default_factory=list)
    checksum: bool = False  # a store records its pages' checksums (verify_on_adopt)
    checksums: list[int] | None = None
    extra: dict[str, object] = field(default_factory=dict)


def run_transfer(t: Transfer, arena: torch.Tensor, buffers: list[list[torch.Tensor]],
                 chunk_bytes: int, block: CompletionBlock) -> TransferStatus:
    """Copy every layer of ``t`` and signal each one; runs in a worker thread.

    Args:
        t: the transfer (its slot was begun by the event loop before the reply went out).
        arena: the host pool as a flat uint8 tensor.
        buffers: the engine's buffers, ``[layer][component]`` of ``[num_pages, chunk_bytes]``.
        chunk_bytes: bytes of one page of one buffer.
        block: the session's completion block.

    Returns:
        The final status. The event loop writes it to the block once the pages are
        committed (a store) or unpinned (a load), so DONE means "visible in L2".
    """
    status = TransferStatus.DONE
    try:
        n_comp = len(buffers[0]) if buffers else 0
        plan = CopyPlan.build(t.page_ids, t.offsets, chunk_bytes,
                              slot_bytes=len(buffers) * n_comp * chunk_bytes)
        for layer, row in enumerate(buffers):
            if t.cancelled:
                status = TransferStatus.CANCELLED
                break
            for comp, buf in enumerate(row):
                chunk_offset = (layer * n_comp + comp) * chunk_bytes
                if t.direction is Direction.STORE:
                    plan.to_host(arena, buf, chunk_offset)
                else:
                    plan.from_host(arena, buf, chunk_offset)
            block.layer_done(t.slot, layer + 1)
        if status is TransferStatus.DONE and t.checksum and t.host_slots:
            # checksummed here, in the copy thread, while the bytes are hot in cache
            t.checksums = page_checksums(arena.numpy(), t.offsets.tolist(),
                                         t.nbytes // len(t.host_slots))
    except Exception:  # a bug or a vanished mapping: the transfer fails, the daemon stays up
        log.exception("transfer session=%d slot=%d failed", t.session_id, t.slot)
        status = TransferStatus.FAILED
    t.status = status
    return status
