"""A CPU kvtierd never loads torch: not to start, not to copy pages on any of its paths.

Importing torch takes longer (1.3-1.7 s on the reference machine) than a restarted daemon is
allowed to take to be healthy again, so the CPU copy path is numpy and C only
(``kernels/page_copy.py``, ``kernels/host_views.py``; the arena and the mapped engine memory
are numpy arrays) and the CUDA back end, the only daemon code that needs torch, is imported
for CUDA sessions alone. A real daemon stores and loads pages through each CPU path (sealed
memory: numpy copies; an unsealed memfd: guarded copies, or ``pread``/``pwrite`` with
the ``guarded_copy`` kernel turned off), and then the shared objects mapped into it
(``/proc/<pid>/maps``) must include numpy's core (the check sees extension modules) and no
part of torch (an ``import torch`` anywhere maps ``libtorch``, whoever imported it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.client.connection.connection import Connection

from tests.engines import client_config, engine, fill_page, page_bytes, tokens
from tests.integration.test_region_memory import VLLM, Engine, random_bytes

pytestmark = pytest.mark.timeout(180)

WAIT_S = 30.0
TORCH_MARKERS = ("libtorch", "libc10", "/torch/")
"""Paths of shared objects that only an import of torch maps."""


def mapped_objects(pid: int) -> set[str]:
    """The files mapped into process ``pid`` (shared objects, the pool, memfds)."""
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            paths.add(fields[5])
    return paths


def torch_objects(paths: set[str]) -> list[str]:
    """The entries of ``paths`` that belong to torch."""
    return sorted(p for p in paths if any(m in p for m in TORCH_MARKERS))


def test_the_check_sees_torch_in_a_process_that_imported_it():
    """The control: a process that imported torch maps objects the test recognises."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; print('ok', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ok"
        assert torch_objects(mapped_objects(proc.pid))
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded-copies", "positional-io"])
def test_a_cpu_daemon_copies_pages_without_ever_loading_torch(daemon_factory, guarded):
    d = daemon_factory(*(() if guarded else ("--native-off", '["guarded_copy"]')))
    # sealed shared memory, kvtier's per-buffer layout: numpy strided copies and memmoves
    pool, conn = engine(d.runtime_dir)
    try:
        src = [1, 2, 3, 4, 9]  # a run of four (one strided copy per buffer) and a single page
        for p in src:
            fill_page(pool, p, seed=p)
        keys = conn.page_keys(tokens(len(src) * pool.geometry.page_size, salt=5))
        h = conn.store(keys, src)
        assert h.wait(WAIT_S) and h.ok
        dst = [20, 21, 22, 23, 30]
        h = conn.load(keys, dst)
        assert h.wait(WAIT_S) and h.ok
        for s, t in zip(src, dst, strict=True):
            assert page_bytes(pool, t) == page_bytes(pool, s), f"page {s} -> {t}"
    finally:
        conn.close()
        pool.close()
    # an unsealed memfd described by regions: guarded copies, or pread/pwrite without them
    a, b = Engine(VLLM, sealed=False), Engine(VLLM, sealed=False)
    ca = Connection(a.memory(), model_id="regions", config=client_config(d.runtime_dir))
    cb = Connection(b.memory(), model_id="regions", config=client_config(d.runtime_dir))
    try:
        a.write(random_bytes(a.size, 1))
        keys = ca.page_keys(tokens(2 * VLLM.page_size, salt=6))
        h = ca.store(keys, [4, 0])
        assert h.wait(WAIT_S) and h.ok
        h = cb.load(keys, [1, 2])
        assert h.wait(WAIT_S) and h.ok
        assert (b.page(1), b.page(2)) == (a.page(4), a.page(0))
    finally:
        ca.close()
        cb.close()
        a.close()
        b.close()
    assert d.proc is not None and d.proc.poll() is None
    paths = mapped_objects(d.pid)
    assert any("_multiarray_umath" in p for p in paths), "numpy's core is not seen mapped"
    assert torch_objects(paths) == [], "the CPU daemon loaded torch"
