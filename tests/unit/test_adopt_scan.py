"""Exact tests of the column-wise adoption scan with page keys of 0 to 32 bytes.

The scan hashes every row's seal in one C call (:mod:`kvtier.daemon.pool.seals`), whatever
its key's length (engines' keys are 32-byte digests; the persistence tests,
test_pool_persistence, mostly use short keys), indexes the rows in C and deduplicates by a
64-bit fingerprint. These tests corrupt rows the way a careless column parser would get
wrong: bytes past a key's length, a key length off by one, a byte of either 16-byte half,
duplicates, and two distinct keys whose fingerprints collide. Pools live over real files, as in
test_pool_persistence; crash states are written into the metadata directly.
"""

from __future__ import annotations

import hashlib
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from kvtier.daemon.pool.adopt import _MULTIPLIERS, _fingerprints
from kvtier.daemon.pool.host_pool import PageState
from kvtier.daemon.pool.layout import KEY_BYTES, seal_of
from kvtier.daemon.pool.seals import seals

from tests.unit.test_pool_persistence import NS, NS2, PoolFile, rows, store
from tests.xxh3_reference import xxh3_64

_MASK = (1 << 64) - 1


def digest(name: str, n: int = KEY_BYTES) -> bytes:
    """A page key of ``n`` bytes (a SHA-256 digest, cut)."""
    return hashlib.sha256(name.encode()).digest()[:n]


@pytest.fixture
def pool_file(tmp_path: Path) -> PoolFile:
    from kvtier.daemon.pool.layout import PoolLayout

    return PoolFile(tmp_path / "pool", PoolLayout.plan(3 * 16 * 1024, 16 * 1024, 4096))


# ------------------------------------------------------------------ seals


@pytest.mark.parametrize("length", range(KEY_BYTES + 1))
def test_seals_match_the_reference_xxh3_for_every_key_length(length: int) -> None:
    """Column hashes equal the tests' own XXH3 (tests/xxh3_reference.py) for each length
    alone and mixed with every other length; the bytes past a row's length never count."""
    rng = random.Random(length)
    n = 64
    keys = np.frombuffer(rng.randbytes(n * KEY_BYTES), dtype=np.uint8).reshape(n, KEY_BYTES)
    seeds = np.array([0, _MASK] + [rng.getrandbits(64) for _ in range(n - 2)], dtype=np.uint64)
    want = [xxh3_64(keys[i, :length].tobytes(), int(seeds[i])) for i in range(n)]
    same = np.full(n, length)
    assert seals(keys, same, seeds).tolist() == want
    mixed = np.array([length if i % 2 else rng.randrange(KEY_BYTES + 1) for i in range(n)])
    want_mixed = [xxh3_64(keys[i, : mixed[i]].tobytes(), int(seeds[i])) for i in range(n)]
    assert seals(keys, mixed, seeds).tolist() == want_mixed
    garbled = keys.copy()
    garbled[:, length:] ^= 0xA5
    assert seals(garbled, same, seeds).tolist() == want


@pytest.mark.parametrize("mixed", [False, True])
def test_seals_of_many_rows(mixed: bool) -> None:
    """Many rows: every digest lands in its place, with one key length throughout or a few
    rows of other lengths among them."""
    rng = random.Random(7)
    n = 20_000
    keys = np.frombuffer(rng.randbytes(n * KEY_BYTES), dtype=np.uint8).reshape(n, KEY_BYTES)
    lengths = np.full(n, KEY_BYTES)
    if mixed:
        lengths[rng.sample(range(n), 300)] = [rng.randrange(KEY_BYTES) for _ in range(300)]
    seeds = np.array([rng.getrandbits(64) for _ in range(n)], dtype=np.uint64)
    want = [xxh3_64(keys[i, : lengths[i]].tobytes(), int(seeds[i])) for i in range(n)]
    assert seals(keys, lengths, seeds).tolist() == want


def test_seals_of_no_rows_and_rows_that_are_not_keys() -> None:
    out = seals(np.zeros((0, KEY_BYTES), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.uint64))
    assert out.shape == (0,) and out.dtype == np.uint64
    seeds = np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="key rows of shape"):
        seals(np.zeros((2, 16), np.uint8), np.full(2, 16), seeds)  # rows of 16 bytes
    with pytest.raises(ValueError, match="key rows of shape"):
        seals(np.zeros((2, KEY_BYTES), np.uint8), np.full(2, 33), seeds)


def test_the_c_seals_are_xxh3_for_every_key_length_and_seed() -> None:
    """The extension itself, one call for rows of every length from 0 to 32 (each of XXH3's
    short-input paths: 0, 1-3, 4-8, 9-16, 17-32 bytes), with seeds whose halves matter (the
    4-8 byte path folds the seed's low half into its high one): each digest is the xxhash
    package's and the tests' own XXH3's."""
    import xxhash

    from kvtier.daemon.pool.native import _keyprobe as probe

    rng = random.Random(17)
    lengths = [n for n in range(KEY_BYTES + 1) for _ in range(40)]
    n = len(lengths)
    rows = np.frombuffer(rng.randbytes(n * KEY_BYTES), dtype=np.uint8).reshape(n, KEY_BYTES)
    special = [0, 1, _MASK, 0xFFFFFFFF, 1 << 32, 0xFFFFFFFF << 32, 0x8000000000000000]
    seeds = np.array(  # every fifth seed a special one: each length meets all of them
        [special[i // 5 % len(special)] if i % 5 == 0 else rng.getrandbits(64) for i in range(n)],
        dtype=np.uint64,
    )
    out = np.zeros(n, dtype=np.uint64)
    probe.seals(rows, np.array(lengths, dtype=np.uint8), seeds, out)
    for i, length in enumerate(lengths):
        key, seed = rows[i, :length].tobytes(), int(seeds[i])
        want = xxhash.xxh3_64_intdigest(key, seed)
        assert int(out[i]) == want == xxh3_64(key, seed), (length, seed)


def test_the_c_seals_refuse_lengths_and_sizes_they_cannot_hash() -> None:
    """The extension hashes 0 to 32 bytes per 32-byte row; a longer length, or buffers of
    other sizes, are a ValueError and nothing is written."""
    from kvtier.daemon.pool.native import _keyprobe as probe

    rows = np.frombuffer(digest("a") + digest("b"), dtype=np.uint8).reshape(2, KEY_BYTES)
    seeds = np.array([1, 2], dtype=np.uint64)
    for lengths in ([32, 33], [33, 32], [0, 255]):
        out = np.zeros(2, dtype=np.uint64)
        with pytest.raises(ValueError, match="not 0 to 32"):
            probe.seals(rows, np.array(lengths, dtype=np.uint8), seeds, out)
        assert not out.any()
    with pytest.raises(ValueError, match="not one 32-byte row"):
        probe.seals(rows[:1], np.array([32, 32], dtype=np.uint8), seeds, np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="not one 32-byte row"):
        probe.seals(rows, np.array([32, 32], dtype=np.uint8), seeds, np.zeros(3, np.uint64))


# ------------------------------------------------------------ adoption


def test_digest_keys_come_back_exactly(pool_file: PoolFile) -> None:
    """32-byte keys, a 20-byte key and a 5-byte key (one C call seals and one indexes
    them all), in two namespaces: every row and lookup comes back."""
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    a = [digest(f"a{i}") for i in range(3)]
    b = [digest(f"b{i}") for i in range(2)]
    store(pool, arena, a)
    store(pool, arena, b, ns=NS2)
    store(pool, arena, [digest("mid", 20), b"short"])
    before = rows(pool)
    pool, res = pool_file.start()
    assert (res.pages_adopted, res.pages_dropped) == (7, 0)
    assert rows(pool) == before
    assert pool.lookup(NS, a) == 3 and pool.lookup(NS2, b) == 2 and pool.lookup(NS, b) == 0
    assert pool.lookup(NS, [digest("mid", 20), b"short"]) == 2


def test_bytes_past_a_keys_length_are_not_part_of_it(pool_file: PoolFile) -> None:
    """Garbage after a 20- and a 24-byte key in the key column: the rows are adopted under
    the keys their lengths say (a parser reading all 32 bytes would drop them, or serve
    them under keys no engine asked for)."""
    pool, _ = pool_file.start()
    keys = [digest("k20", 20), digest("k24", 24), digest("k32")]
    slots = store(pool, pool_file.arena(), keys)
    del pool
    meta = pool_file.meta()
    for s, key in zip(slots, keys):
        for i in range(len(key), KEY_BYTES):
            meta.key[s * KEY_BYTES + i] = 0xEE
    meta.release()
    pool, res = pool_file.start()
    assert (res.pages_adopted, res.pages_dropped) == (3, 0)
    assert [pool.describe(s).key for s in slots] == keys
    assert pool.lookup(NS, keys) == 3


@pytest.mark.parametrize(
    ("n", "where"),
    [
        (32, "byte 0"),
        (32, "byte 15"),
        (32, "byte 16"),
        (32, "byte 31"),
        (24, "byte 8"),
        (24, "byte 23"),
        (32, "length 31"),
        (20, "length 21"),
        (20, "length 16"),
        (12, "byte 7"),
        (6, "byte 2"),
        (5, "length 4"),
        (3, "byte 1"),
        (1, "byte 0"),
        (32, "namespace"),
        (32, "checksum"),
    ],
)
def test_a_stray_write_to_a_digest_row_drops_it(pool_file: PoolFile, n: int, where: str) -> None:
    """One changed byte anywhere in a key that long (through each of XXH3's short-input
    paths), its length off by one (or into another path), or another namespace or
    checksum: the seal no longer matches."""
    pool, _ = pool_file.start()
    key, other = digest("victim", n), digest("bystander")
    slot, kept = store(pool, pool_file.arena(), [key, other])
    del pool
    meta = pool_file.meta()
    what, _, arg = where.partition(" ")
    if what == "byte":
        meta.key[slot * KEY_BYTES + int(arg)] ^= 0x40
    elif what == "length":
        meta.key_len[slot] = int(arg)
    elif what == "namespace":
        meta.ns[slot] = NS2
    else:
        meta.checksum[slot] ^= 1
    meta.release()
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (1, 1)
    assert pool.describe(slot).state is PageState.FREE
    assert pool.describe(kept).key == other and pool.lookup(NS, [other]) == 1


def test_duplicate_digest_keys_keep_the_latest_row_per_namespace(pool_file: PoolFile) -> None:
    """Rows that corruption made claim another row's key (sealed): per namespace the most
    recent row keeps it, the lowest slot of a tie; the same key in another namespace is
    another page."""
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    k0, k1 = digest("k0"), digest("k1")
    s0, s1 = store(pool, arena, [k0, k1])
    x, y = store(pool, arena, [digest("x"), digest("y")])
    (z,) = store(pool, arena, [k0], ns=NS2)  # same key, other namespace
    del pool
    meta = pool_file.meta()
    for s, key, stamp in ((x, k0, 1000), (y, k1, int(meta.stamp[s1]))):
        meta.put_key(s, key)  # x: k0, more recent than s0; y: k1, as recent as s1
        meta.seal[s] = seal_of(key, NS, meta.checksum[s])
        meta.stamp[s] = stamp
    meta.release()
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (3, 2)
    assert pool.describe(x).key == k0 and pool.describe(s0).state is PageState.FREE
    low, high = sorted((s1, y))
    assert pool.describe(low).key == k1 and pool.describe(high).state is PageState.FREE
    assert pool.describe(z).key == k0 and pool.lookup(NS2, [k0]) == 1
    assert pool.lookup(NS, [k0, k1]) == 2


def test_duplicates_differing_only_past_the_key_length_are_duplicates(
    pool_file: PoolFile,
) -> None:
    """Two sealed rows with the same 20-byte key and different bytes after it hold one
    key: only the more recent is adopted."""
    pool, _ = pool_file.start()
    key = digest("short", 20)
    old, new = store(pool, pool_file.arena(), [key, digest("other", 20)])
    del pool
    meta = pool_file.meta()
    meta.put_key(new, key)
    meta.seal[new] = seal_of(key, NS, meta.checksum[new])
    meta.stamp[new] = 1000
    for i in range(20, KEY_BYTES):
        meta.key[old * KEY_BYTES + i] = 0x11
        meta.key[new * KEY_BYTES + i] = 0x22
    meta.release()
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (1, 1)
    assert pool.describe(new).key == key and pool.describe(old).state is PageState.FREE
    assert pool.lookup(NS, [key]) == 1


def _colliding_pair(seed: int) -> tuple[bytes, bytes]:
    """Two distinct 32-byte keys whose (namespace, key) fingerprints are equal."""
    rng = random.Random(seed)
    w = [rng.getrandbits(64) for _ in range(4)]
    m0, m1 = int(_MULTIPLIERS[0]), int(_MULTIPLIERS[1])
    t = rng.getrandbits(64) | 1

    def mix(v: int) -> int:
        return v ^ (v >> 29)

    def unmix(v: int) -> int:
        return v ^ (v >> 29) ^ (v >> 58)

    b0 = unmix((mix(w[0]) + t * m1) & _MASK)
    b1 = unmix((mix(w[1]) - t * m0) & _MASK)
    return struct.pack("<4Q", *w), struct.pack("<4Q", b0, b1, w[2], w[3])


def test_distinct_keys_whose_fingerprints_collide_are_both_adopted(pool_file: PoolFile) -> None:
    """A client can choose keys whose 64-bit fingerprints collide; the scan compares such
    rows whole, so both pages come back (a scan deduplicating by fingerprint alone would
    drop one), and a true duplicate among them is still resolved."""
    a, b = _colliding_pair(1)
    lens, nss = np.full(2, KEY_BYTES, dtype=np.uint8), np.full(2, NS, dtype=np.int64)
    pair = np.frombuffer(a + b, dtype=np.uint8).reshape(2, KEY_BYTES)
    assert a != b and len(set(_fingerprints(pair, lens, nss).tolist())) == 1
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    sa, sb = store(pool, arena, [a, b])
    (dup,) = store(pool, arena, [digest("dup")])
    del pool
    meta = pool_file.meta()
    meta.put_key(dup, a)  # a third row claims a, and is the most recent
    meta.seal[dup] = seal_of(a, NS, meta.checksum[dup])
    meta.stamp[dup] = 1000
    meta.release()
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (2, 1)
    assert pool.describe(dup).key == a and pool.describe(sb).key == b
    assert pool.describe(sa).state is PageState.FREE
    assert pool.lookup(NS, [a, b]) == 2


def test_a_verified_adoption_checks_digest_rows_payloads(pool_file: PoolFile) -> None:
    """With the arena, a 32-byte-key row whose payload changed is dropped; its sealed
    neighbour stays."""
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    s0, s1 = store(pool, arena, [digest("p0"), digest("p1")])
    off = pool.slot_offset(s1)
    del pool
    arena[off] ^= 1
    pool, res = pool_file.start(verify=True)
    assert (res.pages_adopted, res.pages_dropped) == (1, 1)
    assert pool.describe(s0).key == digest("p0") and pool.describe(s1).state is PageState.FREE


# ------------------------------------------------------------ the adopted index


@pytest.mark.parametrize("keys_of", ["digests", "mixed lengths"])
def test_the_adopted_index_holds_every_adopted_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys_of: str
) -> None:
    """Three namespaces, pages freed among them (gaps in the slots): the adopted index
    (built in C by ``index_keys``, one call per namespace, for keys of every length) holds
    exactly the READY rows, key -> slot, each key one object shared with the slot -> key
    list."""
    from kvtier.daemon.pool import adopt
    from kvtier.daemon.pool.layout import PoolLayout

    pf = PoolFile(tmp_path / "pool", PoolLayout.plan(8 * 64 * 1024, 64 * 1024, 4096))
    pool, _ = pf.start()
    arena = pf.arena()
    rng = random.Random(3)
    stored = {}
    for ns in (NS, NS2, 3):
        n = KEY_BYTES if keys_of == "digests" else None
        stored[ns] = [
            digest(f"{ns}-{i}", n or rng.choice([KEY_BYTES, 20, 12, 5, 3])) for i in range(30)
        ]
        store(pool, arena, stored[ns], ns=ns)
    pool.flush(NS2)  # gaps
    stored[NS2] = [digest(f"late{i}") for i in range(5)]
    store(pool, arena, stored[NS2], ns=NS2)
    expected: dict[int, dict[bytes, int]] = {}
    for s in range(pool.layout.n_slots):
        d = pool.describe(s)
        if d.state is PageState.READY:
            expected.setdefault(d.ns_id, {})[d.key] = s
    calls = []
    adopt_c = adopt._keyprobe.index_keys
    monkeypatch.setattr(
        adopt._keyprobe, "index_keys", lambda *a: calls.append(len(a[2])) or adopt_c(*a)
    )
    c_pool, res = pf.start()
    assert res.pages_adopted == 65
    assert sorted(calls) == [5, 30, 30]
    assert c_pool._pages.ready == expected
    assert sum(map(len, c_pool._pages.ready.values())) == 65
    for index in c_pool._pages.ready.values():
        assert all(c_pool._pages.keys[s] is key for key, s in index.items())
    for ns, keys in stored.items():
        assert c_pool.lookup(ns, keys) == len(keys) and c_pool.lookup(ns, keys[::-1][:1]) == 1


def test_index_keys_checks_every_slot_and_changes_nothing_on_failure() -> None:
    """The C index of adopted keys: sizes that do not agree, slots outside the list, a
    slot already holding a key or named twice, a key longer than a row, a key given twice:
    ValueError, and the list is as it was; on success each key is one object held by the
    list and the dict (its reference count shows no leak and no reference too few)."""
    import sys

    from kvtier.daemon.pool.native import _keyprobe as probe

    rows = np.frombuffer(b"".join(digest(f"r{i}") for i in range(4)), dtype=np.uint8)
    rows = rows.reshape(4, KEY_BYTES)
    full = np.full(4, KEY_BYTES, dtype=np.uint8)
    good = np.array([0, 2, 5, 7], dtype=np.int64)
    by_slot: list[bytes | None] = [None] * 8
    index = probe.index_keys(rows, full, good, by_slot)
    assert index == {digest(f"r{i}"): s for i, s in enumerate(good.tolist())}
    assert [by_slot[s] for s in good.tolist()] == [digest(f"r{i}") for i in range(4)]
    assert all(by_slot[s] is key for key, s in index.items())
    refs = [sys.getrefcount(by_slot[s]) for s in good.tolist()]
    assert refs == [3] * 4  # the dict, the list, the call's argument
    slots4 = np.array([0, 1, 2, 3], dtype=np.int64)
    alike = rows.copy()
    alike[3, :5] = alike[2, :5]  # rows 2 and 3 differ, their first 5 bytes do not
    bad = [
        (rows[:3], full, good),  # three keys, four slots
        (rows, full, good[:3]),
        (rows, full[:3], good),  # three lengths
        (rows, full, np.array([0, 1, 2, 8], dtype=np.int64)),  # outside the 8 slots
        (rows, full, np.array([0, 1, -1, 3], dtype=np.int64)),
        (rows, full, np.array([0, 1, 2, 1], dtype=np.int64)),  # slot 1 twice
        (rows, np.array([32, 32, 33, 32], dtype=np.uint8), good),  # longer than its row
        (rows[[0, 1, 2, 1]], full, slots4),  # a key twice
        (alike, np.array([32, 20, 5, 5], dtype=np.uint8), slots4),  # a 5-byte key twice
    ]
    for r, n, s in bad:
        fresh: list[bytes | None] = [None] * 8
        with pytest.raises(ValueError):
            probe.index_keys(np.ascontiguousarray(r), n, s, fresh)
        assert fresh == [None] * 8
    with pytest.raises(ValueError, match="already holds"):
        probe.index_keys(rows, full, good, by_slot)  # the same slots again
    with pytest.raises(TypeError):
        probe.index_keys(rows, full, good, tuple(by_slot))


def test_index_keys_cuts_each_row_to_its_length() -> None:
    """Keys of every length from 0 to 32 in one call: each key is its row's first
    ``lengths[i]`` bytes (the bytes past it, garbage here, are no part of it), so keys
    that share a prefix but differ in length are different keys."""
    from kvtier.daemon.pool.native import _keyprobe as probe

    n = KEY_BYTES + 1
    rows = np.frombuffer(digest("same") * n, dtype=np.uint8).reshape(n, KEY_BYTES).copy()
    lengths = np.arange(n, dtype=np.uint8)
    for i in range(n):
        rows[i, i:] ^= 0xEE  # past the key: not read
    slots = np.arange(n, dtype=np.int64)[::-1].copy()
    by_slot: list[bytes | None] = [None] * n
    index = probe.index_keys(rows, lengths, slots, by_slot)
    want = {digest("same")[:i]: int(slots[i]) for i in range(n)}
    assert index == want and len(index) == n
    assert all(by_slot[s] == key and by_slot[s] is key for key, s in index.items())


def test_a_duplicate_in_a_later_namespace_rebuilds_the_whole_index(pool_file: PoolFile) -> None:
    """Three namespaces, the duplicate in the last one the C index reaches: the
    namespaces indexed before it give their keys back, the duplicates are resolved, and
    the index and the slot -> key list come out as if there had been none."""
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    (a,) = store(pool, arena, [digest("a")], ns=NS)
    (b,) = store(pool, arena, [digest("b")], ns=NS2)
    c0, c1 = store(pool, arena, [digest("c0"), digest("c1")], ns=3)
    del pool
    meta = pool_file.meta()
    meta.put_key(c1, digest("c0"))  # c1 claims c0's key, more recently
    meta.seal[c1] = seal_of(digest("c0"), 3, meta.checksum[c1])
    meta.stamp[c1] = 1000
    meta.release()
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (3, 1)
    assert pool._pages.ready == {NS: {digest("a"): a}, NS2: {digest("b"): b}, 3: {digest("c0"): c1}}
    assert [s for s, key in enumerate(pool._pages.keys) if key is not None] == sorted((a, b, c1))
    assert pool.describe(c0).state is PageState.FREE


def test_starting_and_adopting_an_empty_pool_imports_no_tomllib_and_no_numpy_ma() -> None:
    """What the daemon imports before it is healthy is start-up time: ``tomllib`` is only
    needed for a TOML file (10 ms), and ``np.unique`` without counts imports ``numpy.ma``
    (tens of ms) even for an empty array, as adopting an empty pool did."""
    import subprocess
    import sys

    code = (
        "import mmap, sys\n"
        "import kvtier.daemon.service.server, kvtier.daemon.service.boot\n"
        "from kvtier.daemon.pool.host_pool import HostPool\n"
        "buf = mmap.mmap(-1, HostPool(4 << 20, 1 << 20, 4096).layout.meta_bytes)\n"
        "HostPool(4 << 20, 1 << 20, 4096, meta=buf, cold_start=True)\n"
        "assert HostPool(4 << 20, 1 << 20, 4096, meta=buf).adopted.adopted\n"
        "print(sorted(m for m in ('tomllib', 'numpy.ma') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
