"""Engine processes of ``kvtier bench trace``: each replays its share of a trace.

``python -m kvtier.bench.trace.worker JSON`` connects to the daemon (one model id for all
engines, so they share one namespace), prints ``ready``, waits for ``go`` on stdin, then for
each of its requests (every ``engines``-th of the trace, from its ``index``), at the
request's compressed arrival time or as soon as it can: LOOKUP the chain's keys, LOAD the
leading hit into its pages and check every byte, STORE the rest after it. One trace block
is one page; a page's bytes are its block id as int64, repeated (V: the id's complement),
so a LOAD that brings the wrong page, or a torn one, shows (the pages a LOAD goes to are
first filled with bytes no block has, so a page it leaves unwritten shows too). It prints one JSON line: per
request the hit (pages loaded) and the LOOKUP's send time, the latencies, the mismatched
bytes and its CPU seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.ipc import protocol as P

__all__ = ["GEOMETRY", "block_key", "main"]

GEOMETRY = P.Geometry(num_layers=1, page_size=16, kv_heads=1, head_dim=64, dtype="float16")
"""4 KiB pages (K and V chunks of 2 KiB): the smallest the host pool's 4 KiB slots hold."""

REQUEST_TIMEOUT_S = 60.0


def block_key(block: int) -> bytes:
    """The page key of trace block ``block`` (0 <= block < 2**64): 32 bytes, as the
    daemon's keys are (a shorter key is not stored)."""
    return b"kvtier-bench-trace-block" + block.to_bytes(8, "little")


def _replay(conn: Any, kv: Any, s: dict[str, Any]) -> dict[str, Any]:
    import torch

    chains: list[list[int]] = s["chains"]
    due: list[float] = s["due"]
    half = kv.num_pages // 2
    k_pages = kv.k[0].view(kv.num_pages, -1).view(torch.int64)  # [pages, 256]
    v_pages = kv.v[0].view(kv.num_pages, -1).view(torch.int64)
    hits: list[int] = []
    sent: list[float] = []
    lat: dict[str, list[float]] = {"lookup": [], "load": [], "store": []}
    mismatched = failed = 0
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise RuntimeError("the launcher went away before saying go")
    c0, start = time.process_time(), time.monotonic()
    for chain, at in zip(chains, due, strict=True):
        wait = start + at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        keys = [block_key(b) for b in chain]
        sent.append(time.monotonic())
        a = time.perf_counter()
        n = conn.lookup(keys).l2
        lat["lookup"].append(time.perf_counter() - a)
        got = 0
        if n:
            # no block's bytes (every block's V half is the complement of its K half): a LOAD
            # that leaves a page unwritten cannot pass for one that brought it
            k_pages[half : half + n] = -1
            v_pages[half : half + n] = -1
            a = time.perf_counter()
            h = conn.load(keys[:n], list(range(half, half + n)))
            if h.count and h.wait():
                got = h.count
                ids = torch.tensor(_signed(chain[:got]), dtype=torch.int64).unsqueeze(1)
                bad_k = k_pages[half : half + got] != ids
                bad_v = v_pages[half : half + got] != ~ids
                mismatched += 8 * int(bad_k.sum() + bad_v.sum())
            elif h.count:
                failed += 1  # pages the LOOKUP found and the LOAD pinned, never copied
            lat["load"].append(time.perf_counter() - a)
        hits.append(got)
        rest = chain[got:]
        if rest:
            ids = torch.tensor(_signed(rest), dtype=torch.int64).unsqueeze(1)
            k_pages[: len(rest)] = ids
            v_pages[: len(rest)] = ~ids
            a = time.perf_counter()
            h = conn.store(
                keys[got:], list(range(len(rest))), parent_key=keys[got - 1] if got else None
            )
            if not h.wait() and h.writing:
                failed += 1
            lat["store"].append(time.perf_counter() - a)
    return {
        "hits": hits,
        "sent": sent,
        "lat": lat,
        "mismatched_bytes": mismatched,
        "failed_transfers": failed,
        "cpu": time.process_time() - c0,
    }


def _signed(ids: list[int]) -> list[int]:
    """Block ids (0 to 2**64 - 1) as the int64 words the pages hold."""
    return [b - (1 << 64) if b >= 1 << 63 else b for b in ids]


def main(argv: list[str]) -> int:
    """Worker entry (see the module docstring)."""
    from kvtier.client.connection.connection import Connection
    from kvtier.client.kv_pool.shared import SharedKVPool
    from kvtier.config import ClientConfig

    s = json.loads(sys.stdin.readline())  # the settings: too large for an argument
    cfg = ClientConfig(
        runtime_dir=Path(s["runtime_dir"]),
        request_timeout_s=REQUEST_TIMEOUT_S,
        load_timeout_s=REQUEST_TIMEOUT_S,
    )
    longest = max((len(c) for c in s["chains"]), default=1)
    with (
        SharedKVPool(GEOMETRY, 2 * longest) as kv,
        Connection(kv, model_id="kvtier-bench-trace", config=cfg) as conn,
    ):
        print(json.dumps(_replay(conn, kv, s)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
