"""GPU benchmark of kvtier's CUDA paths: copy bandwidth of both copy modes, and per-layer overlap.

Run ``python -m kvtier.bench.cuda_bench [--json out.json]`` on a machine with an NVIDIA GPU and
the ``cuda`` extra. One prepared run, sized to finish in 2-3 minutes on an H200, against private
kvtierd processes with an 8 GiB host pool (one after the other: ``--cuda-copy dma``, then
``--cuda-copy kernel``). Without a GPU it says why, writes ``{"status": "no_gpu", ...}`` to
``--json`` and exits 0 (``bench/gpu_check.sh`` runs it only once a GPU was found, and accepts
only ``"status": "measured"``).

1. Bandwidth (:mod:`~kvtier.bench.cuda_bench_copies`). 128 whole pages of a Llama-3-8B-like rank
   (32 layers, 8 KV heads of 128, bf16, 64-token pages: 8 MiB a page, 1 GiB a transfer) are
   stored and loaded back into other pages in each copy mode: the daemon mode (CUDA IPC, kvtierd
   copies; fields ``load_gbps`` ...), the engine mode (a pinned staging area, the engine copies;
   ``engine_load_gbps`` ...), and the daemon mode with kvtierd's copy kernels instead of DMA
   (``kernel_load_gbps`` ...; ``faster_cuda_copy`` says which of the two was faster). The
   baseline moves the same bytes with one pinned ``cudaMemcpyAsync`` each way. Targets:
   ``load_over_baseline``, ``store_over_baseline`` and their ``engine_`` twins >= 0.8. The
   engine mode is measured again against a kvtierd with ``--engine-copy-threads`` copy
   threads (``engine_threads_load_gbps`` ..., no target): its staging ↔ pool copies run on the
   daemon's CPU threads, which bound that mode. A plain host copy of the same bytes between
   shared memory and pinned memory with 2 and ``--engine-copy-threads`` threads
   (``host_copy_t2_load_gbps`` ...) gives the bound those two stages allow on this host
   (``engine_load_over_host_bound`` ..., no target). The loaded bytes are checked.
2. Prefill overlap (:mod:`~kvtier.bench.cuda_bench_prefill`): an 8192-token prefill whose first
   4096 tokens' KV is loaded layer by layer, against the same prefill over resident KV, alone
   on the GPU and with a second process running matmuls on it (``contended_``), in both copy
   modes (and the daemon mode with copy kernels, ``kernel_``, and the engine mode with more
   copy threads, ``engine_threads_``, and the engine mode with its copies gathered and
   scattered through a device buffer, ``engine_gathered_``). Targets: ``prefill_overlap``,
   ``contended_prefill_overlap`` and their ``engine_`` twins <= 1.1; every ``*logits_equal``
   true. The ``kernel_``, ``engine_threads_`` and ``engine_gathered_`` figures have no
   target: they tell which daemon copy to choose, what the engine mode gains from more copy
   threads, and from copying consecutive blocks directly.

Every figure is the median of the timed runs after a warm-up (best also reported). Each
section prints its figures as it ends, and ``--json`` is rewritten then with ``"status":
"partial"``, so what was measured survives a run stopped from outside.

Exit status: 0 when every target is met (or there is no GPU), 2 when measured but a target is
missed or the logits differ, 1 when a section could not run or failed a check (wrong bytes, a
failed transfer; its error is printed), or was not started because ``--budget-s`` had passed
(a section whose figures have no target is then reported as skipped, not as an error).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from kvtier.bench.cuda_bench_copies import (
    BenchCheckFailed,
    baseline,
    daemon_bandwidth,
    engine_bandwidth,
    host_copy,
)
from kvtier.bench.cuda_bench_prefill import build_model, prefill_overlap
from kvtier.config import KvtierError
from kvtier.ipc.cuda_ipc import cuda_unavailable_reason

__all__ = [
    "BANDWIDTH_MODES",
    "TARGETS",
    "BenchCheckFailed",
    "derive",
    "main",
    "parse_args",
    "required_targets",
    "verdict",
]

TARGETS = {
    "load_over_baseline": 0.8,
    "store_over_baseline": 0.8,
    "engine_load_over_baseline": 0.8,
    "engine_store_over_baseline": 0.8,
    "prefill_overlap": 1.1,
    "contended_prefill_overlap": 1.1,
    "engine_prefill_overlap": 1.1,
    "engine_contended_prefill_overlap": 1.1,
}
"""Bandwidth ratios (``*_over_baseline``) must reach their target, prefill ratios stay under it."""

BANDWIDTH_MODES = {
    "": "daemon mode, DMA",
    "engine_": "engine mode",
    "kernel_": "daemon mode, kernels",
    "engine_threads_": "engine, copy threads",
}
"""Field prefix of each measured copy path."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvtier.bench.cuda_bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--pool", default="8GiB", help="kvtierd host pool size (default 8GiB)")
    p.add_argument(
        "--pages", type=int, default=128, help="pages per bandwidth transfer (8 MiB each)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per bandwidth figure")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--cached-tokens", type=int, default=4096, help="a multiple of 64")
    p.add_argument("--prefill-repeats", type=int, default=8, help="timed runs per prefill figure")
    p.add_argument(
        "--contender-s",
        type=float,
        default=60.0,
        help="the GPU contender ends by itself after this many seconds (default 60)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=170.0,
        help="start no section past this many seconds (default 170; it then counts as failed)",
    )
    p.add_argument("--skip-prefill", action="store_true", help="only the bandwidth sections")
    p.add_argument("--skip-contended", action="store_true", help="no prefill with a second process")
    p.add_argument(
        "--skip-kernel", action="store_true", help="no second kvtierd with --cuda-copy kernel"
    )
    p.add_argument(
        "--engine-copy-threads",
        type=int,
        default=8,
        help="also measure the engine mode against a kvtierd with this many copy threads "
        "(its CPU copies bound that mode; default 8, 0 = not)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; exits 2 with a message on a bad value."""
    p = _parser()
    args = p.parse_args(argv)
    for name in ("pages", "repeats", "prefill_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.engine_copy_threads <= 64:
        p.error(f"--engine-copy-threads must be in 0..64, got {args.engine_copy_threads}")
    if args.contender_s <= 0 or args.budget_s <= 0:
        p.error("--contender-s and --budget-s must be > 0")
    return args


def required_targets(args: argparse.Namespace) -> list[str]:
    """The targets this run must measure (the sections it skips have none)."""
    names = [n for n in TARGETS if n.endswith("_over_baseline")]
    if not args.skip_prefill:
        names += ["prefill_overlap", "engine_prefill_overlap"]
        if not args.skip_contended:
            names += ["contended_prefill_overlap", "engine_contended_prefill_overlap"]
    return names


def derive(bw: dict[str, Any], engine_copy_threads: int = 8) -> dict[str, Any]:
    """Add each path's ratios to the baseline, and which daemon copy was faster, to ``bw``
    (the bandwidth figures) where both sides were measured; returns it.

    The engine mode's figures are also put against the bound its two stages allow on this
    host (``engine_load_over_host_bound`` ..., no target): a plain host copy with as many
    threads as kvtierd copies with (2, its default, and ``engine_copy_threads`` for the
    ``engine_threads_`` run) combined with the pinned ``cudaMemcpyAsync`` baseline."""
    for p in BANDWIDTH_MODES:
        for name, base in (("load", "baseline_h2d_gbps"), ("store", "baseline_d2h_gbps")):
            if f"{p}{name}_gbps" in bw and base in bw:
                bw[f"{p}{name}_over_baseline"] = bw[f"{p}{name}_gbps"] / bw[base]
    for p, threads in (("engine_", 2), ("engine_threads_", engine_copy_threads)):
        host = f"host_copy_t{threads}_"
        if all(k in bw for k in (f"{p}load_gbps", f"{host}load_gbps", "baseline_h2d_gbps")):
            # a load's layers flow through both stages at once: the slower one bounds it
            bound = min(bw[f"{host}load_gbps"], bw["baseline_h2d_gbps"])
            bw[f"{p}load_over_host_bound"] = bw[f"{p}load_gbps"] / bound
        if all(k in bw for k in (f"{p}store_gbps", f"{host}store_gbps", "baseline_d2h_gbps")):
            # a store copies every page to staging, then STOREs them: the stages add up
            bound = 1.0 / (1.0 / bw[f"{host}store_gbps"] + 1.0 / bw["baseline_d2h_gbps"])
            bw[f"{p}store_over_host_bound"] = bw[f"{p}store_gbps"] / bound
    if all(f"{p}{d}_gbps" in bw for p in ("", "kernel_") for d in ("load", "store")):
        bw["faster_cuda_copy"] = {
            d: "dma" if bw[f"{d}_gbps"] >= bw[f"kernel_{d}_gbps"] else "kernel"
            for d in ("load", "store")
        }
    return bw


def verdict(results: dict[str, Any], required: Sequence[str]) -> tuple[bool, list[str]]:
    """Lines comparing each required ratio with its target (a missing one is missed), the
    logits checks and the informational figures; and whether all targets are met."""
    lines: list[str] = []
    ok = True
    bw, pf = results.get("bandwidth") or {}, results.get("prefill") or {}
    for p, label in BANDWIDTH_MODES.items():
        for d, base in (("load", "baseline_h2d_gbps"), ("store", "baseline_d2h_gbps")):
            if f"{p}{d}_gbps" in bw and base in bw:
                lines.append(
                    f"{d:5s} {label:20s}: {bw[f'{p}{d}_gbps']:6.1f} GB/s vs {bw[base]:6.1f} GB/s "
                    f"cudaMemcpyAsync (pinned)"
                )
    for name in required:
        group = bw if name.endswith("_over_baseline") else pf
        target = TARGETS[name]
        value = group.get(name)
        if value is None:
            ok = False
            lines.append(f"{name}: not measured (target {target}) MISSED")
            continue
        met = value >= target if name.endswith("_over_baseline") else value <= target
        ok &= met
        op = ">=" if name.endswith("_over_baseline") else "<="
        lines.append(f"{name} = {value:.3f} (target {op} {target}) {'OK' if met else 'MISSED'}")
    for name in sorted(bw):
        if name.endswith("_over_host_bound"):
            lines.append(f"{name} = {bw[name]:.3f} (no target)")
    for name in sorted(pf):
        if name.endswith("prefill_overlap") and name not in required:
            lines.append(f"{name} = {pf[name]:.3f} (no target)")
        if name.endswith("logits_equal"):
            diff = pf.get(name.replace("logits_equal", "max_abs_logit_diff"), float("nan"))
            ok &= bool(pf[name])
            lines.append(
                f"{name}: {pf[name]} (max |diff| {diff:.2e}) {'OK' if pf[name] else 'MISSED'}"
            )
    if "faster_cuda_copy" in bw:
        lines.append(f"faster daemon copy (--cuda-copy): {bw['faster_cuda_copy']}")
    return ok, lines


class _Run:
    """The sections of one run: each timed, its error recorded, none started past the budget."""

    def __init__(self, budget_s: float, checkpoint: Callable[[], None] | None = None) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.errors: list[str] = []
        self.skipped: list[str] = []
        self.checkpoint = checkpoint

    def over_budget(self) -> bool:
        """Whether the budget has passed (no section starts any more)."""
        return time.monotonic() - self.start > self.budget_s

    def section(
        self,
        name: str,
        into: dict[str, Any],
        fn: Callable[[], dict[str, Any]],
        optional: bool = False,
    ) -> None:
        """Run ``fn`` and merge its figures into ``into``; record its error, or that it was
        not started because the budget had passed (an error, unless the section is
        ``optional``: its figures have no target)."""
        elapsed = time.monotonic() - self.start
        if elapsed > self.budget_s:
            note = f"{name}: not started, {elapsed:.0f}s past --budget-s"
            (self.skipped if optional else self.errors).append(note)
            print(f"[{name}: skipped, past the budget]", flush=True)
            return
        print(f"[{name} at {elapsed:.1f}s]", flush=True)
        t0 = time.monotonic()
        try:
            figures = fn()
            into.update(figures)
            print(json.dumps(figures, default=str), flush=True)
        except (KvtierError, RuntimeError, ValueError, OSError) as err:  # report, run the next
            self.errors.append(f"{name}: {type(err).__name__}: {err}")
            traceback.print_exc()
        print(f"[{name}: {time.monotonic() - t0:.1f}s]", flush=True)
        if self.checkpoint is not None:  # what is measured so far survives a kill
            self.checkpoint()


def _measure(args: argparse.Namespace, results: dict[str, Any], run: _Run, tmp: Path) -> None:
    from kvtier.launch.daemon_process import DaemonProcess

    bw: dict[str, Any] = results["bandwidth"]
    pf: dict[str, Any] = results["prefill"]
    model: list[Any] = []

    def prefill(
        mode: Any, rdir: Path, prefix: str, salt: int, direct: bool = True
    ) -> dict[str, Any]:
        if not model:
            model.append(build_model())
        contender = None if args.skip_contended else args.contender_s
        return prefill_overlap(
            mode,
            rdir,
            model[0],
            args.prompt_tokens,
            args.cached_tokens,
            args.prefill_repeats,
            contender,
            prefix,
            salt,
            direct=direct,
        )

    run.section("baseline", bw, lambda: baseline(args.pages, args.repeats))
    for threads in sorted({2, args.engine_copy_threads} - {0}):
        run.section(
            f"host copy, {threads} threads",
            bw,
            functools.partial(host_copy, args.pages, args.repeats, threads),
            False,
        )
    daemons = ["dma"] if args.skip_kernel else ["dma", "kernel"]
    if args.engine_copy_threads:
        daemons.append("threads")
    for which in daemons:
        cuda_copy = "dma" if which == "threads" else which
        threads = ["--copy-threads", str(args.engine_copy_threads)] if which == "threads" else []
        label = " ".join(threads) if threads else f"--cuda-copy {cuda_copy}"
        daemon = DaemonProcess(
            tmp / which,
            [
                "--hicache-storage-backend",
                "none",
                "--hicache-size",
                args.pool,
                "--extent-size",
                "64MiB",
                "--cuda-copy",
                cuda_copy,
                *threads,
                "--log-level",
                "warning",
            ],
        )
        rdir = daemon.runtime_dir
        part = functools.partial
        pages, reps = args.pages, args.repeats
        sections: list[tuple[str, dict[str, Any], Callable[[], dict[str, Any]]]] = []
        optional = {"engine prefill, gathered copies"} if which == "dma" else None  # None: all
        if which == "threads":
            sections.append(
                (
                    "engine bandwidth",
                    bw,
                    part(engine_bandwidth, rdir, pages, reps, 7000, prefix="engine_threads_"),
                )
            )
            if not args.skip_prefill:
                sections.append(
                    ("engine prefill", pf, part(prefill, "engine", rdir, "engine_threads_", 8000))
                )
        elif cuda_copy == "dma":
            sections += [
                ("daemon bandwidth", bw, part(daemon_bandwidth, rdir, pages, reps, "", 1000)),
                ("engine bandwidth", bw, part(engine_bandwidth, rdir, pages, reps, 2000)),
            ]
            if not args.skip_prefill:
                sections += [
                    ("daemon prefill", pf, part(prefill, "daemon", rdir, "", 3000)),
                    ("engine prefill", pf, part(prefill, "engine", rdir, "engine_", 4000)),
                    (
                        "engine prefill, gathered copies",
                        pf,
                        part(prefill, "engine", rdir, "engine_gathered_", 9000, direct=False),
                    ),
                ]
        else:
            sections.append(
                ("daemon bandwidth", bw, part(daemon_bandwidth, rdir, pages, reps, "kernel_", 5000))
            )
            if not args.skip_prefill:
                sections.append(
                    ("daemon prefill", pf, part(prefill, "daemon", rdir, "kernel_", 6000))
                )
        if run.over_budget():  # record each section as not started; start no daemon
            for name, into, fn in sections:
                run.section(f"{name} ({label})", into, fn, optional is None or name in optional)
            continue
        errors_before = len(run.errors)
        try:
            print(f"[kvtierd {label}: starting]", flush=True)
            try:
                daemon.start(timeout=120.0)
            except (KvtierError, RuntimeError, OSError, TimeoutError) as err:
                run.errors.append(f"kvtierd {label}: {type(err).__name__}: {err}")
                continue
            for name, into, fn in sections:
                run.section(f"{name} ({label})", into, fn, optional is None or name in optional)
        finally:
            daemon.stop()
            if len(run.errors) > errors_before:
                print(f"kvtierd {label} log tail:\n{daemon.log_tail(60)}")
            daemon.remove_pool()
    derive(bw, args.engine_copy_threads)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Replace ``path`` with ``obj`` whole: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring for the exit status.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    args = parse_args(argv)
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"cuda_bench: nothing measured: kvtier's GPU path {reason}")
        if args.json is not None:
            args.json.write_text(
                json.dumps({"status": "no_gpu", "reason": reason, "targets": TARGETS}, indent=2)
            )
        return 0
    results: dict[str, Any] = {
        "status": "measured",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bandwidth": {},
        "prefill": {},
    }
    print(
        f"cuda_bench on {results['device']} (torch {results['torch']}, CUDA {results['cuda']})",
        flush=True,
    )

    def checkpoint() -> None:
        if args.json is not None:  # whole or not at all: the run may be killed meanwhile
            partial = dict(results, status="partial", errors=run.errors)
            _write_json(args.json, partial)

    run = _Run(args.budget_s, checkpoint)
    tmp = Path(tempfile.mkdtemp(prefix="kvt-cb-", dir="/tmp"))
    try:
        _measure(args, results, run, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok, lines = verdict(results, required_targets(args))
    results["errors"] = run.errors
    results["skipped"] = run.skipped
    results["targets"] = TARGETS
    results["wall_s"] = time.monotonic() - run.start
    for line in (
        lines + [f"error in {e}" for e in run.errors] + [f"skipped {s}" for s in run.skipped]
    ):
        print(line)
    if args.json is not None:
        _write_json(args.json, results)
    if run.errors:
        return 1
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
