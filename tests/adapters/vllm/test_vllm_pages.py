"""Where loaded pages come from: L3 only (prefetched, claimed and loaded asynchronously:
every block of the hit loaded, holding the bytes kvtierd stored), and pages that are not
the engine's KV (the output changes: loaded KV is really used, so the equality tests of
this folder can fail)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.client.page_keys import page_keys
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P
from kvtier.ipc.shm import SharedMemorySegment
from vllm_harness import (
    BLOCK,
    GEOMETRY,
    assert_loaded_as_stored,
    kvtier_pages,
    prompt,
    same_output,
    wait_for_pages,
)

pytestmark = pytest.mark.timeout(600)


def _to_l3_only(d, model, prompts: list[list[int]], pages: int) -> None:
    """Wait for the prompts' pages in L2, write them to L3, drop them from L2."""
    for tokens in prompts:
        wait_for_pages(d.runtime_dir, model, tokens, pages)
    with AdminClient(d.endpoint) as admin:
        assert admin.sync(timeout_s=30).left == 0
        assert isinstance(admin.call(P.Flush(req_id=0, tier="l2")), P.FlushReply)
    for tokens in prompts:
        assert kvtier_pages(d.runtime_dir, model, tokens) == (0, pages)


def _corrupt_l3_payloads(state_dir: Path) -> int:
    """Overwrite the payloads of every L3 segment file (headers intact); files touched."""
    files = sorted((state_dir / "l3").glob("seg-*.kvt"))
    for f in files:
        slots = int(f.name.split("x")[1].split("-")[0])
        table = -(-slots * 128 // 4096) * 4096
        with open(f, "r+b") as fh:
            fh.seek(table)
            fh.write(os.urandom(min(f.stat().st_size - table, 4 << 20)))
    return len(files)


def test_pages_only_in_l3_load_asynchronously_and_corrupt_ones_are_recomputed(
    daemon_factory, engines, reference, tiny_model
):
    d = daemon_factory("--hicache-storage-backend", "file", "--prefetch-threshold", "64")
    p, q = prompt(31, 300), prompt(33, 300)  # 9 pages: above the client's prefetch_threshold
    # one prompt at a time, here and in the reference: vLLM's CPU kernels need not give a
    # prompt computed beside another the KV and logprobs it gets alone
    want = reference.generate([p]) + reference.generate([q])
    e = engines(d.runtime_dir)
    assert [e.generate([x])[0]["cached"] for x in (p, q)] == [0, 0]
    assert_loaded_as_stored(e, d.runtime_dir, tiny_model, [])
    _to_l3_only(d, tiny_model, [p, q], 9)
    out = e.generate([p])  # prefetched from L3, claimed, loaded
    assert out[0]["cached"] == 9 * BLOCK
    assert same_output(out, want[:1])
    assert_loaded_as_stored(e, d.runtime_dir, tiny_model, [(p, 9)])

    assert _corrupt_l3_payloads(d.runtime_dir / "state") > 0
    out = e.generate([q])  # L3 says it has q, its reads fail their checksums: recomputed
    assert same_output(out, want[1:])
    (load,) = e.loads()
    assert (
        load["errors"] == sorted(load["block_ids"]) and len(load["block_ids"]) == 9
    )  # none loaded
    wait_for_pages(d.runtime_dir, tiny_model, q, 9)  # and stored again once recomputed
    out = e.generate([q])
    assert out[0]["cached"] == 9 * BLOCK and same_output(out, want[1:])
    assert_loaded_as_stored(e, d.runtime_dir, tiny_model, [(q, 9)])


def test_pages_that_are_not_the_engines_kv_change_the_output(
    daemon, engines, reference, tiny_model
):
    """Garbage stored under the prompt's keys (same namespace) is loaded and used."""
    p = prompt(32, 200)
    n = (len(p) - 1) // BLOCK
    g = GEOMETRY
    seg = SharedMemorySegment.create_memfd(f"kvt-test-{os.getpid()}", n * g.page_bytes)
    try:
        rng = np.random.default_rng(0)
        seg.array(np.uint16)[:] = (
            rng.standard_normal(seg.size // 2).astype(np.float32).view(np.uint32) >> 16
        ).astype(np.uint16)  # bf16 N(0, 1)
        per_layer = g.page_bytes // g.num_layers
        regions = [
            P.MemoryRegion(
                segment=0,
                offset=layer * per_layer,
                page_stride=g.page_bytes,
                page_bytes=per_layer,
                layer=layer,
            )
            for layer in range(g.num_layers)
        ]
        assert seg.fd is not None
        pool = RegionMemory(g, n, [seg.fd], [seg.size], regions)
        with Connection(
            pool, model_id=str(tiny_model), config=ClientConfig(runtime_dir=daemon.runtime_dir)
        ) as conn:
            keys = page_keys(conn.ns_fingerprint, p[: n * BLOCK], BLOCK)
            assert conn.store(keys, list(range(n))).wait()
        assert kvtier_pages(daemon.runtime_dir, tiny_model, p) == (n, 0)
        e = engines(daemon.runtime_dir)
        out = e.generate([p])
        assert out[0]["cached"] == n * BLOCK
        assert not same_output(out, reference.generate([p]))
    finally:
        seg.close()
