"""Throughput of the cluster L3 backends against their client library used directly.

For ``redis`` and ``mooncake`` the bench starts its own server on loopback (redis-server,
or mooncake_master with its HTTP metadata server), opens the kvtier backend on an arena of
``2 × pages`` slots laid out as kvtierd's host pool lays them out (each page preceded by the
slot's headroom; sources, then destinations) and times, per repeat (one pass over all pages):

    direct put   the same library, same batches, payload only
    kvtier put   backend.put_from: header + checksum + payload
    direct get   the same library, same batches (redis: the values stay Python bytes)
    kvtier get   backend.get_into: verify + copy into the arena slots

The two sides of an operation alternate batch by batch (direct, kvtier, kvtier, direct, ...),
so that both see the same moments of a noisy machine; each side's time in a pass is the sum
of its batches. Before every get, both sides' destination slots are zeroed (untimed), and the
bytes kvtier read back are compared with the bytes written.

Direct means: for redis, redis-py's pipeline object sending ``SET key <slot view>`` and
``GET key`` (hiredis parser); for mooncake, ``batch_put_from`` / ``batch_get_into`` of the
same arena slots. The kvtier redis backend sends pre-encoded frames on redis-py's
connections, which skips the pipeline object's per-command work, so its ratio can pass 1.

The store is emptied between repeats so no put finds its key already there. Throughput is
payload bytes / time in GB/s (1e9); the result holds each side's median over the repeats and
the ratios ``put_over_direct`` / ``get_over_direct``: the median over the repeats of
direct time / kvtier time in the same pass (the price of self-describing, verified objects).

Mooncake runs in one of two placements (``mooncake_segment``):

- ``"remote"`` (default): a separate holder process mounts the store's memory and the
  daemon contributes none, so every page crosses loopback TCP, as it crosses the network
  between nodes in a cluster;
- ``"local"``: the daemon's own segment holds the pages and Mooncake moves them with a
  memcpy inside the process. The direct path is then a bare memcpy, and verification has
  to read every byte once more, so the ratio is bounded by memcpy / (memcpy + xxh3).

Run: ``python -m kvtier.bench.l3_cluster --backend redis`` (or ``mooncake``, ``all``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import json
import mmap
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from kvtier.bench.local_servers import server_backend
from kvtier.daemon.pool.layout import HEADROOM_ALIGN, round_up
from kvtier.daemon.storage.base import HostArena, StorageBackend
from kvtier.daemon.storage.registry import slot_headroom

__all__ = ["main", "print_table", "run_cluster_bench"]


def run_cluster_bench(
    backend: str,
    pages: int = 1000,
    page_bytes: int = 256 * 1024,
    batch: int = 64,
    repeats: int = 9,
    options: Mapping[str, Any] | None = None,
    mooncake_segment: Literal["remote", "local"] = "remote",
) -> dict[str, Any]:
    """Measure ``backend`` ("redis" or "mooncake") against its client library used directly.

    Args:
        backend: which cluster backend; its server is started on loopback and stopped after.
        pages: pages per pass; page_bytes: payload bytes per page; batch: keys per call.
        repeats: timed passes (after one warm-up pass); medians are reported.
        options: extra-config overrides for the backend (e.g. ``{"sub_batch_keys": 32}``).
        mooncake_segment: where Mooncake keeps the pages (see the module docstring).

    Returns:
        ``backend``, ``placement``, ``pages``, ``page_bytes``, ``batch``, ``repeats``, ``put_gbps``,
        ``get_gbps``, ``direct_put_gbps``, ``direct_get_gbps``, ``put_over_direct``,
        ``get_over_direct``, ``exists_us_per_key`` and ``samples`` (every pass, GB/s).

    Raises:
        ValueError: unknown backend or non-positive sizes.
        RuntimeError: the server could not be started, or a pass lost or corrupted a page.
    """
    if backend not in ("redis", "mooncake"):
        raise ValueError(f"backend must be 'redis' or 'mooncake', got {backend!r}")
    if min(pages, page_bytes, batch, repeats) <= 0:
        raise ValueError("pages, page_bytes, batch and repeats must be positive")
    if mooncake_segment not in ("remote", "local"):
        raise ValueError(f"mooncake_segment must be 'remote' or 'local', got {mooncake_segment!r}")
    placement = "server" if backend == "redis" else f"{mooncake_segment} segment"
    result = _run(
        _bench(backend, pages, page_bytes, batch, repeats, dict(options or {}), placement)
    )
    return result


def print_table(result: dict[str, Any]) -> None:
    """Print one bench result as a rich table (GB/s, and kvtier / direct)."""
    from rich.console import Console
    from rich.table import Table

    title = (
        f"L3 {result['backend']} ({result['placement']}): {result['pages']} pages × "
        f"{result['page_bytes'] // 1024} KiB, batch {result['batch']}, "
        f"median of {result['repeats']}"
    )
    table = Table(title=title)
    table.add_column("op")
    table.add_column("kvtier GB/s", justify="right")
    table.add_column("direct GB/s", justify="right")
    table.add_column("kvtier / direct", justify="right")
    for op in ("put", "get"):
        ratio = result[f"{op}_over_direct"]
        style = "green" if ratio >= 0.8 else "red"
        table.add_row(
            op,
            f"{result[f'{op}_gbps']:.2f}",
            f"{result[f'direct_{op}_gbps']:.2f}",
            f"[{style}]{ratio:.2f}[/{style}]",
        )
    table.caption = f"exists: {result['exists_us_per_key']:.1f} µs per key"
    Console().print(table)


# -- the passes ------------------------------------------------------------------------


async def _bench(
    backend: str,
    pages: int,
    page_bytes: int,
    batch: int,
    repeats: int,
    options: dict[str, Any],
    placement: str,
) -> dict[str, Any]:
    stride, headroom = _slot_stride(backend, page_bytes)
    size = 2 * pages * stride
    memory = mmap.mmap(-1, size)
    anchor = ctypes.c_char.from_buffer(memory)
    view = memoryview(memory)
    try:
        view[: pages * stride] = os.urandom(pages * stride)
        view[pages * stride :] = bytes(pages * stride)  # pre-fault the destinations
        arena = HostArena(view, ctypes.addressof(anchor), size, headroom=headroom)
        async with server_backend(
            backend, pages * (page_bytes + 4096), options, placement
        ) as store:
            await store.open(arena)
            try:
                result = await _passes(backend, store, arena, pages, page_bytes, batch, repeats)
                return {"backend": backend, "placement": placement, **result}
            finally:
                await store.close()
    finally:
        del anchor
        view.release()
        memory.close()


def _slot_stride(backend: str, page_bytes: int) -> tuple[int, int]:
    """``(stride, headroom)`` of one arena slot as the host pool of a kvtierd configured
    with ``backend`` lays it out: the slot's headroom (if any), then the page."""
    headroom = slot_headroom(backend)
    return headroom + round_up(page_bytes, HEADROOM_ALIGN if headroom else 4096), headroom


async def _passes(
    backend: str,
    store: StorageBackend,
    arena: HostArena,
    pages: int,
    page_bytes: int,
    batch: int,
    repeats: int,
) -> dict[str, Any]:
    stride, _ = _slot_stride(backend, page_bytes)
    src = [i * stride + arena.headroom for i in range(pages)]
    dst = [(pages + i) * stride + arena.headroom for i in range(pages)]
    spans = [(a, min(a + batch, pages)) for a in range(0, pages, batch)]
    direct = _direct_ops(backend, store, arena, page_bytes)
    samples: dict[str, list[float]] = {k: [] for k in ("put", "get", "direct_put", "direct_get")}
    exists_us: list[float] = []
    total = pages * page_bytes

    async def run_op(
        label: str, ns: bytes, keys: list[bytes], src: list[int], dst: list[int]
    ) -> None:
        if label == "put":
            ok = all(await store.put_from(ns, keys, src, page_bytes))
        elif label == "get":
            ok = all(await store.get_into(ns, keys, dst, page_bytes))
        elif label == "direct_put":
            ok = await direct.put(keys, src)
        else:
            ok = await direct.get(keys, dst)
        if not ok:
            raise RuntimeError(f"{backend}: {label} failed ({store.stats})")

    ratios: dict[str, list[float]] = {"put": [], "get": []}
    for rep in range(repeats + 1):  # pass 0 warms the server's memory and is not counted
        ns = hashlib.sha256(f"kvtier-bench-{rep}".encode()).digest()
        keys = [hashlib.sha256(ns + i.to_bytes(4, "little")).digest() for i in range(pages)]
        spent = dict.fromkeys(samples, 0.0)
        for op in ("put", "get"):
            for n, (a, b) in enumerate(spans):  # batch by batch, who goes first alternating
                pair = [f"direct_{op}", op] if (n + rep) % 2 else [op, f"direct_{op}"]
                for label in pair:
                    lo, hi = dst[a] - arena.headroom, dst[b - 1] + page_bytes
                    if op == "get":  # both sides read into zeroed slots (untimed)
                        arena.view[lo:hi] = bytes(hi - lo)
                    start = time.perf_counter()
                    await run_op(label, ns, keys[a:b], src[a:b], dst[a:b])
                    spent[label] += time.perf_counter() - start
                    if label == "get" and any(
                        arena.view[d : d + page_bytes] != arena.view[o : o + page_bytes]
                        for o, d in zip(src[a:b], dst[a:b])
                    ):
                        raise RuntimeError(f"{backend}: pages read back differ from pages written")
        if rep:
            for label, seconds in spent.items():
                samples[label].append(total / seconds / 1e9)
            for op, series in ratios.items():
                series.append(spent[f"direct_{op}"] / spent[op])
        start = time.perf_counter()
        run = await store.exists(ns, keys)
        if rep:
            exists_us.append((time.perf_counter() - start) / pages * 1e6)
        if run != pages:
            raise RuntimeError(f"{backend}: exists saw {run} of {pages} pages")
        await direct.clear(ns, keys)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "pages": pages,
        "page_bytes": page_bytes,
        "batch": batch,
        "repeats": repeats,
        "put_gbps": med["put"],
        "get_gbps": med["get"],
        "direct_put_gbps": med["direct_put"],
        "direct_get_gbps": med["direct_get"],
        "put_over_direct": statistics.median(ratios["put"]),
        "get_over_direct": statistics.median(ratios["get"]),
        "ratios": ratios,
        "exists_us_per_key": statistics.median(exists_us),
        "samples": samples,
    }


class _Direct:
    """The backend's client library driven without kvtier, on the same buffers and batches."""

    def __init__(
        self,
        put: Callable[[list[bytes], list[int]], Awaitable[bool]],
        get: Callable[[list[bytes], list[int]], Awaitable[bool]],
        clear: Callable[[bytes, list[bytes]], Awaitable[None]],
    ) -> None:
        self.put, self.get, self.clear = put, get, clear


def _direct_ops(backend: str, store: StorageBackend, arena: HostArena, page_bytes: int) -> _Direct:
    view, base = arena.view, arena.address
    if backend == "redis":
        client = store.client  # type: ignore[attr-defined]

        async def rput(keys: list[bytes], offsets: list[int]) -> bool:
            async with client.pipeline(transaction=False) as pipe:
                for key, off in zip(keys, offsets):
                    pipe.set(b"direct:" + key.hex().encode(), view[off : off + page_bytes])
                replies = await pipe.execute()
            return all(reply is True for reply in replies)

        async def rget(keys: list[bytes], offsets: list[int]) -> bool:
            async with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.get(b"direct:" + key.hex().encode())
                values = await pipe.execute()
            return all(value is not None and len(value) == page_bytes for value in values)

        async def rclear(ns: bytes, keys: list[bytes]) -> None:
            await client.flushdb()

        return _Direct(rput, rget, rclear)

    mc = store.store  # type: ignore[attr-defined]

    def names(keys: list[bytes]) -> list[str]:
        return ["direct:" + key.hex() for key in keys]

    async def mput(keys: list[bytes], offsets: list[int]) -> bool:
        ptrs = [base + off for off in offsets]
        return all(
            code == 0 for code in mc.batch_put_from(names(keys), ptrs, [page_bytes] * len(keys))
        )

    async def mget(keys: list[bytes], offsets: list[int]) -> bool:
        ptrs = [base + off for off in offsets]
        codes = mc.batch_get_into(names(keys), ptrs, [page_bytes] * len(keys))
        return all(code == page_bytes for code in codes)

    async def mclear(ns: bytes, keys: list[bytes]) -> None:
        await store.delete(ns, keys)
        mc.batch_remove(names(keys), True)

    return _Direct(mput, mget, mclear)


def _run(coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Run on uvloop when it is installed, as the daemon does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """Command line: run the bench for one or both backends, print tables, optionally save JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.bench.l3_cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backend", choices=("redis", "mooncake", "all"), default="all")
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--page-bytes", type=int, default=256 * 1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--mooncake-segment",
        choices=("remote", "local", "both"),
        default="both",
        help="where Mooncake keeps pages: a separate holder process, this process, or both",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    runs: list[tuple[str, Literal["remote", "local"]]] = []
    for backend in ("redis", "mooncake") if args.backend == "all" else (args.backend,):
        if backend == "mooncake" and args.mooncake_segment == "both":
            runs += [(backend, "remote"), (backend, "local")]
        else:
            runs.append((backend, "local" if args.mooncake_segment == "local" else "remote"))
    results = []
    for backend, segment in runs:
        result = run_cluster_bench(
            backend, args.pages, args.page_bytes, args.batch, args.repeats, mooncake_segment=segment
        )
        print_table(result)
        results.append(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
