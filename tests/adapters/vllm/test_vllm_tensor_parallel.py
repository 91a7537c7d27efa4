"""Tensor parallelism: vLLM with two worker ranks (``tensor_parallel_size=2``, vLLM's
three-process mode). Each rank stores and loads its own half of the KV heads under its own
namespace; the scheduler counts a block as a hit only when every rank holds it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvtier.client.adapters.vllm.namespace import CPU_LAYOUT
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.regions import ControlOnly
from kvtier.client.page_keys import page_keys
from kvtier.config import ClientConfig
from kvtier.ipc.protocol import Geometry
from vllm_harness import BLOCK, TINY, EngineProcess, prompt, same_output

pytestmark = pytest.mark.timeout(900)

RANK_GEOMETRY = Geometry(
    num_layers=TINY["num_hidden_layers"],
    page_size=BLOCK,
    kv_heads=TINY["num_key_value_heads"] // 2,
    head_dim=64,
    dtype="bfloat16",
    layout=CPU_LAYOUT,
)
"""One rank's pages of the tiny Llama under TP 2 (half the KV heads)."""


def _rank_pages(runtime_dir: Path, model: Path, tokens: list[int], rank: int) -> int:
    """Leading pages of ``tokens`` in rank ``rank``'s namespace (L2)."""
    conn = Connection(
        ControlOnly(RANK_GEOMETRY),
        model_id=str(model),
        tp_rank=rank,
        tp_size=2,
        config=ClientConfig(runtime_dir=runtime_dir),
    )
    try:
        return conn.lookup(page_keys(conn.ns_fingerprint, tokens, BLOCK)).l2
    finally:
        conn.close()


def _load_counts(daemon) -> tuple[int, int]:
    with AdminClient(daemon.endpoint) as admin:
        c = dict(admin.stats())["counters"]
    return c["load_pages"], c["load_failed_pages"]


def test_each_rank_stores_and_loads_its_own_pages(daemon, tiny_model, short_tmp):
    p = prompt(51, 300)
    pages = (len(p) - 1) // BLOCK
    e = EngineProcess(
        tiny_model,
        {"runtime_dir": str(daemon.runtime_dir)},
        short_tmp / "tp2.log",
        multiprocess=True,
        tp=2,
    ).wait_ready(timeout=600)
    try:
        computed = e.generate([p], timeout=300)
        assert computed[0]["cached"] == 0
        deadline = time.monotonic() + 60
        while min(_rank_pages(daemon.runtime_dir, tiny_model, p, r) for r in (0, 1)) < pages:
            assert time.monotonic() < deadline, "the ranks' pages did not reach kvtierd"
            time.sleep(0.1)
        before = _load_counts(daemon)

        loaded = e.generate([p], timeout=300)  # prefix caching is off: the hit is kvtier's
        assert loaded[0]["cached"] == pages * BLOCK
        # both ranks loaded their own pages (a rank keyed with another's chain would miss)
        after = _load_counts(daemon)
        assert (after[0] - before[0], after[1] - before[1]) == (2 * pages, 0)
        assert same_output(loaded, computed)
    finally:
        e.close()
