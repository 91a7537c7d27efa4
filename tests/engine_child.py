"""An engine process for fault tests: ``python -m tests.engine_child MODE RUNTIME_DIR N``.

Modes:
    store  store chains 0..N-1 (chain i: 16 pages, contents derived from (i, page)),
           printing ``stored i`` after each completes; then sleep until killed.
    load   store chain 0 once, then load it again and again, printing ``loading`` before
           each load, until killed.
    long   store a chain of its own of N tiny pages (:data:`TINY`, 1 KiB) in one STORE, printing
           ``storing`` before it; a daemon with a small ``slice_pages`` is still allocating
           it for many turns of its event loop when the test kills this process.
Pages are 8 layers x 2 x 64 KiB so that one transfer takes long enough to be interrupted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kvtier.ipc import protocol as P

from tests.engines import engine, fill_page, tokens

BIG = P.Geometry(
    num_layers=8, page_size=64, kv_heads=4, head_dim=64, dtype="float32"
)  # 64 KiB chunks
CHAIN_PAGES = 16
TINY = P.Geometry(
    num_layers=1, page_size=16, kv_heads=1, head_dim=16, dtype="float16"
)  # 1 KiB pages: long chains in a small pool


def chain_tokens(i: int):
    """Tokens of chain ``i``."""
    return tokens(CHAIN_PAGES * BIG.page_size, salt=1000 + i)


def seed_of(chain: int, page: int) -> int:
    """The fill seed of page ``page`` of chain ``chain``."""
    return chain * 100 + page + 1


def main() -> None:
    mode, rdir, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "long":
        pool, conn = engine(rdir, TINY, num_pages=n, model="long")
        keys = conn.page_keys(tokens(n * TINY.page_size, salt=os.getpid()))  # a new chain
        print("storing", flush=True)
        conn.store(keys, list(range(n))).wait()
        print("done", flush=True)
        time.sleep(3600)
    pool, conn = engine(rdir, BIG, num_pages=2 * CHAIN_PAGES, model="fault")
    if mode == "store":
        for i in range(n):
            for p in range(CHAIN_PAGES):
                fill_page(pool, p, seed_of(i, p))
            h = conn.store(conn.page_keys(chain_tokens(i)), list(range(CHAIN_PAGES)))
            print(f"storing {i}", flush=True)
            if h.wait():
                print(f"stored {i}", flush=True)
    else:
        for p in range(CHAIN_PAGES):
            fill_page(pool, p, seed_of(0, p))
        keys = conn.page_keys(chain_tokens(0))
        conn.store(keys, list(range(CHAIN_PAGES))).wait()
        dst = list(range(CHAIN_PAGES, 2 * CHAIN_PAGES))
        for _ in range(n):
            print("loading", flush=True)
            conn.load(keys, dst).wait()
    print("done", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
