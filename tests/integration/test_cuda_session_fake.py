"""The daemon's CUDA session lifecycle, end to end, with a FAKE CUDA backend (no GPU here).

A real kvtierd runs with :mod:`tests.fake_cuda` installed (:mod:`tests.fake_cuda_kvtierd`); the
engine is a real ``Connection`` over a ``CudaKVPool`` backed by the same fake. Only the CUDA
calls are fake ("device memory" is a shared file, events are counters in shared files, copies
are numpy copies): the registration, the session's copier and events, the transfers, the
failure handling, the close order and the re-registration after a restart are the real code.
What the fake cannot tell (real GPU timing, real IPC, real stream ordering) is checked only on
a GPU: tests/cuda, docs/gpu.md.

One test runs a plain kvtierd (no fake): on this machine it has no CUDA, and must say so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.replies import DaemonError
from kvtier.client.kv_pool.cuda import CudaKVPool
from kvtier.client.kv_pool.cuda_regions import CudaRegionMemory
from kvtier.ipc import protocol as P
from kvtier.client.connection.admin import AdminClient
from kvtier.launch.daemon_process import DaemonProcess

from tests.conftest import _daemon_flags
from tests.engines import client_config
from tests.fake_cuda import FakeCuda

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("error")]

G = P.Geometry(num_layers=4, page_size=16, kv_heads=2, head_dim=64, dtype="bfloat16")
PAGES = 32
N = 6  # pages per chain
DEADLINE_S = 30.0
ME = os.getpid()  # the engine, as the fake's journal names it


@pytest.fixture
def fake(short_tmp: Path) -> FakeCuda:
    return FakeCuda(short_tmp / "fc")


@pytest.fixture
def fake_daemon(short_tmp: Path, fake: FakeCuda) -> Iterator[DaemonProcess]:
    """A real kvtierd with the fake CUDA backend installed; it checksums the pages it stores
    and checks them when it adopts its pool after a restart."""
    d = DaemonProcess(
        short_tmp / "d0",
        _daemon_flags(short_tmp, "d0", "--verify-on-adopt"),
        env={"FAKE_CUDA_DIR": str(fake.root)},
        module="tests.fake_cuda_kvtierd",
    )
    d.start()
    try:
        yield d
    finally:
        if d.proc is not None:
            d.stop()
        d.remove_pool()


@pytest.fixture
def engine(fake_daemon: DaemonProcess, fake: FakeCuda) -> Iterator[tuple[CudaKVPool, Connection]]:
    pool = CudaKVPool(G, PAGES, backend=fake)
    conn = Connection(pool, model_id="fake-cuda", config=client_config(fake_daemon.runtime_dir))
    try:
        yield pool, conn
    finally:
        conn.close()
        pool.close()


def raw(pool: CudaKVPool) -> list[torch.Tensor]:
    """Every buffer as bytes per page: ``[num_pages, chunk_bytes]`` uint8 views."""
    return [b.view(torch.uint8).reshape(PAGES, -1) for b in [*pool.k, *pool.v]]


def fill(pool: CudaKVPool, pages: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in raw(pool):
        b[pages] = torch.randint(0, 256, b[pages].shape, dtype=torch.uint8, generator=gen)


def snapshot(pool: CudaKVPool) -> list[torch.Tensor]:
    return [b.clone() for b in raw(pool)]


def stats(d: DaemonProcess) -> dict:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return admin.stats()


def wait_for(d: DaemonProcess, ok, what: str) -> dict:
    end = time.monotonic() + DEADLINE_S
    while True:
        st = stats(d)
        if ok(st):
            return st
        assert time.monotonic() < end, f"{what}: {st['pool']} {st['counters']}"
        time.sleep(0.05)


def ops(fake: FakeCuda, pid: int, op: str) -> list[str]:
    return [what for p, o, what, _ in fake.journal() if p == pid and o == op]


def threads(fake: FakeCuda, pid: int, *names: str) -> set[str]:
    """The threads of ``pid`` that did the operations ``names``."""
    return {t.rsplit("_", 1)[0] for p, o, _, t in fake.journal() if p == pid and o in names}


def keys_for(conn: Connection, salt: int) -> list[bytes]:
    return conn.page_keys([(i * 7919 + salt * 104729) % 32000 for i in range(N * G.page_size)])


def test_register_opens_memory_and_returns_one_event_per_layer(fake_daemon, fake, engine):
    pool, conn = engine
    waiter = conn._cuda
    assert waiter is not None and waiter.num_layers == G.num_layers and not waiter.closed
    dpid = fake_daemon.pid
    assert ops(fake, dpid, "open_mem") == [pool.export().segments[0].name.split(":", 1)[1]]
    assert len(ops(fake, dpid, "create_stream")) == 1
    assert ops(fake, dpid, "pin_host")  # the pool is pinned for the session's copies
    # none of it on the event loop (the main thread): all on the daemon's CUDA thread
    assert threads(fake, dpid, "open_mem", "create_stream", "pin_host") == {"kvtier-cuda"}


def test_store_then_load_round_trip_layer_by_layer(fake_daemon, fake, engine):
    pool, conn = engine
    src, dst = list(range(N)), list(range(10, 10 + N))
    fill(pool, list(range(PAGES)), seed=1)
    before = snapshot(pool)
    keys = keys_for(conn, 1)
    h = conn.store(keys, src)
    assert h.count == N and h.wait()
    fake.set_fault("hold")  # the copies stay "on the GPU": layers recorded, the end not yet
    hl = conn.load(keys, dst)
    assert hl.count == N
    for layer in range(G.num_layers):
        assert hl.wait_layer(layer)
    assert not hl.done  # the daemon has not seen the copies finish: the waits were stream waits
    assert ops(fake, ME, "stream_wait") == [
        f"e{fake_daemon.pid}-{i}" for i in layer_event_ids(fake, fake_daemon.pid)
    ]
    fake.set_fault(None)
    assert hl.wait()
    after = snapshot(pool)
    for b0, b1 in zip(before, after, strict=True):
        assert torch.equal(b1[dst], b0[src])  # loaded byte for byte
        rest = [p for p in range(PAGES) if p not in dst]
        assert torch.equal(b1[rest], b0[rest])  # nothing else touched
    assert conn._cuda is not None and conn._cuda._ready.records == 2  # ready before each
    ready = f"e{fake_daemon.pid}-{layer_event_ids(fake, fake_daemon.pid)[-1] + 1}"
    assert ops(fake, fake_daemon.pid, "stream_wait") == [ready, ready]  # the copies wait for it
    assert ops(fake, fake_daemon.pid, "copy_plan") == ["dma", "dma"]  # cuda_copy's default
    c = stats(fake_daemon)["counters"]
    assert c["transfers_cuda"] == 2
    assert (c["transfers_inline"], c["transfers_shared"], c["transfers_split"]) == (0, 0, 0)
    assert ops(fake, fake_daemon.pid, "BAD") == ops(fake, ME, "BAD") == []


def test_cuda_copy_setting_reaches_the_copy_plan(short_tmp, fake):
    d = DaemonProcess(
        short_tmp / "dk",
        _daemon_flags(short_tmp, "dk", "--cuda-copy", "kernel"),
        env={"FAKE_CUDA_DIR": str(fake.root)},
        module="tests.fake_cuda_kvtierd",
    )
    d.start()
    pool = CudaKVPool(G, PAGES, backend=fake)
    conn = Connection(pool, model_id="fake-cuda", config=client_config(d.runtime_dir))
    try:
        assert conn.store(keys_for(conn, 7), list(range(N))).wait()
        assert ops(fake, d.pid, "copy_plan") == ["kernel"]
    finally:
        conn.close()
        pool.close()
        d.stop()
        d.remove_pool()


def layer_event_ids(fake: FakeCuda, dpid: int) -> list[int]:
    """The numbers of the daemon's layer events, in layer order (made right after its stream)."""
    stream = int(ops(fake, dpid, "create_stream")[0])
    return [stream + 1 + i for i in range(G.num_layers)]


def test_cancel_stops_between_layers(fake_daemon, fake, engine):
    pool, conn = engine
    src, dst = list(range(N)), list(range(10, 10 + N))
    fill(pool, list(range(PAGES)), seed=2)
    keys = keys_for(conn, 2)
    assert conn.store(keys, src).wait()
    before = snapshot(pool)
    fake.set_fault("pause")  # layer 0's copy waits inside the daemon
    h = conn.load(keys, dst)
    assert h.count == N
    conn.release([h])  # answered once the daemon marked the transfer cancelled
    fake.set_fault(None)
    assert not h.wait()
    assert not h.wait_layer(G.num_layers - 1)
    after = snapshot(pool)
    for i, (b0, b1) in enumerate(zip(before, after, strict=True)):
        if i % G.num_layers:  # raw() lists K of every layer, then V of every layer
            assert torch.equal(b1[dst], b0[dst])  # layers after the cancel: never copied
        # layer 0 may or may not have been enqueued before the cancel was seen
    st = wait_for(fake_daemon, lambda s: s["pool"]["pages_pinned"] == 0, "pins dropped")
    assert st["counters"]["load_failed_pages"] == N


def test_store_whose_gpu_end_is_unknown_keeps_its_slots_out_of_use(fake_daemon, fake, engine):
    pool, conn = engine
    fill(pool, list(range(PAGES)), seed=3)
    fake.set_fault("gpu_fault")  # waiting for the copies fails: they might still write
    h = conn.store(keys_for(conn, 3), list(range(N)))
    assert h.count == N and not h.wait()
    st = stats(fake_daemon)
    assert st["counters"]["cuda_held_pages"] == N
    assert st["pool"]["pages_writing"] == N  # held: neither committed nor freed
    fake.set_fault(None)
    h2 = conn.store(keys_for(conn, 4), list(range(N, 2 * N)))
    assert h2.count == N and h2.wait()
    st = stats(fake_daemon)
    assert st["pool"]["pages_writing"] == N and st["pool"]["pages_ready"] == N
    assert conn.lookup(keys_for(conn, 3)).l2 == 0
    conn.close()
    st = wait_for(fake_daemon, lambda s: not s["sessions"], "session closed")
    assert st["pool"]["pages_writing"] == N  # still held after the session ended
    dpid = fake_daemon.pid
    assert ops(fake, dpid, "destroy_stream") == [] and ops(fake, dpid, "close_mem") == []


def test_store_whose_copy_raised_frees_its_slots(fake_daemon, fake, engine):
    pool, conn = engine
    fill(pool, list(range(PAGES)), seed=5)
    fake.set_fault("copy_error")  # raised as it was enqueued: nothing runs on the GPU
    h = conn.store(keys_for(conn, 5), list(range(N)))
    assert h.count == N and not h.wait()
    fake.set_fault(None)
    st = wait_for(fake_daemon, lambda s: s["pool"]["pages_writing"] == 0, "slots freed")
    assert st["counters"]["cuda_held_pages"] == 0
    assert conn.store(keys_for(conn, 5), list(range(N))).wait()  # the session goes on


def test_session_close_closes_the_copier_before_the_memory(fake_daemon, fake, engine):
    pool, conn = engine
    fill(pool, list(range(PAGES)), seed=6)
    assert conn.store(keys_for(conn, 6), list(range(N))).wait()
    conn.close()
    wait_for(fake_daemon, lambda s: not s["sessions"], "session closed")
    dpid = fake_daemon.pid
    end = time.monotonic() + DEADLINE_S
    while not ops(fake, dpid, "close_mem"):  # on the daemon's kvtier-cuda thread
        assert time.monotonic() < end, fake.journal()
        time.sleep(0.05)
    order = [op for p, op, _, _ in fake.journal() if p == dpid]
    closing = order[order.index("destroy_event") :]
    assert closing == ["destroy_event"] * (G.num_layers + 1) + ["destroy_stream", "close_mem"]
    assert ops(fake, ME, "close_event")  # the engine dropped its opened events too
    assert threads(fake, dpid, "destroy_stream", "close_mem") == {"kvtier-cuda"}
    # the engine's GPU ran every queued wait on the events before the daemon destroyed them
    lines = [(p, op) for p, op, _, _ in fake.journal()]
    assert (ME, "synchronize") in lines
    assert lines.index((ME, "synchronize")) < lines.index((dpid, "destroy_event"))


def test_daemon_restart_reregisters_and_never_waits_on_the_old_events(fake_daemon, fake, engine):
    pool, conn = engine
    src, dst = list(range(N)), list(range(10, 10 + N))
    fill(pool, list(range(PAGES)), seed=7)
    before = snapshot(pool)
    keys = keys_for(conn, 7)
    assert conn.store(keys, src).wait()
    old_pid = fake_daemon.pid
    old_waiter = conn._cuda
    fake.set_fault("hold")  # a load whose layers are recorded when its daemon dies
    h = conn.load(keys, dst)
    assert h.count == N
    end = time.monotonic() + DEADLINE_S
    while h.layers_ready() < G.num_layers:
        assert time.monotonic() < end
        time.sleep(0.01)
    fake_daemon.kill()  # SIGKILL: its events are gone with it
    assert not h.wait_layer(0)  # a miss, never a stream wait on a dead daemon's event
    fake.set_fault(None)
    fake_daemon.start()  # adopts the pool the killed daemon left
    new_pid = fake_daemon.pid
    assert new_pid != old_pid
    fake.set_fault("hold")
    h2 = conn.load(keys, dst)  # re-registers first: the new daemon's events
    assert h2.count == N  # adopted, checksums verified
    assert old_waiter is not None and old_waiter.closed and conn._cuda is not old_waiter
    for layer in range(G.num_layers):
        assert h2.wait_layer(layer)
    fake.set_fault(None)
    assert h2.wait()
    for b0, b1 in zip(before, snapshot(pool), strict=True):
        assert torch.equal(b1[dst], b0[src])
    waited = ops(fake, ME, "stream_wait")
    assert waited and all(w.startswith(f"e{new_pid}-") for w in waited)
    assert [line for line in fake.journal() if line[1] == "BAD"] == []


def test_cuda_register_to_a_daemon_without_cuda_is_bad_memory(daemon, fake):
    """A plain kvtierd (no fake): this machine has no GPU, and the daemon says so."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the daemon would open the memory")
    pool = CudaKVPool(G, PAGES, backend=fake)
    try:
        for _ in range(2):  # and it keeps serving
            with pytest.raises(DaemonError) as info:
                Connection(pool, model_id="no-cuda", config=client_config(daemon.runtime_dir))
            assert info.value.code == P.ErrorCode.BAD_MEMORY
            assert "memory.kind = 'cuda_ipc': kvtierd needs an NVIDIA GPU" in str(info.value)
            assert "sees no CUDA device" in str(info.value)
        st = stats(daemon)
        assert not st["sessions"] and st["counters"]["sessions_opened"] == 0
    finally:
        pool.close()


def test_an_engines_own_strided_layout_round_trips_and_shares_pages(fake_daemon, fake, engine):
    """An engine that allocated its KV itself, one allocation per layer laid out as vLLM's
    HND cache ``[pages, 2, chunk]`` (a page's K and V side by side), registers it as regions
    (:class:`CudaRegionMemory`): stores and loads copy only the pages asked for, in both
    components, and a page's bytes are the views' pages in order, as a ``CudaKVPool`` engine
    of the same geometry reads them. (The bytes here are raw; a real HND engine, whose pages
    order heads before tokens, names its layout in its geometry.)"""
    chunk = G.chunk_bytes
    layers = [fake.allocate(PAGES * 2 * chunk, 0) for _ in range(G.num_layers)]
    hnd = [flat.view(PAGES, 2, chunk) for flat, _ in layers]
    buffers = [t[:, c] for t in hnd for c in range(2)]
    mem = CudaRegionMemory(G, PAGES, buffers, layers, backend=fake)
    export = mem.export()
    assert len(export.segments) == G.num_layers and not export.buffer_offsets
    assert [(r.segment, r.offset, r.page_stride, r.layer) for r in export.regions[:2]] == [
        (0, 0, 2 * chunk, 0),
        (0, chunk, 2 * chunk, 0),
    ]
    conn = Connection(mem, model_id="fake-cuda", config=client_config(fake_daemon.runtime_dir))
    try:
        gen = torch.Generator().manual_seed(5)
        for t in hnd:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
        before = [t.clone() for t in hnd]
        src, dst = [3, 4, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25]
        keys = keys_for(conn, 7)
        assert conn.store(keys, src).wait()
        h = conn.load(keys, dst)
        assert h.count == N and all(h.wait_layer(i) for i in range(G.num_layers)) and h.wait()
        rest = [p for p in range(PAGES) if p not in dst]
        for t0, t1 in zip(before, hnd, strict=True):
            assert torch.equal(t1[dst], t0[src])  # both components of each page
            assert torch.equal(t1[rest], t0[rest])  # no other byte
        pool, kv_conn = engine  # a CudaKVPool engine of the same geometry finds the pages
        assert kv_conn.lookup(keys).l2 == N
        assert kv_conn.load(keys, list(range(N))).wait()
        for layer, t in enumerate(before):
            got_k, got_v = (raw(pool)[j][:N] for j in (layer, G.num_layers + layer))
            assert torch.equal(got_k, t[src, 0]) and torch.equal(got_v, t[src, 1])
    finally:
        conn.close()
        mem.close()


def test_regions_that_lie_or_overflow_are_refused_and_the_daemon_keeps_serving(
    fake_daemon, fake, engine
):
    """A client that lies in its regions (pages past its allocation, a huge stride, a
    segment it does not have, layers out of order) gets BAD_MEMORY naming the field; no
    mapping is opened for it, and an honest engine is served meanwhile."""
    chunk = G.chunk_bytes
    flat, path = fake.allocate(PAGES * 2 * chunk, 0)
    seg, _ = fake.export(flat, path)
    good = [
        P.MemoryRegion(0, c * chunk, 2 * chunk, chunk, layer)
        for layer in range(G.num_layers)
        for c in range(2)
    ]
    lies = {
        "past the end": (
            good[:-1] + [P.MemoryRegion(0, chunk, 2 * chunk * PAGES, chunk, 3)],
            r"regions\[7\].offset",
        ),
        "huge stride": (
            good[:-1] + [P.MemoryRegion(0, chunk, 1 << 47, chunk, 3)],
            r"regions\[7\].offset",
        ),
        "foreign segment": (
            good[:-1] + [P.MemoryRegion(5, 0, 2 * chunk, chunk, 3)],
            r"regions\[7\].segment = 5",
        ),
        "layer order": ([good[2], *good[1:]], r"regions\[0\].layer = 1"),
    }

    class Liar:
        geometry, num_pages, cuda_backend, device = G, PAGES, fake, torch.device("cuda", 0)

        def __init__(self, regions):
            self.regions = regions

        def export(self):
            return P.KVMemory(
                kind="cuda_ipc", num_pages=PAGES, segments=[seg], regions=self.regions
            )

    opened = len(ops(fake, fake_daemon.pid, "open_mem"))
    for name, (regions, field) in lies.items():
        with pytest.raises(DaemonError, match=field) as info:
            Connection(
                Liar(regions), model_id="liar", config=client_config(fake_daemon.runtime_dir)
            )
        assert info.value.code == P.ErrorCode.BAD_MEMORY, name
    assert len(ops(fake, fake_daemon.pid, "open_mem")) == opened  # nothing was mapped
    _, conn = engine
    keys = keys_for(conn, 11)
    assert conn.store(keys, list(range(N))).wait() and conn.lookup(keys).l2 == N
