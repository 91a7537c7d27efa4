"""``kvtier bench sglang``: kvtier as SGLang's HiCache storage backend, against SGLang's own.

Two figures, from one run:

**Pages per second, backup and prefetch**, through SGLang 0.5.23's real
``HiCacheController`` (its backup thread and its prefetch threads, driven as its radix cache
drives them; :mod:`kvtier.bench.sglang_stack`), for the same pages (``page_first`` host
layout, bf16, 8 layers × 4 heads × 128 dims × 16 tokens = 256 KiB a page) with two storage
backends in the same process:

- kvtier (``--hicache-storage-backend dynamic``, ``"allocator": "shm"``): a private
  kvtierd, L2 only; backup = STORE from SGLang's host pool into kvtierd's pool, prefetch =
  LOOKUP + LOAD back into SGLang's host pool (the pages are in L2);
- SGLang's built-in ``file`` backend (``HiCacheFile``), in a temp directory under /tmp:
  one file per page, written and read through the page cache.

Each repetition backs up a fresh sequence with both (who goes first alternates), then
prefetches it back; the ratios ``backup_over_hicachefile`` and ``prefetch_over_hicachefile``
are medians over the repetitions of HiCacheFile's time / kvtier's time in the same
repetition.

**Hit rate, 4 instances, same total memory**: one kvtier pool of S pages shared by the 4
instances vs 4 private pools of S/4 (:mod:`kvtier.bench.sglang_sharing` explains the
workload and why it is fair).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.sglang_sharing import run_sharing
from kvtier.bench.sglang_stack import Stack, build_stack
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["main", "run_sglang_bench"]

GEOMETRY: dict[str, Any] = {"layers": 8, "heads": 4, "head_dim": 128, "page_size": 16}
"""256 KiB pages (bf16)."""


def _fill(stack: Stack, idx: Any, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    buf = stack.host.kv_buffer
    flat = torch.randint(
        -32768,
        32768,
        (stack.host.get_dummy_flat_data_page().numel(),),
        dtype=torch.int16,
        generator=gen,
    ).view(buf.dtype)
    for i in range(len(idx) // stack.page):
        stack.host.set_from_flat_data_page(int(idx[i * stack.page]), flat)


def _round(stack: Stack, tokens: list[int], seed: int) -> tuple[float, float]:
    """Back ``tokens`` up, then prefetch them back: ``(backup s, prefetch s)``."""
    keys = stack.keys(tokens)
    idx = stack.alloc(len(tokens))
    _fill(stack, idx, seed)
    t0 = time.perf_counter()
    done = stack.backup(idx, tokens, keys)
    t1 = time.perf_counter()
    stack.host.free(idx)
    if done != len(tokens):
        raise RuntimeError(
            f"{type(stack.backend).__name__}: backed up {done} of {len(tokens)} tokens"
        )
    t2 = time.perf_counter()
    got, _, done, _ = stack.prefetch(tokens)
    t3 = time.perf_counter()
    if got is not None:
        stack.host.free(got)
    if done != len(tokens):
        raise RuntimeError(f"{type(stack.backend).__name__}: prefetched {done} of {len(tokens)}")
    return t1 - t0, t3 - t2


def run_throughput(pages: int = 256, repeats: int = 5) -> dict[str, Any]:
    """Backup and prefetch pages/s, kvtier vs HiCacheFile (see the module doc)."""
    ps = GEOMETRY["page_size"]
    page_bytes = 2 * GEOMETRY["layers"] * ps * GEOMETRY["heads"] * GEOMETRY["head_dim"] * 2
    pool_mib = max(256, 2 * (repeats + 1) * pages * page_bytes >> 20)
    tmp = Path(tempfile.mkdtemp(prefix="kvsgb-", dir="/tmp"))
    daemon = DaemonProcess(
        tmp / "rt",
        ["--hicache-size", f"{pool_mib}MiB", "--hicache-storage-backend", "none"],
        isolated=True,
    )
    stacks: list[Stack] = []
    try:
        daemon.start()
        extra = {
            "backend_name": "kvtier",
            "module_path": "kvtier.client.adapters.sglang",
            "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1,
            "allocator": "shm",
            "hicache_storage_pass_prefix_keys": True,
            "runtime_dir": str(daemon.runtime_dir),
        }
        host_tokens = (pages + 1) * ps
        kv = build_stack("page_first", "dynamic", extra, host_tokens=host_tokens, **GEOMETRY)
        stacks.append(kv)
        hf = build_stack(
            "page_first",
            "file",
            {"file_storage_path": str(tmp / "hicache")},
            host_tokens=host_tokens,
            publish=False,
            **GEOMETRY,
        )
        stacks.append(hf)
        if not kv.backend.connected:
            raise RuntimeError(f"kvtier backend did not register:\n{daemon.log_tail()}")
        times: dict[str, list[tuple[float, float]]] = {"kvtier": [], "file": []}
        for rep in range(repeats + 1):  # the first is a warm-up
            order = [("kvtier", kv), ("file", hf)] if rep % 2 else [("file", hf), ("kvtier", kv)]
            for name, stack in order:
                base = (rep * 2 + (name == "file")) * 1_000_000
                tokens = [base + i for i in range(pages * ps)]
                t = _round(stack, tokens, seed=rep)
                if rep:
                    times[name].append(t)
    finally:
        for s in stacks:
            s.close()
        daemon.discard()
        shutil.rmtree(tmp, ignore_errors=True)

    def rate(name: str, k: int) -> float:
        return pages / statistics.median(t[k] for t in times[name])

    def ratio(k: int) -> float:
        return statistics.median(
            f[k] / v[k] for f, v in zip(times["file"], times["kvtier"], strict=True)
        )

    return {
        "pages": pages,
        "page_bytes": page_bytes,
        "repeats": repeats,
        "kvtier_backup_pages_s": round(rate("kvtier", 0), 1),
        "hicachefile_backup_pages_s": round(rate("file", 0), 1),
        "kvtier_prefetch_pages_s": round(rate("kvtier", 1), 1),
        "hicachefile_prefetch_pages_s": round(rate("file", 1), 1),
        "backup_over_hicachefile": round(ratio(0), 3),
        "prefetch_over_hicachefile": round(ratio(1), 3),
    }


def run_sglang_bench(
    pages: int = 256, repeats: int = 5, instances: int = 4, pool_pages: int = 512
) -> dict[str, Any]:
    """Both figures (see the module doc)."""
    out = run_throughput(pages, repeats)
    out.update(run_sharing(instances, pool_pages))
    return out


def _report(r: dict[str, Any]) -> str:
    mib = r["page_bytes"] / 2**20
    lines = [
        (
            f"SGLang HiCache controller, {r['pages']} pages of {mib:.2f} MiB, median of "
            f"{r['repeats']} (pages/s):"
        ),
        f"  {'':10} {'kvtier':>10} {'HiCacheFile':>12} {'ratio':>7}  target",
        (
            f"  {'backup':10} {r['kvtier_backup_pages_s']:>10.0f} "
            f"{r['hicachefile_backup_pages_s']:>12.0f} {r['backup_over_hicachefile']:>7.2f}  >= 4"
        ),
        (
            f"  {'prefetch':10} {r['kvtier_prefetch_pages_s']:>10.0f} "
            f"{r['hicachefile_prefetch_pages_s']:>12.0f} {r['prefetch_over_hicachefile']:>7.2f}  >= 4"
        ),
        f"{r['instances']} instances, same total memory ({r['pool_pages']} pages):",
        f"  one shared kvtier pool of {r['pool_pages']} pages: hit rate {r['shared_hit_rate']:.3f}",
        (
            f"  {r['instances']} private pools of {r['private_pool_pages']} pages:   hit rate "
            f"{r['private_hit_rate']:.3f}   (ceiling {r['hit_ceiling']:.2f})"
        ),
        f"  workload: {r['workload']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvtier bench sglang [--json PATH]``: run both figures, print them, optionally save."""
    p = argparse.ArgumentParser(prog="kvtier bench sglang", description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--pages", type=int, default=256, help="pages per measurement")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions")
    p.add_argument("--instances", type=int, default=4, help="instances sharing the node")
    p.add_argument("--pool-pages", type=int, default=512, help="total pages of L2 (S)")
    args = p.parse_args(argv)
    try:
        import sglang  # noqa: F401
    except ImportError:
        print("kvtier bench sglang needs SGLang installed (sglang 0.5.23)", file=sys.stderr)
        return 2
    result = run_sglang_bench(args.pages, args.repeats, args.instances, args.pool_pages)
    print(_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
