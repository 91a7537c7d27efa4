"""A reference engine in its own process, driven by JSON lines on stdin/stdout.

The demo runs its engine here so that it can kill it (SIGKILL) and start a new one, as an
engine crash or upgrade would. One request per line in, one reply per line out::

    {"op": "generate", "tokens": [...], "max_new_tokens": 16, "compare": true,
     "report_stored": true}
        -> {"ok": true, "tokens": [...], "prompt_tokens": ..., "cached_l1": ..., "cached_l2": ...,
            "cached_l3": ..., "l2_found": ..., "l3_found": ..., "computed": ..., "ttft_ms": ...,
            "load_failed": false, "matches_uncached": true, "max_abs_diff": 0.0,
            "uncached_ttft_ms": ..., "stored_tokens": ...}
    {"op": "counters"}   -> {"ok": true, "counters": {...}}
    {"op": "flush_l1"}   -> {"ok": true, "freed": n}
    {"op": "quit"}       -> {"ok": true}, then the process exits

``compare`` also runs the prompt on a second engine with kvtier off (same weights) and reports
whether the generated tokens are equal and the largest first-logit difference.
``report_stored`` reports how many of the prompt's leading tokens L2 holds once this request's
stores completed. The first line the worker prints is ``{"ok": true, "ready": true, "pid": ...}``;
errors are ``{"ok": false, "error": "..."}`` and the worker keeps serving.

Run: ``python -m kvtier.engine.worker --model tiny --runtime-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from typing import IO, Any

from kvtier.config import KvtierError, client_config
from kvtier.engine.engine import ReferenceEngine
from kvtier.engine.kv import engine_device
from kvtier.engine.model import ModelConfig, TinyLlama

__all__ = ["MODELS", "build_parser", "main", "model_config", "serve"]

MODELS = ("default", "tiny")


def model_config(name: str) -> ModelConfig:
    """The model named ``name``.

    Args:
        name: ``default`` (:meth:`ModelConfig.default`) or ``tiny`` (:meth:`ModelConfig.tiny`).

    Returns:
        Its config.

    Raises:
        KvtierError: an unknown name.
    """
    if name == "default":
        return ModelConfig.default()
    if name == "tiny":
        return ModelConfig.tiny()
    raise KvtierError(f"model must be one of {MODELS}, got {name!r}")


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line.

    Returns:
        The parser.
    """
    p = argparse.ArgumentParser(prog="kvtier-worker", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="default")
    p.add_argument("--mode", choices=("on", "l1", "off"), default="on")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--runtime-dir", help="the daemon's runtime directory")
    p.add_argument("--endpoint", help="the daemon's ZeroMQ endpoint (overrides --runtime-dir)")
    p.add_argument(
        "--write-policy",
        default="write_through",
        choices=("write_through", "write_through_selective", "write_back"),
    )
    p.add_argument("--device", default="cpu", help="cpu or a CUDA device (e.g. cuda:0)")
    p.add_argument(
        "--copy-mode",
        choices=("daemon", "engine"),
        help="who copies pages to and from kvtierd (default: daemon; engine on CUDA without "
        "CuPy, or when kvtierd refuses the GPU memory)",
    )
    p.add_argument("--staging-pages", type=int, default=64, help="staging area (engine mode)")
    p.add_argument("--threads", type=int, help="torch compute threads (default: torch's choice)")
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="no uncached engine (requests asking to compare fail)",
    )
    return p


def _generate(
    engine: ReferenceEngine, reference: ReferenceEngine | None, req: dict[str, Any]
) -> dict[str, Any]:
    tokens = [int(t) for t in req["tokens"]]
    max_new = int(req.get("max_new_tokens", 16))
    res = engine.generate(tokens, max_new)
    out: dict[str, Any] = {"ok": True, **res.summary()}
    if req.get("compare"):
        if reference is None:
            raise KvtierError("this worker runs without an uncached engine (--no-compare)")
        ref = reference.generate(tokens, max_new)
        out["matches_uncached"] = ref.tokens == res.tokens
        out["max_abs_diff"] = float((ref.first_logits - res.first_logits).abs().max())
        out["uncached_ttft_ms"] = round(ref.ttft_ms, 3)
    if req.get("report_stored"):
        out["stored_tokens"] = (
            engine.cache.stored_prefix_tokens(tokens) if engine.cache is not None else 0
        )
    return out


def serve(
    engine: ReferenceEngine, reference: ReferenceEngine | None, stdin: IO[str], stdout: IO[str]
) -> int:
    """Answer requests from ``stdin`` until ``quit`` or end of input.

    Args:
        engine: the engine under test.
        reference: an engine with kvtier off for ``compare`` (may be None).
        stdin / stdout: the line streams.

    Returns:
        0.
    """
    for line in stdin:
        if not line.strip():
            continue
        reply: dict[str, Any]
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "generate":
                reply = _generate(engine, reference, req)
            elif op == "counters":
                counters = engine.counters
                reply = {"ok": True, "counters": asdict(counters) if counters else {}}
            elif op == "flush_l1":
                reply = {"ok": True, "freed": engine.flush_l1()}
            elif op == "quit":
                stdout.write(json.dumps({"ok": True}) + "\n")
                stdout.flush()
                return 0
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except (KvtierError, ValueError, KeyError, TypeError) as err:
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: build the engines, announce readiness, serve.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = client_config(
        {
            "runtime_dir": args.runtime_dir,
            "endpoint": args.endpoint,
            "hicache_write_policy": args.write_policy,
        }
    )
    model = TinyLlama(model_config(args.model)).to(engine_device(args.device))
    engine = ReferenceEngine(
        mode=args.mode,
        page_size=args.page_size,
        num_pages=args.num_pages,
        client_config=cfg,
        model=model,
        device=args.device,
        copy_mode=args.copy_mode,
        staging_pages=args.staging_pages,
    )
    reference = None
    try:
        engine.warm_up()
        if not args.no_compare:
            reference = ReferenceEngine(
                mode="off",
                page_size=args.page_size,
                num_pages=args.num_pages,
                model=model,
                device=args.device,
            )
        ready = {
            "ok": True,
            "ready": True,
            "pid": os.getpid(),
            "mode": args.mode,
            "model": args.model,
            "device": str(engine.device),
            "copy_mode": engine.copy_mode,
        }
        sys.stdout.write(json.dumps(ready) + "\n")
        sys.stdout.flush()
        return serve(engine, reference, sys.stdin, sys.stdout)
    finally:
        if reference is not None:
            reference.close()
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
