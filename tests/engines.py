"""Test helpers: small CPU engines with deterministic page contents."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import torch
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import TORCH_DTYPES, SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import hand_over, handover_path
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES

SMALL = P.Geometry(
    num_layers=4, page_size=16, kv_heads=2, head_dim=32, dtype="float32"
)  # 16 KiB pages
OTHER = P.Geometry(
    num_layers=3, page_size=8, kv_heads=4, head_dim=16, dtype="float16"
)  # 3 KiB pages
MLA = P.Geometry(
    num_layers=3, page_size=16, kv_heads=1, head_dim=64, dtype="float16", attention="mla"
)  # 6 KiB pages, one latent per layer


class ScrambledKVPool(SharedKVPool):
    """A KV pool whose segment holds the buffers in another order than :class:`SharedKVPool`:
    layers last to first, V before K. Its export says so, as the protocol allows (each
    buffer's offset is declared), so the daemon must follow ``buffer_offsets``::

        segment: | L(n-1).V | L(n-1).K | ... | L0.V | L0.K |
    """

    def __init__(self, geometry: P.Geometry, num_pages: int) -> None:
        super().__init__(geometry, num_pages)
        g = geometry
        buf_bytes = num_pages * g.chunk_bytes
        self._offsets = [
            ((g.num_layers - 1 - layer) * g.components + (g.components - 1 - comp)) * buf_bytes
            for layer in range(g.num_layers)
            for comp in range(g.components)
        ]
        shape = (num_pages, g.page_size, g.kv_heads, g.head_dim)

        def buf(layer: int, comp: int) -> torch.Tensor:
            off = self._offsets[layer * g.components + comp]
            return self.segment.tensor(off, buf_bytes).view(TORCH_DTYPES[g.dtype]).view(shape)

        self.k = [buf(layer, 0) for layer in range(g.num_layers)]
        self.v = [buf(layer, 1) for layer in range(g.num_layers)] if g.components == 2 else []

    def export(self) -> P.KVMemory:
        """The standard export with this pool's buffer offsets."""
        base = super().export()
        return P.KVMemory(
            kind=base.kind,
            num_pages=base.num_pages,
            segments=base.segments,
            buffer_segments=base.buffer_segments,
            buffer_offsets=list(self._offsets),
        )


def handover(rdir: Path, pool: SharedKVPool | None = None, fds: list[int] | None = None) -> bytes:
    """Hand ``pool``'s memory (or ``fds``) to the daemon in ``rdir``; return the token.

    For tests that send REGISTER by hand: name the token as ``handover``. The completion
    block's descriptor of the reply is closed (such a test waits on no transfer).
    """
    token = secrets.token_bytes(HANDOVER_TOKEN_BYTES)
    fd = hand_over(handover_path(rdir), token, pool.memory_fds() if fds is None else fds, 5.0)
    os.close(fd)
    return token


def client_config(rdir: Path, **kw: object) -> ClientConfig:
    """A client config pointing at the daemon in ``rdir`` with test-friendly timeouts."""
    base = {
        "runtime_dir": rdir,
        "request_timeout_s": 3.0,
        "load_timeout_s": 10.0,
        "heartbeat_interval_s": 0.5,
    }
    base.update(kw)
    return ClientConfig(**base)


def engine(
    rdir: Path,
    geometry: P.Geometry = SMALL,
    num_pages: int = 64,
    model: str = "m",
    pool_class: type[SharedKVPool] = SharedKVPool,
    **cfg: object,
) -> tuple[SharedKVPool, Connection]:
    """A KV pool in shared memory (of ``pool_class``) and a registered connection."""
    pool = pool_class(geometry, num_pages)
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
        raw = torch.randint(
            0, 255, (buf[page].numel() * buf.element_size(),), generator=g, dtype=torch.uint8
        )
        buf[page].view(-1).view(torch.uint8).copy_(raw)


def page_bytes(pool: SharedKVPool, page: int) -> bytes:
    """All layers' bytes of engine page ``page``, K then V."""
    return b"".join(
        bytes(buf[page].contiguous().view(-1).view(torch.uint8).numpy()) for buf in pool.k + pool.v
    )


def tokens(n: int, salt: int = 0) -> np.ndarray:
    """Deterministic token ids."""
    return (np.arange(n, dtype=np.int64) * 7919 + salt * 104729) % 32000
