"""CPU page copies on numpy memory (kernels/host_views.py, kernels/page_copy.py), no torch.

The daemon's arena and the engine memory it maps are numpy arrays; torch tensors from callers
that hold them are still taken. Copies through numpy arrays must put the same bytes where
copies through tensors over the same memory put them; a read-only destination is refused
before a byte moves; and the CPU copy path imports no torch (a fresh interpreter shows it).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from kvtier.kernels.host_views import ArenaView, EngineView
from kvtier.kernels.page_copy import (
    CopyPlan,
    PageCopyError,
    copy_layers_from_host,
    copy_layers_to_host,
)

LAYERS, COMPONENTS, PAGES, CHUNK = 3, 2, 10, 40
SLOT = LAYERS * COMPONENTS * CHUNK
# a run of four (one strided copy per buffer) and two single pages, given shuffled
PAGE_IDS = np.array([6, 1, 2, 3, 4, 9], dtype=np.int64)
SLOT_OFFSETS = np.array([7, 1, 2, 3, 4, 0], dtype=np.int64) * SLOT + 3


def buffers(seed: int) -> list[list[np.ndarray]]:
    """``[layer][component]`` float16 buffers ``[PAGES, CHUNK / 2]`` of random bytes."""
    rng = np.random.default_rng(seed)
    return [
        [
            rng.integers(0, 256, PAGES * CHUNK, dtype=np.uint8)
            .view(np.float16)
            .reshape(PAGES, CHUNK // 2)
            for _ in range(COMPONENTS)
        ]
        for _ in range(LAYERS)
    ]


def arena() -> np.ndarray:
    return np.zeros(8 * SLOT + 3, dtype=np.uint8)


def test_numpy_and_torch_buffers_put_the_same_bytes_in_the_same_places():
    bufs = buffers(1)
    a, t = arena(), torch.zeros(arena().size, dtype=torch.uint8)
    copy_layers_to_host(a, SLOT_OFFSETS, bufs, PAGE_IDS)
    copy_layers_to_host(
        t, SLOT_OFFSETS, [[torch.from_numpy(b) for b in row] for row in bufs], PAGE_IDS
    )
    assert a.any() and bytes(a) == bytes(t.numpy())
    for i, (page, off) in enumerate(zip(PAGE_IDS.tolist(), SLOT_OFFSETS.tolist(), strict=True)):
        for layer in range(LAYERS):
            for c in range(COMPONENTS):
                at = off + (layer * COMPONENTS + c) * CHUNK
                assert bytes(a[at : at + CHUNK]) == bufs[layer][c][page].tobytes(), (i, layer, c)
    back = [[np.zeros_like(b) for b in row] for row in bufs]
    copy_layers_from_host(a, SLOT_OFFSETS, back, PAGE_IDS)
    untouched = sorted(set(range(PAGES)) - set(PAGE_IDS.tolist()))
    for row, src in zip(back, bufs, strict=True):
        for b, s in zip(row, src, strict=True):
            assert np.array_equal(b[PAGE_IDS].view(np.uint16), s[PAGE_IDS].view(np.uint16))
            assert not b[untouched].view(np.uint16).any()


def test_strided_rows_of_a_mapping_are_copied_as_rows():
    """Engine memory laid out with gaps between pages: a 2-D uint8 view, rows apart."""
    raw = np.arange(PAGES * (CHUNK + 24), dtype=np.uint64).astype(np.uint8)
    rows = np.ndarray((PAGES, CHUNK), dtype=np.uint8, buffer=raw, strides=(CHUNK + 24, 1))
    view = EngineView.of(rows, "rows")
    assert (view.num_pages, view.row_bytes, view.page_stride) == (PAGES, CHUNK, CHUNK + 24)
    a = arena()
    plan = CopyPlan.build(PAGE_IDS, SLOT_OFFSETS, CHUNK, slot_bytes=SLOT)
    plan.to_host(a, rows, CHUNK)
    for page, off in zip(PAGE_IDS.tolist(), SLOT_OFFSETS.tolist(), strict=True):
        assert bytes(a[off + CHUNK : off + 2 * CHUNK]) == rows[page].tobytes()


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_read_only_destination_is_refused_before_a_byte_moves(direction):
    bufs, a = buffers(2), arena()
    if direction == "store":
        a.flags.writeable = False
        dest, fn, match = a, copy_layers_to_host, "arena is read-only"
    else:
        a[:] = 7
        bufs[2][1].flags.writeable = False
        dest, fn, match = bufs[0][0], copy_layers_from_host, r"engine_bufs\[2\]\[1\] is read-only"
    before = dest.copy()
    with pytest.raises(PageCopyError, match=match):
        fn(a, SLOT_OFFSETS, bufs, PAGE_IDS)
    assert np.array_equal(dest.view(np.uint8), before.view(np.uint8))  # not even layer 0


def test_bad_arenas_and_buffers_are_named():
    with pytest.raises(PageCopyError, match=r"arena must be a numpy array or a torch.Tensor"):
        ArenaView.of(bytearray(16))
    with pytest.raises(PageCopyError, match="arena must be a 1-D contiguous uint8"):
        ArenaView.of(np.zeros(16, dtype=np.int8))
    with pytest.raises(PageCopyError, match="arena must be a 1-D contiguous uint8"):
        ArenaView.of(np.zeros(32, dtype=np.uint8)[::2])
    with pytest.raises(PageCopyError, match="buf must be contiguous"):
        EngineView.of(np.zeros((4, 8), dtype=np.float32).T, "buf")
    with pytest.raises(PageCopyError, match="buf must be contiguous"):
        EngineView.of(np.zeros((4, 8), dtype=object), "buf")
    with pytest.raises(PageCopyError, match=r"buf must be a numpy array or a torch.Tensor"):
        EngineView.of([[0] * 8] * 4, "buf")


def test_the_cpu_copy_path_and_the_daemon_service_import_no_torch():
    code = (
        "import sys\n"
        "import kvtier.kernels, kvtier.kernels.page_copy, kvtier.daemon.transfer.transfer\n"
        "import kvtier.daemon.service.server, kvtier.daemon.service.boot\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
