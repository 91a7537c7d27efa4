"""A real vLLM reuses prefixes through kvtierd: the same tokens and logprobs as without it.

vLLM's own prefix caching is off in every engine, so each hit (``num_cached_tokens``) is
kvtier's. Engines run their engine core in-process here (fast to start); the
three-process layout is tested in test_vllm_faults.py.
"""

from __future__ import annotations

import pytest
from vllm_harness import BLOCK, kvtier_pages, prompt, same_output, wait_for_pages

pytestmark = pytest.mark.timeout(600)

PROMPTS = [prompt(1, 200), prompt(2, 97), prompt(3, 20)]  # 6 pages, 3 pages, none
PAGES = [(len(p) - 1) // BLOCK for p in PROMPTS]  # one token is always left to compute


def test_second_engine_after_exit_and_after_sigkill_gets_the_prefix(
    daemon_factory, engines, reference, tiny_model
):
    d = daemon_factory()
    want = reference.generate(PROMPTS)
    first = engines(d.runtime_dir)
    out = first.generate(PROMPTS)
    assert same_output(out, want)
    assert [o["cached"] for o in out] == [0, 0, 0]
    assert first.close() == 0
    for p, n in zip(PROMPTS, PAGES):
        assert kvtier_pages(d.runtime_dir, tiny_model, p) == (n, 0)

    second = engines(d.runtime_dir)
    out = second.generate(PROMPTS)
    assert [o["cached"] for o in out] == [n * BLOCK for n in PAGES]
    assert same_output(out, want)
    # a new prompt extending the first: its prefix is loaded, its new pages are stored
    longer = PROMPTS[0] + prompt(4, 100)
    want_longer = reference.generate([longer])
    out = second.generate([longer])
    assert out[0]["cached"] == PAGES[0] * BLOCK and same_output(out, want_longer)
    wait_for_pages(d.runtime_dir, tiny_model, longer, (len(longer) - 1) // BLOCK)
    second.kill()  # SIGKILL: kvtierd keeps what the engine stored

    third = engines(d.runtime_dir)
    out = third.generate([longer])
    assert out[0]["cached"] == (len(longer) - 1) // BLOCK * BLOCK
    assert same_output(out, want_longer)


def test_cache_salt_separates_requests(daemon_factory, engines, reference, tiny_model):
    d = daemon_factory()
    p = prompt(5, 130)
    want = reference.generate([p])
    e = engines(d.runtime_dir)
    assert e.generate([p], salt="alice")[0]["cached"] == 0
    wait_for_pages(d.runtime_dir, tiny_model, p, 4, salt="alice")
    assert kvtier_pages(d.runtime_dir, tiny_model, p) == (0, 0)  # unsalted keys: nothing
    out_bob = e.generate([p], salt="bob")
    out_alice = e.generate([p], salt="alice")
    assert out_bob[0]["cached"] == 0 and out_alice[0]["cached"] == 4 * BLOCK
    assert same_output(out_bob, want) and same_output(out_alice, want)


def test_two_engines_at_once_share_pages_stored_by_either(
    daemon_factory, engines, reference, tiny_model
):
    d = daemon_factory()
    a, b = engines(d.runtime_dir), engines(d.runtime_dir)
    pa, pb = prompt(6, 150), prompt(7, 180)
    # each engine computes its prompt alone, so the reference does too (vLLM's CPU kernels
    # need not give a prompt computed beside another the logprobs it gets alone)
    want = reference.generate([pa]) + reference.generate([pb])
    assert a.generate([pa])[0]["cached"] == 0
    assert b.generate([pb])[0]["cached"] == 0
    wait_for_pages(d.runtime_dir, tiny_model, pa, 4)
    wait_for_pages(d.runtime_dir, tiny_model, pb, 5)
    out_b = b.generate([pa])  # stored by a
    out_a = a.generate([pb])  # stored by b
    assert out_b[0]["cached"] == 4 * BLOCK and out_a[0]["cached"] == 5 * BLOCK
    assert same_output(out_b + out_a, want)
