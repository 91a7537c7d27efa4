"""How a transfer runs and how its end reaches the engine.

- A transfer of at most ``INLINE_BYTES`` is copied on the daemon's event loop: it has ended,
  with its final status in the completion block, when the engine reads the reply. One of a
  few MiB, while the copy threads are idle, is copied half on the loop and half on a copy
  thread; a larger one runs on a copy thread. All move the same bytes.
- The completion block wakes a waiting engine through a futex on the slot's wake word, also
  through a read-only mapping in another process; ``wait(end=True)`` returns the final
  status, never the "layers done, still running" state.
- ``wait_loaded`` ends a LOAD at its last layer, before the daemon settles it; the slot is
  reused once the daemon has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.transfer_handle import TransferHandle
from kvtier.daemon.service.handover import COMPLETION_SLOTS
from kvtier.daemon.service.transfers import (
    INLINE_BYTES,
    LOOP_SHARE_BYTES,
    SHARE_MIN_BYTES,
    SPLIT_BYTES,
)
from kvtier.ipc import futex
from kvtier.ipc.completion import SLOT_WORDS, WAKES, CompletionBlock, TransferStatus

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens

pytestmark = pytest.mark.timeout(180)

P = SMALL.page_size
DEADLINE_S = 60.0
"""Bound on each wait below; every futex wait in these tests sleeps twice as long, so one
that is never woken fails the test instead of passing by its timeout."""


@pytest.fixture
def daemon(module_daemon):
    """The module's daemon; each test uses a model id (a namespace) of its own."""
    return module_daemon


def _block_status(conn, slot: int) -> tuple[int, int, int]:
    block = conn._block  # the engine's read-only view of its completion block
    assert block is not None
    return block.read(slot)


ROUNDS = 30
"""Transfers per check: a copy thread could end a transfer before its reply now and then,
never every time."""


def test_a_small_transfer_has_ended_when_its_reply_arrives(daemon):
    pages = INLINE_BYTES // SMALL.page_bytes
    assert pages >= 2, "the inline limit holds several SMALL pages"
    pool, conn = engine(daemon.runtime_dir, num_pages=2 * pages, model="inline")
    try:
        for p in range(pages):
            fill_page(pool, p, seed=p + 1)
        dst = list(range(pages, 2 * pages))
        for i in range(ROUNDS):
            keys = conn.page_keys(tokens(pages * P, salt=i))
            h = conn.store(keys, list(range(pages)))
            assert h.writing == pages
            assert _block_status(conn, h.slot) == (h.seq, SMALL.num_layers, TransferStatus.DONE), (
                f"round {i}: the store had not ended when its reply came"
            )
            assert h.wait()
            h = conn.load(keys, dst)
            assert h.count == pages
            assert _block_status(conn, h.slot) == (h.seq, SMALL.num_layers, TransferStatus.DONE), (
                f"round {i}: the load had not ended when its reply came"
            )
            assert h.wait()
        for i, p in enumerate(dst):
            assert page_bytes(pool, p) == page_bytes(pool, i), f"page {i} differs"
    finally:
        conn.close()
        pool.close()


def test_a_large_transfer_runs_on_a_copy_thread_and_moves_the_same_bytes(daemon):
    pages = 2 * LOOP_SHARE_BYTES // SMALL.page_bytes + 8  # too large to share with the loop
    assert pages * SMALL.page_bytes < 2 * SPLIT_BYTES, "one copy thread copies it whole"
    pool, conn = engine(daemon.runtime_dir, num_pages=2 * pages, model="threaded")
    try:
        keys = conn.page_keys(tokens(pages * P, salt=2))
        for p in range(pages):
            fill_page(pool, p, seed=1000 + p)
        h = conn.store(keys, list(range(pages)))
        assert h.writing == pages and h.wait()
        assert conn.lookup(keys).l2 == pages
        dst = list(range(pages, 2 * pages))
        for _ in range(3):  # the slot's wake word keeps counting across transfers
            h = conn.load(keys, dst[::-1])  # reversed: pages and slots in no common order
            assert h.count == pages
            for layer in range(SMALL.num_layers):
                assert h.wait_layer(layer)
            assert h.wait() and h.ok
        for i, p in enumerate(dst[::-1]):
            assert page_bytes(pool, p) == page_bytes(pool, i), f"page {i} differs"
    finally:
        conn.close()
        pool.close()


def _wakes(conn, slot: int) -> int:
    """The wake counter of ``slot`` in the engine's view of its completion block."""
    return int(conn._block._w[2 * (slot * SLOT_WORDS + WAKES)])


def _wakes_after(conn, slot: int, before: int, at_least: int) -> int:
    """The wakes of ``slot`` since ``before`` once there are ``at_least`` (the last one, at
    the end, may land just after the engine read DONE), or as many as came by the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while (_wakes(conn, slot) - before) % (1 << 32) < at_least and time.monotonic() < deadline:
        time.sleep(0.001)
    return (_wakes(conn, slot) - before) % (1 << 32)


def test_a_store_wakes_its_engine_at_its_end_only_and_a_load_at_each_layer(daemon):
    """Nobody follows a STORE's layers: its engine is woken once, when it ended; a LOAD's
    engine once per layer and at the end. Every layer's wake comes before the end's."""
    pages = 2 * LOOP_SHARE_BYTES // SMALL.page_bytes + 8  # on a copy thread, not shared
    assert SMALL.num_layers >= 2
    pool, conn = engine(daemon.runtime_dir, num_pages=2 * pages, model="wakes")
    try:
        for p in range(pages):
            fill_page(pool, p, seed=3000 + p)
        for i in range(3):
            keys = conn.page_keys(tokens(pages * P, salt=300 + i))
            before = [_wakes(conn, s) for s in range(COMPLETION_SLOTS)]
            h = conn.store(keys, list(range(pages)))
            assert h.writing == pages and h.wait()
            assert _wakes_after(conn, h.slot, before[h.slot], 1) == 1, f"store {i}"
            before = [_wakes(conn, s) for s in range(COMPLETION_SLOTS)]
            h = conn.load(keys, list(range(pages, 2 * pages)))
            assert h.count == pages and h.wait()
            want = SMALL.num_layers + 1
            assert _wakes_after(conn, h.slot, before[h.slot], want) == want, f"load {i}"
            for p in range(pages):
                assert page_bytes(pool, pages + p) == page_bytes(pool, p), f"page {p} differs"
    finally:
        conn.close()
        pool.close()


def _split_count(daemon, counter: str = "transfers_split") -> int:
    with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
        return int(admin.stats()["counters"][counter])  # type: ignore[index]


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="the daemon halves a copy of a few MiB only where it has two CPUs",
)
@pytest.mark.parametrize("native", [True, False], ids=["native-threads", "python-threads"])
def test_a_transfer_of_a_few_mib_is_copied_in_two_halves_at_once(daemon_factory, native):
    """An idle daemon copies it in two halves at once: on the native copy threads both in
    C (a split of two parts, the event loop free), on Python copy threads one on the event
    loop and one on a thread (whichever ends last, the transfer is settled once). Either
    way every page lands, each layer is announced, every round."""
    off = () if native else ("--native-off", '["copy_threads"]')
    d = daemon_factory("--copy-threads", "2", *off)
    pages = 2 * SHARE_MIN_BYTES // SMALL.page_bytes + 3  # odd: the halves differ by a page
    assert pages * SMALL.page_bytes <= 2 * LOOP_SHARE_BYTES
    pool, conn = engine(d.runtime_dir, num_pages=2 * pages, model="shared")
    try:
        for p in range(pages):
            fill_page(pool, p, seed=4000 + p)
        dst = list(range(pages, 2 * pages))[::-1]
        for i in range(ROUNDS // 3):
            keys = conn.page_keys(tokens(pages * P, salt=50 + i))
            h = conn.store(keys, list(range(pages)))
            assert h.writing == pages and h.wait() and h.ok, f"round {i}: the store failed"
            assert conn.lookup(keys).l2 == pages, f"round {i}: not every stored page was kept"
            for p in dst:
                fill_page(pool, p, seed=i)  # the previous round's bytes: overwritten each time
            h = conn.load(keys, dst)
            assert h.count == pages
            for layer in range(SMALL.num_layers):
                assert h.wait_layer(layer), f"round {i}: layer {layer} was not announced"
            assert h.wait() and h.ok, f"round {i}: the load failed"
            for j, p in enumerate(dst):
                assert page_bytes(pool, p) == page_bytes(pool, j), f"round {i}: page {j} differs"
        halves = 2 * (ROUNDS // 3)  # a STORE and a LOAD a round
        assert _split_count(d, "transfers_shared") == (0 if native else halves)
        assert _split_count(d) == (halves if native else 0)
    finally:
        conn.close()
        pool.close()


def test_a_transfer_of_two_split_sizes_is_copied_in_parts_and_moves_the_same_bytes(daemon_factory):
    """Two copy threads copy it at once; each layer is announced once both have copied it."""
    d = daemon_factory("--hicache-size", "192MiB", "--copy-threads", "2")
    pages = 2 * SPLIT_BYTES // SMALL.page_bytes + 15  # after the first 8: 2 x SPLIT_BYTES + 7
    pool, conn = engine(d.runtime_dir, num_pages=2 * pages, model="split")
    try:
        keys = conn.page_keys(tokens(pages * P, salt=3))
        for p in range(pages):
            fill_page(pool, p, seed=2000 + p)
        small = conn.store(keys[:8], list(range(8)))  # 256 KiB: copied whole
        assert small.wait() and _split_count(d) == 0
        h = conn.store(keys[8:], list(range(8, pages)), parent_key=keys[7])
        assert h.writing == pages - 8 and h.wait()
        assert _split_count(d) == 1
        dst = list(range(pages, 2 * pages))[::-1]
        h = conn.load(keys, dst)
        assert h.count == pages
        for layer in range(SMALL.num_layers):
            assert h.wait_layer(layer)
        assert h.wait() and h.ok
        assert _split_count(d) == 2
        for i, p in enumerate(dst):
            assert page_bytes(pool, p) == page_bytes(pool, i), f"page {i} differs"
    finally:
        conn.close()
        pool.close()


def test_wait_for_the_end_does_not_stop_at_the_last_layer(tmp_path: Path):
    block = CompletionBlock.create(tmp_path / "block", 4)
    try:
        block.begin(2, seq=7, num_layers=3)
        block.layer_done(2, 3)  # every layer in place, the transfer not settled yet
        assert block.wait(2, 7, 3, DEADLINE_S) is TransferStatus.RUNNING
        got: list[TransferStatus] = []
        waiter = threading.Thread(
            target=lambda: got.append(block.wait(2, 7, 3, 2 * DEADLINE_S, end=True))
        )
        waiter.start()
        block.finish(2, TransferStatus.CANCELLED)
        waiter.join(DEADLINE_S)
        assert not waiter.is_alive(), "the waiter was not woken by the final status"
        assert got == [TransferStatus.CANCELLED]
        block.begin(2, seq=8, num_layers=3)  # a transfer ended DONE short of its layers
        block.layer_done(2, 1)
        block.finish(2, TransferStatus.DONE)
        assert block.wait(2, 8, 3, DEADLINE_S, end=True) is TransferStatus.FAILED
    finally:
        block.close()


_CHILD = """
import sys
from kvtier.ipc import futex
from kvtier.ipc.completion import SLOT_WORDS, WAKES, CompletionBlock
block = CompletionBlock.open(sys.argv[1], 4)
words = block.segment.array("uint32")
i = 2 * (3 * SLOT_WORDS + WAKES)
before = int(words[i])
print("waiting", flush=True)
futex.wait(words.ctypes.data + 4 * i, before, float(sys.argv[2]))
print(before, int(words[i]), flush=True)
"""


@pytest.mark.skipif(not futex.AVAILABLE, reason="no futex system call known here")
def test_a_layer_wakes_a_waiter_in_another_process_through_a_read_only_mapping(tmp_path: Path):
    path = tmp_path / "block"
    block = CompletionBlock.create(path, 4)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(2 * DEADLINE_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "waiting"
        block.begin(3, seq=1, num_layers=2)
        block.layer_done(3, 1)  # bumps slot 3's wake word, then wakes
        out, _ = child.communicate(timeout=DEADLINE_S)
        before, after = map(int, out.split())
        assert child.returncode == 0
        assert after == before + 1, "the waiter returned before the layer was announced"
        assert block.segment.size == SLOT_WORDS * 8 * 4 and WAKES < SLOT_WORDS
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        block.close()


class _Owner:
    """The two hooks a handle calls on its connection, recorded (no daemon in this test)."""

    def __init__(self, load_timeout_s: float | None = None) -> None:
        config = __import__("kvtier.config", fromlist=["ClientConfig"]).ClientConfig
        self.config = config() if load_timeout_s is None else config(load_timeout_s=load_timeout_s)
        self.slots_done: list[tuple[int, int, TransferStatus]] = []
        self.abandoned: list[tuple[int, int]] = []

    def daemon_alive(self) -> bool:
        return True

    def serving(self) -> bool:
        return True

    def _abandon(self, handle: TransferHandle) -> None:
        self.abandoned.append((handle.slot, handle.seq))

    def _slot_done(
        self, block: CompletionBlock | None, slot: int, seq: int, status: TransferStatus
    ) -> None:
        self.slots_done.append((slot, seq, status))


def test_wait_loaded_ends_at_the_last_layer_and_leaves_the_slot_to_the_daemon(tmp_path: Path):
    block = CompletionBlock.create(tmp_path / "block", 4)
    owner = _Owner()
    try:
        block.begin(1, seq=5, num_layers=3)
        h = TransferHandle(owner, block, 1, 5, count=4, writing=4, num_layers=3)
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(h.wait_loaded(2 * DEADLINE_S)))
        waiter.start()
        block.layer_done(1, 2)  # not yet: one layer is still being copied
        block.layer_done(1, 3)  # every layer in place; the daemon has not settled it
        waiter.join(DEADLINE_S)
        assert not waiter.is_alive(), "the last layer did not end the wait"
        assert got == [True] and h.done and h.ok
        # the slot is still the daemon's: the connection keeps it aside until it settles
        assert owner.slots_done == [(1, 5, TransferStatus.RUNNING)]
        assert h.wait_loaded() and len(owner.slots_done) == 1  # a second call: no new hook

        block.begin(2, seq=6, num_layers=3)  # a load that fails after its first layer
        bad = TransferHandle(owner, block, 2, 6, count=4, writing=4, num_layers=3)
        block.layer_done(2, 1)
        block.finish(2, TransferStatus.FAILED)
        assert not bad.wait_loaded(DEADLINE_S) and bad.done and not bad.ok
        assert owner.slots_done[-1] == (2, 6, TransferStatus.FAILED)
    finally:
        block.close()


def test_a_wait_for_the_end_that_times_out_leaves_the_slot_in_limbo(tmp_path: Path):
    """Every layer landed but the daemon did not settle the transfer within
    ``load_timeout_s``: ``wait()`` reports a failure and hands the transfer to the
    connection as given up on (its slot kept aside, a RELEASE sent), never as ended: the
    daemon may still hold that slot, and a new transfer in it would be refused."""
    block = CompletionBlock.create(tmp_path / "block", 4)
    owner = _Owner(load_timeout_s=0.2)
    try:
        block.begin(3, seq=9, num_layers=2)
        h = TransferHandle(owner, block, 3, 9, count=4, writing=4, num_layers=2)
        block.layer_done(3, 2)  # every layer in place; the daemon never settles it
        assert not h.wait() and h.done and not h.ok
        assert owner.abandoned == [(3, 9)]
    finally:
        block.close()


def test_loads_ended_at_their_last_layer_move_the_bytes_and_give_their_slots_back(daemon):
    """More loads than completion slots, each ended by ``wait_loaded``: the slots left to
    the daemon come back once it settled them, and every load moves the right bytes."""
    pages = 4 * INLINE_BYTES // SMALL.page_bytes  # on a copy thread: settled after the copy
    pool, conn = engine(daemon.runtime_dir, num_pages=2 * pages, model="landed")
    try:
        keys = conn.page_keys(tokens(pages * P, salt=4))
        for p in range(pages):
            fill_page(pool, p, seed=3000 + p)
        assert conn.store(keys, list(range(pages))).wait()
        dst = list(range(pages, 2 * pages))
        for i in range(2 * COMPLETION_SLOTS + 5):
            for p in dst:
                fill_page(pool, p, seed=i)  # the previous round's bytes: overwritten each time
            h = conn.load(keys, dst)
            assert h.count == pages, f"round {i}: no completion slot was free again"
            assert h.wait_loaded(DEADLINE_S), f"round {i}: the load failed"
            for j, p in enumerate(dst):
                assert page_bytes(pool, p) == page_bytes(pool, j), f"round {i}: page {j} differs"
    finally:
        conn.close()
        pool.close()


def test_a_wait_on_a_block_a_re_registration_closed_ends_at_once(tmp_path: Path):
    """Another thread re-registered (the daemon died; a successor answered): the old block
    is closed and nobody writes it any more. A wait on it ends as a failure within a poll,
    not after ``load_timeout_s``, even where the dead daemon's pid cannot be watched (the
    connection still says it serves)."""
    block = CompletionBlock.create(tmp_path / "block", 4)
    owner = _Owner(load_timeout_s=600.0)
    block.begin(1, seq=7, num_layers=3)
    h = TransferHandle(owner, block, 1, 7, count=4, writing=4, num_layers=3)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(h.wait()))
    waiter.start()
    try:
        time.sleep(0.05)  # the wait has begun (one that begins after the close fails too)
    finally:
        block.close()
    waiter.join(DEADLINE_S)
    assert not waiter.is_alive(), "a wait on a closed block went on"
    assert got == [False] and h.done and not h.ok
