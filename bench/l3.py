"""L3 benchmark: the ``file`` backend against raw positional I/O on the same disk, same run.

What one run measures (payload bytes only, page cache used throughout, nothing dropped)::

    put  : FileBackend.put_from   arena (/dev/shm mmap) -> segment files, batches of 64 pages
    get  : FileBackend.get_into   segment files -> arena, verified
    raw write : os.pwrite  of the same pages into one preallocated file in the same directory
    raw read  : os.preadv  of the same pages back into the arena

Each measurement runs ``repeats`` times after one warm-up, interleaved (raw write, put, raw
read, get) so that machine noise hits both sides alike; the median is reported. The
ratios ``put_over_raw_write`` and ``get_over_raw_read`` are what to compare across machines.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.file import FileBackend

_NS = hashlib.sha256(b"kvtier bench l3").digest()


def _shm_arena(size: int) -> tuple[mmap.mmap, HostArena]:
    """Map ``size`` bytes of a fresh file in /dev/shm (unlinked at once), filled with noise."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(prefix="kvtier-bench-", dir=shm) as f:
        os.ftruncate(f.fileno(), size)
        mm = mmap.mmap(f.fileno(), size)
    words = np.frombuffer(mm, dtype=np.uint64)
    words[:] = np.random.default_rng(0).integers(0, 2**63, size=words.size, dtype=np.uint64)
    del words  # no export may outlive the mapping
    return mm, HostArena(view=memoryview(mm), address=0, size=size)


def _median_gbps(seconds: list[float], nbytes: int) -> float:
    return nbytes / statistics.median(seconds) / 1e9


async def _bench(path: Path, pages: int, page_bytes: int, batch: int, repeats: int) -> dict[str, Any]:
    total = pages * page_bytes
    mm, arena = _shm_arena(total)
    offsets = [i * page_bytes for i in range(pages)]
    keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(pages)]
    chunks = [(keys[i:i + batch], offsets[i:i + batch]) for i in range(0, pages, batch)]
    raw_path, store_path = path / "raw.bin", path / "file-store"
    raw = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(raw, 0, total)
    backend = FileBackend({"path": str(store_path)})
    view = arena.view
    times: dict[str, list[float]] = {"raw_write": [], "put": [], "raw_read": [], "get": []}
    try:
        await backend.open(arena)

        def raw_write() -> None:
            for off in offsets:
                os.pwrite(raw, view[off:off + page_bytes], off)

        def raw_read() -> None:
            for off in offsets:
                os.preadv(raw, [view[off:off + page_bytes]], off)

        async def put() -> None:
            for ks, offs in chunks:
                assert all(await backend.put_from(_NS, ks, offs, page_bytes))

        async def get() -> None:
            for ks, offs in chunks:
                assert all(await backend.get_into(_NS, ks, offs, page_bytes))

        async def timed(name: str, step: Callable[[], None | Coroutine[Any, Any, None]]) -> None:
            start = time.perf_counter()
            pending = step()
            if pending is not None:
                await pending
            times[name].append(time.perf_counter() - start)

        for rep in range(repeats + 1):  # rep 0 warms the page cache and the segments up
            await backend.delete(_NS, keys)  # puts must write, as raw writes do
            await timed("raw_write", raw_write)
            await timed("put", put)
            await timed("raw_read", raw_read)
            await timed("get", get)
            if rep == 0:
                for series in times.values():
                    series.clear()
        await backend.close()
        reopened = FileBackend({"path": str(store_path)})
        await reopened.open(arena)
        rebuild_s, rebuilt = reopened.rebuild_seconds, len(reopened.entries())
        await reopened.close()
    finally:
        await backend.close()
        os.close(raw)
        raw_path.unlink(missing_ok=True)
        shutil.rmtree(store_path, ignore_errors=True)
        view.release()
        mm.close()
    result: dict[str, Any] = {
        "backend": "file",
        "pages": pages,
        "page_bytes": page_bytes,
        "batch": batch,
        "repeats": repeats,
        **{f"{name}_gbps": _median_gbps(t, total) for name, t in times.items()},
        "rebuild_s": rebuild_s,
        "rebuild_objects": rebuilt,
    }
    result["put_over_raw_write"] = result["put_gbps"] / result["raw_write_gbps"]
    result["get_over_raw_read"] = result["get_gbps"] / result["raw_read_gbps"]
    return result


def run_file_bench(
    path: str, pages: int = 1000, page_bytes: int = 256 * 1024, batch: int = 64, repeats: int = 5
) -> dict[str, Any]:
    """Measure the ``file`` backend against raw pwrite/pread in one run.

    Args:
        path: a scratch directory on the disk to measure (created if missing); the store
            and the raw file made inside it are removed afterwards.
        pages: pages per measurement.
        page_bytes: payload bytes per page.
        batch: pages per ``put_from`` / ``get_into`` call, as the daemon sends them.
        repeats: timed repetitions per measurement (after one warm-up); medians are kept.

    Returns:
        ``put_gbps``, ``get_gbps``, ``raw_write_gbps``, ``raw_read_gbps`` (payload GB/s),
        ``put_over_raw_write``, ``get_over_raw_read``, ``rebuild_s`` (index rebuild at
        reopen of the ``rebuild_objects`` pages written), and the parameters.
    """
    scratch = Path(path)
    scratch.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_bench(scratch, pages, page_bytes, batch, repeats))


def print_table(result: dict[str, Any]) -> None:
    """Print ``result`` of :func:`run_file_bench` as a table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"L3 file backend: {result['pages']} pages of {result['page_bytes'] // 1024} KiB, "
                        f"batches of {result['batch']}, median of {result['repeats']}")
    for column in ("direction", "file backend GB/s", "raw GB/s", "backend / raw"):
        table.add_column(column, justify="right" if column != "direction" else "left")
    table.add_row("write (put)", f"{result['put_gbps']:.2f}", f"{result['raw_write_gbps']:.2f}",
                  f"{result['put_over_raw_write']:.2f}")
    table.add_row("read (get)", f"{result['get_gbps']:.2f}", f"{result['raw_read_gbps']:.2f}",
                  f"{result['get_over_raw_read']:.2f}")
    Console().print(table)
    Console().print(f"index rebuild at reopen: {result['rebuild_s'] * 1e3:.1f} ms "
                    f"for {result['rebuild_objects']} objects")


if __name__ == "__main__":
    import sys

    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as scratch:
        print_table(run_file_bench(scratch))
