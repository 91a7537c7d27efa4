"""The engine copy mode's worker side in this process, against a real kvtierd and vLLM's
connector factory: what a copy that raises does to the jobs queued behind it, and what the
connector asks of vLLM's CUDA graphs. (The end-to-end cases with a real vLLM engine are in
test_vllm_engine_copy.py.)"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from kvtier.client.page_keys import page_keys
from kvtier.ipc.protocol import Geometry

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations), not ours
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvtier.client.adapters.vllm.metadata import KvtierMetadata, LoadSpec, StoreSpec
    from kvtier.client.adapters.vllm.namespace import CPU_LAYOUT, chain_seed
    from kvtier.client.adapters.vllm.settings import ConnectorSettings
    from kvtier.client.adapters.vllm.staged_worker import StagedWorkerSide
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

pytestmark = pytest.mark.timeout(120)

G = Geometry(num_layers=2, page_size=4, kv_heads=2, head_dim=8, dtype="bfloat16", layout=CPU_LAYOUT)
BLOCKS = 16


def _worker(runtime_dir: str) -> tuple[StagedWorkerSide, list[torch.Tensor]]:
    settings = ConnectorSettings.from_extra_config(
        {"runtime_dir": runtime_dir, "copy_mode": "engine", "staging_pages": 8}
    )
    w = StagedWorkerSide(G, settings, "staged-test", "", 0, 1, 0)
    layers = [
        torch.randn(BLOCKS, G.kv_heads, G.page_size, 2 * G.head_dim).to(torch.bfloat16)
        for _ in range(G.num_layers)
    ]
    names = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)}
    w.register_kv_caches(names, {n: i for i, n in enumerate(names)})
    assert w.area is not None, "the staging area was not made"
    return w, layers


def _tokens(seed: int, pages: int) -> list[int]:
    return [(seed * 1000 + i) % 5000 for i in range(pages * G.page_size)]


def _wait_sent(w: StagedWorkerSide, rids: set[str], timeout: float = 20.0) -> set[str]:
    """Report ``rids`` finished until their stores have ended; the ones reported."""
    sent: set[str] = set()
    deadline = time.monotonic() + timeout
    while sent != rids and time.monotonic() < deadline:
        sending, _ = w.get_finished(rids - sent)
        sent |= sending
        time.sleep(0.01)
    return sent


def test_a_copy_that_raises_fails_its_job_and_the_next_ones_still_run(daemon_factory):
    d = daemon_factory()
    w, layers = _worker(str(d.runtime_dir))
    try:
        assert w.copier is not None and w.link is not None
        real_to_host = w.copier.to_host
        failures = iter([RuntimeError("CUDA out of memory (raised by the test)")])

        def to_host(*args, **kwargs):  # the first store's device copy fails
            err = next(failures, None)
            if err is not None:
                raise err
            return real_to_host(*args, **kwargs)

        w.copier.to_host = to_host  # type: ignore[method-assign]
        a, b = _tokens(1, 3), _tokens(2, 3)
        w.start_stores(
            KvtierMetadata(
                stores=[
                    StoreSpec("a", a, "", 0, [1, 2, 3]),
                    StoreSpec("b", b, "", 0, [4, 5, 6]),
                ]
            )
        )
        assert _wait_sent(w, {"a", "b"}) == {"a", "b"}  # neither request waits forever
        assert w._thread is not None and w._thread.is_alive()
        conn = w.link.get()
        assert conn is not None
        seed = chain_seed(conn.ns_fingerprint, "")
        assert conn.lookup(page_keys(seed, a, G.page_size)).l2 == 0  # a's store failed
        assert conn.lookup(page_keys(seed, b, G.page_size)).l2 == 3
        # and an asynchronous load queued after it brings b's pages back, byte for byte
        want = [t[4:7].clone() for t in layers]
        for t in layers:
            t[8:11].zero_()
        w.start_loads(KvtierMetadata(loads=[LoadSpec("c", b, "", 0, [8, 9, 10], in_l2=3)]))
        deadline = time.monotonic() + 20
        loaded: set[str] = set()
        while "c" not in loaded and time.monotonic() < deadline:
            loaded |= w.get_finished(set())[1]
            time.sleep(0.01)
        assert "c" in loaded and not w.load_errors()
        assert all(torch.equal(t[8:11], x) for t, x in zip(layers, want))
        assert w.area is not None
        free = w.area.acquire(w.area.capacity, 0.0)  # the failed store's slots came back too
        assert free is not None and len(free) == w.area.capacity
    finally:
        w.close()


def test_a_layerwise_load_whose_copy_raises_is_recomputed_and_frees_its_slots(daemon_factory):
    d = daemon_factory()
    w, _ = _worker(str(d.runtime_dir))
    try:
        assert w.copier is not None and w.area is not None
        b = _tokens(3, 3)
        w.start_stores(KvtierMetadata(stores=[StoreSpec("b", b, "", 0, [4, 5, 6])]))
        assert _wait_sent(w, {"b"}) == {"b"}

        def to_device(*args, **kwargs):
            raise RuntimeError("CUDA error (raised by the test)")

        w.copier.to_device = to_device  # type: ignore[method-assign]
        w.start_loads(
            KvtierMetadata(loads=[LoadSpec("c", b, "", 0, [8, 9, 10], in_l2=3, layerwise=True)])
        )
        w.wait_for_layer("model.layers.0.self_attn.attn")  # raises nothing into the forward
        handle = w._layerwise[0].handle  # type: ignore[attr-defined]
        w.get_finished(set())
        assert handle.done  # its completion slot is the connection's again
        assert w.load_errors() == {8, 9, 10}  # vLLM recomputes them
        free = w.area.acquire(w.area.capacity, 0.0)  # every slot came back
        assert free is not None and len(free) == w.area.capacity
        w.area.release(free, None)
    finally:
        w.close()


def test_vllm_captures_cuda_graphs_piecewise_with_the_connector():
    """vLLM asks the connector class it resolves from the transfer config whether full CUDA
    graphs must be split (their replay would skip ``wait_for_layer_load``)."""
    cases = [({}, True), ({"copy_mode": "engine"}, True), ({"copy_mode": "daemon"}, True)]
    cases.append(({"layerwise_loads": False}, False))  # every load asynchronous: no waits
    for extra, piecewise in cases:
        tc = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.client.adapters.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
        cls = KVConnectorFactory.get_connector_class(tc)
        assert cls.requires_piecewise_for_cudagraph(tc.kv_connector_extra_config) is piecewise


def test_a_load_takes_at_most_half_the_staging_area():
    assert [StagedWorkerSide.load_capacity(n) for n in (1, 2, 3, 8, 256)] == [1, 1, 1, 4, 128]
