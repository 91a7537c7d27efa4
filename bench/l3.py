"""L3 benchmark: the ``file`` tier through kvtierd, and the backend alone, against raw
positional I/O on the same disk, same run.

Through the daemon (``put_gbps``, ``get_gbps``; payload bytes, page cache used throughout)::

    put  : L2 -> L3. An engine STOREs the pages into L2 under write_back (untimed: L2 has
           room, so nothing is written yet); timed from one SYNC request until its answer,
           which comes once every page is in L3
    get  : L3 -> L2. The L2 pool flushed, one PREFETCH of the whole chain, then
           CLAIM(wait_complete); timed from the PREFETCH until the CLAIM answers with
           every page in L2
    raw write / raw read : os.pwrite / os.preadv of as many bytes, page by page, into / from
           one preallocated file in the same directory, from / into a /dev/shm arena

``store_put_gbps`` adds the engine side: under write_through, from the first STORE (batches
of 64) until a SYNC sent after the last STORE answers; the engine -> L2 copies share the
CPU with the L3 writes. ``store_gbps`` is that engine side alone: the same STOREs under
write_back (nothing goes to L3 while L2 has room), timed within each put until every STORE
has answered. Write-through moves every byte twice (engine -> L2, L2 -> L3) where the raw
baseline moves it once: where the cores are all busy its time is about the sum of the two
alone (``1 / store_put_over_raw_write`` ~ ``1 / store_over_raw_write + 1 / put_over_raw_write``);
on idle cores the two overlap and it nears the slower one.

The backend alone (``backend_put_gbps``, ``backend_get_gbps``)::

    put  : FileBackend.put_from   arena (/dev/shm mmap) -> segment files, batches of 64 pages
    get  : FileBackend.get_into   segment files -> arena, verified
    raw write / raw read : as above, batch by batch alternating with the backend

Each measurement runs ``repeats`` times after one warm-up. Within a repetition the
backend-alone sides alternate batch by batch (raw batch, backend batch, backend batch, raw
batch, ...) and the daemon sides alternate run by run, so that the noise of a shared machine
and the kernel's writeback hit both alike; each repetition starts with no dirty pages
(fsync, untimed). Throughputs are medians over the repetitions; the ratios
``put_over_raw_write`` and ``get_over_raw_read`` (through the daemon) and
``backend_put_over_raw_write`` / ``backend_get_over_raw_read`` are the median over the
repetitions of raw time / kvtier time within one repetition (a pair measured back to back),
and are what to compare across machines.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.file import FileBackend
from kvtier.ipc.limits import FlushTier

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


def _settle(raw: int, store: Path) -> None:
    """Flush the raw file and the store's segment files to disk (untimed, between rounds)."""
    os.fsync(raw)
    for segment in store.glob("seg-*.kvt"):
        fd = os.open(segment, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _paired(baseline_s: list[float], measured_s: list[float]) -> float:
    """Median over the repetitions of baseline time / measured time in the same repetition."""
    return statistics.median(b / m for b, m in zip(baseline_s, measured_s, strict=True))


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
            _settle(raw, store_path)

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
        **{f"backend_{name}_gbps": _median_gbps(t, total) for name, t in times.items()},
        "rebuild_s": rebuild_s,
        "rebuild_objects": rebuilt,
    }
    b = "backend_"
    result[f"{b}put_over_raw_write"] = _paired(times["raw_write"], times["put"])
    result[f"{b}get_over_raw_read"] = _paired(times["raw_read"], times["get"])
    median = statistics.median
    result[f"{b}put_cpu_over_raw_write"] = median(cpu["raw_write"]) / median(cpu["put"])
    result[f"{b}get_cpu_over_raw_read"] = median(cpu["raw_read"]) / median(cpu["get"])
    return result


DAEMON_BATCH = 64
"""Pages per STORE of the through-the-daemon measurement."""


def _geometry_for(page_bytes: int) -> Any:
    """An MHA float16 geometry of 8 layers x K/V whose pages are ``page_bytes`` bytes."""
    from kvtier.ipc.protocol import Geometry

    per_token = 8 * 2 * 8 * 2  # layers x (K, V) x heads x bytes per element, per head_dim unit
    head_dim, rest = divmod(page_bytes, 16 * per_token)
    if rest or head_dim < 1:
        raise ValueError(f"page_bytes = {page_bytes} is not a multiple of {16 * per_token}")
    return Geometry(num_layers=8, page_size=16, kv_heads=8, head_dim=head_dim, dtype="float16")


def _daemon_bench(path: Path, pages: int, page_bytes: int, repeats: int) -> dict[str, Any]:
    """Time L2 → L3 (SYNC) and L3 → L2 (prefetch + claim) through a real kvtierd, against
    raw pwrite / preadv of as many bytes in the same directory."""
    from kvtier.client.connection.admin import AdminClient
    from kvtier.client.connection.connection import Connection
    from kvtier.client.kv_pool.shared import SharedKVPool
    from kvtier.config import ClientConfig
    from kvtier.ipc import protocol as P
    from kvtier.launch.daemon_process import DaemonProcess

    geometry = _geometry_for(page_bytes)
    total = pages * page_bytes
    extent = 32 << 20
    pool_bytes = (total * 5 // 4 // extent + 2) * extent
    store_dir, raw_path = path / "daemon-l3", path / "daemon-raw.bin"
    rdir = Path(tempfile.mkdtemp(prefix="kvtb-", dir="/tmp"))  # ipc:// paths must be short
    conf = rdir / "kvtierd.toml"  # the write policy lives here: SIGHUP switches it
    conf.write_text('hicache_write_policy = "write_back"\n')
    daemon = DaemonProcess(
        rdir,
        [
            "--config",
            str(conf),
            "--hicache-size",
            str(pool_bytes),
            "--extent-size",
            str(extent),
            "--log-level",
            "warning",
            "--hicache-storage-backend",
            "file",
            "--hicache-storage-backend-extra-config",
            json.dumps({"path": str(store_dir)}),
            "--prefetch-threshold",
            "0",
            "--write-back-queue",
            str(2 * pages),
        ],
    )
    times: dict[str, list[float]] = {
        "put": [],
        "get": [],
        "raw_write": [],
        "raw_read": [],
        "store_put": [],
    }
    stored: list[float] = []  # engine -> L2 alone, timed within each put
    with ExitStack() as stack:
        mm, arena = _shm_arena(total)
        stack.callback(mm.close)
        stack.callback(arena.view.release)
        raw = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        stack.callback(raw_path.unlink, missing_ok=True)
        stack.callback(os.close, raw)
        os.posix_fallocate(raw, 0, total)
        stack.callback(shutil.rmtree, rdir, ignore_errors=True)
        stack.callback(shutil.rmtree, store_dir, ignore_errors=True)
        stack.callback(daemon.remove_pool)
        stack.enter_context(daemon)
        kv = SharedKVPool(geometry, pages)
        stack.callback(kv.close)
        for buf in kv.k + kv.v:  # page contents: noise
            buf.view(-1).copy_(torch.randn(buf.numel()).to(buf.dtype))
        conn = Connection(
            kv,
            "kvtier-bench-l3",
            config=ClientConfig(runtime_dir=rdir, request_timeout_s=30.0, claim_timeout_s=120.0),
        )
        stack.callback(conn.close)
        admin = stack.enter_context(AdminClient(daemon.endpoint, timeout_s=30.0))
        keys = conn.page_keys(list(range(pages * geometry.page_size)))
        view = arena.view

        def flush(tier: FlushTier) -> None:
            # emptied for the next repetition, its disk space kept, as the raw file keeps its
            # blocks (an operator's flush gives them back: reclaim, the default)
            rep = admin.call(P.Flush(req_id=0, tier=tier, reclaim=False))
            refused = rep.message if isinstance(rep, P.ErrorReply) else None
            if refused is not None:
                raise RuntimeError(f"flush {tier} refused: {refused}")

        def settle() -> None:  # no side starts behind the other's dirty pages
            _settle(raw, store_dir)

        def store_all() -> None:
            handles = [
                conn.store(
                    keys[i : i + DAEMON_BATCH],
                    list(range(i, min(i + DAEMON_BATCH, pages))),
                    parent_key=keys[i - 1] if i else None,
                )
                for i in range(0, pages, DAEMON_BATCH)
            ]
            if not all(
                h.wait() and h.count == len(keys[i : i + DAEMON_BATCH])
                for i, h in zip(range(0, pages, DAEMON_BATCH), handles)
            ):
                raise RuntimeError("a STORE failed")

        def written() -> int:
            return int(admin.stats()["counters"]["l3_write_written_pages"])  # type: ignore[index]

        def sync_all(expect: int) -> None:
            rep = admin.sync(120.0)
            if (rep.written, rep.failed, rep.left) != (expect, 0, 0):
                raise RuntimeError(
                    f"SYNC wrote {rep.written} of {expect} pages "
                    f"({rep.failed} not written, {rep.left} left)"
                )

        def set_policy(policy: str) -> None:  # untimed
            conf.write_text(f'hicache_write_policy = "{policy}"\n')
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30.0
            while admin.stats()["l3"]["write_policy"] != policy:  # type: ignore[index]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not reload to {policy} in 30 s")
                time.sleep(0.01)

        def put() -> float:  # L2 -> L3: the pages stored under write-back, then one SYNC
            flush("all")  # puts must write, as raw writes do
            start = time.perf_counter()
            store_all()  # engine -> L2 alone: nothing goes to L3 yet (write-back, room)
            stored.append(time.perf_counter() - start)
            settle()
            start = time.perf_counter()
            sync_all(pages)
            return time.perf_counter() - start

        def store_put() -> float:  # engine -> L2 -> L3 under write-through, until SYNC answers
            flush("all")
            set_policy("write_through")
            settle()
            base = written()
            start = time.perf_counter()
            store_all()
            rep = admin.sync(120.0)  # waits for the pages still queued at that moment
            elapsed = time.perf_counter() - start
            if rep.failed or rep.left or written() != base + pages:
                raise RuntimeError(f"write-through wrote {written() - base} of {pages} pages")
            set_policy("write_back")
            return elapsed

        def get() -> float:  # L3 -> L2: one PREFETCH of the chain, CLAIM(wait_complete)
            flush("l2")
            start = time.perf_counter()
            conn.prefetch(keys)
            got = conn.claim(keys, policy="wait_complete")
            elapsed = time.perf_counter() - start
            if got != pages:
                raise RuntimeError(f"CLAIM answered {got} of {pages} pages")
            return elapsed

        def raw_write() -> float:
            settle()
            start = time.perf_counter()
            for off in range(0, total, page_bytes):
                os.pwrite(raw, view[off : off + page_bytes], off)
            return time.perf_counter() - start

        def raw_read() -> float:
            start = time.perf_counter()
            for off in range(0, total, page_bytes):
                os.preadv(raw, [view[off : off + page_bytes]], off)
            return time.perf_counter() - start

        for rep in range(repeats + 1):  # rep 0 warms files, pool and page cache up
            for pair in (
                (("raw_write", raw_write), ("put", put)),
                (("raw_write", raw_write), ("store_put", store_put)),
                (("raw_read", raw_read), ("get", get)),
            ):
                for name, step in pair if rep % 2 else pair[::-1]:
                    seconds = step()
                    if rep:
                        times[name].append(seconds)
    times["store"] = stored[1:]  # rep 0 warmed up
    result: dict[str, Any] = {f"{name}_gbps": _median_gbps(t, total) for name, t in times.items()}
    raw_write_s = times["raw_write"][0::2]  # the raw write paired with put, then with store_put
    result["put_over_raw_write"] = _paired(raw_write_s, times["put"])
    result["store_over_raw_write"] = _paired(raw_write_s, times["store"])
    result["store_put_over_raw_write"] = _paired(times["raw_write"][1::2], times["store_put"])
    result["get_over_raw_read"] = _paired(times["raw_read"], times["get"])
    return result


def run_file_bench(
    path: str,
    pages: int = 1000,
    page_bytes: int = 256 * 1024,
    batch: int = 64,
    repeats: int = 9,
    extra_config: Mapping[str, Any] | None = None,
    through_daemon: bool = True,
) -> dict[str, Any]:
    """Measure the ``file`` tier through kvtierd, and the backend alone, against raw I/O.

    Args:
        path: a scratch directory on the disk to measure (created if missing); the store
            and the raw file made inside it are removed afterwards.
        pages: pages per measurement.
        page_bytes: payload bytes per page.
        batch: pages per ``put_from`` / ``get_into`` call, as the daemon sends them.
        repeats: timed repetitions per measurement (after one warm-up); medians are kept.
        extra_config: the backend's extra config for the backend-alone part (``path`` is
            set to a directory in ``path``).
        through_daemon: also measure through a kvtierd (the headline figures).

    Returns:
        Through the daemon: ``put_gbps``, ``get_gbps``, ``raw_write_gbps``,
        ``raw_read_gbps`` (payload GB/s), ``put_over_raw_write``, ``get_over_raw_read``
        (put: L2 → L3 by SYNC; get: L3 → L2 by PREFETCH + CLAIM), and
        ``store_put_gbps`` / ``store_put_over_raw_write`` (engine → L2 → L3 under
        write-through), and ``store_gbps`` / ``store_over_raw_write`` (engine → L2 alone,
        the same STOREs).
        The backend alone: the same names prefixed ``backend_``, the same ratios in CPU
        seconds of the whole process (``backend_put_cpu_over_raw_write``,
        ``backend_get_cpu_over_raw_read``: raw CPU / backend CPU, steadier on a busy
        machine), ``rebuild_s`` (index rebuild at reopen of the ``rebuild_objects`` pages
        written), and the parameters.
    """
    scratch = Path(path)
    scratch.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(_bench(scratch, pages, page_bytes, batch, repeats, extra_config or {}))
    if through_daemon:
        result.update(_daemon_bench(scratch, pages, page_bytes, repeats))
    return result


def print_table(result: dict[str, Any]) -> None:
    """Print ``result`` of :func:`run_file_bench` as tables (through the daemon, backend alone)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    size = f"{result['pages']} pages of {result['page_bytes'] // 1024} KiB"
    if "put_gbps" in result:
        table = Table(title=f"L3 file tier through kvtierd: {size}, median of {result['repeats']}")
        for column in ("direction", "kvtierd GB/s", "raw GB/s", "kvtierd / raw"):
            table.add_column(column, justify="right" if column != "direction" else "left")
        for label, side, raw_side in (
            ("L2 -> L3 (SYNC)", "put", "raw_write"),
            ("L3 -> L2 (prefetch + claim)", "get", "raw_read"),
            ("engine -> L2 -> L3 (write-through)", "store_put", "raw_write"),
            ("engine -> L2 alone (same STOREs)", "store", "raw_write"),
        ):
            table.add_row(
                label,
                f"{result[f'{side}_gbps']:.2f}",
                f"{result[f'{raw_side}_gbps']:.2f}",
                f"{result[f'{side}_over_{raw_side}']:.2f}",
            )
        console.print(table)
    table = Table(
        title=f"L3 file backend alone: {size}, batches of {result['batch']}, "
        f"median of {result['repeats']}"
    )
    for column in ("direction", "file backend GB/s", "raw GB/s", "backend / raw", "same, CPU time"):
        table.add_column(column, justify="right" if column != "direction" else "left")
    b = "backend_"
    for label, side, raw_side in (
        ("write (put)", "put", "raw_write"),
        ("read (get)", "get", "raw_read"),
    ):
        table.add_row(
            label,
            f"{result[f'{b}{side}_gbps']:.2f}",
            f"{result[f'{b}{raw_side}_gbps']:.2f}",
            f"{result[f'{b}{side}_over_{raw_side}']:.2f}",
            f"{result[f'{b}{side}_cpu_over_{raw_side}']:.2f}",
        )
    console.print(table)
    console.print(
        f"index rebuild at reopen: {result['rebuild_s'] * 1e3:.1f} ms "
        f"for {result['rebuild_objects']} objects"
    )


if __name__ == "__main__":
    import sys

    # python -m kvtier.bench.l3 [SCRATCH_PARENT [EXTRA_CONFIG_JSON]]
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as scratch:
        print_table(
            run_file_bench(
                scratch, extra_config=json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
            )
        )
