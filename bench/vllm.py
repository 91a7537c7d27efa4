"""``kvtier bench vllm``: a real vLLM (CPU) reusing a long prefix through kvtierd.

Every measurement is taken in a fresh vLLM process (bench/vllm_engine.py), on a random
Llama whose 4K-token prefill takes about a second here (vllm_engine.BENCH_MODEL), with
vLLM's own prefix caching off, greedy decoding, and a warm-up request per process:

1. a kvtier engine computes prompts P (4K tokens each) and exits: their pages are in L2;
2. a fresh kvtier engine runs P (hits: loaded from L2) and cold prompts Q (misses);
3. a fresh engine without a connector runs P (recomputed) and Q;
4. an engine with vLLM's ``ExampleConnector`` (its reference disk connector) computes P,
   and a fresh one runs P (loaded from its safetensors files).

Fields (medians over the prompts):

- ``ttft_hit_over_recompute``: time to first token of P with kvtier / without a connector;
- ``miss_overhead``: time to first token of Q with kvtier / without a connector;
- ``kvtier_over_example_connector``: ExampleConnector's load time / kvtier's load time,
  where a load time is measured in the engine from the step that starts the request's
  load to the moment its KV is in vLLM's blocks (kvtier: queued in ``start_load_kv`` until
  its asynchronous load ended; ExampleConnector: its synchronous ``start_load_kv``);
  above 1, kvtier loads faster;
- ``outputs_match``: kvtier's tokens and logprobs for P and Q equal the recomputed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.client.daemon_process import DaemonProcess

__all__ = ["main", "run_vllm_bench"]

TARGETS = {"ttft_hit_over_recompute": ("<=", 0.3), "miss_overhead": ("<=", 1.05),
           "kvtier_over_example_connector": (">=", 3.0)}


def _prompt(seed: int, n: int, vocab: int = 8000) -> list[int]:
    return [(seed * 7919 + i * 37 + (i * i) % 101) % vocab + 3 for i in range(n)]


def _engine(cfg: dict[str, Any], log: Path, timeout: float = 900.0) -> dict[str, Any]:
    """Run one fresh engine process; its JSON answer."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    cfg_path = log.with_suffix(".json")
    cfg_path.write_text(json.dumps(cfg))
    with open(log, "ab") as err:
        done = subprocess.run([sys.executable, "-m", "kvtier.bench.vllm_engine", str(cfg_path)],
                              stdout=subprocess.PIPE, stderr=err, env=env, timeout=timeout,
                              check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vLLM engine ({cfg.get('connector')}) exited {done.returncode}:\n{tail}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def run_vllm_bench(tokens: int = 4096, prompts: int = 3) -> dict[str, Any]:
    """Run the benchmark; the result fields (see the module docstring)."""
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    daemon = DaemonProcess(tmp / "rt", ["--hicache-storage-backend", "none", "--hicache-size",
                                        "1GiB", "--log-level", "warning"])
    try:
        model = str(tmp / "model")
        _engine({"model": model, "make_model": True}, tmp / "model.log")
        hits = {f"P{i}": _prompt(100 + i, tokens) for i in range(prompts)}
        cold = {f"Q{i}": _prompt(200 + i, tokens) for i in range(prompts)}
        warm = _prompt(300, tokens)
        daemon.start()
        base = {"model": model, "runtime_dir": str(daemon.runtime_dir),
                "example_dir": str(tmp / "example")}
        (tmp / "example").mkdir()
        _engine({**base, "connector": "kvtier", "prompts": hits}, tmp / "prime.log")
        kv = _engine({**base, "connector": "kvtier", "warmup": warm, "prompts": {**hits, **cold}},
                     tmp / "kvtier.log")
        plain = _engine({**base, "connector": "none", "warmup": warm,
                         "prompts": {**hits, **cold}}, tmp / "plain.log")
        _engine({**base, "connector": "example", "prompts": hits}, tmp / "example-prime.log")
        ex = _engine({**base, "connector": "example", "warmup": _prompt(301, tokens),
                      "prompts": hits}, tmp / "example.log")
    finally:
        daemon.stop()
        daemon.remove_pool()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(run: dict[str, Any], labels: Any, field: str = "ttft_s") -> float:
        return statistics.median(run[label][field] for label in labels)

    def load_med(run: dict[str, Any]) -> float:
        times = [t for label in hits for t in run[label]["load_s"]]
        return statistics.median(times) if times else float("nan")

    same = all((kv[k]["tokens"], kv[k]["logprobs"]) == (plain[k]["tokens"], plain[k]["logprobs"])
               for k in (*hits, *cold))
    result = {
        "ttft_hit_over_recompute": med(kv, hits) / med(plain, hits),
        "miss_overhead": med(kv, cold) / med(plain, cold),
        "kvtier_over_example_connector": load_med(ex) / load_med(kv),
        "outputs_match": same,
        "example_outputs_match": all(ex[k]["tokens"] == plain[k]["tokens"] for k in hits),
        "prompt_tokens": tokens,
        "prompts": prompts,
        "ttft_hit_s": med(kv, hits), "ttft_recompute_s": med(plain, hits),
        "ttft_cold_kvtier_s": med(kv, cold), "ttft_cold_plain_s": med(plain, cold),
        "ttft_hit_example_s": med(ex, hits),
        "load_kvtier_s": load_med(kv), "load_example_s": load_med(ex),
        "cached_tokens_kvtier": [kv[k]["cached"] for k in hits],
        "cached_tokens_example": [ex[k]["cached"] for k in hits],
        "seconds": round(time.monotonic() - t_start, 1),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    """``kvtier bench vllm [--json [PATH]]``: run it, print the fields (exit 0)."""
    ap = argparse.ArgumentParser(prog="kvtier bench vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH",
                    help="print the result as JSON (to PATH, or stdout without one)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per case (default 3)")
    args = ap.parse_args(argv)
    result = run_vllm_bench(args.tokens, args.prompts)
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        for name, value in result.items():
            target = TARGETS.get(name)
            note = f"   (target {target[0]} {target[1]})" if target else ""
            print(f"{name:32} {value}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
