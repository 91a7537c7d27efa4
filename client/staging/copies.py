"""The engine's copies between its KV cache and a :class:`~kvtier.client.staging.area.StagingArea`.

Plain torch mechanisms only, so the same code runs on CPU tensors (synchronous copies) and
on CUDA tensors:

- on CUDA, every copy is issued on one dedicated ``torch.cuda.Stream``. Where consecutive
  staging slots hold consecutive blocks, a run is one ``copy_(non_blocking=True)`` between
  the page-locked staging area and the blocks themselves: DMA and no kernel where those
  blocks lie contiguous in memory (a part whose blocks are strided, such as vLLM's
  blocks-first K and V, goes through torch's strided copy, a kernel). Otherwise
  (``direct=False``, or blocks so scattered that direct copies would more than double the
  number of copies) host → device copies a run of slots into a device buffer and scatters
  it into the engine's blocks with ``index_copy_``; device → host gathers the blocks with
  ``index_select`` and copies them to staging the same way. Each copy ends with an event
  recorded on that stream: the compute stream waits for it
  (:meth:`CopyDone.wait_on_compute`, no CPU sync) or the CPU does
  (:meth:`CopyDone.synchronize`). Direct copies matter beside other processes' work on the
  GPU: a kernel of this engine's (``index_copy_``) runs only in its time slices, the copy
  engines do not wait for them. A block outside the engine's tensors is an ``IndexError``;
  A copy that raises after issuing some of its parts waits for those before the exception
  reaches the caller, who then reuses the slots and recomputes the blocks;
- on the CPU, the same calls copy at once and :class:`CopyDone` has nothing to wait for.

A copy from the engine's blocks must start after the compute that wrote them:
:meth:`StagedCopier.compute_marker` records an event on the compute stream (on the engine's
thread) and :meth:`StagedCopier.to_host` makes the copy stream wait for it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
from kvtier.client.staging.area import StagingArea, slot_runs

log = logging.getLogger("kvtier.staged")

__all__ = ["CopyDone", "StagedCopier"]

_Run = tuple[int, int, int | torch.Tensor]
"""(first staging slot, count, the first of count consecutive blocks or their indices)."""


def _consecutive(blocks: Sequence[int], start: int, end: int) -> list[tuple[int, int]]:
    """``[i, j)`` index ranges of ``blocks[start:end]`` whose block numbers follow one another."""
    out: list[tuple[int, int]] = []
    i = start
    for j in range(start + 1, end + 1):
        if j == end or blocks[j] != blocks[j - 1] + 1:
            out.append((i, j))
            i = j
    return out


class CopyDone:
    """Copies issued on the copy stream, up to an event (CPU copies: already done).

    Attributes:
        event: the event recorded after the copies (None on the CPU).
    """

    __slots__ = ("_device", "_keep", "event")

    def __init__(
        self,
        event: torch.cuda.Event | None,
        keep: list[torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        self.event = event
        self._keep = keep  # device buffers the copies still read or write
        self._device = device

    def wait_on_compute(self) -> None:
        """Make the current (compute) stream wait for the copies (no CPU sync)."""
        if self.event is not None:
            torch.cuda.current_stream(self._device).wait_event(self.event)

    def synchronize(self) -> None:
        """Block the calling thread until the copies are done; drop their buffers."""
        if self.event is not None:
            self.event.synchronize()
        self._keep = []


class StagedCopier:
    """Copies pages between an engine's KV tensors and a staging area.

    Args:
        area: the staging area (its ``parts`` in the order of ``device_parts``).
        device_parts: per part, the engine's tensor ``[num_blocks, *part.shape]`` (any
            strides; all on one device).
        direct: copy runs of consecutive slots holding consecutive blocks directly (the
            module docstring); False always gathers and scatters through a device buffer.

    Raises:
        ValueError: the tensors do not match the area's parts, or lie on several devices.
    """

    def __init__(
        self, area: StagingArea, device_parts: Sequence[torch.Tensor], direct: bool = True
    ) -> None:
        if len(device_parts) != len(area.parts):
            raise ValueError(
                f"{len(device_parts)} engine tensors for {len(area.parts)} staging parts"
            )
        devices = {t.device for t in device_parts}
        if len(devices) != 1:
            raise ValueError(f"engine tensors on several devices: {sorted(map(str, devices))}")
        for i, (t, p) in enumerate(zip(device_parts, area.parts)):
            if tuple(t.shape[1:]) != p.shape or t.dtype != p.dtype:
                raise ValueError(
                    f"engine tensor {i}: pages of shape {tuple(t.shape[1:])} "
                    f"{t.dtype}, the staging part holds {p.shape} {p.dtype}"
                )
        self.area = area
        self.direct = direct
        self.parts = list(device_parts)
        self._num_blocks = min(t.shape[0] for t in self.parts)
        self.device: torch.device = devices.pop()
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._by_layer: dict[int, list[int]] = {}
        for i, p in enumerate(area.parts):
            self._by_layer.setdefault(p.layer, []).append(i)

    @property
    def layers(self) -> list[int]:
        """The layers the parts hold, in order."""
        return sorted(self._by_layer)

    def parts_of(self, layer: int) -> list[int]:
        """Indices of the parts holding ``layer``."""
        return self._by_layer.get(layer, [])

    def compute_marker(self) -> torch.cuda.Event | None:
        """An event recorded now on the compute stream (None on the CPU): pass it to
        :meth:`to_host` so the copy reads blocks the forward pass has written."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def to_device(
        self,
        parts: Sequence[int],
        slots: Sequence[int],
        blocks: Sequence[int],
        after: torch.cuda.Event | None = None,
    ) -> CopyDone:
        """Copy staging ``slots`` into the engine's ``blocks`` (same order) for ``parts``.

        Args:
            after: an event from :meth:`compute_marker`: the copy starts after it (so it
                never overwrites blocks that earlier kernels still read).
        """
        assert len(slots) == len(blocks)
        keep: list[torch.Tensor] = []
        if not self.cuda:
            runs = self._runs(slots, blocks)
            for i in parts:
                self._h2d(i, runs, keep)
            return CopyDone(None, keep)
        assert self.stream is not None
        with torch.cuda.stream(self.stream), self._drained_on_error():
            runs = self._runs(slots, blocks)
            if after is not None:
                self.stream.wait_event(after)
            for i in parts:
                self._h2d(i, runs, keep)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return CopyDone(ev, keep, self.device)

    def _h2d(self, part: int, runs: list[_Run], keep: list[torch.Tensor]) -> None:
        stage, dev = self.area.views[part], self.parts[part]
        for s0, n, idx in runs:
            src = stage[s0 : s0 + n]
            if isinstance(idx, int):  # consecutive blocks from idx on
                dev[idx : idx + n].copy_(src, non_blocking=self.cuda)
                continue
            if self.cuda:
                src = src.to(self.device, non_blocking=True)
                keep += (src, idx)
            dev.index_copy_(0, idx, src)

    def to_host(
        self, slots: Sequence[int], blocks: Sequence[int], after: torch.cuda.Event | None = None
    ) -> CopyDone:
        """Copy the engine's ``blocks`` (every part) into staging ``slots`` (same order).

        Args:
            after: an event from :meth:`compute_marker`: the copy starts after it.
        """
        assert len(slots) == len(blocks)
        keep: list[torch.Tensor] = []
        if not self.cuda:
            runs = self._runs(slots, blocks)
            for i in range(len(self.parts)):
                self._d2h(i, runs, keep)
            return CopyDone(None, keep)
        assert self.stream is not None
        with torch.cuda.stream(self.stream), self._drained_on_error():
            # the block indices go to the device before the wait: a copy from pageable
            # memory would block this thread until the forward pass ended
            runs = self._runs(slots, blocks)
            if after is not None:
                self.stream.wait_event(after)
            for i in range(len(self.parts)):
                self._d2h(i, runs, keep)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return CopyDone(ev, keep, self.device)

    @contextlib.contextmanager
    def _drained_on_error(self) -> Iterator[None]:
        """Copies that raise after issuing some parts: wait for the parts issued before the
        exception goes on. The caller then reuses the staging slots and recomputes the
        blocks, which no copy still in flight may read or write."""
        try:
            yield
        except BaseException:
            assert self.stream is not None
            try:
                self.stream.synchronize()
            except Exception:  # a sticky CUDA error: the context is lost, nothing runs
                log.exception("staged copy: the copy stream could not be drained")
            raise

    def _runs(self, slots: Sequence[int], blocks: Sequence[int]) -> list[_Run]:
        """Per run of consecutive slots, ``(first slot, count, blocks)``: the blocks as the
        first of ``count`` consecutive ones (an int; runs split where blocks are not
        consecutive), or as indices on the device (see the module docstring)."""
        if len(blocks) and not 0 <= min(blocks) <= max(blocks) < self._num_blocks:
            bad = next(b for b in blocks if not 0 <= b < self._num_blocks)
            raise IndexError(f"block {bad} is outside the engine's {self._num_blocks} blocks")
        runs = slot_runs(slots)
        if self.direct:
            direct = [
                (s0 + i - at, j - i, int(blocks[i]))
                for s0, n, at in runs
                for i, j in _consecutive(blocks, at, at + n)
            ]
            if len(direct) <= 2 * len(runs):
                return list(direct)
        return [
            (s0, n, torch.tensor(blocks[at : at + n], dtype=torch.long, device=self.device))
            for s0, n, at in runs
        ]

    def _d2h(self, part: int, runs: list[_Run], keep: list[torch.Tensor]) -> None:
        stage, dev = self.area.views[part], self.parts[part]
        for s0, n, idx in runs:
            if isinstance(idx, int):  # consecutive blocks from idx on
                stage[s0 : s0 + n].copy_(dev[idx : idx + n], non_blocking=self.cuda)
                continue
            if self.cuda:
                tmp = dev.index_select(0, idx)
                stage[s0 : s0 + n].copy_(tmp, non_blocking=True)
                keep += (tmp, idx)
            else:
                torch.index_select(dev, 0, idx, out=stage[s0 : s0 + n])
