"""``kvtier bench vllm`` runs on a fresh checkout, and its output comparison means something:
kvtier's hits, ExampleConnector's and vLLM's own prefix cache reusing the same prefix give
the same tokens and logprobs, bit for bit.

Short prompts (256 tokens, one of each kind), so the run takes minutes, not the full
benchmark's; no timing is asserted (these machines are too noisy for that, and the full
run prints its ratios for a person to read).
"""

from __future__ import annotations

import pytest
from kvtier.bench.vllm import run_vllm_bench

pytestmark = pytest.mark.timeout(900)

BLOCK = 32  # the benchmark's vLLM block size


def test_bench_runs_and_kvtier_reproduces_vllms_own_prefix_reuse():
    r = run_vllm_bench(tokens=256, prompts=1)
    reused = (256 - 1) // BLOCK * BLOCK  # one token is always left to compute
    # every compared output really reused the prefix, from kvtier and from vLLM's cache
    assert r["cached_tokens_kvtier"] == [reused] and r["cached_tokens_example"] == [reused]
    assert r["reused_tokens"] == {"kvtier": [reused, reused], "native": [reused, reused]}
    assert r["outputs_match"] is True, r["outputs_differ"]
    assert r["example_outputs_match"] is True and r["kvtier_equals_example"] is True
    assert r["recompute_repeatable"] is True
    for field in ("ttft_hit_over_recompute", "miss_overhead", "kvtier_over_example_connector"):
        assert r[field] > 0, (field, r[field])
