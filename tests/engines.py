"""Test helpers: small CPU engines with deterministic page contents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from kvtier.client.connection import Connection
from kvtier.client.kv_pool import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P

SMALL = P.Geometry(num_layers=4, page_size=16, kv_heads=2, head_dim=32, dtype="float32")  # 16 KiB pages
OTHER = P.Geometry(num_layers=3, page_size=8, kv_heads=4, head_dim=16, dtype="float16")  # 3 KiB pages


def client_config(rdir: Path, **kw: object) -> ClientConfig:
    """A client config pointing at the daemon in ``rdir`` with test-friendly timeouts."""
    base = {"runtime_dir": rdir, "request_timeout_s": 3.0, "load_timeout_s": 10.0,
            "heartbeat_interval_s": 0.5}
    base.update(kw)
    return ClientConfig(**base)


def engine(rdir: Path, geometry: P.Geometry = SMALL, num_pages: int = 64, model: str = "m",
           **cfg: object) -> tuple[SharedKVPool, Connection]:
    """A KV pool in shared memory and a registered connection."""
    pool = SharedKVPool(geometry, num_pages)
    try:
        conn = Connection(pool, model_id=model, config=client_config(rdir, **cfg))
    except BaseException:
        pool.close()
        raise
    return pool, conn


def fill_page(pool: SharedKVPool, page: int, seed: int) -> None:
    """Write a pattern derived from ``seed`` into every layer of engine page ``page``."""
    for layer, buf in enumerate(pool.k + pool.v):
        g = torch.Generator().manual_seed(seed * 1000 + layer)
        raw = torch.randint(0, 255, (buf[page].numel() * buf.element_size(),), generator=g,
                            dtype=torch.uint8)
        buf[page].view(-1).view(torch.uint8).copy_(raw)


def page_bytes(pool: SharedKVPool, page: int) -> bytes:
    """All layers' bytes of engine page ``page``, K then V."""
    return b"".join(bytes(buf[page].contiguous().view(-1).view(torch.uint8).numpy())
                    for buf in pool.k + pool.v)


def tokens(n: int, salt: int = 0) -> np.ndarray:
    """Deterministic token ids."""
    return (np.arange(n, dtype=np.int64) * 7919 + salt * 104729) % 32000
