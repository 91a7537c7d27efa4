"""The reference engine with kvtier on computes exactly what it computes without it.

Edges of the engine's request path (``kvtier.engine.engine``) and of the cache manager and
radix tree it uses (``kvtier.client.cache``, ``kvtier.client.radix``), each against a real
kvtierd and compared with the same model run with kvtier off.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.cache.manager import CacheManager, LoadHandle, MatchResult
from kvtier.engine.engine import GenerationResult, ReferenceEngine
from kvtier.engine.model import ModelConfig, TinyLlama

from tests.engines import client_config

TOL = 1e-4


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_same(got: GenerationResult, want: GenerationResult) -> None:
    assert got.tokens == want.tokens
    diff = float((got.first_logits - want.first_logits).abs().max())
    assert diff < TOL, f"first logits differ by {diff}"


# Wide KV (1 MiB pages, 64 MiB per load) so the load is still copying when the daemon stops.
WIDE = ModelConfig(
    vocab_size=256, hidden_size=64, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, ffn_size=128
)


class _StopDaemonAfterLoad(CacheManager):
    """SIGSTOPs the daemon as soon as a load has been accepted: the load times out while
    the daemon, still alive, could write its pages late (they are quarantined). With
    ``resume_after``, a timer lets the daemon go on that many seconds later."""

    victim = None
    resume_after: float | None = None

    def load(self, match: MatchResult, device_pages) -> LoadHandle:
        handle = super().load(match, device_pages)
        if handle.pages and self.victim is not None:
            os.kill(self.victim.pid, signal.SIGSTOP)
            if self.resume_after is not None:
                pid = self.victim.pid
                threading.Timer(self.resume_after, os.kill, (pid, signal.SIGCONT)).start()
        return handle


@pytest.mark.timeout(120)
def test_stalled_load_in_a_pool_sized_for_the_request_still_recomputes(daemon_factory):
    """A load that times out while kvtierd hangs falls back to a recompute: in an engine
    sized (``num_pages``) for the request alone, with no room for fresh pages while the
    failed load's are quarantined, the recompute waits (at most ``load_timeout_s``) for the
    daemon to end the load, here a daemon that goes on half a second after the load timed
    out, and returns what the engine without kvtier returns."""
    model = TinyLlama(WIDE)
    page, n_pages = 32, 64
    prefix = prompt(n_pages * page, WIDE.vocab_size, 10)
    full = prefix + prompt(40, WIDE.vocab_size, 11)
    total = n_pages + 4  # what the request needs: 64 full pages, the rest, decode
    with ReferenceEngine(mode="off", page_size=page, num_pages=total, model=model) as off:
        want = off.generate(full, 8)
    for attempt in range(3):
        d = daemon_factory("--hicache-size", "160MiB", "--extent-size", "32MiB", name=f"s{attempt}")
        cc = client_config(d.runtime_dir, request_timeout_s=0.5, load_timeout_s=1.0)
        with ReferenceEngine(
            mode="on", page_size=page, num_pages=total, model=model, client_config=cc
        ) as writer:
            writer.generate(prefix, 1)
        with ReferenceEngine(
            mode="on",
            page_size=page,
            num_pages=total,
            model=model,
            client_config=cc,
            cache_factory=_StopDaemonAfterLoad,
        ) as e:
            cache = e.cache
            assert isinstance(cache, _StopDaemonAfterLoad)
            cache.victim = d
            cache.resume_after = cc.load_timeout_s + 0.5
            try:
                got = e.generate(full, 8)
            finally:
                cache.victim = None
                os.kill(d.pid, signal.SIGCONT)
            assert_same(got, want)
            if got.load_failed:
                return
    pytest.fail("the load completed before the daemon stopped, three times")


COPY_NICE = 19  # the daemon's copy threads are the threads at this nice value
HOG = """
import os, sys, time
end = time.monotonic() + 60
print("ready", flush=True)
while time.monotonic() < end:
    pass
"""


@contextlib.contextmanager
def _copies_starved(pid: int) -> Iterator[None]:
    """While inside, kvtierd ``pid``'s copy threads (started with ``--copy-nice 19``) get
    almost no CPU: they share one CPU with a busy process and run only when it does not
    want the CPU (SCHED_IDLE). A STORE the daemon accepted is then still copying when the
    test stops the daemon, however fast this machine copies."""
    if os.getpriority(os.PRIO_PROCESS, 0) >= COPY_NICE:
        pytest.skip(f"the tests run at nice {COPY_NICE}: the copy threads cannot be told apart")
    cpu = max(os.sched_getaffinity(0))
    copiers = []
    for t in Path(f"/proc/{pid}/task").iterdir():
        stat = (t / "stat").read_text()
        if int(stat.rsplit(")", 1)[1].split()[16]) == COPY_NICE:
            copiers.append(int(t.name))
    assert copiers, "kvtierd's copy threads (at nice 19)"
    for tid in copiers:
        os.sched_setaffinity(tid, {cpu})
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        assert hog.stdout is not None and hog.stdout.readline() == "ready\n"
        yield
    finally:
        hog.kill()
        hog.wait()


class _StopDaemonAfterStore(CacheManager):
    """SIGSTOPs the daemon as soon as an insert has sent its write-through STORE: the STORE
    times out while the daemon, still alive, may read its pages (they are held back)."""

    victim = None

    def insert(self, match: MatchResult, device_pages) -> list[int]:
        dups = super().insert(match, device_pages)
        if self.pending_stores and self.victim is not None:
            os.kill(self.victim.pid, signal.SIGSTOP)
            self.victim = None
        return dups


@pytest.mark.timeout(120)
def test_eviction_evicts_enough_when_the_oldest_pages_are_held_by_a_stalled_store(
    daemon_factory,
):
    """When L1 must evict to make room, it frees as many pages as the request needs if that
    many are evictable: pages that a timed-out STORE may still read are kept back, but then
    other unlocked L1 pages must be evicted in their place. The request is served (and equals
    the engine without kvtier) instead of failing with DevicePoolExhausted while evictable L1
    pages remain."""
    model = TinyLlama(WIDE)
    page = 32
    a = prompt(32 * page + 1, WIDE.vocab_size, 20)  # 32 full pages: one 32 MiB STORE
    c = prompt(16 * page + 1, WIDE.vocab_size, 21)  # 16 full pages (its STORE never starts)
    b = prompt(16 * page + 1, WIDE.vocab_size, 22)  # needs 17 pages: 9 must be evicted
    total = 56
    with ReferenceEngine(mode="off", page_size=page, num_pages=total, model=model) as off:
        want = off.generate(b, 1)
    for attempt in range(3):
        d = daemon_factory(
            "--hicache-size",
            "160MiB",
            "--extent-size",
            "32MiB",
            "--copy-nice",
            str(COPY_NICE),
            name=f"w{attempt}",
        )
        cc = client_config(
            d.runtime_dir,
            request_timeout_s=0.3,
            load_timeout_s=0.5,
            hicache_write_policy="write_through",
        )
        e = ReferenceEngine(
            mode="on",
            page_size=page,
            num_pages=total,
            model=model,
            client_config=cc,
            cache_factory=_StopDaemonAfterStore,
        )
        try:
            cache = e.cache
            assert isinstance(cache, _StopDaemonAfterStore)
            cache.victim = d
            with _copies_starved(d.pid):
                e.generate(a, 1)  # its STORE stalls: its 32 pages are held back once evicted
            if cache.counters.store_failures == 0:
                continue  # the STORE ended before the daemon stopped: try again
            e.generate(c, 1)  # the daemon does not answer: computed, 16 more L1 pages
            assert cache.tree.evictable_page_count == 48
            got = e.generate(b, 1)
            assert_same(got, want)
            return
        finally:
            os.kill(d.pid, signal.SIGCONT)
            e.close()
    pytest.fail("the STORE completed before the daemon stopped, three times")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_page_boundary_prompts_through_l1_and_l2_match_recompute(daemon, policy):
    """Prompts of 1, page-1, page, page+1, 2*page-1, 2*page and 2*page+1 tokens of one
    prefix, sent twice in a row and again after L1 was flushed (L2 then serves them), give
    the engine-without-kvtier's tokens and logits; the per-tier tokens add up to the prompt,
    the tree's invariants hold and no lock or page is left over after each request."""
    model = TinyLlama(ModelConfig.tiny())
    page = 4
    cc = client_config(daemon.runtime_dir, hicache_write_policy=policy, cache_salt=policy)
    base = prompt(3 * page, model.cfg.vocab_size, 30)
    with (
        ReferenceEngine(
            mode="on", page_size=page, num_pages=32, model=model, client_config=cc
        ) as on,
        ReferenceEngine(mode="off", page_size=page, num_pages=32, model=model) as off,
    ):
        cache = on.cache
        assert cache is not None
        for n in (1, page - 1, page, page + 1, 2 * page - 1, 2 * page, 2 * page + 1):
            for flush in (False, False, True):
                if flush:
                    on.flush_l1()
                got = on.generate(base[:n], page + 1)
                assert_same(got, off.generate(base[:n], page + 1))
                assert got.cached_l1 + got.cached_l2 + got.cached_l3 + got.computed == n
                cache.tree.check_invariants()
                assert cache.tree.evictable_page_count == cache.tree.device_page_count
                assert on.allocator.used_count == cache.tree.device_page_count
        assert cache.counters.loaded_tokens > 0
