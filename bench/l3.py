"""L3 benchmark: the ``file`` backend against raw positional I/O on the same disk, same run.

What one run measures (payload bytes only, page cache used throughout, nothing dropped)::

    put  : FileBackend.put_from   arena (/dev/shm mmap) -> segment files, batches of 64 pages
    get  : FileBackend.get_into   segment files -> arena, verified
    raw write : os.pwrite  of the same pages into one preallocated file in the same directory
    raw read  : os.preadv  of the same pages back into the arena

Each measurement runs ``repeats`` times after one warm-up. Within a repetition the two
sides alternate batch by batch (raw batch, backend batch, backend batch, raw batch, ...) so
that the noise of a shared machine and the kernel's writeback hit both alike; each repetition
starts with no dirty pages (fsync, untimed). Medians over the repetitions are reported. The
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
from collections.abc import Callable, Coroutine, Mapping
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


async def _bench(
    path: Path, pages: int, page_bytes: int, batch: int, repeats: int, extra: Mapping[str, Any]
) -> dict[str, Any]:
    total = pages * page_bytes
    mm, arena = _shm_arena(total)
    offsets = [i * page_bytes for i in range(pages)]
    keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(pages)]
    chunks = [(keys[i : i + batch], offsets[i : i + batch]) for i in range(0, pages, batch)]
    raw_path, store_path = path / "raw.bin", path / "file-store"
    raw = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(raw, 0, total)
    backend = FileBackend({**extra, "path": str(store_path)})
    view = arena.view
    times: dict[str, list[float]] = {"raw_write": [], "put": [], "raw_read": [], "get": []}
    cpu: dict[str, list[float]] = {name: [] for name in times}
    try:
        await backend.open(arena)

        async def raw_write(ks: list[bytes], offs: list[int]) -> None:
            for off in offs:
                os.pwrite(raw, view[off : off + page_bytes], off)

        async def raw_read(ks: list[bytes], offs: list[int]) -> None:
            for off in offs:
                os.preadv(raw, [view[off : off + page_bytes]], off)

        async def put(ks: list[bytes], offs: list[int]) -> None:
            if not all(await backend.put_from(_NS, ks, offs, page_bytes)):
                raise RuntimeError(f"put_from refused pages (stats: {backend.stats})")

        async def get(ks: list[bytes], offs: list[int]) -> None:
            if not all(await backend.get_into(_NS, ks, offs, page_bytes)):
                raise RuntimeError(f"get_into missed pages (stats: {backend.stats})")

        def settle() -> None:  # neither side starts behind dirty pages of the previous round
            os.fsync(raw)
            for segment in store_path.glob("seg-*.kvt"):
                fd = os.open(segment, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        Step = Callable[[list[bytes], list[int]], Coroutine[Any, Any, None]]

        async def measure(rep: int, pair: list[tuple[str, Step]]) -> None:
            spent = dict.fromkeys((name for name, _ in pair), 0.0)
            used = spent.copy()
            for c, (ks, offs) in enumerate(chunks):  # batch by batch, who goes first alternating
                for name, step in pair if (c + rep) % 2 else pair[::-1]:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    await step(ks, offs)
                    spent[name] += time.perf_counter() - start
                    used[name] += time.process_time() - start_cpu  # all threads of the process
            for name in spent:
                times[name].append(spent[name])
                cpu[name].append(used[name])

        for rep in range(repeats + 1):  # rep 0 warms the page cache and the segments up
            await backend.delete(_NS, keys)  # puts must write, as raw writes do
            settle()
            await measure(rep, [("raw_write", raw_write), ("put", put)])
            await measure(rep, [("raw_read", raw_read), ("get", get)])
            if rep == 0:
                for series in (*times.values(), *cpu.values()):
                    series.clear()
        await backend.close()
        reopened = FileBackend({**extra, "path": str(store_path)})
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
        "extra_config": dict(extra),
        **{f"{name}_gbps": _median_gbps(t, total) for name, t in times.items()},
        "rebuild_s": rebuild_s,
        "rebuild_objects": rebuilt,
    }
    result["put_over_raw_write"] = result["put_gbps"] / result["raw_write_gbps"]
    result["get_over_raw_read"] = result["get_gbps"] / result["raw_read_gbps"]
    median = statistics.median
    result["put_cpu_over_raw_write"] = median(cpu["raw_write"]) / median(cpu["put"])
    result["get_cpu_over_raw_read"] = median(cpu["raw_read"]) / median(cpu["get"])
    return result


def run_file_bench(
    path: str,
    pages: int = 1000,
    page_bytes: int = 256 * 1024,
    batch: int = 64,
    repeats: int = 6,
    extra_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure the ``file`` backend against raw pwrite/pread in one run.

    Args:
        path: a scratch directory on the disk to measure (created if missing); the store
            and the raw file made inside it are removed afterwards.
        pages: pages per measurement.
        page_bytes: payload bytes per page.
        batch: pages per ``put_from`` / ``get_into`` call, as the daemon sends them.
        repeats: timed repetitions per measurement (after one warm-up); medians are kept.
        extra_config: the backend's extra config (``path`` is set to a directory in ``path``).

    Returns:
        ``put_gbps``, ``get_gbps``, ``raw_write_gbps``, ``raw_read_gbps`` (payload GB/s),
        ``put_over_raw_write``, ``get_over_raw_read`` (wall-clock ratios), the same ratios
        in CPU seconds of the whole process (``put_cpu_over_raw_write``,
        ``get_cpu_over_raw_read``: raw CPU / backend CPU, steadier on a busy machine),
        ``rebuild_s`` (index rebuild at reopen of the ``rebuild_objects`` pages written),
        and the parameters.
    """
    scratch = Path(path)
    scratch.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_bench(scratch, pages, page_bytes, batch, repeats, extra_config or {}))


def print_table(result: dict[str, Any]) -> None:
    """Print ``result`` of :func:`run_file_bench` as a table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"L3 file backend: {result['pages']} pages of {result['page_bytes'] // 1024} KiB, "
        f"batches of {result['batch']}, median of {result['repeats']}"
    )
    for column in ("direction", "file backend GB/s", "raw GB/s", "backend / raw", "same, CPU time"):
        table.add_column(column, justify="right" if column != "direction" else "left")
    for label, side, raw_side in (
        ("write (put)", "put", "raw_write"),
        ("read (get)", "get", "raw_read"),
    ):
        table.add_row(
            label,
            f"{result[f'{side}_gbps']:.2f}",
            f"{result[f'{raw_side}_gbps']:.2f}",
            f"{result[f'{side}_over_{raw_side}']:.2f}",
            f"{result[f'{side}_cpu_over_{raw_side}']:.2f}",
        )
    Console().print(table)
    Console().print(
        f"index rebuild at reopen: {result['rebuild_s'] * 1e3:.1f} ms "
        f"for {result['rebuild_objects']} objects"
    )


if __name__ == "__main__":
    import json
    import sys

    # python -m kvtier.bench.l3 [SCRATCH_PARENT [EXTRA_CONFIG_JSON]]
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as scratch:
        print_table(
            run_file_bench(
                scratch, extra_config=json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
            )
        )
