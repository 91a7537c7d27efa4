"""N instances, one node: one shared kvtier pool of S pages vs N private pools of S/N pages.

The workload (a shared-prefix one, the case co-located instances of one model meet)::

    8 system prompts of 24 pages each (192 pages in all), popularity 1/rank (Zipf, s = 1)
    each request: one system prompt + 8 pages of its own (never seen again)
    requests go round-robin to the N instances; 100 per instance, the same trace for both
    each request: LOOKUP its pages, then STORE the ones the pool lacks (as HiCache backs
    up what it computed); hit rate = pages found / pages asked, over all requests

At most 24 of a request's 32 pages can ever hit (its own 8 are new), so 0.75 is the ceiling.

Both sides run the same code with the same total memory: the shared side is one kvtierd
with an L2 pool of S pages; the private side is N kvtierd processes with S/N pages each, one
per instance: the eviction policy (LRU, leaves first) is the same as each side's, so the
only difference is that a system prompt is held once on the node instead of once per
instance. (SGLang's own host pool evicts by LRU over its radix tree's leaves too; a private
SGLang host pool of S/N behaves like one private kvtierd here.)
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc.protocol import Geometry
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["WORKLOAD", "run_sharing"]

GEOMETRY = Geometry(num_layers=2, page_size=16, kv_heads=2, head_dim=64, dtype="bfloat16")
"""16 KiB pages: small, so the pools are small; the hit rates do not depend on page bytes."""
PROMPTS, PROMPT_PAGES, OWN_PAGES, PER_INSTANCE = 8, 24, 8, 100
WORKLOAD = (
    f"{PROMPTS} system prompts x {PROMPT_PAGES} pages (Zipf popularity), each request "
    f"= one prompt + {OWN_PAGES} pages of its own, {PER_INSTANCE} requests per "
    "instance round-robin, LOOKUP then STORE of what is missing"
)


def _trace(instances: int, seed: int = 1) -> list[tuple[int, list[int]]]:
    """``(instance, tokens)`` per request."""
    rng = random.Random(seed)
    weights = [1 / (r + 1) for r in range(PROMPTS)]
    ps = GEOMETRY.page_size
    out = []
    for n in range(instances * PER_INSTANCE):
        prompt = rng.choices(range(PROMPTS), weights)[0]
        head = [prompt * 100_000 + i for i in range(PROMPT_PAGES * ps)]
        own = [10_000_000 + n * 1000 + i for i in range(OWN_PAGES * ps)]
        out.append((n % instances, head + own))
    return out


def _replay(conns: list[Connection], trace: list[tuple[int, list[int]]]) -> float:
    asked = hit = 0
    for inst, tokens in trace:
        conn = conns[inst]
        keys = conn.page_keys(tokens)
        found = conn.lookup(keys).l2
        handle = conn.store(keys, list(range(len(keys))))
        handle.wait()
        asked += len(keys)
        hit += found
    return hit / asked


def run_sharing(instances: int = 4, pool_pages: int = 512) -> dict[str, object]:
    """Hit rates of one shared pool of ``pool_pages`` vs ``instances`` private pools of
    ``pool_pages / instances`` each, on the same trace (see the module doc)."""
    page_kib = GEOMETRY.page_bytes // 1024
    extent_kib = 16 * page_kib
    if pool_pages % (instances * 16):
        raise ValueError(f"pool_pages must be a multiple of {instances * 16}")
    trace = _trace(instances)
    rates = {}
    with tempfile.TemporaryDirectory(prefix="kvsb-", dir="/tmp") as tmp:
        for side, n_daemons in (("shared", 1), ("private", instances)):
            kib = pool_pages * page_kib // n_daemons
            daemons = [
                DaemonProcess(
                    Path(tmp) / f"{side}{i}",
                    [
                        "--hicache-size",
                        f"{kib}KiB",
                        "--extent-size",
                        f"{extent_kib}KiB",
                        "--hicache-storage-backend",
                        "none",
                    ],
                    isolated=True,
                )
                for i in range(n_daemons)
            ]
            pools: list[SharedKVPool] = []
            conns: list[Connection] = []
            try:
                for d in daemons:
                    d.start()
                for i in range(instances):
                    d = daemons[i % n_daemons]
                    pools.append(SharedKVPool(GEOMETRY, num_pages=PROMPT_PAGES + OWN_PAGES))
                    conns.append(
                        Connection(
                            pools[-1],
                            model_id="bench-sharing",
                            config=ClientConfig(runtime_dir=d.runtime_dir),
                        )
                    )
                rates[side] = _replay(conns, trace)
            finally:
                for c in conns:
                    c.close()
                for p in pools:
                    p.close()
                for d in daemons:
                    d.discard()
    return {
        "instances": instances,
        "pool_pages": pool_pages,
        "private_pool_pages": pool_pages // instances,
        "workload": WORKLOAD,
        "hit_ceiling": PROMPT_PAGES / (PROMPT_PAGES + OWN_PAGES),
        "shared_hit_rate": round(rates["shared"], 4),
        "private_hit_rate": round(rates["private"], 4),
    }
