"""The reference engine reusing KV through kvtierd computes what a full recompute computes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from kvtier.client.cache.manager import CacheManager, LoadHandle, MatchResult
from kvtier.engine.engine import GenerationResult, ReferenceEngine
from kvtier.engine.model import ModelConfig, TinyLlama
from kvtier.launch.daemon_process import DaemonProcess

from tests.engines import client_config

TOL = 1e-4
PAGE = 16


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_same(got: GenerationResult, want: GenerationResult) -> None:
    assert got.tokens == want.tokens
    diff = float((got.first_logits - want.first_logits).abs().max())
    assert diff < TOL, f"first logits differ by {diff}"


@pytest.fixture
def tiny() -> TinyLlama:
    return TinyLlama(ModelConfig.tiny())


@pytest.fixture
def engines(daemon, tiny):
    """``make(mode, **client_config)`` builds engines on the tiny model; all closed at the end."""
    made: list[ReferenceEngine] = []

    def make(
        mode: str = "on",
        num_pages: int = 64,
        model: TinyLlama | None = None,
        page_size: int = PAGE,
        **cfg,
    ) -> ReferenceEngine:
        made.append(
            ReferenceEngine(
                mode=mode,
                page_size=page_size,
                num_pages=num_pages,  # type: ignore[arg-type]
                client_config=client_config(daemon.runtime_dir, **cfg),
                model=model or tiny,
            )
        )
        return made[-1]

    yield make
    for e in reversed(made):
        e.close()


@pytest.mark.timeout(60)
def test_prefix_loaded_from_l2_matches_recompute(engines, tiny):
    on, off = engines("on"), engines("off")
    prefix = prompt(10 * PAGE, tiny.cfg.vocab_size, 1)
    on.generate(prefix, 4)
    assert on.flush_l1() == 10
    full = prefix + prompt(37, tiny.cfg.vocab_size, 2)
    got = on.generate(full, 12)
    assert (got.cached_l1, got.cached_l2, got.computed) == (0, 10 * PAGE, 37)
    assert not got.load_failed
    assert_same(got, off.generate(full, 12))
    assert on.counters is not None and on.counters.loaded_tokens == 10 * PAGE


@pytest.mark.timeout(60)
def test_l1_and_l2_together_match_recompute(engines, tiny):
    on, off = engines("on"), engines("off")
    prefix = prompt(10 * PAGE, tiny.cfg.vocab_size, 3)
    on.generate(prefix, 1)
    on.flush_l1()
    head = on.generate(prefix[: 3 * PAGE + 5], 1)  # brings pages 0-2 back to L1 from L2
    assert head.cached_l2 == 3 * PAGE
    full = prefix + prompt(21, tiny.cfg.vocab_size, 4)
    got = on.generate(full, 8)
    assert (got.cached_l1, got.cached_l2, got.computed) == (3 * PAGE, 7 * PAGE, 21)
    assert_same(got, off.generate(full, 8))


@pytest.mark.timeout(60)
def test_new_engine_reuses_l2_after_restart(engines, tiny):
    first = engines("on")
    prefix = prompt(12 * PAGE + 7, tiny.cfg.vocab_size, 5)
    first.generate(prefix, 6)
    first.close()  # pool and connection gone; the next engine has new ones
    second, off = engines("on"), engines("off")
    full = prefix + prompt(30, tiny.cfg.vocab_size, 6)
    got = second.generate(full, 10)
    assert (got.cached_l1, got.cached_l2) == (0, 12 * PAGE)
    assert_same(got, off.generate(full, 10))


class _KillDaemonAfterLoad(CacheManager):
    """Kills the daemon as soon as a load has been accepted: the load fails half-way."""

    victim: DaemonProcess | None = None
    killed_during: int | None = None

    def load(self, match: MatchResult, device_pages) -> LoadHandle:
        handle = super().load(match, device_pages)
        if handle.pages and self.victim is not None:
            self.victim.kill()
            self.killed_during, self.victim = handle.pages, None
        return handle


class _StopDaemonAfterLoad(CacheManager):
    """SIGSTOPs the daemon as soon as a load has been accepted: the load times out, and the
    daemon, still alive, could write the pages late."""

    victim: DaemonProcess | None = None

    def load(self, match: MatchResult, device_pages) -> LoadHandle:
        handle = super().load(match, device_pages)
        if handle.pages and self.victim is not None:
            os.kill(self.victim.pid, signal.SIGSTOP)
            self.victim = None
        return handle


# Wide KV (1 MiB pages, 64 MiB per load) so the load is still copying when the daemon stops.
WIDE = ModelConfig(
    vocab_size=256, hidden_size=64, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, ffn_size=128
)


@pytest.mark.timeout(180)
def test_load_failing_half_way_falls_back_to_recompute(daemon_factory):
    cfg = WIDE
    model = TinyLlama(cfg)
    page, n_pages = 32, 64
    prefix = prompt(n_pages * page, cfg.vocab_size, 7)
    full = prefix + prompt(40, cfg.vocab_size, 8)
    off = ReferenceEngine(mode="off", page_size=page, num_pages=n_pages + 4, model=model)
    try:
        want = off.generate(full, 8)
        failed = None
        for attempt in range(3):  # a load that finished before the kill proves nothing: retry
            d = daemon_factory(
                "--hicache-size", "160MiB", "--extent-size", "32MiB", name=f"d{attempt}"
            )
            cc = client_config(d.runtime_dir, request_timeout_s=1.0, load_timeout_s=5.0)
            with ReferenceEngine(
                mode="on", page_size=page, num_pages=n_pages + 4, model=model, client_config=cc
            ) as writer:
                writer.generate(prefix, 1)
            with ReferenceEngine(
                mode="on",
                page_size=page,
                num_pages=n_pages + 4,
                model=model,
                client_config=cc,
                cache_factory=_KillDaemonAfterLoad,
            ) as e:
                assert isinstance(e.cache, _KillDaemonAfterLoad)
                e.cache.victim = d
                got = e.generate(full, 8)
                assert e.cache.killed_during == n_pages
                assert_same(got, want)
                if got.load_failed:
                    failed = got
                    break
        assert failed is not None, "the load completed before the daemon died, three times"
        assert (failed.cached_l1, failed.cached_l2, failed.computed) == (0, 0, len(full))
        assert failed.l2_found == n_pages * page
    finally:
        off.close()


@pytest.mark.timeout(60)
def test_write_policies_back_up_as_hicache_does(engines, tiny, daemon):
    from kvtier.client.connection.admin import AdminClient

    def stored() -> int:
        with AdminClient(daemon.endpoint) as admin:
            return int(admin.stats()["counters"]["store_pages"])  # type: ignore[index]

    p = prompt(6 * PAGE + 3, tiny.cfg.vocab_size, 9)
    wt = engines("on", hicache_write_policy="write_through")
    wt.generate(p, 2)
    assert stored() == 6
    sel = engines("on", hicache_write_policy="write_through_selective", cache_salt="sel")
    sel.generate(p, 2)
    assert stored() == 6
    sel.generate(p, 2)
    assert stored() == 12
    wb = engines("on", hicache_write_policy="write_back", cache_salt="wb")
    wb.generate(p, 2)
    wb.generate(p, 2)
    assert stored() == 12
    wb.flush_l1()
    assert stored() == 18


@pytest.mark.timeout(180)
def test_load_timing_out_quarantines_its_pages_while_the_daemon_lives(daemon_factory):
    model = TinyLlama(WIDE)
    page, n_pages = 32, 64
    total = 2 * n_pages + 8
    prefix = prompt(n_pages * page, WIDE.vocab_size, 10)
    full = prefix + prompt(40, WIDE.vocab_size, 11)
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
            try:
                got = e.generate(full, 8)
            finally:
                os.kill(d.pid, signal.SIGCONT)  # late layers now land in the quarantined pages
            assert_same(got, want)
            if not got.load_failed:
                continue
            # the failed load's pages were neither used nor freed: the recompute took fresh ones
            assert cache.quarantined_pages == n_pages
            held = cache.tree.device_page_count + cache.quarantined_pages
            assert e.allocator.free_count == total - held
            # once the daemon cannot write them any more, the next allocation frees them
            deadline = time.monotonic() + 30
            while cache.quarantined_pages:
                assert time.monotonic() < deadline, "quarantine never ended"
                time.sleep(0.1)
                again = e.generate(full, 2)
                assert again.tokens == want.tokens[:2]
            assert e.allocator.free_count == total - cache.tree.device_page_count
            return
    pytest.fail("the load completed before the daemon stopped, three times")
