"""Hits wholly in L2 load layer by layer within the step that schedules them; the same
batch through asynchronous loads (``layerwise_loads: false``) gives the same tokens (its
requests may share their steps otherwise, so logprobs may round otherwise). Both
ways, every block of each hit is loaded, none is left for vLLM to recompute, and each
holds the bytes kvtierd stored (vLLM would recompute a block left out, so equal outputs
alone cannot tell)."""

from __future__ import annotations

import pytest
from vllm_harness import (
    BLOCK,
    assert_loaded_as_stored,
    prompt,
    same_output,
    same_tokens,
    wait_for_pages,
)

pytestmark = pytest.mark.timeout(600)


def test_a_batch_mixing_layerwise_hits_and_a_miss_matches_the_reference(
    daemon, engines, reference, tiny_model
):
    hit_a, hit_b, miss = prompt(41, 300), prompt(42, 200), prompt(43, 250)
    batch = [hit_a, miss, hit_b]
    want = reference.generate(batch)
    e = engines(daemon.runtime_dir)
    assert [o["cached"] for o in e.generate([hit_a, hit_b])] == [0, 0]
    assert_loaded_as_stored(e, daemon.runtime_dir, tiny_model, [])  # misses load nothing
    wait_for_pages(daemon.runtime_dir, tiny_model, hit_a, 9)
    wait_for_pages(daemon.runtime_dir, tiny_model, hit_b, 6)

    # two loads of one step run beside the miss's prefill, each layer waited for in turn
    out = e.generate(batch)
    assert [o["cached"] for o in out] == [9 * BLOCK, 0, 6 * BLOCK]
    assert same_output(out, want)
    assert_loaded_as_stored(e, daemon.runtime_dir, tiny_model, [(hit_a, 9), (hit_b, 6)])
    wait_for_pages(daemon.runtime_dir, tiny_model, miss, 7)

    # the same hits loaded asynchronously (the request waits a step for its load): each
    # request is scheduled once its own load ended, so the three may share their steps
    # otherwise than in the reference; the bytes loaded are checked exactly below
    e2 = engines(daemon.runtime_dir, layerwise_loads=False)
    out = e2.generate(batch)
    assert [o["cached"] for o in out] == [9 * BLOCK, 7 * BLOCK, 6 * BLOCK]
    assert same_tokens(out, want, logprob_tol=0.1)
    assert_loaded_as_stored(e2, daemon.runtime_dir, tiny_model, [(hit_a, 9), (miss, 7), (hit_b, 6)])
