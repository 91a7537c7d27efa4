"""The overlap section of :mod:`kvtier.bench.cuda_bench`: a prefill whose cached prefix is
loaded layer by layer by kvtier, against the same prefill with that KV already on the GPU,
alone on the GPU and with a second process computing on it (:class:`Contender`), in either
copy mode.

The reference model (bf16, 16 layers, ~0.9 B parameters) prefills an 8192-token prompt whose
first 4096 tokens' KV is loaded: each layer waits for its KV just before it reads it (daemon
copy mode: the daemon's event for that layer; engine copy mode: that layer's host → device copy
out of staging, issued once the daemon has filled it). The two prefills alternate, and their
logits must be equal.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from kvtier.bench.cuda_bench_copies import (
    BenchCheckFailed,
    StagedKV,
    connect,
    daemon_store,
    timed,
    tokens,
)
from kvtier.config import KvtierError

__all__ = ["PAGE", "Contender", "build_model", "prefill_overlap"]

PAGE = 64

# A second process's compute on the same GPU: matmuls, synchronized every few so no long queue
# is left behind, for at most argv[1] seconds, on device argv[2] with argv[3]-square matrices.
# "ready" once its first matmul has run.
_CONTENDER = r"""
import sys, time, torch
end = time.monotonic() + float(sys.argv[1])
dev, n = sys.argv[2], int(sys.argv[3])
dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
a = torch.randn(n, n, device=dev, dtype=dtype)
b = torch.randn_like(a)
c = a @ b
if dev.startswith("cuda"):
    torch.cuda.synchronize()
print("ready", flush=True)
while time.monotonic() < end:
    for _ in range(4):
        torch.mm(a, b, out=c)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
"""


class Contender:
    """A child process running matmuls while the block runs, in its own process group;
    killed (the whole group) on exit. It ends by itself after ``limit_s`` seconds.

    Args:
        limit_s: its own bound, in case nothing kills it.
        log: where its output goes (read for its "ready" line).
        device / size: the device it computes on, and its matrices' side.
        start_timeout_s: how long it may take to start computing.

    Raises (on entry):
        BenchCheckFailed: it exited, or did not start computing within ``start_timeout_s``.
    """

    def __init__(
        self,
        limit_s: float,
        log: Path,
        device: str = "cuda",
        size: int = 8192,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.limit_s = limit_s
        self.log = log
        self.device, self.size = device, size
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Contender:
        with self.log.open("wb") as out:  # a file, not a pipe: its output can never block it
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CONTENDER, str(self.limit_s), self.device, str(self.size)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                text = self.log.read_text(errors="replace")
                if "ready" in text.splitlines():
                    return self
                if self.proc.poll() is not None:
                    tail = " | ".join(text.strip().splitlines()[-5:])
                    raise BenchCheckFailed(
                        f"the GPU contender exited ({self.proc.returncode}): {tail}"
                    )
                if time.monotonic() > deadline:
                    raise BenchCheckFailed(
                        f"the GPU contender did not start within {self.start_timeout_s:.0f}s"
                    )
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def running(self) -> bool:
        """Whether it is still computing (it had not ended by itself)."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill its process group and reap it. Idempotent."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        finally:
            self.proc = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_model() -> tuple[Any, Any]:
    """The bench's reference model on the GPU, and its config."""
    from kvtier.engine.model import ModelConfig, TinyLlama

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
    return TinyLlama(cfg).to("cuda"), cfg


def _alternate(
    alone: Callable[[], None], overlapped: Callable[[], None], repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``repeats`` runs of each, alternating which goes first; a warm-up first."""
    alone_s: list[float] = []
    overlap_s: list[float] = []
    for r in range(repeats + 1):
        first, second = (alone, overlapped) if r % 2 else (overlapped, alone)
        t1, t2 = timed(first), timed(second)
        if r:
            (alone_s if first is alone else overlap_s).append(t1)
            (overlap_s if first is alone else alone_s).append(t2)
    return alone_s, overlap_s


def prefill_overlap(
    mode: Literal["daemon", "engine"],
    rdir: Path,
    model: tuple[Any, Any],
    prompt_tokens: int,
    cached_tokens: int,
    repeats: int,
    contender_s: float | None,
    prefix: str,
    salt: int,
    device: str = "cuda",
    direct: bool = True,
) -> dict[str, Any]:
    """Layer-wise loaded prefill against the same prefill over resident KV.

    Args:
        mode: the copy mode (``daemon``: a CudaKVPool; ``engine``: a staging area).
        model: :func:`build_model`'s result.
        contender_s: also measure with a :class:`Contender` running, bounded to this many
            seconds (None: alone only).
        prefix: put before every field name (``engine_``, ...).
        salt: makes this run's page keys its own.
        device: the model's device (the engine mode also runs on the CPU; the daemon mode
            needs CUDA).
        direct: the engine mode's copies of consecutive blocks are direct (False: gathered
            and scattered through a device buffer, with a kernel).

    Returns:
        ``{prefix}prefill_overlap`` (overlapped / alone, medians), their milliseconds, whether
        the logits are equal, and the same with ``contended_`` after the prefix.

    Raises:
        BenchCheckFailed: a transfer failed, or the contender ended before the measurement.
    """
    from kvtier.client.kv_pool.cuda import CudaKVPool
    from kvtier.engine.engine import geometry_for

    net, cfg = model
    if cached_tokens % PAGE or not 0 < cached_tokens < prompt_tokens:
        raise KvtierError(f"--cached-tokens must be a multiple of {PAGE} in (0, prompt_tokens)")
    geometry = geometry_for(cfg, PAGE)
    n_pages, n_cached = -(-prompt_tokens // PAGE), cached_tokens // PAGE
    blocks = n_pages + n_cached + 1
    prompt = tokens(prompt_tokens, salt=salt, vocab=cfg.vocab_size)
    contender_log = rdir.parent / f"contender-{salt}.log"  # beside the daemon's runtime dir
    table_a = list(range(n_pages))  # the prefix's KV computed here, the suffix's pages
    table_b = list(range(n_pages, n_pages + n_cached)) + table_a[n_cached:]  # prefix loaded
    pool: Any = None
    staged: StagedKV | None = None
    if mode == "daemon":
        pool = CudaKVPool(geometry, blocks)
        try:
            conn = connect(pool, rdir)
        except BaseException:
            pool.close()
            raise
        k, v = pool.k, pool.v
    else:
        staged = StagedKV(geometry, blocks, n_cached, rdir, device, direct)
        conn, k, v = staged.conn, staged.k, staged.v
    out: dict[str, torch.Tensor] = {}
    res: dict[str, Any] = {}
    try:
        net.prefill(prompt, 0, table_a, k, v)  # KV of the whole prompt
        keys = conn.page_keys(prompt[:cached_tokens])
        if staged is not None:
            staged.store(keys, table_a[:n_cached])
        else:
            daemon_store(conn, keys, table_a[:n_cached], n_cached)

        def alone() -> None:
            out["alone"] = net.prefill(prompt, cached_tokens, table_a, k, v)

        def overlapped() -> None:
            if staged is not None:
                load = staged.start_load(keys, table_b[:n_cached])
                try:
                    out["overlap"] = net.prefill(
                        prompt, cached_tokens, table_b, k, v, layer_wait=load.gate
                    )
                finally:
                    load.finish()
                return
            h = conn.load(keys, table_b[:n_cached])
            if h.count != n_cached:
                raise BenchCheckFailed(f"load found {h.count} of {n_cached} pages")

            def gate(layer: int) -> None:
                if not h.wait_layer(layer):
                    raise BenchCheckFailed(f"load failed at layer {layer}")

            out["overlap"] = net.prefill(prompt, cached_tokens, table_b, k, v, layer_wait=gate)
            if not h.wait():
                raise BenchCheckFailed("load did not end DONE")

        res.update(_figures(prefix, *_alternate(alone, overlapped, repeats), out))
        if contender_s is not None:
            size = 8192 if torch.device(device).type == "cuda" else 64  # small on a CPU
            with Contender(contender_s, contender_log, device, size) as contender:
                contended = _alternate(alone, overlapped, repeats)
                if not contender.running():
                    raise BenchCheckFailed(
                        f"the GPU contender ended before the measurement (--contender-s "
                        f"{contender_s:g} too short)"
                    )
            res.update(_figures(prefix + "contended_", *contended, out))
    finally:
        if staged is not None:
            staged.close()
        else:
            conn.close()
            pool.close()
    res.update(
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        layers=cfg.n_layers,
        kv_bytes_loaded=n_cached * geometry.page_bytes,
    )
    return res


def _figures(
    p: str, alone_s: list[float], overlap_s: list[float], out: dict[str, torch.Tensor]
) -> dict[str, Any]:
    alone, over = statistics.median(alone_s), statistics.median(overlap_s)
    return {
        f"{p}compute_alone_ms": alone * 1e3,
        f"{p}overlapped_ms": over * 1e3,
        f"{p}compute_alone_best_ms": min(alone_s) * 1e3,
        f"{p}overlapped_best_ms": min(overlap_s) * 1e3,
        f"{p}prefill_overlap": over / alone,
        f"{p}logits_equal": bool(torch.equal(out["alone"], out["overlap"])),
        f"{p}max_abs_logit_diff": float((out["alone"] - out["overlap"]).abs().max()),
    }
