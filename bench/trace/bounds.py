"""How far eviction by page classes can go on a trace: a hindsight bound.

An online cache knows, of a page, what its past says: how often it was used, how long it
waited before its last use, how long the requests that used it were. A policy that gives each
*class* of pages (pages alike in those features) its own hold time (keep a page of class c
until it has been idle for ``ttl[c]``, then drop it) is what every recency and frequency
policy amounts to on a steady workload; LHD, hazard-rate and multi-queue rules are ways of
learning such hold times online. :func:`ttl_bound` computes the best such policy *with
hindsight*: the hold times are chosen knowing every future access of the trace, so no online
policy that tells pages apart by the same features does better than it on a steady workload,
and one that learns as it goes does worse.

It is an upper bound of the class-TTL policies, relaxed twice more in the policy's favour:

- a page's access is a hit when the page's previous access left it with a hold time at least
  as long as the gap (per page: a page whose prefix was dropped still counts, where a prefix
  cache would miss it);
- the cache holds ``capacity`` pages on average over the trace, not at every moment (its
  occupancy is the sum of the time pages are held within the trace over the trace's
  length: a page's hold that runs past the last request costs nothing);
- the hold times are any mix of the grid's (0 to 3,600 s, 15 s apart): the best mix for the
  capacity is found by a Lagrangian search and interpolated on its convex hull, which is at
  least the best single choice per class.

More classes never lower the bound (with a class per page it is MIN's), and hold times picked
with hindsight for many classes fit the trace rather than its traffic: the bound of a few
coarse features is the one that says what a policy could learn.

Features, each a few buckets:

- ``uses``: the page's accesses so far, this one included: 1, 2, 3, 4 or more;
- ``gap``: the time between its last two accesses, in powers of four seconds (0 to 5; 0 also
  for a first access);
- ``length``: the length of the request's chain, in powers of two blocks (0 to 7).

``python -m kvtier.bench.trace.bounds [--trace FILE] [--blocks N,...] [--json PATH]`` prints
the bound for each feature set at each size, beside Belady's MIN, LRU and the pool's ``reuse``
policy (which tells pages apart by use count alone) simulated on the same trace.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.trace.policies import reuse_hit_rate
from kvtier.bench.trace.sim import DEFAULT_TRACE, load_trace, lru_hit_rate, min_hit_rate

__all__ = ["FEATURES", "FEATURE_SETS", "TTL_GRID_S", "TtlBound", "main", "ttl_bound"]

FEATURES = ("uses", "gap", "length")
"""What a class may be told apart by (see the module docstring)."""

FEATURE_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("uses",),
    ("uses", "gap"),
    ("uses", "gap", "length"),
)
"""The feature sets the command line reports, from none to all."""

TTL_GRID_S = tuple(range(0, 3601, 15))
"""The hold times a class may be given, in seconds."""

Chains = Sequence[Sequence[int]]


@dataclass(frozen=True)
class TtlBound:
    """What :func:`ttl_bound` found.

    Attributes:
        hit_rate: hits / all blocks of all requests.
        classes: how many classes the trace has under the features.
        ttl_s: each class's hold time (its feature buckets joined by commas) at the point
            chosen: the shorter of the two the bound mixes.
        occupancy: pages held on average at that point.
    """

    hit_rate: float
    classes: int
    ttl_s: dict[str, int]
    occupancy: float


def _class_gaps(
    chains: Chains, stamps_ms: Sequence[float], features: Sequence[str]
) -> dict[tuple[int, ...], tuple[list[float], list[float]]]:
    """Per class, for each access of its pages: the gap to the page's next access, in
    seconds (the first list), or, for an access with none, the time left to the end of the
    trace (the second: a page held past the end takes no room within it). Times are
    subtracted in milliseconds, then divided: a reuse exactly on a grid value is one."""
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"features: unknown {unknown!r}; choose from {list(FEATURES)}")
    end = stamps_ms[-1] if stamps_ms else 0.0
    nxt: dict[int, float] = {}
    after: list[list[float | None]] = [[] for _ in chains]
    for t in range(len(chains) - 1, -1, -1):
        after[t] = [None if b not in nxt else (nxt[b] - stamps_ms[t]) / 1000.0 for b in chains[t]]
        for b in chains[t]:
            nxt[b] = stamps_ms[t]
    uses: dict[int, int] = defaultdict(int)
    last: dict[int, float] = {}
    out: dict[tuple[int, ...], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for t, chain in enumerate(chains):
        length = min(len(chain).bit_length(), 7)
        for b, gap_next in zip(chain, after[t], strict=True):
            uses[b] += 1
            prev = last.get(b)
            last[b] = stamps_ms[t]
            key = []
            for f in features:
                if f == "uses":
                    key.append(min(uses[b], 4))
                elif f == "gap":
                    g = 0.0 if prev is None else (stamps_ms[t] - prev) / 1000.0
                    key.append(min(int(math.log2(g + 1.0)) // 2, 5))
                else:
                    key.append(length)
            reused, tails = out[tuple(key)]
            if gap_next is None:
                tails.append((end - stamps_ms[t]) / 1000.0)
            else:
                reused.append(gap_next)
    return out


def _curves(reused: list[float], tails: list[float]) -> tuple[list[float], list[int]]:
    """For each hold time of the grid: the page-seconds held within the trace and the hits
    of one class (``reused``: gaps to a next access; ``tails``: what is left of the trace
    after an access with none)."""
    sums = []
    for xs in (sorted(reused), sorted(tails)):
        prefix = [0.0]
        for x in xs:
            prefix.append(prefix[-1] + x)
        sums.append((xs, prefix))
    costs, hits = [], []
    for ttl in TTL_GRID_S:
        cost = 0.0
        for xs, prefix in sums:  # each held until its next access, the end, or ttl
            k = bisect.bisect_right(xs, ttl)
            cost += prefix[k] + ttl * (len(xs) - k)
        hits.append(bisect.bisect_right(sums[0][0], ttl))  # reused within ttl
        costs.append(cost)
    return costs, hits


def ttl_bound(
    chains: Chains, timestamps_ms: Sequence[float], capacity: int, features: Sequence[str] = ()
) -> TtlBound:
    """The hindsight bound of class-TTL eviction (see the module docstring).

    Args:
        chains: the requests' block chains, in arrival order.
        timestamps_ms: their arrival times, in milliseconds (non-decreasing).
        capacity: the cache's size, in blocks (pages held on average).
        features: a subset of :data:`FEATURES`.

    Returns:
        the bound, and the hold times it chose.

    Raises:
        ValueError: an unknown feature, a negative capacity, timestamps that are not as
            many as the chains or go back in time.
    """
    if capacity < 0:
        raise ValueError(f"capacity: must be >= 0, got {capacity!r}")
    if len(timestamps_ms) != len(chains):
        raise ValueError(
            f"timestamps_ms: {len(timestamps_ms)} for {len(chains)} chains (one per chain)"
        )
    if any(b < a for a, b in itertools.pairwise(timestamps_ms)):
        raise ValueError("timestamps_ms: must not decrease (arrival order)")
    total = sum(len(c) for c in chains)
    span = (timestamps_ms[-1] - timestamps_ms[0]) / 1000.0 if timestamps_ms else 0.0
    classes = _class_gaps(chains, timestamps_ms, features)
    curves = {k: _curves(*v) for k, v in classes.items()}
    if total == 0:
        return TtlBound(0.0, len(curves), {}, 0.0)
    if span <= 0.0:  # one instant: no hold takes room in it, and only same-time reuses hit
        same = sum(hs[0] for _, hs in curves.values())
        return TtlBound(same / total, len(curves), {}, 0.0)

    def at(lam: float) -> tuple[float, int, dict[tuple[int, ...], int]]:
        cost = 0.0
        hits = 0
        pick: dict[tuple[int, ...], int] = {}
        for k, (cs, hs) in curves.items():
            i = max(range(len(cs)), key=lambda j: (hs[j] - lam * cs[j], -j))
            cost += cs[i]
            hits += hs[i]
            pick[k] = TTL_GRID_S[i]
        return cost / span, hits, pick

    lo, hi = 1e-9, float(total)  # prices of a page-second: lo holds too much, hi fits
    occ_hi, hits_hi, pick = at(hi)
    while occ_hi > capacity and hi < 1e30:  # a short trace: a page-second is dearer
        hi *= 1e3
        occ_hi, hits_hi, pick = at(hi)
    if occ_hi > capacity:  # holding nothing past a same-time reuse costs nothing: fits
        occ_hi, hits_hi = 0.0, sum(hs[0] for _, hs in curves.values())
        pick = dict.fromkeys(curves, 0)
    occ_lo, hits_lo, pick_lo = at(lo)
    if occ_lo <= capacity:  # everything the grid can keep fits
        occ_hi, hits_hi, pick = occ_lo, hits_lo, pick_lo
    else:
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            o, h, p = at(mid)
            if o > capacity:
                lo, occ_lo, hits_lo = mid, o, h
            else:
                hi, occ_hi, hits_hi, pick = mid, o, h, p
    hits = float(hits_hi)
    if occ_lo > capacity > occ_hi and occ_lo > occ_hi:  # mix the two points of the hull
        hits += (hits_lo - hits_hi) * (capacity - occ_hi) / (occ_lo - occ_hi)
    ttls = {",".join(map(str, k)): v for k, v in sorted(pick.items())}
    return TtlBound(hits / total, len(curves), ttls, round(occ_hi, 1))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the bound of each feature set at each size, beside MIN and LRU."""
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.trace.bounds", description=__doc__)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format trace")
    ap.add_argument("--blocks", default="2000,5000,10000,20000", help="cache sizes, in blocks")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.blocks.split(",")]
    except ValueError:
        ap.error(f"--blocks: comma-separated integers, got {args.blocks!r}")
    if any(s <= 0 for s in sizes):
        ap.error(f"--blocks: sizes must be > 0, got {args.blocks!r}")
    chains, stamps = load_trace(args.trace)
    report: dict[str, object] = {
        "trace": Path(args.trace).name,
        "sizes": sizes,
        "lru_hit_rate": [round(lru_hit_rate(chains, s), 4) for s in sizes],
        "min_hit_rate": [round(min_hit_rate(chains, s), 4) for s in sizes],
        "reuse_hit_rate": [round(reuse_hit_rate(chains, s), 4) for s in sizes],
    }
    print("| classes by | " + " | ".join(str(s) for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name in ("lru_hit_rate", "min_hit_rate", "reuse_hit_rate"):
        row = report[name]
        assert isinstance(row, list)
        print(f"| {name.split('_')[0]} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
    bounds: dict[str, list[float]] = {}
    for fs in FEATURE_SETS:
        label = "+".join(fs) or "nothing"
        row = [round(ttl_bound(chains, stamps, s, fs).hit_rate, 4) for s in sizes]
        bounds[label] = row
        print(f"| {label} | " + " | ".join(f"{v:.4f}" for v in row) + " |", flush=True)
    report["ttl_bound"] = bounds
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
