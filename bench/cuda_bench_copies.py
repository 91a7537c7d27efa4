"""The bandwidth section of :mod:`kvtier.bench.cuda_bench`: kvtier's two copy modes against
``cudaMemcpyAsync`` of the same bytes.

- daemon copy mode: the engine's KV in a :class:`~kvtier.client.kv_pool.cuda.CudaKVPool`,
  exported by CUDA IPC; kvtierd copies GPU ↔ host pool itself (by DMA or by kernels, its
  ``--cuda-copy``);
- engine copy mode: the engine's KV in plain device tensors (:class:`StagedKV`); the engine
  copies them ↔ a pinned :class:`~kvtier.client.staging.area.StagingArea` on its own stream
  (:class:`~kvtier.client.staging.copies.StagedCopier`) and kvtierd copies staging ↔ pool on
  the CPU. A load copies each layer to the device as soon as the daemon has filled it in
  staging, as the vLLM connector's staged worker does.

A store is timed from its first copy to the daemon's DONE; a load from the request to the
last layer being on the device. The baseline moves the same bytes with
``copy_(non_blocking=True)`` between one pinned host tensor and one device tensor (one
``cudaMemcpyAsync`` each way). Every section checks the loaded bytes.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from kvtier.config import ClientConfig, KvtierError
from kvtier.ipc.protocol import Geometry

__all__ = [
    "BANDWIDTH_GEOMETRY",
    "MODEL_ID",
    "BenchCheckFailed",
    "StagedKV",
    "StagedLoad",
    "baseline",
    "connect",
    "daemon_bandwidth",
    "daemon_load",
    "daemon_store",
    "engine_bandwidth",
    "host_copy",
    "timed",
    "tokens",
]

BANDWIDTH_GEOMETRY = Geometry(
    num_layers=32, page_size=64, kv_heads=8, head_dim=128, dtype="bfloat16"
)
MODEL_ID = "kvtier-cuda-bench"


class BenchCheckFailed(KvtierError):
    """A correctness check inside the benchmark failed (wrong bytes, a failed transfer)."""


def tokens(n: int, salt: int, vocab: int = 32000) -> list[int]:
    """``n`` deterministic token ids; another ``salt`` gives other page keys."""
    return [(i * 7919 + salt * 104729) % vocab for i in range(n)]


def connect(memory: Any, rdir: Path) -> Any:
    """A :class:`~kvtier.client.connection.connection.Connection` over ``memory`` (a
    CudaKVPool, or a staging area's RegionMemory) to the kvtierd of ``rdir``."""
    from kvtier.client.connection.connection import Connection

    # generous timeouts: the daemon's first CUDA registration creates a context and pins the pool
    cfg = ClientConfig(runtime_dir=rdir, request_timeout_s=120.0, load_timeout_s=120.0)
    return Connection(memory, model_id=MODEL_ID, config=cfg)


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, with the device idle before and after."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _raw(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.uint8).view(buf.shape[0], -1)


def _gbps(nbytes: int, samples: Sequence[float]) -> float:
    return nbytes / statistics.median(samples) / 1e9


def _figures(prefix: str, nbytes: int, store_s: list[float], load_s: list[float]) -> dict[str, Any]:
    return {
        f"{prefix}load_gbps": _gbps(nbytes, load_s),
        f"{prefix}store_gbps": _gbps(nbytes, store_s),
        f"{prefix}load_best_s": min(load_s),
        f"{prefix}store_best_s": min(store_s),
    }


# ---------------------------------------------------------------------- baseline
def baseline(pages: int, repeats: int) -> dict[str, Any]:
    """GB/s of ``copy_(non_blocking=True)`` of ``pages`` pages' bytes host -> device and
    device -> host, between one pinned host tensor and one device tensor."""
    nbytes = pages * BANDWIDTH_GEOMETRY.page_bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = [timed(functools.partial(dev.copy_, host, non_blocking=True)) for _ in range(repeats + 1)]
    d2h = [timed(functools.partial(host.copy_, dev, non_blocking=True)) for _ in range(repeats + 1)]
    return {
        "bytes_per_transfer": nbytes,
        "pages": pages,
        "page_bytes": BANDWIDTH_GEOMETRY.page_bytes,
        "baseline_h2d_gbps": _gbps(nbytes, h2d[1:]),
        "baseline_d2h_gbps": _gbps(nbytes, d2h[1:]),
    }


def host_copy(pages: int, repeats: int, threads: int) -> dict[str, Any]:
    """GB/s of a plain host copy of ``pages`` pages' bytes between a shared-memory file (as
    kvtierd's pool is) and pinned memory (as an engine's staging area is), in both directions,
    by ``threads`` threads each calling ``memmove`` on its share: what the engine copy mode's
    CPU stage can reach at best with kvtierd's copy threads. (Not torch's ``copy_``: it copies
    on all of the host's cores, whatever the threads calling it.) Fields
    ``host_copy_t<threads>_load_gbps`` (shared memory → pinned, a load's CPU stage) and
    ``..._store_gbps``.

    Raises:
        BenchCheckFailed: the copied bytes differ.
        OSError: no room in ``/dev/shm`` or the pinned memory cannot be allocated.
    """
    import ctypes
    import mmap
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    nbytes = pages * BANDWIDTH_GEOMETRY.page_bytes
    pin = torch.cuda.is_available()  # pageable without a GPU (the unit tests)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    piece = 64 << 20  # one memmove call's bytes: ctypes releases the GIL for each
    with tempfile.TemporaryFile(dir="/dev/shm") as f, ThreadPoolExecutor(threads) as pool:
        f.truncate(nbytes)
        with mmap.mmap(f.fileno(), nbytes) as mm:
            shm = torch.frombuffer(mm, dtype=torch.uint8)
            try:
                shm.random_(0, 256)  # faults every page in, as the pool's are
                step = -(-nbytes // threads)
                shares = [(i, min(i + step, nbytes)) for i in range(0, nbytes, step)]

                def copy(dst: int, src: int) -> None:
                    def share(cut: tuple[int, int]) -> None:
                        for at in range(cut[0], cut[1], piece):
                            ctypes.memmove(dst + at, src + at, min(piece, cut[1] - at))

                    list(pool.map(share, shares))

                a_pin, a_shm = pinned.data_ptr(), shm.data_ptr()
                load = [timed(functools.partial(copy, a_pin, a_shm)) for _ in range(repeats + 1)]
                same = torch.equal(pinned, shm)
                pinned.random_(0, 256)
                store = [timed(functools.partial(copy, a_shm, a_pin)) for _ in range(repeats + 1)]
                if not (same and torch.equal(pinned, shm)):
                    raise BenchCheckFailed("the host copy's bytes differ from its source")
            finally:
                del shm  # the view must go before the mapping closes
    return _figures(f"host_copy_t{threads}_", nbytes, store[1:], load[1:])


# ---------------------------------------------------------------------- daemon copy mode
def daemon_store(conn: Any, keys: list[bytes], pages: list[int], n: int) -> None:
    """STORE ``pages`` of a CudaKVPool and wait for DONE (BenchCheckFailed otherwise)."""
    h = conn.store(keys, pages)
    if h.writing != n or not h.wait():
        raise BenchCheckFailed(f"store of {n} pages: {h.writing} written, ok={h.ok}")


def daemon_load(conn: Any, keys: list[bytes], pages: list[int], n: int, layers: int) -> None:
    """LOAD into ``pages`` layer by layer; the engine's stream waits for every layer."""
    h = conn.load(keys, pages)
    if h.count != n:
        raise BenchCheckFailed(f"load of {n} pages found {h.count} in L2")
    for layer in range(layers):
        if not h.wait_layer(layer):
            raise BenchCheckFailed(f"load failed at layer {layer}")
    torch.cuda.current_stream().synchronize()  # the engine's stream passed every layer's copies
    if not h.wait():
        raise BenchCheckFailed("load did not end DONE")


def daemon_bandwidth(
    rdir: Path, pages: int, repeats: int, prefix: str, salt: int
) -> dict[str, Any]:
    """Store and load ``pages`` pages of a CudaKVPool through kvtierd (daemon copy mode).

    Returns:
        ``{prefix}load_gbps`` and ``{prefix}store_gbps`` (medians) and the best seconds.

    Raises:
        BenchCheckFailed: a transfer failed or the loaded bytes differ.
    """
    from kvtier.client.kv_pool.cuda import CudaKVPool

    g = BANDWIDTH_GEOMETRY
    pool = CudaKVPool(g, 2 * pages)
    conn = connect(pool, rdir)
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    bufs = [b for pair in zip(pool.k, pool.v) for b in pair]
    store_s: list[float] = []
    load_s: list[float] = []
    try:
        for b in bufs:
            _raw(b)[:pages].random_(0, 256)
        for r in range(repeats + 1):  # run 0 warms up (kernel compile, first transfer)
            keys = conn.page_keys(tokens(pages * g.page_size, salt=salt + r))
            t_store = timed(functools.partial(daemon_store, conn, keys, src, pages))
            t_load = timed(functools.partial(daemon_load, conn, keys, dst, pages, g.num_layers))
            if r:
                store_s.append(t_store)
                load_s.append(t_load)
        for b in bufs:
            if not torch.equal(_raw(b)[:pages], _raw(b)[pages : 2 * pages]):
                raise BenchCheckFailed("loaded pages differ from the stored ones")
    finally:
        conn.close()
        pool.close()
    return _figures(prefix, pages * g.page_bytes, store_s, load_s)


# ---------------------------------------------------------------------- engine copy mode
class StagedKV:
    """An engine in the engine copy mode: its KV in plain device tensors (one K and one V
    ``[blocks, page_size, kv_heads, head_dim]`` per layer on ``device``), a staging area of
    ``staging_pages`` pages (pinned for a CUDA device) registered with the kvtierd of
    ``rdir``, and the copier between them (``direct``: see
    :class:`~kvtier.client.staging.copies.StagedCopier`). The bench runs it on CUDA; the same
    code runs on the CPU (synchronous copies), where the unit tests run it.

    Raises:
        OSError: the staging area cannot be page-locked.
    """

    def __init__(
        self,
        geometry: Geometry,
        blocks: int,
        staging_pages: int,
        rdir: Path,
        device: str = "cuda",
        direct: bool = True,
    ) -> None:
        from kvtier.client.kv_pool.shared import TORCH_DTYPES
        from kvtier.client.staging.area import StagingArea, StagingPart
        from kvtier.client.staging.copies import StagedCopier

        g = geometry
        dtype = TORCH_DTYPES[g.dtype]
        shape = (g.page_size, g.kv_heads, g.head_dim)
        self.geometry = g
        self.k = [
            torch.zeros((blocks, *shape), dtype=dtype, device=device) for _ in range(g.num_layers)
        ]
        self.v = [
            torch.zeros((blocks, *shape), dtype=dtype, device=device) for _ in range(g.num_layers)
        ]
        parts = [StagingPart(layer, shape, dtype) for layer in range(g.num_layers) for _ in "kv"]
        self.area = StagingArea(parts, staging_pages, pin=torch.device(device).type == "cuda")
        self.conn: Any = None
        try:
            self.copier = StagedCopier(
                self.area, [t for kv in zip(self.k, self.v) for t in kv], direct=direct
            )
            self.conn = connect(self.area.memory(g, label="cuda-bench-staging"), rdir)
        except BaseException:
            self.area.close()
            raise

    def tensors(self) -> list[torch.Tensor]:
        """Every K and V tensor, layer by layer."""
        return [t for kv in zip(self.k, self.v) for t in kv]

    def store(self, keys: list[bytes], blocks: list[int]) -> None:
        """Copy ``blocks`` into staging after the compute stream's work so far, then STORE
        them and wait for DONE (BenchCheckFailed otherwise)."""
        n = len(blocks)
        slots = self._acquire(n)
        h: Any = None
        ok = False
        try:
            self.copier.to_host(slots, blocks, after=self.copier.compute_marker()).synchronize()
            h = self.conn.store(keys, slots)
            ok = h.writing == n and h.wait()
            if not ok:
                raise BenchCheckFailed(f"staged store of {n} pages: {h.writing} written, ok={h.ok}")
        finally:  # slots the daemon may still read stay out of use until it stops
            self.area.release(slots, None if ok or h is None else h.copying)

    def start_load(self, keys: list[bytes], blocks: list[int]) -> StagedLoad:
        """Send a LOAD of ``keys`` into staging slots, to be copied into ``blocks`` layer by
        layer (BenchCheckFailed when L2 has fewer pages)."""
        slots = self._acquire(len(blocks))
        h = self.conn.load(keys, slots)
        if h.count != len(blocks):
            self.area.release(slots, h.copying)
            raise BenchCheckFailed(f"staged load of {len(blocks)} pages found {h.count} in L2")
        return StagedLoad(self, h, slots, blocks)

    def load(self, keys: list[bytes], blocks: list[int]) -> None:
        """Load ``keys`` into ``blocks``, each layer copied as soon as staging has it; return
        once every layer is on the device."""
        self.start_load(keys, blocks).finish()

    def _acquire(self, n: int) -> list[int]:
        slots = self.area.acquire(n, timeout=10.0)
        if slots is None:
            raise BenchCheckFailed(f"{n} staging slots not free within 10 s")
        return slots

    def close(self) -> None:
        """Unregister, then unpin and close the staging area."""
        if self.conn is not None:
            self.conn.close()
        self.area.close()


class StagedLoad:
    """A layer-wise load of :class:`StagedKV` in flight: :meth:`gate` before layer *i* makes
    the compute stream wait for that layer's host → device copy."""

    def __init__(self, kv: StagedKV, handle: Any, slots: list[int], blocks: list[int]) -> None:
        self.kv, self.handle, self.slots, self.blocks = kv, handle, slots, blocks
        self.next_layer = 0
        self.copies: list[Any] = []

    def gate(self, layer: int) -> None:
        """Copy layers up to ``layer`` (and any later one staging already has) to the device;
        the compute stream waits for them. BenchCheckFailed when the load failed."""
        upto = max(layer, self.handle.layers_ready() - 1)
        copier = self.kv.copier
        while self.next_layer <= upto:
            i = self.next_layer
            if not self.handle.wait_layer(i):
                raise BenchCheckFailed(f"staged load failed at layer {i}")
            done = copier.to_device(copier.parts_of(i), self.slots, self.blocks)
            done.wait_on_compute()
            self.copies.append(done)
            self.next_layer = i + 1

    def finish(self) -> None:
        """Copy the remaining layers, wait for every copy and for the load's end, give the
        slots back."""
        ok = False
        try:
            self.gate(self.kv.geometry.num_layers - 1)
            for c in self.copies:
                c.synchronize()
            ok = bool(self.handle.wait())
            if not ok:
                raise BenchCheckFailed("staged load did not end DONE")
        finally:
            self.kv.area.release(self.slots, None if ok else self.handle.copying)


def engine_bandwidth(
    rdir: Path,
    pages: int,
    repeats: int,
    salt: int,
    device: str = "cuda",
    prefix: str = "engine_",
) -> dict[str, Any]:
    """Store and load ``pages`` pages through a staging area (engine copy mode).

    Returns:
        ``<prefix>load_gbps`` and ``<prefix>store_gbps`` (medians) and the best seconds.

    Raises:
        BenchCheckFailed: a transfer failed or the loaded bytes differ.
    """
    g = BANDWIDTH_GEOMETRY
    kv = StagedKV(g, 2 * pages, pages, rdir, device)
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    store_s: list[float] = []
    load_s: list[float] = []
    try:
        for t in kv.tensors():
            _raw(t)[:pages].random_(0, 256)
        for r in range(repeats + 1):  # run 0 warms up (first pinned copies, first transfer)
            keys = kv.conn.page_keys(tokens(pages * g.page_size, salt=salt + r))
            t_store = timed(functools.partial(kv.store, keys, src))
            t_load = timed(functools.partial(kv.load, keys, dst))
            if r:
                store_s.append(t_store)
                load_s.append(t_load)
        for t in kv.tensors():
            if not torch.equal(_raw(t)[:pages], _raw(t)[pages : 2 * pages]):
                raise BenchCheckFailed("pages loaded through staging differ from the stored ones")
    finally:
        kv.close()
    return _figures(prefix, pages * g.page_bytes, store_s, load_s)
