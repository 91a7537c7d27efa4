"""Prefix-cache hit rates of eviction policies over a request trace, simulated.

A trace is a list of requests in arrival order, each a chain of block ids (the Mooncake
format's ``hash_ids``: two requests whose lists start with the same ids share that prefix).
Each request counts its *leading* resident blocks as hits (a block is useful only with its
whole prefix), then every block of its chain is resident (the missed ones inserted), and the
cache evicts down to its capacity. Hit rate: hit blocks / all blocks of all requests.

Policies (all evict only leaves: a block with a resident child stays, so no chain is cut in
the middle):

- :func:`lru_hit_rate`: the least recently used leaf, a chain touched tail first (its tail
  is the colder end), as the host pool's ``lru`` policy does.
- :func:`arc_hit_rate`: ARC (Megiddo and Modha, FAST'03), the host pool's ``arc`` policy:
  blocks seen once (T1) and blocks reused (T2), each in LRU order; a target size ``p`` of
  T1 adapts on hits in the ghost lists B1 and B2 (keys recently evicted from T1 and T2,
  each at most the capacity); a block re-inserted from a ghost list goes to T2.
- :func:`min_hit_rate`: Belady's MIN (offline: evicts the block used again farthest in the
  future), counted per block; a reference for what knowing the future could keep.

Used by ``kvtier bench trace`` (beside the hit rate of a real kvtierd) and on its own:
``python -m kvtier.bench.trace.sim [--trace FILE] [--blocks N,...]`` prints every policy
on the whole trace, its halves and a synthetic workload.
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_TRACE",
    "POLICIES",
    "TraceError",
    "arc_hit_rate",
    "load_trace",
    "lru_hit_rate",
    "main",
    "min_hit_rate",
    "synthetic_trace",
    "workloads",
]

DEFAULT_TRACE = Path(__file__).parent.parent / "data" / "mooncake_conversation_trace.jsonl.gz"
"""The Mooncake FAST'25 conversation trace (Apache-2.0; bench/data/NOTICE), gzipped."""

Chains = Sequence[Sequence[int]]


class TraceError(ValueError):
    """A trace file that cannot be read as the Mooncake format (names line and field)."""


def load_trace(
    path: str | Path = DEFAULT_TRACE, limit: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """Read a Mooncake-format trace (``.jsonl`` or ``.jsonl.gz``).

    Args:
        path: the file: one JSON object a line with ``hash_ids`` (a list of ints) and
            ``timestamp`` (milliseconds, optional).
        limit: read at most this many requests.

    Returns:
        ``(chains, timestamps)``, in file order.

    Raises:
        TraceError: the file cannot be read, or a line is not such an object (naming the
            line and what is wrong), or holds a block twice.
    """
    try:
        return _read_trace(path, limit)
    except (OSError, EOFError) as err:  # missing, a directory, a corrupt or cut gzip
        raise TraceError(f"{path}: cannot read it: {err}") from err


def _read_trace(path: str | Path, limit: int | None) -> tuple[list[list[int]], list[int]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    chains: list[list[int]] = []
    stamps: list[int] = []
    with opener(path, "rt") as fh:
        for n, line in enumerate(fh, 1):
            if limit is not None and len(chains) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise TraceError(f"{path}:{n}: not JSON ({err})") from err
            ids = row.get("hash_ids") if isinstance(row, dict) else None
            if not isinstance(ids, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 1 << 64 for b in ids
            ):
                raise TraceError(
                    f"{path}:{n}: hash_ids must be a list of ints in [0, 2**64), got {ids!r:.80}"
                )
            if len(set(ids)) != len(ids):  # a block names its whole prefix: never twice
                raise TraceError(f"{path}:{n}: hash_ids holds a block twice: {ids!r:.80}")
            ts = row.get("timestamp", 0)
            if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
                raise TraceError(f"{path}:{n}: timestamp must be a number, got {ts!r:.80}")
            chains.append(ids)
            stamps.append(int(ts))
    return chains, stamps


def _leading_hits(chain: Sequence[int], resident: dict[int, int] | set[int]) -> int:
    n = 0
    for b in chain:
        if b not in resident:
            break
        n += 1
    return n


def lru_hit_rate(chains: Chains, capacity: int) -> float:
    """Hit rate of leaf-only LRU with ``capacity`` blocks (see the module docstring)."""
    stamp: dict[int, int] = {}  # resident block -> last access
    kids: dict[int, int] = {}  # resident block -> resident children
    parent: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (stamp, block) of leaves; stale entries skipped
    clock = hits = total = 0
    for chain in chains:
        total += len(chain)
        hits += _leading_hits(chain, stamp)
        for i, b in enumerate(chain):
            if b not in stamp:
                kids[b] = 0
                if i:  # the parent it has now (a block evicted may come back under another)
                    parent[b] = chain[i - 1]
                    kids[chain[i - 1]] += 1
                stamp[b] = 0
        for b in reversed(chain):  # the tail is touched first: the colder end
            clock += 1
            stamp[b] = clock
            if kids[b] == 0:
                heapq.heappush(heap, (clock, b))
        while len(stamp) > capacity and heap:
            st, b = heapq.heappop(heap)
            if stamp.get(b) != st or kids[b]:
                continue
            del stamp[b], kids[b]
            p = parent.pop(b, None)
            if p is not None and p in stamp:
                kids[p] -= 1
                if kids[p] == 0:
                    heapq.heappush(heap, (stamp[p], p))
    return hits / total if total else 0.0


def arc_hit_rate(chains: Chains, capacity: int, ghost: float = 1.0) -> float:
    """Hit rate of leaf-only ARC with ``capacity`` blocks (see the module docstring);
    ``ghost``: each ghost list's length as a multiple of the capacity (ARC's own: 1)."""
    stamp: dict[int, int] = {}
    tier: dict[int, int] = {}  # resident block -> 0 (T1) or 1 (T2)
    kids: dict[int, int] = {}
    parent: dict[int, int] = {}
    heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
    ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())
    t2 = clock = hits = total = 0
    p = 0.0
    glen = int(ghost * capacity)

    def coldest(k: int) -> int | None:
        hp = heaps[k]
        while hp:
            st, b = hp[0]
            if stamp.get(b) == st and tier[b] == k and kids[b] == 0:
                return b
            heapq.heappop(hp)
        return None

    for chain in chains:
        total += len(chain)
        n = _leading_hits(chain, stamp)
        hits += n
        for i, b in enumerate(chain):
            if i < n:
                if tier[b] == 0:
                    tier[b] = 1
                    t2 += 1
                continue
            k = 0
            if b in ghosts[0]:
                p = min(capacity, p + max(len(ghosts[1]) / len(ghosts[0]), 1.0))
                del ghosts[0][b]
                k = 1
            elif b in ghosts[1]:
                p = max(0.0, p - max(len(ghosts[0]) / len(ghosts[1]), 1.0))
                del ghosts[1][b]
                k = 1
            tier[b], kids[b], stamp[b] = k, 0, 0
            t2 += k
            if i:
                parent[b] = chain[i - 1]
                kids[chain[i - 1]] += 1
        for b in reversed(chain):
            clock += 1
            stamp[b] = clock
            if kids[b] == 0:
                heapq.heappush(heaps[tier[b]], (clock, b))
        while len(stamp) > capacity:
            k = 0 if len(stamp) - t2 > p else 1
            v = coldest(k)
            if v is None:
                k = 1 - k
                v = coldest(k)
            assert v is not None
            b = v
            heapq.heappop(heaps[k])
            del stamp[b], kids[b], tier[b]
            t2 -= k
            gone = ghosts[k]
            gone[b] = None
            if len(gone) > glen:
                gone.popitem(last=False)
            pb = parent.pop(b, None)
            if pb is not None and pb in stamp:
                kids[pb] -= 1
                if kids[pb] == 0:
                    heapq.heappush(heaps[tier[pb]], (stamp[pb], pb))
    return hits / total if total else 0.0


def min_hit_rate(chains: Chains, capacity: int) -> float:
    """Hit rate of Belady's MIN with ``capacity`` blocks, per block: after each request
    the blocks used again farthest in the future (never: first) go, deeper ones first."""
    never = len(chains)
    next_use: list[list[int]] = [[] for _ in chains]
    seen: dict[int, int] = {}
    for t in range(len(chains) - 1, -1, -1):
        next_use[t] = [seen.get(b, never) for b in chains[t]]
        for b in chains[t]:
            seen[b] = t
    resident: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []
    hits = total = 0
    for t, chain in enumerate(chains):
        total += len(chain)
        hits += _leading_hits(chain, resident)
        for i, b in enumerate(chain):
            nu = next_use[t][i]
            resident[b] = nu
            heapq.heappush(heap, (-nu, -i, b))
        while len(resident) > capacity:
            neg, _, b = heapq.heappop(heap)
            if resident.get(b) == -neg:
                del resident[b]
    return hits / total if total else 0.0


POLICIES = {"lru": lru_hit_rate, "arc": arc_hit_rate, "min": min_hit_rate}
"""Each policy's simulation: ``(chains, capacity) -> hit rate``."""


def synthetic_trace(requests: int, seed: int = 0) -> list[list[int]]:
    """A synthetic multi-turn workload, independent of any real trace.

    Conversations (a shared system prompt of 1 to 3 blocks from a few templates) arrive
    at random and come back for another turn with probability 0.6 after a gap drawn from
    an exponential distribution, each turn adding 1 to 8 blocks; one request in five is a
    one-off long document (20 to 80 fresh blocks).
    """
    rng = random.Random(seed)
    next_id = 1000
    templates = [list(range(k * 4, k * 4 + rng.randint(1, 3))) for k in range(8)]
    waiting: list[tuple[float, int, list[int]]] = []
    out: list[list[int]] = []
    now = 0.0
    for _ in range(requests):
        now += 1.0
        if waiting and waiting[0][0] <= now:
            _, _, chain = heapq.heappop(waiting)
        elif rng.random() < 0.2:
            chain = []
            for _ in range(rng.randint(20, 80)):
                chain.append(next_id)
                next_id += 1
            out.append(chain)
            continue
        else:
            chain = list(rng.choice(templates))
        for _ in range(rng.randint(1, 8)):
            chain.append(next_id)
            next_id += 1
        out.append(chain)
        if rng.random() < 0.6:
            heapq.heappush(waiting, (now + rng.expovariate(1 / 300), next_id, list(chain)))
    return out


def workloads(
    prog: str, description: str | None, argv: Sequence[str] | None
) -> tuple[list[int], dict[str, list[list[int]]]]:
    """The sizes and workloads a simulation command runs, from its command line.

    ``--trace`` (default: the shipped conversation trace) and ``--blocks`` (comma-separated
    cache sizes); the workloads are the whole trace, its two halves and a synthetic trace of
    as many requests (:func:`synthetic_trace`), so a policy is not judged on one file alone.
    """
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format trace")
    ap.add_argument("--blocks", default="2000,5000,10000,20000", help="cache sizes, in blocks")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.blocks.split(",")]
    chains, _ = load_trace(args.trace)
    half = len(chains) // 2
    return sizes, {
        "trace": chains,
        "first half": chains[:half],
        "second half": chains[half:],
        "synthetic": synthetic_trace(len(chains)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print every policy's hit rate (and ARC's gap closed) per size and workload."""
    sizes, work = workloads("python -m kvtier.bench.trace.sim", __doc__, argv)
    print(
        f"{'workload':<12} {'blocks':>7} "
        + " ".join(f"{k:>6}" for k in POLICIES)
        + "  arc gap_closed"
    )
    for name, ch in work.items():
        for size in sizes:
            r = {k: f(ch, size) for k, f in POLICIES.items()}
            span = r["min"] - r["lru"]  # under 0.01, LRU is all but optimal: no gap to close
            gap = f"{(r['arc'] - r['lru']) / span:6.2f}" if span >= 0.01 else "   n/a"
            print(
                f"{name:<12} {size:>7} " + " ".join(f"{v:6.3f}" for v in r.values()) + f"  {gap}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
