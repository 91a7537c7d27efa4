"""The GPU bench's parts that run without a GPU: its arguments, the figures it derives, its
verdict over every targeted field, and what it writes when there is no GPU.

The figures below are made-up inputs of the verdict, not measurements.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from kvtier.bench import cuda_bench as cb
from kvtier.ipc.cuda_ipc import cuda_unavailable_reason


def _bandwidth(**over: float) -> dict[str, Any]:
    bw: dict[str, Any] = {
        "baseline_h2d_gbps": 50.0,
        "baseline_d2h_gbps": 40.0,
        "load_gbps": 45.0,
        "store_gbps": 36.0,
        "engine_load_gbps": 42.0,
        "engine_store_gbps": 34.0,
        "kernel_load_gbps": 30.0,
        "kernel_store_gbps": 38.0,
    }
    bw.update(over)
    return cb.derive(bw)


def _prefill(**over: Any) -> dict[str, Any]:
    pf: dict[str, Any] = {}
    for p in ("", "engine_", "kernel_"):
        for c in ("", "contended_"):
            pf[f"{p}{c}prefill_overlap"] = 1.05
            pf[f"{p}{c}logits_equal"] = True
            pf[f"{p}{c}max_abs_logit_diff"] = 0.0
    pf.update(over)
    return pf


def _all_required() -> list[str]:
    return cb.required_targets(cb.parse_args([]))


def test_defaults_and_skips_choose_the_required_targets() -> None:
    args = cb.parse_args([])
    assert (args.pages, args.repeats, args.prefill_repeats) == (128, 5, 8)
    assert not (args.skip_prefill or args.skip_contended or args.skip_kernel)
    assert sorted(cb.required_targets(args)) == sorted(cb.TARGETS)
    no_contention = cb.required_targets(cb.parse_args(["--skip-contended"]))
    assert "engine_contended_prefill_overlap" not in no_contention
    assert "engine_prefill_overlap" in no_contention
    bandwidth_only = cb.required_targets(cb.parse_args(["--skip-prefill"]))
    assert sorted(bandwidth_only) == sorted(n for n in cb.TARGETS if "over_baseline" in n)
    assert {"engine_load_over_baseline", "engine_store_over_baseline"} <= set(bandwidth_only)


@pytest.mark.parametrize(
    "argv", [["--pages", "0"], ["--repeats", "-1"], ["--contender-s", "0"], ["--budget-s", "x"]]
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cb.parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_derive_gives_each_mode_its_ratio_and_names_the_faster_daemon_copy() -> None:
    bw = _bandwidth()
    assert bw["load_over_baseline"] == pytest.approx(45 / 50)
    assert bw["store_over_baseline"] == pytest.approx(36 / 40)
    assert bw["engine_load_over_baseline"] == pytest.approx(42 / 50)
    assert bw["engine_store_over_baseline"] == pytest.approx(34 / 40)
    assert bw["kernel_load_over_baseline"] == pytest.approx(30 / 50)
    assert bw["faster_cuda_copy"] == {"load": "dma", "store": "kernel"}
    partial = cb.derive({"load_gbps": 1.0, "store_gbps": 1.0})  # no baseline, no kernel run
    assert "load_over_baseline" not in partial and "faster_cuda_copy" not in partial


def test_verdict_met_when_every_target_is_met() -> None:
    ok, lines = cb.verdict({"bandwidth": _bandwidth(), "prefill": _prefill()}, _all_required())
    assert ok, lines
    assert not any("MISSED" in line for line in lines)
    assert any(line.startswith("engine_load_over_baseline = 0.840") for line in lines)
    assert any("faster daemon copy" in line for line in lines)


@pytest.mark.parametrize(
    ("bw", "pf", "missed"),
    [
        ({"engine_load_gbps": 30.0}, {}, "engine_load_over_baseline"),
        ({"engine_store_gbps": 20.0}, {}, "engine_store_over_baseline"),
        ({"load_gbps": 10.0}, {}, "load_over_baseline"),
        ({}, {"engine_prefill_overlap": 1.3}, "engine_prefill_overlap"),
        ({}, {"contended_prefill_overlap": 1.2}, "contended_prefill_overlap"),
        ({}, {"engine_contended_prefill_overlap": 2.0}, "engine_contended_prefill_overlap"),
        ({}, {"engine_contended_logits_equal": False}, "engine_contended_logits_equal"),
    ],
)
def test_verdict_misses_each_target(bw: dict[str, float], pf: dict[str, Any], missed: str) -> None:
    ok, lines = cb.verdict(
        {"bandwidth": _bandwidth(**bw), "prefill": _prefill(**pf)}, _all_required()
    )
    assert not ok
    assert [line for line in lines if "MISSED" in line and line.startswith(missed)], lines


def test_a_required_figure_not_measured_is_missed() -> None:
    bw = _bandwidth()
    del bw["engine_store_over_baseline"]
    pf = _prefill()
    del pf["engine_contended_prefill_overlap"]
    ok, lines = cb.verdict({"bandwidth": bw, "prefill": pf}, _all_required())
    assert not ok
    missing = [line for line in lines if "not measured" in line]
    assert len(missing) == 2, lines


def test_kernel_copy_figures_are_reported_without_a_target() -> None:
    results = {
        "bandwidth": _bandwidth(kernel_load_gbps=1.0, kernel_store_gbps=1.0),
        "prefill": _prefill(kernel_prefill_overlap=3.0, kernel_contended_prefill_overlap=3.0),
    }
    ok, lines = cb.verdict(results, _all_required())
    assert ok, lines
    assert "kernel_contended_prefill_overlap = 3.000 (no target)" in lines
    assert results["bandwidth"]["faster_cuda_copy"] == {"load": "dma", "store": "dma"}


@pytest.mark.skipif(
    cuda_unavailable_reason() is None, reason="this machine has a GPU: the bench would measure"
)
def test_without_a_gpu_main_writes_why_and_returns_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert cb.main(["--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["status"] == "no_gpu"
    assert summary["reason"] and summary["reason"] in capsys.readouterr().out
    assert summary["targets"] == cb.TARGETS
    assert "bandwidth" not in summary  # gpu_check.sh accepts only "measured" with figures


def test_sections_record_errors_and_start_none_past_the_budget() -> None:
    """A section's figures are merged and a failing one's error recorded, and once the run's
    clock is past the budget no section starts (the run's start is moved back, not waited
    out)."""
    run = cb._Run(budget_s=60.0)
    into: dict[str, Any] = {}
    run.section("good", into, lambda: {"x": 1})

    def broken() -> dict[str, Any]:
        raise cb.BenchCheckFailed("loaded pages differ")

    run.section("bad", into, broken)
    assert into == {"x": 1} and run.errors == ["bad: BenchCheckFailed: loaded pages differ"]
    late = cb._Run(budget_s=1.0)
    late.start -= 2.0  # started two seconds ago by its clock: past the budget, no waiting
    assert late.over_budget()
    called: list[int] = []
    late.section("late", into, lambda: {"y": called.append(1) or 2})
    assert not called and "y" not in into
    assert late.errors and late.errors[0].startswith("late: not started")


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The contender runs here on the CPU (the bench runs it on the GPU): the same child process,
# started in its own process group, bounded, and killed as a group.
@pytest.mark.timeout(120)
def test_contender_computes_until_stopped_and_its_group_is_killed(tmp_path: Path) -> None:
    """Once ready, the contender goes on computing (its CPU time keeps growing, waited for
    without a fixed sleep, bounded far below its own 600 s limit) and is still running;
    leaving the block kills its whole process group."""
    from kvtier.bench.cuda_bench_prefill import Contender

    with Contender(600.0, tmp_path / "c.log", device="cpu", size=64) as c:
        assert c.proc is not None
        pid = c.proc.pid
        assert os.getpgid(pid) == pid  # its own process group
        at_ready = _cpu_seconds(pid)
        deadline = time.monotonic() + 60
        while _cpu_seconds(pid) < at_ready + 0.25:
            assert c.running(), "the contender ended by itself"
            assert time.monotonic() < deadline, "the contender used no CPU after it was ready"
            time.sleep(0.01)
        assert c.running()
    assert c.proc is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


@pytest.mark.timeout(120)
def test_contender_that_cannot_compute_names_why(tmp_path: Path) -> None:
    from kvtier.bench.cuda_bench_copies import BenchCheckFailed
    from kvtier.bench.cuda_bench_prefill import Contender

    contender = Contender(60.0, tmp_path / "c.log", device="no-such-device", size=8)
    with pytest.raises(BenchCheckFailed, match="contender exited"):
        contender.__enter__()
    assert contender.proc is None  # reaped


@pytest.mark.timeout(120)
def test_contender_ends_by_itself_within_its_limit(tmp_path: Path) -> None:
    from kvtier.bench.cuda_bench_prefill import Contender

    with Contender(0.5, tmp_path / "c.log", device="cpu", size=8) as c:
        assert c.proc is not None
        c.proc.wait(timeout=60)
        assert not c.running()


# The engine copy mode's sections run unchanged on the CPU (StagedCopier copies at once there):
# against a real kvtierd, they move real bytes through a staging area, layer by layer.
@pytest.mark.timeout(180)
def test_engine_mode_bandwidth_moves_the_bytes_on_the_cpu(daemon_factory: Any) -> None:
    from kvtier.bench.cuda_bench_copies import engine_bandwidth

    d = daemon_factory("--hicache-size", "128MiB", "--extent-size", "16MiB")
    res = cb.derive({"baseline_h2d_gbps": 1.0, "baseline_d2h_gbps": 1.0})
    res.update(engine_bandwidth(d.runtime_dir, pages=2, repeats=2, salt=7, device="cpu"))
    cb.derive(res)
    assert res["engine_load_gbps"] > 0 and res["engine_store_gbps"] > 0
    assert res["engine_load_over_baseline"] == res["engine_load_gbps"]


@pytest.mark.timeout(240)
def test_engine_mode_prefill_loads_layer_by_layer_on_the_cpu(
    daemon_factory: Any, tmp_path: Path
) -> None:
    import torch
    from kvtier.bench.cuda_bench_prefill import prefill_overlap
    from kvtier.engine.model import ModelConfig, TinyLlama

    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_size=128,
        dtype=torch.float32,
    )
    d = daemon_factory("--hicache-size", "64MiB", "--extent-size", "4MiB")
    res = prefill_overlap(
        "engine", d.runtime_dir, (TinyLlama(cfg), cfg), 320, 192, 2, 60.0, "engine_", 11, "cpu"
    )
    assert res["engine_logits_equal"] and res["engine_contended_logits_equal"], res
    assert res["engine_prefill_overlap"] > 0 and res["engine_contended_prefill_overlap"] > 0
    assert res["kv_bytes_loaded"] == 3 * cfg.n_layers * 2 * 64 * 2 * 16 * 4


def test_the_engine_mode_is_put_against_its_host_copy_bound() -> None:
    """A load's two stages overlap (the slower bounds it); a store's add up."""
    bw = _bandwidth(
        host_copy_t2_load_gbps=21.0,
        host_copy_t2_store_gbps=40.0,
        host_copy_t8_load_gbps=100.0,
        engine_threads_load_gbps=25.0,
        engine_threads_store_gbps=10.0,
    )
    assert bw["engine_load_over_host_bound"] == pytest.approx(42.0 / 21.0)
    assert bw["engine_store_over_host_bound"] == pytest.approx(34.0 / 20.0)  # 1/(1/40 + 1/40)
    assert bw["engine_threads_load_over_host_bound"] == pytest.approx(25.0 / 50.0)  # DMA bounds
    assert "engine_threads_store_over_host_bound" not in bw  # no 8-thread store copy measured
    _, lines = cb.verdict({"bandwidth": bw, "prefill": _prefill()}, [])
    assert "engine_load_over_host_bound = 2.000 (no target)" in lines


def test_host_copy_moves_the_bytes_both_ways_in_threads() -> None:
    from kvtier.bench.cuda_bench_copies import host_copy

    figures = host_copy(pages=2, repeats=1, threads=3)
    assert set(figures) == {
        f"host_copy_t3_{d}_{f}" for d in ("load", "store") for f in ("gbps", "best_s")
    }
    assert all(v > 0 for v in figures.values())
