"""Edges of SGLang's HiCache storage contract, through SGLang 0.5.23's own classes.

Every instance is a process of its own (``sglang_instance.py``): SGLang's host pool and
``HiCacheController``, the kvtier backend loaded by SGLang's dynamic loader, against real
kvtierd processes. SGLang offers a request the pages its hit query reported and then reads
them; a page offered and never delivered costs SGLang host memory and a failed load, so
what ``batch_exists`` reports is what ``batch_get_v1`` delivers. Misconfigurations of the
extra config stop SGLang at start with kvtier's own error naming the key.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from sglang_harness import both_ranks, extra_config, flush_l2

pytestmark = pytest.mark.timeout(300)

PAGE = 16


def test_tp_ranks_are_not_offered_an_l3_run_no_prefetch_brings(daemons, instances) -> None:
    """Two TP ranks; their pages only in L3, 3 pages (48 tokens), fewer than kvtierd's
    ``prefetch_threshold`` of 64 tokens: no prefetch reads them on any rank, so, as with a
    single rank, neither rank's hit query offers them (hit 0), and nothing is offered that
    is then not delivered."""
    d = daemons("tp-thr", "--hicache-storage-backend", "file", "--prefetch-threshold", "64")
    extra = extra_config(d.runtime_dir, model_id="tp-thr")
    ranks = [instances(f"tp-thr-{r}", "page_first", extra, tp_rank=r, tp_size=2) for r in (0, 1)]
    assert [g["tokens"] for g in both_ranks(ranks, "store", seq=4, pages=3)] == [3 * PAGE] * 2
    assert flush_l2(d) >= 6
    got = both_ranks(ranks, "prefetch", seq=4, pages=3)
    assert [(g["hit"], g["done"], g["bad"]) for g in got] == [(0, 0, 0)] * 2, got


def test_tp_ranks_find_their_pages_again_after_one_rank_saw_kvtierd_stall(
    daemons, instances
) -> None:
    """Two TP ranks hold 8 pages each. kvtierd stalls (SIGSTOP) for longer than
    ``request_timeout_s`` while only rank 0 has a request in flight (its backup thread's
    STORE: a miss, answered within the timeout). kvtierd resumes; both ranks run one hit
    query at once, then, once the client's one-second back-off is over, more: the ranks'
    hit queries stay paired, so within a few requests both get their 8 pages again, and
    no hit query waits for the other rank's round."""
    d = daemons("tp-stall")
    extra = extra_config(d.runtime_dir, model_id="tp-stall")
    ranks = [instances(f"tp-stall-{r}", "page_first", extra, tp_rank=r, tp_size=2) for r in (0, 1)]
    assert [g["tokens"] for g in both_ranks(ranks, "store", seq=1, pages=8)] == [8 * PAGE] * 2
    got = both_ranks(ranks, "prefetch", seq=1, pages=8)
    assert [(g["hit"], g["done"]) for g in got] == [(8 * PAGE, 8 * PAGE)] * 2
    os.kill(d.pid, signal.SIGSTOP)
    try:
        assert ranks[0].call("store", seq=2, pages=4)["tokens"] == 0  # timed out: a miss
    finally:
        os.kill(d.pid, signal.SIGCONT)
    both_ranks(ranks, "prefetch", seq=1, pages=8)  # rank 0 within its back-off
    time.sleep(1.5)  # past the back-off
    seen = []
    for _ in range(4):
        got = both_ranks(ranks, "prefetch", seq=1, pages=8)
        seen.append([(g["hit"], g["done"], round(g["seconds"], 2)) for g in got])
    assert [(h, dn) for h, dn, _ in seen[-1]] == [(8 * PAGE, 8 * PAGE)] * 2, seen
    assert all(s < 1.0 for _, _, s in seen[-1]), seen


def test_a_backend_without_interface_v1_offers_no_hit_it_cannot_deliver(daemons, instances) -> None:
    """Without ``"interface_v1": 1`` SGLang reads pages through ``batch_get`` into tensors,
    which the kvtier backend answers with misses. Such a configuration is either refused at
    start with an error naming ``interface_v1``, or its hit query offers only what its
    reads deliver: pages stored by another instance are not offered and then failed."""
    d = daemons("nov1")
    extra = extra_config(d.runtime_dir, model_id="nov1")
    writer = instances("nov1-writer", "page_first", extra)
    assert writer.call("store", seq=1, pages=8)["tokens"] == 8 * PAGE
    no_v1 = {k: v for k, v in extra.items() if k != "interface_v1"}
    reader = instances("nov1-reader", "page_first", no_v1)
    try:
        reader.wait_ready()
    except RuntimeError as err:  # refused at start: the message names the key
        assert "interface_v1" in str(err), str(err)
        return
    got = reader.call("prefetch", seq=1, pages=8)
    assert got["hit"] == got["done"], got


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("retry_interval_s", "abc"),
        ("retry_interval_s", float("inf")),
        ("request_timeout_s", float("inf")),
        ("endpoint", "bogus"),
    ],
    ids=["retry-not-a-number", "retry-infinite", "request-timeout-infinite", "endpoint-bogus"],
)
def test_a_bad_value_is_refused_naming_its_key(instances, module_tmp, key, value) -> None:
    """A bad value in the extra config (JSON allows ``Infinity``) stops SGLang at start with
    kvtier's ``SettingsError``, and the message names the key: a retry interval that is not
    a finite number of seconds (an infinite one would never reach a kvtierd started after
    SGLang), an infinite request timeout, an endpoint that is not ``ipc://`` or ``tcp://``."""
    extra = extra_config(module_tmp / f"nodaemon-{key}", **{key: value})
    inst = instances(f"cfg-{key}-{value}", "page_first", extra, only_attempts=True, attempts=[{}])
    rep = inst.reply()
    assert "refused" in rep, rep
    assert "SettingsError" in rep["refused"] and key in rep["refused"], rep["refused"]
