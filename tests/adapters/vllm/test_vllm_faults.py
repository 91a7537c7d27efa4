"""vLLM keeps serving while kvtierd is absent, killed and restarted, and reuses once it is
back. This engine runs vLLM's default three processes: the scheduler-side connector in
the EngineCore process, the worker-side one in the worker."""

from __future__ import annotations

import time

import pytest
from vllm_harness import BLOCK, kvtier_pages, prompt, same_output, wait_for_pages

pytestmark = pytest.mark.timeout(600)


def reached_kvtierd(engine, runtime_dir, model, timeout: float = 60.0) -> None:
    """Wait until the connector, which tries to reach an absent kvtierd again at most once
    per ``retry_interval_s`` and only at a request, is registered on both sides: send fresh
    prompts (each must be a plain miss) until kvtierd's L2 holds the pages of one, which the
    worker stored; then send that one again until it hits, which the scheduler looked up.
    The wait ends on what kvtierd holds and what the engine reports, and fails only after
    ``timeout``."""
    pages = 4
    deadline = time.monotonic() + timeout
    probes: list[list[int]] = []
    stored: list[int] | None = None
    while stored is None:
        assert time.monotonic() < deadline, f"none of {len(probes)} probes stored in {timeout}s"
        probes.append(prompt(100 + len(probes), pages * BLOCK + 1))
        assert engine.generate([probes[-1]])[0]["cached"] == 0
        stored = next((p for p in probes if kvtier_pages(runtime_dir, model, p)[0] == pages), None)
    while (cached := engine.generate([stored])[0]["cached"]) == 0:
        assert time.monotonic() < deadline, f"a stored probe did not hit in {timeout}s"
        time.sleep(0.05)
    assert cached == pages * BLOCK


def test_kvtierd_absent_then_killed_mid_run_then_back(
    daemon_factory, engines, reference, tiny_model
):
    """vLLM serves plain misses with no kvtierd, reuses pages once kvtierd is up, serves a
    miss while it is killed and reuses the adopted pool once it is back, and a hit loaded
    while kvtierd is killed still gives the right output. Every wait for the connector
    to reach a (re)started kvtierd ends on an observed store or hit, not after a fixed
    time."""
    d = daemon_factory(start=False)
    p1, p2, p3 = prompt(21, 200), prompt(22, 150), prompt(23, 170)
    want = {i: reference.generate([p]) for i, p in enumerate((p1, p2, p3))}
    # a batch is compared with the same batch: vLLM's CPU kernels need not give a prompt
    # computed beside another the logprobs it gets alone (on AVX2 machines they differ in
    # the third decimal)
    want_batch = reference.generate([p1, p3])
    e = engines(d.runtime_dir, multiprocess=True, retry_interval_s=0.2)

    out = e.generate([p1])  # no kvtierd at all: a plain miss
    assert out[0]["cached"] == 0 and same_output(out, want[0])

    d.start()
    reached_kvtierd(e, d.runtime_dir, tiny_model)
    out = e.generate([p1])
    assert out[0]["cached"] == 0 and same_output(out, want[0])
    wait_for_pages(d.runtime_dir, tiny_model, p1, 6)
    out = e.generate([p1])
    assert out[0]["cached"] == 6 * BLOCK and same_output(out, want[0])

    d.kill()  # SIGKILL, between requests
    out = e.generate([p2])
    assert out[0]["cached"] == 0 and same_output(out, want[1])
    d.start()  # adopts the pool the killed daemon left: p1's pages are still there
    deadline = time.monotonic() + 30
    while True:  # the connector reconnects at its next attempt
        out = e.generate([p1])
        assert same_output(out, want[0])
        if out[0]["cached"] == 6 * BLOCK:
            break
        assert time.monotonic() < deadline, "no kvtier hit after kvtierd came back"
        time.sleep(0.2)

    e.send([p1, p3])  # a hit being loaded while kvtierd is SIGKILLed
    d.kill()
    out = e.receive()
    assert same_output(out, want_batch)
    out = e.generate([p2])  # and it goes on serving
    assert same_output(out, want[1])
