"""Micro-benchmark of the CPU page copies against a one-thread numpy memcpy of the same bytes.

Run ``python -m kvtier.bench.kernels_bench``. It stores (engine -> host) and loads (host ->
engine) one transfer of whole pages (default 256 MiB in 128 KiB page-layer chunks, 8 layers x 2
components) through :class:`kvtier.kernels.page_copy.CopyPlan`, with consecutive and with randomly
permuted page ids and slots, and prints GB/s next to ``numpy.copyto`` of the same number of bytes
measured in the same run. GB/s are the best of ``--repeats`` rounds. Two ratios: the median over
rounds of memcpy time / copy time, with the memcpy timed right before each copy so that the noise
of a shared machine hits both alike, and best memcpy time / best copy time. Compare the ratios,
not the absolute numbers.
Each timed transfer includes building its plan. All buffers live in pre-faulted shared memory, as
the daemon's do.
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvtier.kernels.page_copy import CopyPlan


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Geometry of the benchmarked transfer."""

    total_mib: int
    chunk_kib: int
    layers: int
    components: int
    repeats: int
    seed: int

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one page of one (layer, component) buffer."""
        return self.chunk_kib << 10

    @property
    def slot_bytes(self) -> int:
        """Bytes of one host page (all layers and components)."""
        return self.layers * self.components * self.chunk_bytes

    @property
    def pages(self) -> int:
        """Pages moved per transfer."""
        return max(1, (self.total_mib << 20) // self.slot_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes moved per transfer."""
        return self.pages * self.slot_bytes


@dataclass(frozen=True, slots=True)
class BenchResult:
    """One measured case."""

    order: str
    direction: str
    gbps: float
    """Best throughput over the rounds."""
    ratio: float
    """Median over rounds of memcpy time / copy time (memcpy timed right before the copy)."""
    best_ratio: float
    """Best memcpy time / best copy time."""
    runs: int
    singles: int


def _shared_bytes(nbytes: int, keep: list[mmap.mmap]) -> torch.Tensor:
    """A pre-faulted anonymous shared mapping of ``nbytes`` as a uint8 tensor."""
    region = mmap.mmap(-1, nbytes)
    keep.append(region)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    tensor.numpy().fill(1)  # fault every page in now, not in the first timed copy
    return tensor


def _measure(
    cases: dict[str, Callable[[], None]], reference: Callable[[], None], repeats: int
) -> tuple[float, dict[str, tuple[float, float]]]:
    """Time every case against the reference over ``repeats`` rounds.

    In each round the reference runs right before each case, so both see the same machine load.

    Returns:
        The reference's best time, and per case its best time and the median over rounds of
        ``reference time / case time``.
    """
    best_ref = float("inf")
    best = {name: float("inf") for name in cases}
    ratios: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            reference()
            middle = time.perf_counter()
            fn()
            end = time.perf_counter()
            best_ref = min(best_ref, middle - start)
            best[name] = min(best[name], end - middle)
            ratios[name].append((middle - start) / (end - middle))
    return best_ref, {name: (best[name], float(np.median(ratios[name]))) for name in cases}


def run(config: BenchConfig) -> tuple[float, list[BenchResult]]:
    """Measure memcpy and the four page copy cases; return memcpy GB/s and the results."""
    keep: list[mmap.mmap] = []
    chunk, pages = config.chunk_bytes, config.pages
    engine_pages = 2 * pages
    host_slots = 2 * pages
    arena = _shared_bytes(host_slots * config.slot_bytes, keep)
    bufs = [
        [
            _shared_bytes(engine_pages * chunk, keep).view(engine_pages, chunk)
            for _ in range(config.components)
        ]
        for _ in range(config.layers)
    ]
    src = _shared_bytes(config.nbytes, keep).numpy()
    dst = _shared_bytes(config.nbytes, keep).numpy()

    rng = np.random.default_rng(config.seed)
    orders = {
        "consecutive": (np.arange(pages), np.arange(pages)),
        "random": (rng.permutation(engine_pages)[:pages], rng.permutation(host_slots)[:pages]),
    }
    fns: dict[str, Callable[[], None]] = {}
    plans: dict[str, CopyPlan] = {}
    for order, (page_ids, slots) in orders.items():
        pids = page_ids.astype(np.int64)
        offs = slots.astype(np.int64) * config.slot_bytes
        plans[order] = CopyPlan.build(pids, offs, chunk, slot_bytes=config.slot_bytes)
        fns[f"{order}/store"] = _transfer(arena, bufs, pids, offs, config, store=True)
        fns[f"{order}/load"] = _transfer(arena, bufs, pids, offs, config, store=False)
        _spot_check(arena, bufs, pids, offs, config, fns[f"{order}/store"])

    memcpy, timings = _measure(fns, lambda: np.copyto(dst, src), config.repeats)
    results = []
    for name, (seconds, ratio) in timings.items():
        order, direction = name.split("/")
        plan = plans[order]
        results.append(
            BenchResult(
                order,
                direction,
                config.nbytes / seconds / 1e9,
                ratio,
                memcpy / seconds,
                plan.num_runs,
                plan.num_singles,
            )
        )
    return config.nbytes / memcpy / 1e9, results


def _transfer(
    arena: torch.Tensor,
    bufs: Sequence[Sequence[torch.Tensor]],
    pids: np.ndarray,
    offs: np.ndarray,
    config: BenchConfig,
    *,
    store: bool,
) -> Callable[[], None]:
    """One transfer as the daemon runs it: plan once, then copy layer by layer."""

    def transfer() -> None:
        plan = CopyPlan.build(pids, offs, config.chunk_bytes, slot_bytes=config.slot_bytes)
        for layer, layer_bufs in enumerate(bufs):
            if store:
                plan.layer_to_host(arena, layer_bufs, layer)
            else:
                plan.layer_from_host(arena, layer_bufs, layer)

    return transfer


def _spot_check(
    arena: torch.Tensor,
    bufs: Sequence[Sequence[torch.Tensor]],
    pids: np.ndarray,
    offs: np.ndarray,
    config: BenchConfig,
    store: Callable[[], None],
) -> None:
    """Store once with marked pages and check the first and last page of the last layer."""
    layer, comp = config.layers - 1, config.components - 1
    buf = bufs[layer][comp]
    for i in (0, len(pids) - 1):
        buf[int(pids[i])].fill_(i % 251 + 2)
    store()
    chunk_offset = (layer * config.components + comp) * config.chunk_bytes
    for i in (0, len(pids) - 1):
        start = int(offs[i]) + chunk_offset
        if not torch.equal(arena[start : start + config.chunk_bytes], buf[int(pids[i])]):
            raise AssertionError(f"page {int(pids[i])} was not stored into its slot")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run the benchmark and print a table."""
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.bench.kernels_bench", description=__doc__
    )
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per transfer, MiB")
    parser.add_argument("--chunk-kib", type=int, default=128, help="page-layer chunk, KiB")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--components", type=int, default=2, choices=(1, 2), help="2: MHA, 1: MLA")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = BenchConfig(
        args.total_mib, args.chunk_kib, args.layers, args.components, args.repeats, args.seed
    )
    memcpy_gbps, results = run(config)
    print(
        f"page copy: {config.nbytes / 2**20:.0f} MiB per transfer, {config.chunk_kib} KiB chunks, "
        f"{config.layers} layers x {config.components} components, {config.pages} pages, "
        f"{config.repeats} rounds"
    )
    print(f"numpy memcpy, one thread: {memcpy_gbps:6.2f} GB/s")
    print(
        f"{'order':<12} {'direction':<9} {'GB/s':>7} {'x memcpy median':>15} {'best':>5} "
        f"{'runs':>5} {'singles':>8}"
    )
    for r in results:
        print(
            f"{r.order:<12} {r.direction:<9} {r.gbps:7.2f} {r.ratio:15.2f} {r.best_ratio:5.2f} "
            f"{r.runs:5d} {r.singles:8d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
