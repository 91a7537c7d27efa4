"""GPU benchmark of kvtier's CUDA path: copy bandwidth through kvtierd, and per-layer overlap.

Run ``python -m kvtier.bench.cuda_bench [--json out.json]`` on a machine with an NVIDIA GPU and
the ``cuda`` extra. One prepared run, sized to finish in 2-4 minutes on an H200 (well inside 10),
against a private kvtierd with an 8 GiB host pool. Without a GPU it says why and exits 0.

1. Bandwidth. 128 whole pages of a Llama-3-8B-like rank (32 layers, 8 KV heads of 128, bf16,
   64-token pages: 8 MiB a page, 1 GiB a transfer) are stored (GPU → host pool) and loaded back
   (host pool → other GPU pages) through the daemon. A store is timed from the request to DONE;
   a load from the request to the engine's stream having waited for every layer's event. The
   baseline moves the same bytes with ``copy_(non_blocking=True)`` between one pinned host tensor
   and one device tensor (a single ``cudaMemcpyAsync``). Target: kvtier / baseline >= 0.8, both
   directions. The loaded bytes are checked.
2. Prefill overlap. The reference model (bf16, 16 layers, ~0.9 B parameters) prefills an
   8192-token prompt whose first 4096 tokens' KV is loaded by kvtier, each layer waiting for its
   event just before it reads its KV, against the same prefill with that KV already on the GPU
   (compute alone). Target: overlapped / compute alone <= 1.1. The logits are checked equal.

Every figure is the median of ``--repeats`` runs after a warm-up (best also reported).

Exit status: 0 when every target is met (or there is no GPU), 2 when measured but a target is
missed or a check failed, 1 when a section could not run (its error is printed).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from kvtier.config import ClientConfig, KvtierError
from kvtier.ipc.cuda_ipc import cuda_unavailable_reason
from kvtier.ipc.protocol import Geometry

__all__ = ["BANDWIDTH_GEOMETRY", "TARGETS", "main"]

BANDWIDTH_GEOMETRY = Geometry(
    num_layers=32, page_size=64, kv_heads=8, head_dim=128, dtype="bfloat16"
)
TARGETS = {"load_over_baseline": 0.8, "store_over_baseline": 0.8, "prefill_overlap": 1.1}
MODEL_ID = "kvtier-cuda-bench"


class BenchCheckFailed(KvtierError):
    """A correctness check inside the benchmark failed (wrong bytes, a failed transfer)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvtier.bench.cuda_bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--pool", default="8GiB", help="kvtierd host pool size (default 8GiB)")
    p.add_argument(
        "--pages", type=int, default=128, help="pages per bandwidth transfer (8 MiB each)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--cached-tokens", type=int, default=4096, help="a multiple of 64")
    p.add_argument("--skip-prefill", action="store_true", help="only the bandwidth section")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def _tokens(n: int, salt: int, vocab: int = 32000) -> list[int]:
    return [(i * 7919 + salt * 104729) % vocab for i in range(n)]


def _raw(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.uint8).view(buf.shape[0], -1)


def _connect(pool: Any, rdir: Path) -> Any:
    from kvtier.client.connection.connection import Connection

    # generous timeouts: the daemon's first CUDA registration creates a context and pins the pool
    cfg = ClientConfig(runtime_dir=rdir, request_timeout_s=120.0, load_timeout_s=120.0)
    return Connection(pool, model_id=MODEL_ID, config=cfg)


def _timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, with the device idle before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _summary(samples: Sequence[float]) -> dict[str, float]:
    return {"median_s": statistics.median(samples), "best_s": min(samples)}


def bandwidth(rdir: Path, pages: int, repeats: int) -> dict[str, Any]:
    """Store and load ``pages`` pages through kvtierd; the same bytes by cudaMemcpyAsync.

    Returns:
        GB/s (medians), the ratios to the baseline, and the samples.

    Raises:
        BenchCheckFailed: a transfer failed or the loaded bytes differ.
    """
    from kvtier.client.kv_pool.cuda import CudaKVPool

    g = BANDWIDTH_GEOMETRY
    nbytes = pages * g.page_bytes
    pool = CudaKVPool(g, 2 * pages)
    conn = _connect(pool, rdir)
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    bufs = [b for pair in zip(pool.k, pool.v) for b in pair]
    store_s: list[float] = []
    load_s: list[float] = []
    try:
        for b in bufs:
            _raw(b)[:pages].random_(0, 256)
        for r in range(repeats + 1):  # run 0 warms up (kernel compile, first transfer)
            keys = conn.page_keys(_tokens(pages * g.page_size, salt=r))
            t_store = _timed(functools.partial(_store, conn, keys, src, pages))
            t_load = _timed(functools.partial(_load, conn, keys, dst, pages, g.num_layers))
            if r:
                store_s.append(t_store)
                load_s.append(t_load)
        for b in bufs:
            if not torch.equal(_raw(b)[:pages], _raw(b)[pages : 2 * pages]):
                raise BenchCheckFailed("loaded pages differ from the stored ones")
    finally:
        conn.close()
        pool.close()
    h2d, d2h = _baseline(nbytes, repeats)

    def gbps(samples: list[float]) -> float:
        return nbytes / statistics.median(samples) / 1e9

    res: dict[str, Any] = {
        "bytes_per_transfer": nbytes,
        "pages": pages,
        "page_bytes": g.page_bytes,
        "load_gbps": gbps(load_s),
        "store_gbps": gbps(store_s),
        "baseline_h2d_gbps": gbps(h2d),
        "baseline_d2h_gbps": gbps(d2h),
        "load": _summary(load_s),
        "store": _summary(store_s),
        "baseline_h2d": _summary(h2d),
        "baseline_d2h": _summary(d2h),
    }
    res["load_over_baseline"] = res["load_gbps"] / res["baseline_h2d_gbps"]
    res["store_over_baseline"] = res["store_gbps"] / res["baseline_d2h_gbps"]
    return res


def _baseline(nbytes: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of ``copy_(non_blocking=True)`` of ``nbytes`` host -> device and device -> host,
    between one pinned host tensor and one device tensor (one cudaMemcpyAsync each)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = [
        _timed(functools.partial(dev.copy_, host, non_blocking=True)) for _ in range(repeats + 1)
    ]
    d2h = [
        _timed(functools.partial(host.copy_, dev, non_blocking=True)) for _ in range(repeats + 1)
    ]
    return h2d[1:], d2h[1:]


def _store(conn: Any, keys: list[bytes], pages: list[int], n: int) -> None:
    h = conn.store(keys, pages)
    if h.writing != n or not h.wait():
        raise BenchCheckFailed(f"store of {n} pages: {h.writing} written, ok={h.ok}")


def _load(conn: Any, keys: list[bytes], pages: list[int], n: int, layers: int) -> None:
    h = conn.load(keys, pages)
    if h.count != n:
        raise BenchCheckFailed(f"load of {n} pages found {h.count} in L2")
    for layer in range(layers):
        if not h.wait_layer(layer):
            raise BenchCheckFailed(f"load failed at layer {layer}")
    torch.cuda.current_stream().synchronize()  # the engine's stream passed every layer's copies
    if not h.wait():
        raise BenchCheckFailed("load did not end DONE")


def prefill_overlap(
    rdir: Path, prompt_tokens: int, cached_tokens: int, repeats: int
) -> dict[str, Any]:
    """Prefill over KV loaded layer by layer by kvtier, against the same prefill over resident KV.

    Returns:
        Median and best milliseconds of both, their ratio, and whether the logits are equal.

    Raises:
        BenchCheckFailed: a load failed.
    """
    from kvtier.client.kv_pool.cuda import CudaKVPool
    from kvtier.engine.engine import geometry_for
    from kvtier.engine.model import ModelConfig, TinyLlama

    page = 64
    if cached_tokens % page or not 0 < cached_tokens < prompt_tokens:
        raise KvtierError(f"--cached-tokens must be a multiple of {page} in (0, prompt_tokens)")
    cfg = ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        ffn_size=5632,
        dtype=torch.bfloat16,
    )
    model = TinyLlama(cfg).to("cuda")
    n_pages, n_cached = -(-prompt_tokens // page), cached_tokens // page
    pool = CudaKVPool(geometry_for(cfg, page), n_pages + n_cached + 1)
    conn = _connect(pool, rdir)
    prompt = _tokens(prompt_tokens, salt=99, vocab=cfg.vocab_size)
    table_a = list(range(n_pages))  # the prefix's KV computed here, the suffix's pages
    table_b = list(range(n_pages, n_pages + n_cached)) + table_a[n_cached:]  # prefix loaded
    alone_s: list[float] = []
    overlap_s: list[float] = []
    try:
        model.prefill(prompt, 0, table_a, pool.k, pool.v)  # KV of the whole prompt
        keys = conn.page_keys(prompt[:cached_tokens])
        _store(conn, keys, table_a[:n_cached], n_cached)
        out: dict[str, torch.Tensor] = {}

        def alone() -> None:
            out["alone"] = model.prefill(prompt, cached_tokens, table_a, pool.k, pool.v)

        def overlapped() -> None:
            h = conn.load(keys, table_b[:n_cached])
            if h.count != n_cached:
                raise BenchCheckFailed(f"load found {h.count} of {n_cached} pages")

            def gate(layer: int) -> None:
                if not h.wait_layer(layer):
                    raise BenchCheckFailed(f"load failed at layer {layer}")

            out["overlap"] = model.prefill(
                prompt, cached_tokens, table_b, pool.k, pool.v, layer_wait=gate
            )
            h.wait()

        for r in range(repeats + 1):  # alternate the order; run 0 warms up
            first, second = (alone, overlapped) if r % 2 else (overlapped, alone)
            t1, t2 = _timed(first), _timed(second)
            if r:
                (alone_s if first is alone else overlap_s).append(t1)
                (overlap_s if first is alone else alone_s).append(t2)
        equal = bool(torch.equal(out["alone"], out["overlap"]))
        diff = float((out["alone"] - out["overlap"]).abs().max())
    finally:
        conn.close()
        pool.close()
    return {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "layers": cfg.n_layers,
        "kv_bytes_loaded": n_cached * geometry_for(cfg, page).page_bytes,
        "compute_alone_ms": statistics.median(alone_s) * 1e3,
        "overlapped_ms": statistics.median(overlap_s) * 1e3,
        "compute_alone_best_ms": min(alone_s) * 1e3,
        "overlapped_best_ms": min(overlap_s) * 1e3,
        "prefill_overlap": statistics.median(overlap_s) / statistics.median(alone_s),
        "logits_equal": equal,
        "max_abs_logit_diff": diff,
    }


def _verdict(results: dict[str, Any]) -> tuple[bool, list[str]]:
    """Lines comparing each measured ratio with its target, and whether all are met."""
    lines, ok = [], True
    bw, pf = results.get("bandwidth"), results.get("prefill")
    if bw is not None:
        for name, base in (("load", "baseline_h2d"), ("store", "baseline_d2h")):
            ratio, target = bw[f"{name}_over_baseline"], TARGETS[f"{name}_over_baseline"]
            met = ratio >= target
            ok &= met
            lines.append(
                f"{name:5s}: {bw[f'{name}_gbps']:6.1f} GB/s through kvtierd vs "
                f"{bw[f'{base}_gbps']:6.1f} GB/s cudaMemcpyAsync (pinned) -> ratio "
                f"{ratio:.2f} (target >= {target}) {'OK' if met else 'MISSED'}"
            )
    if pf is not None:
        ratio, target = pf["prefill_overlap"], TARGETS["prefill_overlap"]
        met = ratio <= target and pf["logits_equal"]
        ok &= met
        lines.append(
            f"prefill {pf['prompt_tokens']} tokens, {pf['cached_tokens']} loaded per "
            f"layer: {pf['overlapped_ms']:.2f} ms overlapped vs "
            f"{pf['compute_alone_ms']:.2f} ms compute alone -> ratio {ratio:.3f} "
            f"(target <= {target}) {'OK' if ratio <= target else 'MISSED'}; logits "
            f"equal: {pf['logits_equal']} (max |diff| {pf['max_abs_logit_diff']:.2e})"
        )
    return ok, lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring for the exit status.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    args = _parser().parse_args(argv)
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"cuda_bench: nothing measured: kvtier's GPU path {reason}")
        return 0
    from kvtier.launch.daemon_process import DaemonProcess

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    print(
        f"cuda_bench on {results['device']} (torch {results['torch']}, CUDA {results['cuda']})",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="kvt-cb-", dir="/tmp"))
    daemon = DaemonProcess(
        tmp / "d",
        [
            "--hicache-storage-backend",
            "none",
            "--hicache-size",
            args.pool,
            "--extent-size",
            "64MiB",
            "--log-level",
            "warning",
        ],
    )
    errors: list[str] = []
    t_start = time.monotonic()
    try:
        daemon.start(timeout=120.0)
        sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("bandwidth", lambda: bandwidth(daemon.runtime_dir, args.pages, args.repeats))
        ]
        if not args.skip_prefill:
            sections.append(
                (
                    "prefill",
                    lambda: prefill_overlap(
                        daemon.runtime_dir, args.prompt_tokens, args.cached_tokens, 2 * args.repeats
                    ),
                )
            )
        for name, run in sections:
            t0 = time.monotonic()
            try:
                results[name] = run()
            except (KvtierError, RuntimeError, ValueError) as err:  # report it, run the next one
                errors.append(f"{name}: {type(err).__name__}: {err}")
                traceback.print_exc()
            print(f"[{name} section: {time.monotonic() - t0:.1f}s]", flush=True)
    finally:
        daemon.stop()
        if errors:
            print(f"kvtierd log tail:\n{daemon.log_tail(60)}")
        daemon.remove_pool()
        shutil.rmtree(tmp, ignore_errors=True)
    ok, lines = _verdict(results)
    results["errors"] = errors
    results["targets"] = TARGETS
    results["wall_s"] = time.monotonic() - t_start
    for line in lines + [f"error in {e}" for e in errors]:
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if errors:
        return 1
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
