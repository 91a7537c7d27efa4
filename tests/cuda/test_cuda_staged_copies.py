"""The engine copy mode's copies on a GPU when one of them raises part-way.

A copy between the engine's blocks and the staging area issues one copy per part on the
copier's stream. When issuing raises after some parts (out of memory, a CUDA error), the
caller treats the load as a miss or the store as dropped: it reuses the staging slots and
recomputes the blocks at once, so no copy issued before the exception may still be running.

Marked ``cuda``: skipped without an NVIDIA GPU (torch's), with the reason; ``make gpu-check``
runs it. The CPU path copies synchronously and has nothing in flight.
"""

from __future__ import annotations

import pytest
import torch
from kvtier.client.staging.area import StagingArea, StagingPart
from kvtier.client.staging.copies import StagedCopier

REASON = None if torch.cuda.is_available() else "torch reports no CUDA device"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.timeout(120),
]

PAGE = (64, 8, 128)  # 128 KiB of bfloat16 per page and part
SLOTS = 256  # 32 MiB per part: a copy long enough to be in flight when the next part raises


class Boom(RuntimeError):
    """The failure injected after the first part was issued."""


@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_a_copy_that_raises_part_way_leaves_nothing_running(direction: str) -> None:
    parts = [StagingPart(layer, PAGE, torch.bfloat16) for layer in range(2)]
    area = StagingArea(parts, capacity=SLOTS, pin=True)
    try:
        dev = [torch.zeros((SLOTS, *PAGE), dtype=torch.bfloat16, device="cuda") for _ in parts]
        copier = StagedCopier(area, dev)
        assert copier.cuda and copier.stream is not None
        issue = copier._h2d if direction == "to_device" else copier._d2h
        calls = []

        def first_then_boom(part, runs, keep):
            calls.append(part)
            if len(calls) > 1:
                raise Boom("injected after one part was issued")
            issue(part, runs, keep)

        setattr(copier, "_h2d" if direction == "to_device" else "_d2h", first_then_boom)
        slots = blocks = list(range(SLOTS))
        with pytest.raises(Boom):
            if direction == "to_device":
                copier.to_device([0, 1], slots, blocks)
            else:
                copier.to_host(slots, blocks)
        assert calls == [0, 1]
        # the first part's copy ended before the exception reached the caller
        assert copier.stream.query(), "a copy issued before the exception is still running"
    finally:
        torch.cuda.synchronize()
        area.close()
