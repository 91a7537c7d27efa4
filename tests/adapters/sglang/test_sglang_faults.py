"""kvtierd absent, killed mid-prefetch, restarted; SGLang's own fault injector: SGLang's
controller sees misses, never an exception or a hang, never a wrong page; reuse resumes."""

from __future__ import annotations

import time

import pytest
from sglang_harness import extra_config, start_daemon

pytestmark = pytest.mark.timeout(600)

PAGE = 16
RECONNECT_DEADLINE_S = 30.0


def _until(fn, deadline_s: float = RECONNECT_DEADLINE_S):
    """Call ``fn`` until it returns something true (the backend re-registers lazily)."""
    deadline = time.monotonic() + deadline_s
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            return got


def test_daemon_absent_killed_mid_prefetch_and_restarted(instances, module_tmp) -> None:
    rd = module_tmp / "away"
    rd.mkdir()
    inst = instances(
        "faults-away",
        "page_first",
        extra_config(rd, retry_interval_s=0.2, request_timeout_s=1.0, model_id="faults"),
    )

    # no kvtierd at all: misses, nothing raised
    assert inst.call("store", seq=1, pages=8)["tokens"] == 0
    assert inst.call("prefetch", seq=1, pages=8)["hit"] == 0
    assert inst.call("stats")["registrations"] == 0

    daemon = start_daemon(rd)
    try:
        # it registers by itself and works
        assert _until(lambda: inst.call("store", seq=1, pages=8)["tokens"]) == 8 * PAGE
        assert inst.call("prefetch", seq=1, pages=8)["done"] == 8 * PAGE

        # killed between the hit query and the page reads
        inst.send("prefetch", seq=1, pages=8, pause=True)
        assert inst.reply()["paused"] == 8 * PAGE
        daemon.kill()
        inst.send("go")
        got = inst.reply()
        assert (got["done"], got["bad"]) == (0, 0)
        assert inst.call("prefetch", seq=1, pages=8)["hit"] == 0
        assert inst.call("store", seq=2, pages=4)["tokens"] == 0

        # restarted on the same runtime dir: it adopts its pool; reuse resumes
        daemon = start_daemon(rd)
        got = _until(lambda: (r := inst.call("prefetch", seq=1, pages=8))["done"] and r)
        assert (got["hit"], got["done"], got["bad"]) == (8 * PAGE, 8 * PAGE, 0)
        assert inst.call("stats")["registrations"] == 2
    finally:
        daemon.stop()
        daemon.remove_pool()


def test_random_failures_never_return_a_wrong_page(instances, daemons) -> None:
    """SGLang's fault injector fails 30% of the backend's calls: hits shrink, bytes never lie."""
    daemon = daemons("inject")
    inst = instances(
        "faults-inject",
        "page_head",
        extra_config(daemon.runtime_dir),
        env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3"},
    )
    assert inst.call("stats")["wrapped"]  # SGLang wrapped the backend in its injector
    full = short = 0
    for seq in range(10, 34):
        inst.call("store", seq=seq, pages=4)
        got = inst.call("prefetch", seq=seq, pages=4)
        assert got["bad"] == 0, got
        assert got["done"] <= got["hit"] <= 4 * PAGE
        full += got["done"] == 4 * PAGE
        short += got["done"] < 4 * PAGE
    assert full and short  # some pages were compared; some calls were failed
