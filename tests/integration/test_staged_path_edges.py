"""The engine-side copy path (``copy_mode = "engine"``) against a real kvtierd: its settings
and tensors checked before any memory is allocated, an engine killed mid-transfer, a
stalled daemon.

The engine keeps its KV in plain (CPU) tensors and copies pages through a bounded staging
area (a sealed memfd kvtierd maps): :class:`~kvtier.client.cache.staged.StagedConnection`.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kvtier.client.cache.staged import StagedConnection
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import MAX_PAGES

from tests.engines import SMALL, client_config

REPO = Path(__file__).resolve().parents[2]
PAGES = 16
BIG = P.Geometry(num_layers=8, page_size=16, kv_heads=8, head_dim=128, dtype="float32")  # 1 MiB


def kv_tensors(seed: int | None, pages: int = PAGES, g: P.Geometry = SMALL) -> list[torch.Tensor]:
    """Per layer K then V; random with a seed, else zeros."""
    shape = (pages, g.page_size, g.kv_heads, g.head_dim)
    if seed is None:
        return [torch.zeros(shape) for _ in range(g.num_layers * 2)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(g.num_layers * 2)]


def keys_for(salt: int, n: int) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


# ---------------------------------------------------------------------------- bad values
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "value", [0, True, 2.5, "3", MAX_PAGES + 1], ids=["0", "True", "2.5", "str", "over-max"]
)
def test_a_bad_staging_pages_is_refused_naming_staging_pages(daemon, value) -> None:
    """``StagedConnection.over(..., staging_pages=...)`` takes a whole number of pages from
    1 to the most a registration may hold (``MAX_PAGES``); anything else is refused at once,
    before any staging memory is allocated, with a ValueError that names ``staging_pages``."""
    cfg = client_config(daemon.runtime_dir)
    # 4-byte pages: the over-max case would allocate 256 MiB, never more
    g = P.Geometry(num_layers=1, page_size=1, kv_heads=1, head_dim=1, dtype="float16")
    kv = [torch.zeros(4, 1, 1, 1, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(ValueError, match="staging_pages"):
        StagedConnection.over(kv, g, "bad", staging_pages=value, config=cfg).close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [math.nan, "0.05", None])
def test_a_bad_wait_s_is_refused_naming_wait_s(daemon, value) -> None:
    """``wait_s`` (the longest wait for free staging slots) is a number of seconds >= 0
    (a NaN is not: it bounds no wait); anything else is refused when the connection is
    made, with a ValueError naming ``wait_s``, not later inside a load in the engine's
    forward pass (a NaN would wait for free slots forever)."""
    cfg = client_config(daemon.runtime_dir)
    with pytest.raises(ValueError, match="wait_s"):
        StagedConnection.over(kv_tensors(None), SMALL, "bad", wait_s=value, config=cfg)


@pytest.mark.timeout(60)
def test_the_reference_engine_refuses_a_staging_wait_that_is_not_a_number(daemon) -> None:
    """``ReferenceEngine(staging_wait_s=...)`` that is not a number is refused with an
    EngineInputError naming ``staging_wait_s`` (as ``staging_pages`` is)."""
    from kvtier.engine.engine import ReferenceEngine
    from kvtier.engine.model import EngineInputError, ModelConfig, TinyLlama

    with pytest.raises(EngineInputError, match="staging_wait_s"):
        ReferenceEngine(
            mode="off",
            page_size=16,
            num_pages=8,
            model=TinyLlama(ModelConfig.tiny()),
            copy_mode="engine",
            staging_wait_s="0.05",  # type: ignore[arg-type]
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [math.inf, -0.5, 61.0])
def test_the_reference_engine_refuses_a_staging_wait_out_of_range(daemon, value) -> None:
    """``ReferenceEngine(staging_wait_s=...)`` is a finite number of seconds in [0, 60], as
    the vLLM connector's ``staging_wait_s`` is: an infinite one (which a wait for staging
    slots could not take: the request would fail inside the forward pass) and the others
    out of range are refused when the engine is made, with an EngineInputError naming it."""
    from kvtier.engine.engine import ReferenceEngine
    from kvtier.engine.model import EngineInputError, ModelConfig, TinyLlama

    with pytest.raises(EngineInputError, match="staging_wait_s"):
        ReferenceEngine(
            mode="on",
            page_size=16,
            num_pages=32,
            client_config=client_config(daemon.runtime_dir),
            model=TinyLlama(ModelConfig.tiny()),
            copy_mode="engine",
            staging_pages=8,
            staging_wait_s=value,
        )


# ---------------------------------------------------------------------------- engine killed
CHILD = r"""
import sys, torch
from kvtier.client.cache.staged import StagedConnection
from kvtier.ipc import protocol as P
from tests.engines import client_config
rdir, mode = sys.argv[1], sys.argv[2]
g = P.Geometry(num_layers=8, page_size=16, kv_heads=8, head_dim=128, dtype="float32")  # 1 MiB pages
n = 24
kv = [torch.randn(n, 16, 8, 128) for _ in range(16)]
conn = StagedConnection.over(kv, g, "killed", staging_pages=n, wait_s=1.0,
                             config=client_config(rdir))
keys = [bytes([9, i]) * 16 for i in range(n)]
assert conn.store(keys, list(range(n))).wait()
print("memfd", __import__("os").readlink(f"/proc/self/fd/{conn.area.segment.fd}"), flush=True)
i = 0
while True:
    if mode == "load":
        ld = conn.load(keys, list(range(n)))
        ld.wait()
    else:
        conn.store([bytes([10 + i % 200, j]) * 16 for j in range(n)], list(range(n))).wait()
    i += 1
    print("turn", i, flush=True)
"""


def _stats(endpoint: str) -> dict:
    with AdminClient(endpoint) as admin:
        return admin.stats()


def _maps_of(pid: int, name: str) -> list[str]:
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if name in line]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["load", "store"])
def test_an_engine_killed_mid_transfer_leaves_the_daemon_serving_and_unmaps_its_staging(
    daemon_factory, mode
) -> None:
    """SIGKILL of an engine in the middle of staged loads / stores: the daemon keeps serving
    others, ends the dead engine's session and unmaps its staging memfd (its memory goes),
    and leaves no pinned or writing page behind."""
    d = daemon_factory("--hicache-size", "256MiB", "--extent-size", "16MiB")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(d.runtime_dir), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("memfd"), line
        name = line.split()[1].removeprefix("/memfd:").split(" (deleted)")[0]
        for _ in range(3):
            assert proc.stdout.readline().startswith("turn")
        assert _maps_of(d.pid, name), "the daemon should map the engine's staging area"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while True:
        st = _stats(d.endpoint)
        pool = st["pool"]
        gone = not st["sessions"] and pool["pages_pinned"] == 0 and pool["pages_writing"] == 0
        if gone and not _maps_of(d.pid, name):
            break
        assert time.monotonic() < deadline, (st["sessions"], pool, _maps_of(d.pid, name))
        time.sleep(0.1)
    # and another engine is served
    src = kv_tensors(21)
    with StagedConnection.over(
        src, SMALL, "after-kill", staging_pages=4, config=client_config(d.runtime_dir)
    ) as conn:
        keys = keys_for(21, 4)
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        ld = conn.load(keys, [4, 5, 6, 7])
        assert ld.count == 4 and ld.wait()
    assert all(torch.equal(x[4:8], x[0:4]) for x in src)


# ---------------------------------------------------------------------------- geometry
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shape_dtype",
    [
        ((PAGES, SMALL.kv_heads, SMALL.page_size, SMALL.head_dim), torch.float32),  # HND order
        ((PAGES, SMALL.page_size, SMALL.kv_heads, 2 * SMALL.head_dim), torch.float16),  # dtype
    ],
    ids=["heads-first", "other-dtype"],
)
def test_tensors_of_another_shape_or_dtype_with_the_same_bytes_are_refused(
    daemon, shape_dtype
) -> None:
    """``StagedConnection.over`` stages ``[num_pages, page_size, kv_heads, head_dim]``
    tensors of the geometry's dtype (the bytes a ``SharedKVPool`` holds, so engines of
    either copy mode share pages). Tensors of another shape or dtype are refused with a
    ValueError, even when a page happens to hold as many bytes: their pages would be shared
    under the geometry's namespace with engines that read them as the geometry says."""
    shape, dtype = shape_dtype
    kv = [torch.zeros(shape, dtype=dtype) for _ in range(SMALL.num_layers * 2)]
    cfg = client_config(daemon.runtime_dir)
    with pytest.raises(ValueError):
        StagedConnection.over(kv, SMALL, "shape", config=cfg).close()


@pytest.mark.timeout(180)
def test_a_stalled_daemon_keeps_its_slots_out_of_use_and_they_come_back_after(
    daemon_factory,
) -> None:
    """kvtierd stalled (SIGSTOP) in the middle of a staged load: the engine's wait gives up
    (a miss), loads and stores meanwhile miss or are dropped within a bounded time (the area
    is full, never grown), and once kvtierd resumes every slot comes back and loads and stores
    are byte exact again."""
    d = daemon_factory("--hicache-size", "256MiB", "--extent-size", "16MiB")
    n = 64
    src = kv_tensors(61, pages=3 * n, g=BIG)
    cfg = client_config(d.runtime_dir, request_timeout_s=1.0, load_timeout_s=1.0)
    keys_a, keys_b = keys_for(61, n), keys_for(62, n)
    caught = 0
    with StagedConnection.over(src, BIG, "stall", staging_pages=n, wait_s=0.2, config=cfg) as c:
        assert c.store(keys_a, list(range(n))).wait()
        for _ in range(5):
            for t in src:
                t[n : 2 * n].zero_()
            ld = c.load(keys_a, list(range(n, 2 * n)))
            assert ld.count == n
            os.kill(d.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                if not ld.wait():
                    caught += 1
                    assert c.area.free < n  # the stalled daemon may still write them
                    st = c.store(keys_b, list(range(2 * n, 3 * n)))
                    assert st.count == 0 and st.wait()
                    again = c.load(keys_a, list(range(n, 2 * n)))
                    assert again.count == 0 and again.wait()
                assert time.monotonic() - t0 < 30
            finally:
                os.kill(d.pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while c.area.free != n:
                assert time.monotonic() < deadline, c.area.free
                time.sleep(0.05)
            time.sleep(1.2)  # the client's back-off after an unanswered request
            for t in src:
                t[n : 2 * n].zero_()
            assert c.store(keys_b, list(range(2 * n, 3 * n))).wait()
            ld = c.load(keys_a, list(range(n, 2 * n)))
            assert ld.count == n and ld.wait()
            assert all(torch.equal(t[n : 2 * n], t[:n]) for t in src)
            ld = c.load(keys_b, list(range(n, 2 * n)))
            assert ld.count == n and ld.wait()
            assert all(torch.equal(t[n : 2 * n], t[2 * n :]) for t in src)
            assert c.area.free == n
            if caught:
                break
    assert caught, "the daemon was never stopped in the middle of a load"


@pytest.mark.timeout(120)
def test_slots_a_stalled_daemon_may_still_write_come_off_the_room_for_loads(
    daemon_factory,
) -> None:
    """A staged load given up while kvtierd is stalled keeps its slots out of use; the room
    for loads (what the cache manager keeps its loads within under write_back, so that an
    eviction's STORE finds slots) no longer counts them until kvtierd has stopped copying."""
    d = daemon_factory("--hicache-size", "256MiB", "--extent-size", "16MiB")
    n = 64
    share = n - n // 2
    src = kv_tensors(63, pages=2 * n, g=BIG)
    cfg = client_config(d.runtime_dir, request_timeout_s=1.0, load_timeout_s=1.0)
    keys = keys_for(63, n)
    caught = False
    with StagedConnection.over(src, BIG, "room", staging_pages=n, wait_s=0.2, config=cfg) as c:
        assert c.load_room[1] == share and c.store_room[1] == n // 2 and c.area.held == 0
        assert c.store(keys, list(range(n))).wait()
        for _ in range(5):
            ld = c.load(keys, list(range(n, 2 * n)))
            assert ld.count == n
            os.kill(d.pid, signal.SIGSTOP)
            try:
                if not ld.wait():
                    caught = True
                    held = c.area.held
                    assert held == n - c.area.free > 0
                    assert c.load_room[1] == max(0, share - held)
                    # past the loads' share, held slots come off the STOREs' half too
                    assert c.store_room[1] == max(1, n // 2 - max(0, held - share))
            finally:
                os.kill(d.pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while c.area.held:
                assert time.monotonic() < deadline, c.area.held
                time.sleep(0.05)
            assert c.load_room[1] == share and c.store_room[1] == n // 2
            if caught:
                break
            time.sleep(1.2)  # the client's back-off after an unanswered request
    assert caught, "the daemon was never stopped in the middle of a load"
