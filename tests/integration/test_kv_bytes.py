"""A real kvtierd lays KV pages out in its pool file as documented, whatever the engine's layout.

A store and a load through the same daemon are symmetric: if both swapped K and V (or
layers), a round trip would still return the engine's bytes. But the pool file outlives the
daemon, other engines with other buffer layouts read it, and the L3 backends copy slots as
they are, so the slot layout is a contract (docs/protocol.md, "Geometry and exported
memory")::

    one host slot = one page:  | L0.K | L0.V | L1.K | L1.V | ... |   (MLA: | L0 | L1 | ... |)

These tests read and write the pool file in /dev/shm directly, next to the running daemon,
by its documented format (daemon/pool/layout.py, docs/architecture.md "Restart survival"):
its header and per-slot key/state rows locate a page's slot (slot offsets as
daemon/pool/slots.py documents them), and the expected bytes are assembled from the
engine's K and V tensors by hand.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config.loader import pool_path
from kvtier.launch.daemon_process import DaemonProcess

from tests.engines import MLA, SMALL, ScrambledKVPool, engine, fill_page, tokens

pytestmark = pytest.mark.timeout(60)

# the daemon fixture's pool: --hicache-size 64MiB --extent-size 4MiB, no L3 (no headroom)
POOL_BYTES = 64 << 20
EXTENT_BYTES = 4 << 20

LAYOUTS = [pytest.param(SharedKVPool, id="standard"), pytest.param(ScrambledKVPool, id="scrambled")]
GEOMETRIES = [pytest.param(SMALL, id="mha"), pytest.param(MLA, id="mla")]


_HEADER = struct.Struct("<8sIIQQQQQQIIQQ")
"""The pool file's header (daemon/pool/layout.py): magic, format version, header size,
capacity, extent bytes, alignment, slot ids per extent, extents, slots, key bytes, id-table
capacity, metadata bytes, headroom."""
_COLUMNS = (
    ("stamp", 8),
    ("checksum", 8),
    ("seal", 8),
    ("ns", 8),
    ("owner", 8),
    ("length", 8),
    ("parent", 4),
    ("key", 32),
    ("state", 1),
)
"""The per-slot columns, in file order, with their bytes per slot (the rest do not matter)."""
_READY = 2


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class PoolFile:
    """The daemon's pool file, opened next to it, read by its documented format (format
    version 2), not by the pool's code: finds the slot of a page by its key.

    Args:
        runtime_dir: the daemon's runtime directory (the pool file is named after it).
    """

    def __init__(self, runtime_dir: Path) -> None:
        self.path = pool_path(Path("/dev/shm"), runtime_dir)
        self.fd = os.open(self.path, os.O_RDWR)
        (
            magic,
            version,
            _,
            capacity,
            self.extent_bytes,
            self.align,
            self.per_extent,
            self.n_extents,
            self.n_slots,
            key_bytes,
            id_capacity,
            self.meta_bytes,
            self.headroom,
        ) = _HEADER.unpack(os.pread(self.fd, _HEADER.size, 0))
        assert (magic, version, key_bytes) == (b"KVTPOOL\x00", 2, 32)
        assert (capacity, self.extent_bytes, self.headroom) == (POOL_BYTES, EXTENT_BYTES, 0)
        # 4 KiB header region, then two id tables (32-byte digests, then 1-byte used flags),
        # then the extent table (page bytes per extent, int64), then the slot columns, each
        # 64-byte aligned
        self.ext_off = _round_up(4096 + 2 * id_capacity * 33, 64)
        off = _round_up(self.ext_off + 8 * self.n_extents, 64)
        self.columns: dict[str, int] = {}
        for name, size in _COLUMNS:
            self.columns[name] = off
            off = _round_up(off + size * self.n_slots, 64)
        assert off <= self.meta_bytes

    def _column(self, name: str, size: int, dtype: str) -> np.ndarray:
        data = os.pread(self.fd, size * self.n_slots, self.columns[name])
        return np.frombuffer(data, dtype=dtype)

    def slot_of(self, key: bytes) -> tuple[int, int]:
        """``(file offset of the payload, page bytes)`` of the READY page named ``key``."""
        keys = self._column("key", 32, "u1").reshape(self.n_slots, 32)
        state = self._column("state", 1, "i1")
        hits = np.flatnonzero(
            (keys == np.frombuffer(key, dtype=np.uint8)).all(axis=1) & (state == _READY)
        )
        assert hits.size == 1, f"{hits.size} READY slots hold key {key.hex()[:16]}"
        slot = int(hits[0])
        extent, index = divmod(slot, self.per_extent)
        (page_bytes,) = struct.unpack("<q", os.pread(self.fd, 8, self.ext_off + 8 * extent))
        # daemon/pool/slots.py: offset = extent * span + index * stride (+ headroom: none
        # here), in the arena that starts right after the metadata
        span = self.extent_bytes + self.per_extent * self.headroom
        stride = self.headroom + _round_up(page_bytes, self.align)
        return self.meta_bytes + extent * span + index * stride + self.headroom, page_bytes

    def read(self, key: bytes) -> bytes:
        """The payload of the page named ``key``."""
        off, size = self.slot_of(key)
        return os.pread(self.fd, size, off)

    def write(self, key: bytes, payload: bytes) -> None:
        """Overwrite the payload of the page named ``key`` (as an L3 object restored there
        would land)."""
        off, size = self.slot_of(key)
        assert len(payload) == size
        assert os.pwrite(self.fd, payload, off) == size

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def daemon(module_daemon: DaemonProcess) -> DaemonProcess:
    """The module's daemon: each test stores in a namespace of its own (see :func:`model`)."""
    return module_daemon


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """A model id of this test's own, so its pages live in a namespace of their own."""
    return request.node.name


@pytest.fixture
def pool_file(daemon: DaemonProcess) -> Iterator[PoolFile]:
    f = PoolFile(daemon.runtime_dir)
    yield f
    f.close()


def raw(t: torch.Tensor) -> bytes:
    """The bytes of one page of one buffer."""
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy())


def documented_slot(pool: SharedKVPool, page: int) -> bytes:
    """The slot bytes of engine page ``page`` per the documented layout: per layer, K then V."""
    out = b""
    for layer in range(pool.geometry.num_layers):
        out += raw(pool.k[layer][page])
        if pool.v:
            out += raw(pool.v[layer][page])
    return out


def store(pool: SharedKVPool, conn: Connection, pages: list[int], salt: int) -> list[bytes]:
    """Fill ``pages`` with distinct patterns and store them; return their keys."""
    for p in pages:
        fill_page(pool, p, seed=salt * 100 + p)
    keys = conn.page_keys(tokens(len(pages) * pool.geometry.page_size, salt=salt))
    h = conn.store(keys, pages)
    assert h.count == len(pages) and h.wait()
    return keys


# pages given out of order, with a run of three and single pages (both copy paths)
PAGES = [6, 0, 1, 2, 9]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("pool_class", LAYOUTS)
def test_a_stored_page_lies_in_the_pool_as_documented(
    daemon, model, pool_file, pool_class, geometry
):
    pool, conn = engine(
        daemon.runtime_dir, geometry, num_pages=16, model=model, pool_class=pool_class
    )
    try:
        keys = store(pool, conn, PAGES, salt=1)
        for key, page in zip(keys, PAGES):
            got = pool_file.read(key)
            assert len(got) == geometry.page_bytes
            assert got == documented_slot(pool, page), f"engine page {page}"
    finally:
        conn.close()
        pool.close()


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("pool_class", LAYOUTS)
def test_bytes_placed_in_the_pool_load_into_the_right_buffers(
    daemon, model, pool_file, pool_class, geometry
):
    pool, conn = engine(
        daemon.runtime_dir, geometry, num_pages=16, model=model, pool_class=pool_class
    )
    try:
        keys = store(pool, conn, PAGES, salt=2)
        g = geometry
        placed: list[list[bytes]] = []  # per page: the chunks, in slot order
        for i, key in enumerate(keys):
            gen = np.random.default_rng(1000 + i)
            chunks = [gen.bytes(g.chunk_bytes) for _ in range(g.num_layers * g.components)]
            pool_file.write(key, b"".join(chunks))
            placed.append(chunks)
        dst = [15, 12, 13, 14, 3]
        h = conn.load(keys, dst)
        assert h.count == len(keys) and h.wait()
        for chunks, page in zip(placed, dst):
            for layer in range(g.num_layers):
                k_chunk = chunks[layer * g.components]  # K first in each layer
                assert raw(pool.k[layer][page]) == k_chunk, f"K of layer {layer}, page {page}"
                if g.components == 2:
                    v_chunk = chunks[layer * g.components + 1]  # then V
                    assert raw(pool.v[layer][page]) == v_chunk, f"V of layer {layer}, page {page}"
    finally:
        conn.close()
        pool.close()


def test_an_engine_with_another_buffer_layout_loads_the_same_k_and_v(daemon, model):
    std_pool, std = engine(daemon.runtime_dir, SMALL, num_pages=16, model=model)
    odd_pool, odd = engine(
        daemon.runtime_dir, SMALL, num_pages=16, model=model, pool_class=ScrambledKVPool
    )
    try:
        assert odd.ns_fingerprint == std.ns_fingerprint  # one namespace: the pages are shared
        keys = store(std_pool, std, PAGES, salt=3)
        dst = [3, 4, 5, 10, 11]
        h = odd.load(keys, dst)
        assert h.count == len(keys) and h.wait()
        for src, page in zip(PAGES, dst):
            for layer in range(SMALL.num_layers):
                assert raw(odd_pool.k[layer][page]) == raw(std_pool.k[layer][src])
                assert raw(odd_pool.v[layer][page]) == raw(std_pool.v[layer][src])
    finally:
        for c, p in ((std, std_pool), (odd, odd_pool)):
            c.close()
            p.close()
