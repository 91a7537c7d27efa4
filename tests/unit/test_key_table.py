"""The pool's key table answers LOOKUPs exactly as the key-by-key index does (no mocks).

``HostPool.lookup_packed``, ``lookup`` and ``pin`` go through the key table, probed in C
(``daemon/pool/native/_keyprobe.c``), whatever the number of keys; ``dict_run``
(``tests/pool_model.py``) probes the page table's dict key by key and is the reference.
Every case compares
the two and, where the answer is known by construction, the number itself: hostile lists
(not a chain, duplicates, another namespace's keys, absent keys between present ones),
pages that left (evicted, flushed, aborted, slots reused under other keys), pages still
WRITING, a table that grew and was rebuilt, an adopted pool, keys crafted to share
their first bytes so that their bucket overflows, and keys equal to stored ones in all but
their last 24, 16, 8 or 1 bytes (the probe compares whole keys).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
from kvtier.daemon.pool import keytable
from kvtier.daemon.pool.host_pool import HostPool, HostPoolError
from kvtier.daemon.pool.keytable import MAX_ROUNDS
from kvtier.daemon.pool.native import _keyprobe

from tests.pool_model import dict_run

KIB = 1024
PAGE = 4 * KIB
NS, NS2 = 1, 2
OWNER = 7
N = 512  # keys of the test's chains


def new_pool(pages: int = 4 * N, **kwargs: Any) -> HostPool:
    return HostPool(pages * PAGE, 64 * KIB, **kwargs)


def keys_of(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(n)]


def store(pool: HostPool, keys: list[bytes], ns: int = NS, commit: bool = True) -> list[int]:
    got = pool.allocate(ns, OWNER, pool.register_class(PAGE), keys)
    assert len(got) == len(keys), "the test pool is large enough"
    slots = [s for _, s in got]
    if commit:
        pool.commit(slots)
    return slots


def stored_pool(rng: random.Random) -> tuple[HostPool, list[bytes]]:
    """A new pool holding one committed chain of N random keys (returned with it)."""
    pool = new_pool()
    keys = keys_of(rng, N)
    store(pool, keys)
    return pool, keys


def run(pool: HostPool, ns: int, keys: list[bytes]) -> int:
    """The table's answer, checked against the key-by-key reference and the list form; the
    slots the probe returns for a pin, against the index's."""
    expected = dict_run(pool._pages, ns, keys)
    packed = pool.lookup_packed(ns, b"".join(keys)) if all(len(k) == 32 for k in keys) else None
    assert packed in (None, len(expected))
    assert pool.lookup(ns, keys) == len(expected)
    assert pool._lookups.run_slots(ns, keys) == expected
    return len(expected)


def test_chains_prefixes_and_misses() -> None:
    rng = random.Random(1)
    pool, keys = stored_pool(rng)
    assert run(pool, NS, keys) == N
    assert run(pool, NS, keys[: N // 2] + keys_of(rng, 300)) == N // 2
    assert run(pool, NS, keys_of(rng, 1) + keys) == 0
    assert run(pool, NS, keys[:10] + keys_of(rng, 1) + keys[11:]) == 10
    assert run(pool, NS, keys[:-1] + keys_of(rng, 1)) == N - 1


def test_hostile_lists_not_chains_duplicates_other_namespace() -> None:
    rng = random.Random(2)
    pool = new_pool()
    mine, theirs = keys_of(rng, N), keys_of(rng, N)
    store(pool, mine)
    store(pool, theirs, ns=NS2)
    shuffled = mine[:]
    rng.shuffle(shuffled)
    assert run(pool, NS, shuffled) == N  # every key present, in no chain order
    assert run(pool, NS, [mine[5]] * N) == N  # one present key, N times
    assert run(pool, NS, [mine[0]] * 300 + [theirs[0]] + mine) == 300
    assert run(pool, NS, theirs) == 0  # another namespace's pages are never seen
    assert run(pool, NS2, theirs + mine) == N
    assert run(pool, 99, mine) == 0  # a namespace with no pages


def test_writing_evicted_flushed_aborted_and_reused_slots() -> None:
    rng = random.Random(3)
    pool = new_pool()
    keys = keys_of(rng, N)
    slots = store(pool, keys)
    late = keys_of(rng, 300)
    writing = store(pool, late, commit=False)
    assert run(pool, NS, keys + late) == N  # WRITING pages do not count
    pool.abort(writing)
    assert run(pool, NS, keys + late) == N
    pool.flush(NS)
    assert run(pool, NS, keys) == 0  # the table still names the slots; the rows decide
    few = keys_of(rng, 8)
    store(pool, few)  # the namespace holds pages again; most freed rows keep their old keys
    assert run(pool, NS, keys) == 0
    assert run(pool, NS, few + keys) == 8
    again = keys_of(rng, N)
    reused = store(pool, again)  # the freed slots come back under other keys
    assert set(reused) & set(slots)
    assert run(pool, NS, keys) == 0
    assert run(pool, NS, again) == N
    assert run(pool, NS, again[:100] + keys[:100]) == 100


def test_eviction_leaves_only_what_is_resident() -> None:
    rng = random.Random(4)
    pool = new_pool(pages=N + N // 2)  # room for 1.5 lists: the second evicts the first
    first, second = keys_of(rng, N), keys_of(rng, N)
    store(pool, first)
    store(pool, second)
    assert pool.stats().evictions > 0
    assert run(pool, NS, second) == N
    held = run(pool, NS, first)
    assert held < N
    assert held == len(dict_run(pool._pages, NS, first))


def test_growth_rebuilds_and_random_lists_agree() -> None:
    rng = random.Random(5)
    pool = new_pool(pages=16 * N)
    table = pool._lookups.table
    caps, stored = {table.capacity}, []
    for _ in range(24):  # many small commits: the table grows by rebuilds
        batch = keys_of(rng, rng.randint(1, 3 * N // 4))
        store(pool, batch)
        stored += batch
        caps.add(pool._lookups.table.capacity)
    assert len(caps) > 1
    for _ in range(40):
        n = rng.choice((1, 2, 8, 64, rng.randint(1, 2 * N)))
        keys = [rng.choice(stored) if rng.random() < 0.97 else rng.randbytes(32) for _ in range(n)]
        run(pool, NS, keys)


def test_same_bucket_in_another_namespace_is_not_a_hit() -> None:
    rng = random.Random(9)
    pool = new_pool()
    pool._lookups.table._mult[1] = 0  # the namespace no longer moves the bucket: probes meet
    pool._lookups.table.rebuild()
    keys = keys_of(rng, N)
    store(pool, keys, ns=NS2)
    store(pool, keys_of(rng, 4))  # NS holds pages too
    assert run(pool, NS, keys) == 0
    store(pool, keys[: N // 2])  # now NS holds the first half under the same keys
    assert run(pool, NS, keys) == N // 2
    assert run(pool, NS2, keys) == N


def test_crafted_keys_overflowing_a_bucket_stay_exact() -> None:
    rng = random.Random(6)
    pool = new_pool()
    head = rng.randbytes(8)  # same first 8 bytes: the same bucket, whatever the hashing
    crafted = [head + rng.randbytes(24) for _ in range(N)]
    store(pool, crafted)
    assert run(pool, NS, crafted) == N
    assert pool._lookups.table.left_out >= N - MAX_ROUNDS  # past the bucket's run: the exact way
    other = [head + rng.randbytes(24) for _ in range(3)]
    assert run(pool, NS, crafted[: N // 2] + other + crafted) == N // 2
    plain = keys_of(rng, N)
    store(pool, plain)
    assert run(pool, NS, plain + crafted) == 2 * N


@pytest.mark.parametrize("shared", [8, 16, 24, 31])
def test_a_key_sharing_all_but_its_last_bytes_with_a_stored_one_is_not_it(shared: int) -> None:
    """Keys equal to stored ones in their first ``shared`` bytes (so in the same bucket,
    whatever the table's hashing) and different after: the probe that meets the stored key
    must compare all 32 bytes, not a prefix."""
    rng = random.Random(13 + shared)
    pool, keys = stored_pool(rng)

    def twin(key: bytes) -> bytes:  # the same first `shared` bytes, then different ones
        tail = bytes(b ^ 0xFF for b in key[shared:])
        return key[:shared] + tail

    assert all(twin(x)[:shared] == x[:shared] and twin(x) != x for x in keys)
    for at in (0, 1, N // 2, N - 1):
        assert run(pool, NS, keys[:at] + [twin(keys[at])] + keys[at + 1 :]) == at
    assert run(pool, NS, [twin(x) for x in keys]) == 0
    # stored side by side, each key finds its own page
    store(pool, [twin(x) for x in keys[: N // 2]])
    twins = [twin(x) for x in keys[: N // 2]]
    assert run(pool, NS, twins + [twin(keys[N // 2])]) == N // 2
    slots = pool._lookups.run_slots
    assert set(slots(NS, twins)).isdisjoint(slots(NS, keys[: N // 2]))


def test_a_short_key_is_not_a_padded_one() -> None:
    pool = new_pool()
    short = [i.to_bytes(2, "big") + b"\7" * 29 for i in range(N)]  # 31 bytes each
    store(pool, short)
    padded = [k + b"\0" for k in short]  # the bytes the key column holds for them
    assert pool.lookup_packed(NS, b"".join(padded)) == 0
    assert pool.lookup(NS, padded) == 0


def test_partial_key_is_refused() -> None:
    pool = new_pool()
    store(pool, keys_of(random.Random(7), 4))
    with pytest.raises(HostPoolError, match="multiple of 32"):
        pool.lookup_packed(NS, b"\1" * 33)
    assert pool.lookup_packed(NS, b"") == 0


def test_an_adopted_pool_finds_its_pages() -> None:
    rng = random.Random(8)
    meta = bytearray(new_pool().layout.meta_bytes)
    first = new_pool(meta=meta)
    keys = keys_of(rng, N)
    store(first, keys)
    assert run(first, NS, keys) == N
    second = new_pool(meta=meta)  # a restart over the same metadata
    res = second.adopted
    assert res is not None and res.adopted and res.pages_adopted == N
    assert run(second, NS, keys) == N
    assert run(second, NS, keys[: N // 3] + keys_of(rng, 1)) == N // 3
    first.close()
    second.close()


def test_stale_entries_pointing_anywhere_read_nothing_outside() -> None:
    # a table entry only proposes a slot: the C probe must check ids past the columns,
    # never read there, and leave the answer exact
    rng = random.Random(10)
    pool, keys = stored_pool(rng)
    table = pool._lookups.table._table
    empty = np.flatnonzero(table < 0)
    table[empty[: len(empty) // 2]] = np.int32(2**31 - 1)  # far past the slots
    table[empty[len(empty) // 2 :]] = np.int32(pool.layout.n_slots)  # just past them
    assert run(pool, NS, keys) == N
    assert run(pool, NS, keys[: N // 4] + keys_of(rng, 2) + keys) == N // 4


def test_leading_run_starts_where_asked_and_tells_a_miss_from_an_open_probe() -> None:
    rng = random.Random(11)
    pool, keys = stored_pool(rng)
    words = np.frombuffer(b"".join(keys + keys_of(rng, 1)), dtype="<u8").reshape(-1, 4)
    t = pool._lookups.table

    def run_from(start: int) -> int:
        # a page the table left out beside a crowded bucket ends a call with an open
        # probe (the table's hashing is drawn per table): resume after it, as a lookup does
        i, open_ = t.leading_run(NS, words, start)
        while open_ and i < N:
            i, open_ = t.leading_run(NS, words, i + 1)
        return i

    assert run_from(0) == N  # every stored key, then the absent last one
    assert run_from(N - 3) == N
    assert t.leading_run(NS, words, N + 1) == (N + 1, False)  # nothing left to probe
    assert t.leading_run(NS2, words)[0] == 0
    t._table[:] = np.int32(0)  # every entry taken, none this key's: the probe stays open
    assert t.leading_run(NS, words[1:]) == (0, True)
    assert run(pool, NS, keys) == N  # the exact probe decides each open key


def test_the_c_probe_refuses_columns_that_do_not_agree() -> None:
    t = new_pool()._lookups.table
    words = np.zeros((4, 4), dtype="<u8")
    good = [t._table, t._keys, t._ns, t._state, t._key_len]
    tail = [3, 5, t._shift, MAX_ROUNDS, 1]
    assert _keyprobe.Probe(*good, *tail).leading_run(words, NS, 0) == (0, False)
    for i, bad in (
        (1, t._keys[:-1]),
        (2, t._ns[:-1]),
        (3, t._state[:-1]),
        (4, t._key_len[1:]),
        (0, t._table[:-1]),
    ):
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError, match=r"do not agree|power of two"):
            _keyprobe.Probe(*args, *tail)
    for j, value in ((2, 64), (3, 0)):
        args2 = list(tail)
        args2[j] = value
        with pytest.raises(ValueError, match=r"shift|max_rounds"):
            _keyprobe.Probe(*good, *args2)
    probe = _keyprobe.Probe(*good, *tail)
    with pytest.raises(ValueError, match="words of"):
        probe.leading_run(words.ravel()[:-1], NS, 0)
    for start in (-1, 5):
        with pytest.raises(ValueError, match="start"):
            probe.leading_run(words, NS, start)
    with pytest.raises(ValueError, match="lengths has"):
        probe.leading_run(words, NS, 0, None, b"\x20" * 3)
    assert probe.add(["not a slot", -1, 2**70, t._n_slots]) == 0  # nothing to enter
    assert (t._table == -1).all()
    with pytest.raises(TypeError, match="int64"):
        probe.add(np.zeros(2, dtype=np.int32))
    probe.close()
    with pytest.raises(ValueError, match="closed"):
        probe.leading_run(words, NS, 0)


def test_keys_left_to_the_exact_probe_cost_one_pass_each(monkeypatch) -> None:
    # crafted keys sharing a bucket leave every probe open: C resumes after each key the
    # exact probe found, never probing the rest again
    rng = random.Random(12)
    pool = new_pool()
    head = rng.randbytes(8)
    crafted = [head + rng.randbytes(24) for _ in range(N)]
    store(pool, crafted)
    keys_probed: list[int] = []
    for name in ("leading_run",):
        real = getattr(keytable.KeyTable, name)

        def counted(self, ns_id, packed, *rest, _real=real):
            keys_probed.append(len(packed) // 32 - (rest[0] if rest else 0))
            return _real(self, ns_id, packed, *rest)

        monkeypatch.setattr(keytable.KeyTable, name, counted)
    assert pool.lookup_packed(NS, b"".join(crafted)) == N
    # each call starts after the key the exact probe found before it
    assert keys_probed[0] == N and len(keys_probed) <= N + 1
    assert all(a > b for a, b in itertools.pairwise(keys_probed))


def test_the_c_probe_returns_the_run_s_slots_and_a_pin_uses_them() -> None:
    rng = random.Random(12)
    pool, keys = stored_pool(rng)
    expected = [pool._pages.ready[NS][k] for k in keys]
    words = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 4)
    t = pool._lookups.table

    def run_from(start: int, slots: list[int]) -> int:
        # a page the table left out (its hashing is drawn per table) ends a call with an
        # open probe: its slot is the exact probe's to add, as the pool's own loop does
        i, open_ = t.leading_run(NS, words, start, slots)
        while open_ and i < N:
            slots.append(pool._pages.ready[NS][keys[i]])
            i, open_ = t.leading_run(NS, words, i + 1, slots)
        return i

    slots = [-5]
    assert run_from(0, slots) == N
    assert slots == [-5, *expected]  # appended
    slots = []
    assert run_from(N - 10, slots) == N  # only from start on
    assert slots == expected[-10:]
    slots = []
    assert t.leading_run(NS, words[: N // 2].tobytes() + b"\1" * 32, 0, slots)[0] <= N // 2
    assert slots == expected[: len(slots)]  # the run's slots only, up to where it stopped
    with pytest.raises(TypeError, match="a list or None"):
        t.leading_run(NS, words, 0, np.empty(N, dtype=np.int64))  # type: ignore[arg-type]
    assert pool.pin(NS, keys + keys_of(rng, 1)) == expected
    pool.unpin(expected)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 256, N])
def test_every_size_and_key_length_is_answered_by_the_table(n: int) -> None:
    # one path for every LOOKUP: with the dict hidden, the table alone finds the pages of
    # lists of any length, keys of 32 bytes and shorter alike (at their own lengths)
    rng = random.Random(20 + n)
    pool = new_pool()
    table = pool._lookups.table
    table._mult[:] = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F)  # fixed hashing: no page left out
    table.rebuild()
    keys = list(dict.fromkeys(rng.randbytes(rng.choice((32, 32, 31, 17, 5, 2))) for _ in range(n)))
    keys += [rng.randbytes(32) for _ in range(n - len(keys))]  # distinct, n of them
    slots = store(pool, keys)
    assert run(pool, NS, keys) == n
    assert table.left_out == 0  # every page has its entry (else its key is the dict's)
    pool._pages.ready = {}  # the exact probe's dict: absent, so only the table answers
    assert pool.lookup(NS, keys) == n
    assert pool._lookups.run_slots(NS, keys) == slots
    assert pool.pin(NS, keys) == slots
    pool.unpin(slots)
    padded = [k.ljust(32, b"\0") for k in keys]  # a shorter key is not its padded bytes
    assert pool.lookup(NS, padded) == next((i for i, k in enumerate(keys) if len(k) < 32), n)
    assert pool.lookup(NS, keys[: n // 2] + [keys[-1] + b"\1" * 32] + keys) == n // 2
    assert pool.lookup(NS, keys[: n // 2] + ["not bytes"] + keys) == n // 2  # type: ignore[list-item]


def test_the_c_probe_runs_no_python_code_that_could_pull_its_memory_away() -> None:
    """An argument whose conversion runs Python code (``__index__``) could close the probe or
    empty the list it is reading: the probe never converts a slot that is not an int, and it
    checks that it is open only after its arguments are parsed."""
    pool = new_pool()
    t = pool._lookups.table
    probe = _keyprobe.Probe(t._table, t._keys, t._ns, t._state, t._key_len, 3, 5, t._shift, 4, 1)
    slots: list[object] = []

    class EmptiesTheList:
        def __index__(self) -> int:
            slots.clear()
            return 0

    slots[:] = [EmptiesTheList(), *(object() for _ in range(10_000))]
    assert probe.add(slots) == 0 and len(slots) == 10_001  # skipped, never converted

    class ClosesTheProbe:
        def __index__(self) -> int:
            probe.close()
            return NS

    with pytest.raises(ValueError, match="closed"):
        probe.leading_run(np.zeros((4, 4), dtype="<u8"), ClosesTheProbe(), 0)


def test_keys_that_are_not_bytes_end_the_run_in_any_sequence() -> None:
    pool, keys = stored_pool(random.Random(7))
    assert pool.lookup(NS, tuple(keys[:3])) == run(pool, NS, keys[:3]) == 3
    assert pool.lookup(NS, ("a" * 32, keys[0])) == 0
    assert pool.lookup(NS, (keys[0], 1, keys[1])) == 1
    assert pool.lookup(NS, (keys[0], bytearray(keys[1]))) == 1  # bytes only, as in a list:
    assert pool.lookup(NS, [keys[0], bytearray(keys[1])]) == 1
    pool.close()
    pool.close()  # a second close does nothing
