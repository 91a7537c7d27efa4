"""The layer-wise completion contract, end to end against a real kvtierd.

docs/protocol.md ("Completion block", "STORE and LOAD") promises:

- a LOAD announces layer ``l`` (``layers_done > l``) only once every byte of layer ``l`` of
  every loaded page is in the engine's pages; ``layers_done`` never goes backwards nor past
  ``num_layers``;
- a STORE's ``count`` pages are in L2 at DONE (``wait()``): a LOOKUP right after it finds
  them;
- a transfer the engine gave up on (a wait that timed out, a RELEASE) writes nothing into the
  engine's pages once the slot says it has ended, and its slot can be reused.

Each test starts its own daemon (``daemon_factory``) with a pool big enough for transfers
that run on the copy threads (1 MiB pages: 8 layers x K, V x 64 KiB).
"""

from __future__ import annotations

import time

import pytest
import torch
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import TransferStatus

from tests.engines import engine, tokens

BIG = P.Geometry(num_layers=8, page_size=16, kv_heads=8, head_dim=128, dtype="float32")
"""1 MiB pages: a 64-page LOAD (64 MiB) is split over the copy threads."""

FLAGS = ("--hicache-size", "512MiB", "--lease-s", "30")


def _fill(pool, pages: range, salt: int = 0) -> None:
    """Page ``p``, buffer ``b`` (K of every layer, then V) holds int32 ``p*1000+b+1+salt``."""
    for p in pages:
        for b, buf in enumerate(pool.k + pool.v):
            buf[p].view(-1).view(torch.int32).fill_(p * 1000 + b + 1 + salt)


def _layer_ok(pool, layer: int, dst: list[int], salt: int = 0) -> bool:
    """Layer ``layer`` of engine pages ``dst`` holds what source page ``i`` held."""
    nl = pool.geometry.num_layers
    for c, bufs in enumerate((pool.k, pool.v)):
        b = layer + c * nl
        got = bufs[layer].view(pool.num_pages, -1).view(torch.int32)[dst]
        want = torch.tensor([i * 1000 + b + 1 + salt for i in range(len(dst))], dtype=torch.int32)[
            :, None
        ]
        if not bool((got == want).all()):
            return False
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [(), ("--slice-pages", "8")], ids=["whole", "sliced"])
def test_a_store_reports_as_stored_only_what_is_in_l2_at_done(daemon_factory, flags):
    """A STORE whose keys another session is still writing does not count them as stored
    (that other STORE may yet be cancelled): its ``count`` is the leading run it can vouch
    for, and once ``wait()`` returned True a LOOKUP finds at least ``count`` keys
    (docs/protocol.md: a STORE's pages are in L2 at DONE). Keys of its own after the others'
    are written all the same."""
    d = daemon_factory(*FLAGS, "--copy-threads", "1", *flags)
    pa, a = engine(d.runtime_dir, BIG, num_pages=200)
    pb, b = engine(d.runtime_dir, BIG, num_pages=200)
    try:
        filler = a.page_keys(tokens(150 * 16, salt=9))
        keys = a.page_keys(tokens(32 * 16))
        assert keys == b.page_keys(tokens(32 * 16))  # one namespace
        hx = a.store(filler, list(range(150)))  # holds the one copy thread for a while
        ha = a.store(keys[:16], list(range(150, 166)))  # queued behind it
        hb = b.store(keys, list(range(32)))
        assert hb.count == 0 and hb.writing == 16  # the first key is a's, still being written
        done = hb.wait()
        found = b.lookup(keys).l2
        assert done and hb.ok
        assert found >= hb.count
        assert ha.wait() and hx.wait()
        assert b.lookup(keys).l2 == 32  # a's and b's own, all in L2 now
    finally:
        a.close()
        b.close()
        pa.close()
        pb.close()


@pytest.mark.timeout(120)
def test_keys_another_store_was_writing_are_stored_again_once_it_is_cancelled(daemon_factory):
    """The other STORE is cancelled (RELEASE) and its pages thrown away: the engine that
    was told its STORE did not store them (``count`` 0) stores them again, and they are
    in L2 then."""
    d = daemon_factory(*FLAGS, "--copy-threads", "1")
    pa, a = engine(d.runtime_dir, BIG, num_pages=200)
    pb, b = engine(d.runtime_dir, BIG, num_pages=200)
    try:
        filler = a.page_keys(tokens(150 * 16, salt=7))
        keys = a.page_keys(tokens(32 * 16, salt=3))
        hx = a.store(filler, list(range(150)))
        ha = a.store(keys, list(range(150, 182)))
        hb = b.store(keys, list(range(32)))
        assert hb.count == 0 and hb.wait()
        a.release([ha])  # the other writer gives up
        assert not ha.wait()  # CANCELLED: its pages are aborted
        assert hx.wait()
        assert b.lookup(keys).l2 == 0
        again = b.store(keys, list(range(32)))
        assert again.count == 32 and again.wait()
        assert b.lookup(keys).l2 == 32
    finally:
        a.close()
        b.close()
        pa.close()
        pb.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags",
    [
        ("--copy-threads", "4"),
        ("--copy-threads", "4", "--slice-pages", "8"),
        ("--copy-threads", "3", "--native-off", '["copy_threads"]'),
    ],
    ids=["native", "long", "python-threads"],
)
def test_each_announced_layer_is_in_the_engine_pages(daemon_factory, flags):
    """Guard: whatever path a LOAD takes (halved, whole on a thread, split over threads,
    more than ``slice_pages`` pages), layer ``l`` is announced only once its bytes are in
    every loaded page; ``layers_done`` never goes backwards nor past ``num_layers``, and the
    transfer ends DONE with every layer there."""
    d = daemon_factory(*FLAGS, *flags)
    pool, conn = engine(d.runtime_dir, BIG, num_pages=160)
    try:
        n_src = 64
        _fill(pool, range(n_src))
        keys = conn.page_keys(tokens(n_src * 16, salt=1))
        assert conn.store(keys, list(range(n_src))).wait()
        nl = BIG.num_layers
        for n in (2, 4, 16, 40, 64):
            dst = list(range(159, 159 - n, -1))
            for buf in pool.k + pool.v:
                buf[159 - n + 1 : 160].zero_()
            h = conn.load(keys[:n], dst)
            assert h.count == n
            seen, last = 0, []
            for _ in range(2_000_000):
                seq, done, status = h.block.read(h.slot)
                if seq == h.seq:
                    assert 0 <= done <= nl, f"layers_done = {done} outside [0, {nl}]"
                    assert done >= seen, f"layers_done went back from {seen} to {done}"
                    for layer in range(seen, done):
                        assert _layer_ok(pool, layer, dst), f"layer {layer} announced early"
                    seen = done
                    last.append(done)
                    if status != TransferStatus.RUNNING:
                        break
            assert h.wait()
            assert all(_layer_ok(pool, layer, dst) for layer in range(nl))
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_no_write_after_a_timed_out_load_ends_and_its_slot_is_reused(daemon_factory):
    """Guard: a wait that times out gives the LOAD up (RELEASE); once ``copying()`` says
    False the daemon writes nothing more into the engine's pages, and the slot's next
    transfer (a new ``seq``) is waited on from a fresh start and lands whole."""
    d = daemon_factory(*FLAGS, "--copy-threads", "2")
    pool, conn = engine(d.runtime_dir, BIG, num_pages=160)
    try:
        n = 64
        _fill(pool, range(n))
        keys = conn.page_keys(tokens(n * 16, salt=2))
        assert conn.store(keys, list(range(n))).wait()
        dst = list(range(159, 159 - n, -1))
        for _ in range(3):
            h = conn.load(keys, dst)
            assert h.count == n
            if h.wait_layer(BIG.num_layers - 1, timeout=1e-6):
                assert h.wait()
                continue  # it was faster than the timeout: try again
            h.until_ended()
            assert not h.copying()
            for buf in pool.k + pool.v:
                buf[159 - n + 1 : 160].zero_()
            time.sleep(0.2)
            for buf in pool.k + pool.v:
                assert not bool(buf[159 - n + 1 : 160].any()), "written after the load ended"
        # the slots given up are reused; every LOAD after them lands whole
        for _ in range(4):
            h = conn.load(keys, dst)
            assert h.count == n and h.wait()
            assert all(_layer_ok(pool, layer, dst) for layer in range(BIG.num_layers))
    finally:
        conn.close()
        pool.close()
