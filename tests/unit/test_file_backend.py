"""Unit tests of the ``file`` L3 backend against a real directory and an mmap arena."""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import mmap
import os
import random
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier.config.errors import ConfigError, StorageError
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.file import (
    HEADER_STRIDE,
    FileBackend,
    table_bytes,
)
from kvtier.daemon.storage.objects import HEADER_SIZE

pytestmark = pytest.mark.timeout(30)

NS = hashlib.sha256(b"namespace").digest()
OTHER_NS = hashlib.sha256(b"other namespace").digest()
PAGE = 8192  # one page fills one payload slot exactly
ARENA_PAGES = 64


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


@pytest.fixture
def arena() -> Iterator[HostArena]:
    mm = mmap.mmap(-1, ARENA_PAGES * 65536)
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor  # a live ctypes export would keep the mmap from closing
    view = memoryview(mm)
    yield HostArena(view=view, address=address, size=len(mm))
    view.release()
    mm.close()


@pytest.fixture
async def store(tmp_path: Path, arena: HostArena) -> AsyncIterator[FileBackend]:
    backend = await opened(tmp_path / "l3", arena)
    yield backend
    await backend.close()


async def opened(path: Path, arena: HostArena, **extra: object) -> FileBackend:
    backend = FileBackend({"path": str(path), **extra})
    await backend.open(arena)
    return backend


def fill(arena: HostArena, offsets: list[int], length: int, seed: int = 0) -> list[bytes]:
    """Write a random payload at each offset; return the payloads."""
    rng = random.Random(seed)
    payloads = []
    for off in offsets:
        data = rng.randbytes(length)
        arena.view[off : off + length] = data
        payloads.append(data)
    return payloads


def clear(arena: HostArena, offsets: list[int], length: int) -> None:
    for off in offsets:
        arena.view[off : off + length] = bytes(length)


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.kvt"))


def segment_size(slots: int, slot: int = PAGE) -> int:
    """Bytes of a segment of ``slots`` slots: header table, then payloads."""
    return table_bytes(slots) + slots * slot


def payload_pos(segment: Path, index: int) -> int:
    """File offset of slot ``index``'s payload in a segment named seg-<slot>x<slots>-<seq>.kvt."""
    slot, slots = (int(x) for x in segment.name[4:].split("-")[0].split("x"))
    return table_bytes(slots) + index * slot


def flip(segment: Path, pos: int) -> None:
    with open(segment, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x40]))


async def test_put_then_get_returns_identical_bytes(store: FileBackend, arena: HostArena) -> None:
    keys = [key(f"k{i}") for i in range(8)]
    src = [i * PAGE for i in range(8)]
    dst = [(i + 16) * PAGE for i in range(8)]
    payloads = fill(arena, src, PAGE)
    assert await store.put_from(NS, keys, src, PAGE) == [True] * 8
    assert await store.get_into(NS, keys, dst, PAGE) == [True] * 8
    assert [bytes(arena.view[o : o + PAGE]) for o in dst] == payloads
    assert (store.stats.puts, store.stats.put_bytes) == (8, 8 * PAGE)
    assert (store.stats.gets, store.stats.misses, store.stats.corrupt) == (8, 0, 0)


@pytest.mark.parametrize("writer", ["python", "default"])
async def test_objects_are_the_same_with_the_pure_python_io(
    tmp_path: Path, arena: HostArena, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    # written by one implementation of the page I/O, read by the other: same objects
    import kvtier.daemon.storage.file.batch_io as file_module
    from kvtier.kernels import file_io

    keys = [key(f"k{i}") for i in range(4)]
    src, dst = [i * PAGE for i in range(4)], [(i + 16) * PAGE for i in range(4)]
    payloads = fill(arena, src, PAGE, seed=9)
    if writer == "python":
        monkeypatch.setattr(file_module, "write_pages", file_io.py_write_pages)
    store = await opened(tmp_path / "l3", arena)
    assert await store.put_from(NS, keys, src, PAGE) == [True] * 4
    await store.close()
    monkeypatch.setattr(file_module, "write_pages", file_io.write_pages)
    if writer == "default":
        monkeypatch.setattr(file_module, "read_pages", file_io.py_read_pages)
    store = await opened(tmp_path / "l3", arena)
    assert await store.get_into(NS, keys, dst, PAGE) == [True] * 4
    assert [bytes(arena.view[o : o + PAGE]) for o in dst] == payloads
    await store.close()


async def test_exists_is_the_leading_run(store: FileBackend, arena: HostArena) -> None:
    keys = [key(f"k{i}") for i in range(3)]
    fill(arena, [0, PAGE, 2 * PAGE], PAGE)
    await store.put_from(NS, keys, [0, PAGE, 2 * PAGE], PAGE)
    assert await store.exists(NS, keys) == 3
    assert await store.exists(NS, [keys[0], keys[1], key("absent"), keys[2]]) == 2
    assert await store.exists(NS, [key("absent"), *keys]) == 0
    assert await store.exists(OTHER_NS, keys) == 0
    assert await store.exists(NS, []) == 0


async def test_wrong_namespace_key_or_length_is_a_miss(
    store: FileBackend, arena: HostArena
) -> None:
    fill(arena, [0], PAGE)
    await store.put_from(NS, [key("a")], [0], PAGE)
    assert await store.get_into(OTHER_NS, [key("a")], [PAGE], PAGE) == [False]
    assert await store.get_into(NS, [key("b")], [PAGE], PAGE) == [False]
    assert await store.get_into(NS, [key("a")], [PAGE], PAGE - 1) == [False]
    assert (store.stats.misses, store.stats.corrupt) == (3, 0)
    assert await store.get_into(NS, [key("a")], [PAGE], PAGE) == [True]


async def test_flipped_payload_byte_is_a_corrupt_miss(
    tmp_path: Path, store: FileBackend, arena: HostArena
) -> None:
    keys = [key("a"), key("b")]
    fill(arena, [0, PAGE], PAGE)
    await store.put_from(NS, keys, [0, PAGE], PAGE)
    (seg,) = segment_files(tmp_path / "l3")
    flip(seg, payload_pos(seg, 0) + 1234)  # slot 0 holds keys[0]: the free list starts there
    assert await store.get_into(NS, keys, [2 * PAGE, 3 * PAGE], PAGE) == [False, True]
    assert (store.stats.corrupt, store.stats.misses, store.stats.gets) == (1, 1, 1)
    assert await store.exists(NS, keys) == 0  # the damaged object left the index
    assert await store.get_into(NS, keys[:1], [2 * PAGE], PAGE) == [False]
    assert store.stats.corrupt == 1
    await store.close()
    reopened = await opened(tmp_path / "l3", arena)  # its header was wiped: gone for good
    assert [e[1] for e in reopened.entries()] == [keys[1]]
    await reopened.close()


async def test_flipped_header_byte_is_a_corrupt_miss(
    tmp_path: Path, store: FileBackend, arena: HostArena
) -> None:
    fill(arena, [0], PAGE)
    await store.put_from(NS, [key("a")], [0], PAGE)
    (seg,) = segment_files(tmp_path / "l3")
    flip(seg, 0 * HEADER_STRIDE + 72)  # slot 0's header, payload length field
    assert await store.get_into(NS, [key("a")], [PAGE], PAGE) == [False]
    assert store.stats.corrupt == 1
    assert HEADER_SIZE <= HEADER_STRIDE


async def test_truncated_segment_is_a_miss(
    tmp_path: Path, store: FileBackend, arena: HostArena
) -> None:
    keys = [key(f"k{i}") for i in range(3)]
    offsets = [0, PAGE, 2 * PAGE]
    payloads = fill(arena, offsets, PAGE)
    await store.put_from(NS, keys, offsets, PAGE)
    (seg,) = segment_files(tmp_path / "l3")
    os.truncate(seg, payload_pos(seg, 1) + 1000)  # slot 0 whole, slot 1 torn, slot 2 gone
    clear(arena, offsets, PAGE)
    assert await store.get_into(NS, keys, offsets, PAGE) == [True, False, False]
    assert bytes(arena.view[0:PAGE]) == payloads[0]
    assert (store.stats.corrupt, await store.exists(NS, keys)) == (2, 1)


async def test_segment_truncated_while_closed_reads_as_misses(
    tmp_path: Path, arena: HostArena
) -> None:
    store = await opened(tmp_path / "l3", arena)
    keys = [key(f"k{i}") for i in range(3)]
    offsets = [0, PAGE, 2 * PAGE]
    fill(arena, offsets, PAGE)
    await store.put_from(NS, keys, offsets, PAGE)
    await store.close()
    (seg,) = segment_files(tmp_path / "l3")
    os.truncate(seg, payload_pos(seg, 1) + 1000)
    reopened = await opened(tmp_path / "l3", arena)  # headers intact: indexed, payloads lost
    assert await reopened.get_into(NS, keys, offsets, PAGE) == [True, False, False]
    assert (reopened.stats.corrupt, await reopened.exists(NS, keys)) == (2, 1)
    assert os.path.getsize(seg) >= payload_pos(seg, 3)  # its size was restored at open
    await reopened.close()


async def test_reopen_rebuilds_the_index(tmp_path: Path, arena: HostArena) -> None:
    backend = await opened(tmp_path / "l3", arena)
    keys = [key(f"k{i}") for i in range(20)]
    offsets = [i * PAGE for i in range(20)]
    payloads = fill(arena, offsets, PAGE, seed=7)
    assert all(await backend.put_from(NS, keys, offsets, PAGE))
    await backend.close()
    clear(arena, offsets, PAGE)
    reopened = await opened(tmp_path / "l3", arena)
    assert await reopened.exists(NS, keys) == 20
    assert all(await reopened.get_into(NS, keys, offsets, PAGE))
    assert [bytes(arena.view[o : o + PAGE]) for o in offsets] == payloads
    assert reopened.rebuild_seconds > 0
    assert reopened.allocated_bytes == backend.allocated_bytes
    await reopened.close()


async def test_second_open_of_the_same_directory_is_refused(
    tmp_path: Path, store: FileBackend, arena: HostArena
) -> None:
    with pytest.raises(StorageError, match="in use"):
        await opened(tmp_path / "l3", arena)


async def test_lru_evicts_tail_first(tmp_path: Path, arena: HostArena) -> None:
    store = await opened(
        tmp_path / "l3", arena, capacity=segment_size(4), segment_bytes=segment_size(4)
    )
    offsets = [i * PAGE for i in range(4)]
    fill(arena, offsets, PAGE)
    a = [key(f"a{i}") for i in range(3)]
    b = [key(f"b{i}") for i in range(2)]
    assert await store.put_from(NS, a, offsets[:3], PAGE) == [True] * 3
    assert await store.put_from(NS, b, offsets[:2], PAGE) == [True] * 2  # evicts a2, the tail
    assert {e[1] for e in store.entries()} == {a[0], a[1], b[0], b[1]}
    assert await store.put_from(NS, [key("c0")], offsets[:1], PAGE) == [True]  # evicts a1
    assert {e[1] for e in store.entries()} == {a[0], b[0], b[1], key("c0")}
    assert await store.get_into(NS, [a[0]], offsets[:1], PAGE) == [True]  # a0 is now newest
    assert await store.put_from(NS, [key("d0"), key("d1")], offsets[:2], PAGE) == [True, True]
    assert {e[1] for e in store.entries()} == {a[0], key("c0"), key("d0"), key("d1")}
    assert store.evictions == 4
    assert store.allocated_bytes == segment_size(4)
    await store.close()


async def test_put_of_a_stored_prefix_protects_it(tmp_path: Path, arena: HostArena) -> None:
    store = await opened(
        tmp_path / "l3", arena, capacity=4 * segment_size(1), segment_bytes=segment_size(1)
    )
    fill(arena, [i * PAGE for i in range(6)], PAGE)
    chain = [key(f"k{i}") for i in range(6)]
    assert await store.put_from(NS, chain[:2], [0, PAGE], PAGE) == [True, True]
    assert await store.put_from(NS, [key("x"), key("y")], [0, PAGE], PAGE) == [True, True]
    # k0, k1 are stored: touched, not rewritten; x and y make room; k4, k5 would evict k0..k3
    result = await store.put_from(NS, chain, [i * PAGE for i in range(6)], PAGE)
    assert result == [True, True, True, True, False, False]
    assert await store.exists(NS, chain) == 4
    assert store.stats.puts == 6
    assert len(segment_files(tmp_path / "l3")) == 4  # one slot per segment, created lazily


async def test_batches_across_segments_in_any_order(tmp_path: Path, arena: HostArena) -> None:
    store = await opened(tmp_path / "l3", arena, segment_bytes=segment_size(3))
    names = [f"k{i}" for i in range(10)]
    payloads = fill(arena, [i * PAGE for i in range(10)], PAGE, seed=11)
    assert all(
        await store.put_from(NS, [key(n) for n in names], [i * PAGE for i in range(10)], PAGE)
    )
    assert len(segment_files(tmp_path / "l3")) == 4
    order = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
    dst = [(20 + j) * PAGE for j in range(10)]
    assert all(await store.get_into(NS, [key(names[i]) for i in order], dst, PAGE))
    assert [bytes(arena.view[o : o + PAGE]) for o in dst] == [payloads[i] for i in order]
    await store.delete(NS, [key(names[i]) for i in (4, 5)])  # gaps in the runs
    assert await store.get_into(NS, [key(n) for n in names], dst, PAGE) == [
        i not in (4, 5) for i in range(10)
    ]
    assert store.stats.corrupt == 0
    await store.close()


async def test_several_payload_lengths_coexist(
    tmp_path: Path, store: FileBackend, arena: HostArena
) -> None:
    lengths = [3000, 4000, PAGE, 65536]  # 3000 and 4000 share the 4 KiB payload slot size
    payloads = {}
    for n, length in enumerate(lengths):
        offsets = [i * 65536 for i in range(3)]
        payloads[length] = fill(arena, offsets, length, seed=n)
        keys = [key(f"{length}-{i}") for i in range(3)]
        assert await store.put_from(NS, keys, offsets, length) == [True] * 3
    for length in lengths:
        keys = [key(f"{length}-{i}") for i in range(3)]
        offsets = [(i + 10) * 65536 for i in range(3)]
        assert await store.get_into(NS, keys, offsets, length) == [True] * 3
        assert [bytes(arena.view[o : o + length]) for o in offsets] == payloads[length]
    assert await store.get_into(NS, [key("3000-0")], [0], 4000) == [False]  # wrong length
    assert store.stats.corrupt == 0
    assert len(segment_files(tmp_path / "l3")) == 3


async def test_delete_removes_for_good(
    tmp_path: Path, store: FileBackend, arena: HostArena
) -> None:
    keys = [key("a"), key("b")]
    fill(arena, [0, PAGE], PAGE)
    await store.put_from(NS, keys, [0, PAGE], PAGE)
    assert await store.delete(NS, [keys[0], key("absent"), keys[0]]) == 1
    assert await store.exists(NS, keys[1:]) == 1
    assert await store.get_into(NS, keys[:1], [0], PAGE) == [False]
    await store.close()
    reopened = await opened(tmp_path / "l3", arena)
    assert [e[1] for e in reopened.entries()] == [keys[1]]
    await reopened.close()


async def test_concurrent_put_batches_stay_consistent(tmp_path: Path, arena: HostArena) -> None:
    # 12 slots for 3 x 8 distinct keys written by 6 overlapping batches: eviction runs meanwhile
    store = await opened(
        tmp_path / "l3", arena, capacity=3 * segment_size(4), segment_bytes=segment_size(4)
    )
    names = [f"k{i}" for i in range(24)]
    offsets = {name: i * PAGE for i, name in enumerate(names)}
    payloads = dict(zip(names, fill(arena, list(offsets.values()), PAGE, seed=3)))
    batches = [names[0:8], names[0:8], names[8:16], names[8:16], names[16:24], names[4:12]]
    results = await asyncio.gather(
        *(
            store.put_from(NS, [key(n) for n in batch], [offsets[n] for n in batch], PAGE)
            for batch in batches
        )
    )
    assert all(len(r) == 8 for r in results)
    stored = [(ns, k) for ns, k, _ in store.entries()]
    assert len(stored) == len(set(stored)) <= 12
    by_key = {key(n): n for n in names}
    readback = [(40 + i) * PAGE for i in range(len(stored))]
    gets = await asyncio.gather(
        *(store.get_into(NS, [k], [o], PAGE) for (_, k), o in zip(stored, readback))
    )
    assert all(g == [True] for g in gets)
    for (_, k), o in zip(stored, readback):
        assert bytes(arena.view[o : o + PAGE]) == payloads[by_key[k]]
    assert store.stats.corrupt == 0
    await store.close()


class _HeldFileBackend(FileBackend):
    """Stops the first put batch inside its writes until ``release`` is set."""

    def __init__(self, extra: dict[str, object]) -> None:
        super().__init__(extra)
        self.writing = threading.Event()
        self.release = threading.Event()

    def _write(self, *args: Any) -> dict[int, bool]:
        if not self.writing.is_set():
            self.writing.set()
            assert self.release.wait(10)
        return super()._write(*args)


async def _second_batch_while_the_first_writes(
    path: Path, arena: HostArena, capacity: int
) -> _HeldFileBackend:
    """Open a store of ``capacity`` (segments of 4 slots); put a0, a1 and, while that batch
    is held inside its writes, b0, b1; both must succeed."""
    store = _HeldFileBackend(
        {"path": str(path), "capacity": capacity, "segment_bytes": segment_size(4)}
    )
    await store.open(arena)
    first = asyncio.ensure_future(store.put_from(NS, [key("a0"), key("a1")], [0, PAGE], PAGE))
    assert await asyncio.to_thread(store.writing.wait, 10)
    second = await store.put_from(NS, [key("b0"), key("b1")], [2 * PAGE, 3 * PAGE], PAGE)
    store.release.set()
    assert second == [True, True] and await first == [True, True]
    return store


async def test_a_put_batch_writes_another_segment_than_one_in_flight(
    tmp_path: Path, arena: HostArena
) -> None:
    # two batches writing one file would serialize on its inode lock
    fill(arena, [i * PAGE for i in range(6)], PAGE, seed=5)
    store = await _second_batch_while_the_first_writes(tmp_path / "l3", arena, 4 * segment_size(4))
    assert len(segment_files(tmp_path / "l3")) == 2  # the second batch grew its own segment
    third = await store.put_from(NS, [key("c0"), key("c1")], [4 * PAGE, 5 * PAGE], PAGE)
    assert third == [True, True]
    assert len(segment_files(tmp_path / "l3")) == 2  # nothing in flight: the free slots serve
    got = await store.get_into(
        NS,
        [key(n) for n in ("a0", "a1", "b0", "b1", "c0", "c1")],
        [(10 + i) * PAGE for i in range(6)],
        PAGE,
    )
    assert got == [True] * 6
    assert [bytes(arena.view[(10 + i) * PAGE : (11 + i) * PAGE]) for i in range(6)] == [
        bytes(arena.view[i * PAGE : (i + 1) * PAGE]) for i in range(6)
    ]
    await store.close()


async def test_a_put_batch_shares_a_segment_when_no_other_can_grow(
    tmp_path: Path, arena: HostArena
) -> None:
    fill(arena, [i * PAGE for i in range(4)], PAGE, seed=6)
    store = await _second_batch_while_the_first_writes(tmp_path / "l3", arena, segment_size(4))
    assert len(segment_files(tmp_path / "l3")) == 1
    await store.close()


async def test_concurrent_reads_and_evicting_writes_never_return_wrong_bytes(
    tmp_path: Path, arena: HostArena
) -> None:
    store = await opened(
        tmp_path / "l3", arena, capacity=segment_size(8), segment_bytes=segment_size(8)
    )
    names = [f"k{i}" for i in range(16)]
    payloads = fill(arena, [i * PAGE for i in range(16)], PAGE, seed=5)

    async def writer(round_: int) -> None:
        batch = list(range(round_ % 16, round_ % 16 + 4))
        batch = [i % 16 for i in batch]
        await store.put_from(NS, [key(names[i]) for i in batch], [i * PAGE for i in batch], PAGE)

    async def reader(slot: int) -> None:
        for r in range(30):
            i = (r * 7 + slot) % 16
            dst = (20 + slot) * PAGE
            if (await store.get_into(NS, [key(names[i])], [dst], PAGE))[0]:
                assert bytes(arena.view[dst : dst + PAGE]) == payloads[i]

    await asyncio.gather(*(writer(r) for r in range(40)), *(reader(s) for s in range(6)))
    await store.close()


async def test_close_is_idempotent_and_later_calls_miss(
    store: FileBackend, arena: HostArena
) -> None:
    fill(arena, [0], PAGE)
    await store.put_from(NS, [key("a")], [0], PAGE)
    assert await store.health()
    await store.close()
    await store.close()
    assert not await store.health()
    assert await store.exists(NS, [key("a")]) == 0
    assert await store.get_into(NS, [key("a")], [0], PAGE) == [False]
    assert await store.put_from(NS, [key("b")], [0], PAGE) == [False]
    assert await store.delete(NS, [key("a")]) == 0


async def test_malformed_batches_raise(store: FileBackend, arena: HostArena) -> None:
    with pytest.raises(ValueError):
        await store.put_from(NS, [b"short"], [0], PAGE)
    with pytest.raises(ValueError):
        await store.get_into(NS, [key("a")], [arena.size - PAGE + 1], PAGE)
    with pytest.raises(ValueError):
        await store.put_from(NS[:16], [key("a")], [0], PAGE)
    with pytest.raises(ValueError):
        await store.put_from(NS, [key("a")], [0, PAGE], PAGE)


async def test_use_before_open_raises(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="before open"):
        await FileBackend({"path": str(tmp_path)}).put_from(NS, [key("a")], [0], PAGE)


def test_extra_config_is_validated(tmp_path: Path) -> None:
    extra = {"path": str(tmp_path), "capacity": "2GiB", "segment_bytes": "64 MiB", "fsync": "batch"}
    config = FileBackend(extra).config
    assert (config.capacity, config.segment_bytes, config.fsync) == (2 * 2**30, 64 * 2**20, "batch")
    assert (FileBackend({"path": tmp_path}).config.capacity, config.path) == (16 * 2**30, tmp_path)
    bad: list[tuple[dict[str, object], str]] = [
        ({"path": str(tmp_path), "bogus": 17}, "'bogus' = 17"),
        ({"capacity": 2**20}, "'path'"),
        ({"path": ""}, "'path' = ''"),
        ({"path": str(tmp_path), "capacity": "16XB"}, "'capacity' = '16XB'"),
        ({"path": str(tmp_path), "capacity": True}, "'capacity' = True"),
        ({"path": str(tmp_path), "segment_bytes": 100}, "'segment_bytes' = 100"),
        ({"path": str(tmp_path), "fsync": "always"}, "'fsync' = 'always'"),
    ]
    for bad_extra, match in bad:
        with pytest.raises(ConfigError, match=match):
            FileBackend(bad_extra)


async def test_fsync_batch_mode_round_trips(tmp_path: Path, arena: HostArena) -> None:
    store = await opened(tmp_path / "l3", arena, fsync="batch", segment_bytes="1MiB")
    payloads = fill(arena, [0, PAGE], PAGE)
    assert await store.put_from(NS, [key("a"), key("b")], [0, PAGE], PAGE) == [True, True]
    assert await store.get_into(NS, [key("a"), key("b")], [2 * PAGE, 3 * PAGE], PAGE) == [
        True,
        True,
    ]
    assert bytes(arena.view[2 * PAGE : 3 * PAGE]) == payloads[0]
    await store.close()


async def test_list_keys_lists_the_index_and_survives_a_reopen(
    tmp_path: Path, arena: HostArena
) -> None:
    store = await opened(tmp_path / "l3", arena)
    fill(arena, [0], PAGE)
    ours = [key(f"n{i}") for i in range(5)]
    assert await store.put_from(NS, ours, [0] * 5, PAGE) == [True] * 5
    assert await store.put_from(OTHER_NS, [key("o")], [0], PAGE) == [True]
    assert await store.delete(NS, [ours[0]]) == 1
    expected = {(NS, k) for k in ours[1:]} | {(OTHER_NS, key("o"))}
    listed = await store.list_keys()
    assert len(listed) == len(expected) and set(listed) == expected
    assert set(await store.list_keys({OTHER_NS})) == {(OTHER_NS, key("o"))}
    assert await store.list_keys(set()) == []
    await store.close()
    assert await store.list_keys() == []  # closed: nothing to list
    reopened = await opened(tmp_path / "l3", arena)  # the index rebuilt from the headers
    assert set(await reopened.list_keys()) == expected
    await reopened.close()


def allocated(path: Path) -> int:
    """Bytes the file system holds for the segment files (``st_blocks`` × 512)."""
    return sum(seg.stat().st_blocks * 512 for seg in segment_files(path))


async def test_delete_keeps_the_space_and_release_space_gives_it_back(
    tmp_path: Path, arena: HostArena
) -> None:
    path = tmp_path / "l3"
    store = await opened(path, arena, segment_bytes=segment_size(8))  # 8 slots a segment
    keys = [key(f"k{i}") for i in range(24)]
    offsets = [i * PAGE for i in range(24)]
    fill(arena, offsets, PAGE, seed=3)
    assert all(await store.put_from(NS, keys, offsets, PAGE))
    segments = segment_files(path)
    tables = len(segments) * table_bytes(8)
    full = allocated(path)
    assert full >= tables + 24 * PAGE  # preallocated and written
    assert await store.delete(NS, keys[:12]) == 12
    assert allocated(path) == full  # a delete keeps the blocks for the next writes
    assert await store.release_space() == 12 * PAGE
    assert allocated(path) <= tables + 12 * PAGE + len(segments) * 4096  # half given back
    assert await store.delete(NS, keys[12:]) == 12
    assert await store.release_space() == 24 * PAGE  # every free slot (punching is idempotent)
    assert allocated(path) <= tables + len(segments) * 4096  # the header tables, about
    assert [s.stat().st_size for s in segment_files(path)] == [segment_size(8)] * len(segments)
    # the store still works: the freed slots are written again, and read back intact
    again = fill(arena, offsets[:10], PAGE, seed=4)
    assert all(await store.put_from(OTHER_NS, keys[:10], offsets[:10], PAGE))
    clear(arena, offsets[:10], PAGE)
    assert all(await store.get_into(OTHER_NS, keys[:10], offsets[:10], PAGE))
    assert [bytes(arena.view[o : o + PAGE]) for o in offsets[:10]] == again
    assert segment_files(path) == segments  # reused, not grown
    await store.close()
    # a reopen does not allocate the holes again, and reads what was written since
    reopened = await opened(path, arena, segment_bytes=segment_size(8))
    assert allocated(path) <= tables + 10 * PAGE + len(segments) * 4096
    assert await reopened.exists(OTHER_NS, keys[:10]) == 10
    assert all(await reopened.get_into(OTHER_NS, keys[:10], offsets[:10], PAGE))
    assert [bytes(arena.view[o : o + PAGE]) for o in offsets[:10]] == again
    await reopened.close()


async def test_release_space_gives_never_used_slots_back_too(
    tmp_path: Path, arena: HostArena
) -> None:
    path = tmp_path / "l3"
    store = await opened(path, arena, segment_bytes=segment_size(8))
    keys = [key(f"k{i}") for i in range(11)]  # one full segment, one with 3 of 8 slots used
    offsets = [i * PAGE for i in range(11)]
    fill(arena, offsets, PAGE, seed=5)
    assert all(await store.put_from(NS, keys, offsets, PAGE))
    assert len(segment_files(path)) == 2
    assert allocated(path) >= 2 * segment_size(8)  # preallocated, used or not
    assert await store.delete(NS, keys[8:]) == 3  # the second segment's objects, all
    await store.release_space()
    left = [s.stat().st_blocks * 512 for s in segment_files(path)]
    # the first segment as it was; the second, now empty, its header table only (its five
    # never-used slots were preallocated: they are given back too)
    assert left == [segment_size(8), table_bytes(8)]
    assert await store.delete(NS, keys[:1]) == 1  # a segment still in use: that slot only
    await store.release_space()
    left = [s.stat().st_blocks * 512 for s in segment_files(path)]
    assert left == [segment_size(8) - PAGE, table_bytes(8)]
    assert await store.exists(NS, keys[1:8]) == 7
    assert all(await store.get_into(NS, keys[1:8], offsets[1:8], PAGE))
    await store.close()


async def test_segments_are_readable_by_the_daemons_user_only(
    tmp_path: Path, arena: HostArena
) -> None:
    """Segments hold every tenant's pages: mode 0600 even in a directory others can list."""
    path = tmp_path / "l3"
    path.mkdir(mode=0o755)
    backend = await opened(path, arena)
    try:
        offs = [0]
        fill(arena, offs, PAGE)
        assert await backend.put_from(NS, [key("a")], offs, PAGE) == [True]
    finally:
        await backend.close()
    files = segment_files(path)
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    files[0].chmod(0o644)  # readable by others: put back to its user's alone
    backend = await opened(path, arena)
    try:
        assert files[0].stat().st_mode & 0o777 == 0o600
    finally:
        await backend.close()


@pytest.mark.parametrize("how", ["group_writable", "world_writable", "symlink", "not_a_dir"])
async def test_a_store_directory_others_could_write_is_refused(
    tmp_path: Path, arena: HostArena, how: str
) -> None:
    """The store's objects are served to every engine and their checksums are no signature:
    a directory another user may write (or a link to one) is refused, naming the path."""
    path = tmp_path / "l3"
    if how == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
    elif how == "not_a_dir":
        path.write_bytes(b"")
    else:
        path.mkdir()
        path.chmod(0o770 if how == "group_writable" else 0o777)
    why = {"symlink": "symlink", "not_a_dir": "exists"}.get(how, "written by other")
    with pytest.raises(StorageError, match=f"path='{path}'.*{why}"):
        await opened(path, arena)


async def test_a_second_name_of_a_file_is_not_taken_as_a_segment(
    tmp_path: Path, arena: HostArena
) -> None:
    """A segment name hard-linked to another file (which the store would write into) or a
    symlinked one is refused: the store does not open, and the linked file is untouched."""
    path = tmp_path / "l3"
    backend = await opened(path, arena)
    try:
        offs = [0]
        fill(arena, offs, PAGE)
        assert await backend.put_from(NS, [key("a")], offs, PAGE) == [True]
    finally:
        await backend.close()
    seg = segment_files(path)[0]
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    seg.unlink()
    os.link(victim, seg)
    with pytest.raises(StorageError, match="links"):
        await opened(path, arena)
    seg.unlink()
    seg.symlink_to(victim)
    with pytest.raises(StorageError, match=str(path)):
        await opened(path, arena)
    assert victim.read_bytes() == b"precious"
