"""``kvtier bench vllm``: a real vLLM (CPU) reusing a long prefix through kvtierd.

Every engine is a fresh vLLM process (bench/vllm_engine.py) on a random Llama whose
4K-token prefill takes about a second here (vllm_engine.BENCH_MODEL), with vLLM's own
prefix caching off, greedy decoding, and a warm-up request per process:

1. a kvtier engine computes prompts P (4K tokens each) and exits: their pages are in L2;
   an engine with vLLM's ``ExampleConnector`` (its reference disk connector) computes P
   and exits: P is in its safetensors files (in the page cache);
2. three fresh engines run side by side, one request at a time: kvtier (P: hits loaded
   from L2; cold prompts Q: misses), one without a connector (P recomputed, Q) and one
   with ExampleConnector (P loaded from its files). Requests alternate between the
   engines, in an order that turns round every prompt, with a pause between requests so
   each starts with nothing in flight (no store from the one before), so a drift of the
   machine's load falls on every engine alike;
3. an engine without a connector but with vLLM's own prefix caching on runs every prompt
   (untimed): its second request of each prompt reuses the prefix from vLLM's own cache,
   the computation a hit through a connector does. That is the output a connector must
   reproduce bit for bit.

Fields (medians over the prompts):

- ``ttft_hit_over_recompute``: time to first token of P with kvtier / without a connector;
- ``miss_overhead``: time to first token of Q with kvtier / without a connector;
- ``kvtier_over_example_connector``: ExampleConnector's load time / kvtier's load time,
  both measured by the same wrapper around vLLM's calls into the connector (see
  vllm_engine): the time the request waited on its load, i.e. for a load within the
  step (ExampleConnector's; kvtier's layer-wise load of an L2 hit, whose copy overlaps
  the forward pass) the time the step spent in the connector's ``start_load_kv``,
  ``wait_for_layer_load`` and ``get_finished`` calls; above 1, kvtier loads faster;
- ``outputs_match``: kvtier's tokens and logprobs for P and Q equal those vLLM computes the
  same way without a connector: the output compared is each prompt's second request; where
  it reused as many tokens as engine 3's second request (from kvtier, from vLLM's own
  cache), it must equal engine 3's, bit for bit; where it reused none, the recompute's;
  reusing any other number of tokens counts as a mismatch. ``example_outputs_match`` the
  same for ExampleConnector's P; ``kvtier_equals_example``: kvtier's P equal
  ExampleConnector's;
- ``outputs_match_recompute``: kvtier's outputs equal the full recompute's (no connector,
  no prefix cache), ``tokens_match_recompute`` their tokens alone. On a CPU, vLLM computing
  the last tokens of a prompt over reused KV is not bitwise vLLM computing the whole prompt
  at once, whoever supplies that KV (its own prefix cache too: ``native_matches_recompute``);
  ``outputs_differ`` names the prompts that differ from the recompute, how many of their
  tokens that output reused, whether their tokens differ, and by how much their logprobs do;
  ``recompute_repeatable``: vLLM without a connector gave each prompt's first token the same
  logprob both times it computed the prompt (the timed request and the one that generates).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench import report
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["main", "run_vllm_bench"]

TARGETS = {
    "ttft_hit_over_recompute": ("<=", 0.3),
    "miss_overhead": ("<=", 1.05),
    "kvtier_over_example_connector": (">=", 3.0),
}
PAUSE_S = 0.3
"""Pause before each timed request (the previous one's stores end meanwhile)."""


def _prompt(seed: int, n: int, vocab: int = 8000) -> list[int]:
    return [(seed * 7919 + i * 37 + (i * i) % 101) % vocab + 3 for i in range(n)]


class _Engine:
    """One engine process (bench/vllm_engine.py), asked one prompt at a time."""

    def __init__(self, cfg: dict[str, Any], log: Path, timeout: float = 900.0) -> None:
        env = dict(
            os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind"
        )
        self.log, self.timeout, self.name = log, timeout, cfg.get("connector", "model")
        cfg_path = log.with_suffix(".json")
        cfg_path.write_text(json.dumps(cfg))
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.bench.vllm_engine", str(cfg_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
        self._reply()  # {"ready": true}, or {} once a model is written

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.proc.kill()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM engine ({self.name}) gave no answer:\n{tail}")
        return json.loads(line)

    def ask(self, ids: list[int]) -> dict[str, Any]:
        """Run one prompt; the engine's measurements."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"prompt": ids}) + "\n").encode())
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        """End the engine (it exits when its stdin closes)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _run_once(cfg: dict[str, Any], log: Path, prompts: list[list[int]]) -> None:
    """A fresh engine runs ``prompts`` and exits."""
    e = _Engine(cfg, log)
    try:
        for ids in prompts:
            e.ask(ids)
    finally:
        e.close()


def run_vllm_bench(tokens: int = 4096, prompts: int = 3, copy_mode: str = "auto") -> dict[str, Any]:
    """Run the benchmark; the result fields (see the module docstring).

    Args:
        copy_mode: the kvtier engines' ``copy_mode`` (``auto``, ``daemon``: kvtierd copies
            into vLLM's KV memory; ``engine``: vLLM's own allocation, pages staged).
    """
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    daemon = DaemonProcess(
        tmp / "rt",
        ["--hicache-storage-backend", "none", "--hicache-size", "1GiB", "--log-level", "warning"],
    )
    engines: dict[str, _Engine] = {}
    runs: dict[str, dict[str, Any]] = {"kvtier": {}, "none": {}, "example": {}}
    try:
        model = str(tmp / "model")
        _Engine({"model": model, "make_model": True}, tmp / "model.log").close()
        hits = {f"P{i}": _prompt(100 + i, tokens) for i in range(prompts)}
        cold = {f"Q{i}": _prompt(200 + i, tokens) for i in range(prompts)}
        daemon.start()
        base = {
            "model": model,
            "runtime_dir": str(daemon.runtime_dir),
            "example_dir": str(tmp / "example"),
            "pause_s": PAUSE_S,
            "extra": {"copy_mode": copy_mode},
        }
        (tmp / "example").mkdir()
        _run_once({**base, "connector": "kvtier"}, tmp / "prime.log", list(hits.values()))
        _run_once({**base, "connector": "example"}, tmp / "example-prime.log", list(hits.values()))
        for name in runs:
            engines[name] = _Engine({**base, "connector": name}, tmp / f"{name}.log")
            engines[name].ask(_prompt(300, tokens))  # warm-up
        for i, label in enumerate(label for pair in zip(hits, cold) for label in pair):
            names = [n for n in runs if n != "example" or label in hits]
            for name in names if i % 2 == 0 else names[::-1]:
                time.sleep(PAUSE_S)
                runs[name][label] = engines[name].ask({**hits, **cold}[label])
        for e in engines.values():
            e.close()
        engines = {
            "native": _Engine(
                {**base, "connector": "none", "prefix_caching": True}, tmp / "native.log"
            )
        }
        native = {label: engines["native"].ask(ids) for label, ids in {**hits, **cold}.items()}
    finally:
        for e in engines.values():
            e.close()
        daemon.discard()
        shutil.rmtree(tmp, ignore_errors=True)
    kv, plain, ex = runs["kvtier"], runs["none"], runs["example"]

    def med(run: dict[str, Any], labels: Any, field: str = "ttft_s") -> float:
        return statistics.median(run[label][field] for label in labels)

    def load_med(run: dict[str, Any]) -> float:
        times = [t for label in hits for t in run[label]["load_s"]]
        return statistics.median(times) if times else float("nan")

    def out(run: dict[str, Any], label: str) -> tuple[list[int], list[float]]:
        return run[label]["tokens"], run[label]["logprobs"]

    def differ(run: dict[str, Any], labels: Any) -> dict[str, Any]:
        """The labels whose output differs from the recomputed one, and how."""
        return {
            k: {
                "reused_tokens": run[k].get("tokens_cached", 0),
                "tokens_equal": run[k]["tokens"] == plain[k]["tokens"],
                "max_logprob_diff": round(
                    max(abs(a - b) for a, b in zip(run[k]["logprobs"], plain[k]["logprobs"])), 4
                ),
            }
            for k in labels
            if out(run, k) != out(plain, k)
        }

    def equal(run: dict[str, Any], labels: Any) -> bool:
        """``run``'s outputs equal those vLLM computes the same way without a connector:
        reusing as many tokens from its own prefix cache, or none (recomputed)."""

        def ref(k: str) -> dict[str, Any] | None:
            reused = run[k]["tokens_cached"]
            return {native[k]["tokens_cached"]: native, 0: plain}.get(reused)

        return all((r := ref(k)) is not None and out(run, k) == out(r, k) for k in labels)

    both = (*hits, *cold)
    return {
        "ttft_hit_over_recompute": med(kv, hits) / med(plain, hits),
        "miss_overhead": med(kv, cold) / med(plain, cold),
        "kvtier_over_example_connector": load_med(ex) / load_med(kv),
        "outputs_match": equal(kv, both),
        "example_outputs_match": equal(ex, hits),
        "kvtier_equals_example": all(out(kv, k) == out(ex, k) for k in hits),
        "outputs_match_recompute": not differ(kv, both),
        "tokens_match_recompute": all(kv[k]["tokens"] == plain[k]["tokens"] for k in both),
        "native_matches_recompute": not differ(native, both),
        "reused_tokens": {
            "kvtier": [kv[k]["tokens_cached"] for k in both],
            "native": [native[k]["tokens_cached"] for k in both],
        },
        "outputs_differ": {
            "kvtier": differ(kv, both),
            "example": differ(ex, hits),
            "native": differ(native, both),
        },
        "recompute_repeatable": all(
            v["first"] == [v["tokens"][0], v["logprobs"][0]] for v in plain.values()
        ),
        "copy_mode": copy_mode,
        "prompt_tokens": tokens,
        "prompts": prompts,
        "ttft_hit_s": med(kv, hits),
        "ttft_recompute_s": med(plain, hits),
        "ttft_cold_kvtier_s": med(kv, cold),
        "ttft_cold_plain_s": med(plain, cold),
        "ttft_hit_example_s": med(ex, hits),
        "load_kvtier_s": load_med(kv),
        "load_example_s": load_med(ex),
        "cached_tokens_kvtier": [kv[k]["cached"] for k in hits],
        "cached_tokens_example": [ex[k]["cached"] for k in hits],
        "ttft_each_s": {
            name: {k: round(v["ttft_s"], 4) for k, v in run.items()} for name, run in runs.items()
        },
        "load_each_s": {
            name: [round(t, 5) for k in hits for t in run[k]["load_s"]]
            for name, run in runs.items()
            if name != "none"
        },
        "seconds": round(time.monotonic() - t_start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """``kvtier bench vllm [--copy-mode MODE] [--json [PATH]]``: run it, print the fields
    (exit 0)."""
    ap = argparse.ArgumentParser(prog="kvtier bench vllm", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print the result as JSON (to PATH, or stdout without one)",
    )
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per case (default 3)")
    ap.add_argument(
        "--copy-mode",
        choices=("auto", "daemon", "engine"),
        default="auto",
        help="the kvtier engines' copy_mode (default auto: daemon on the CPU)",
    )
    args = ap.parse_args(argv)
    result = run_vllm_bench(args.tokens, args.prompts, args.copy_mode)
    report(result, args.json, TARGETS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
