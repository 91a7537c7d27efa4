"""The KV-event state a restart keeps (engine hashes, block sizes, model ids) and the chains a restarted
daemon announces (the daemon round trip is in tests/integration/test_kv_events.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import pytest
from kvtier.daemon.service import kv_event_state as S


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_chains_follow_single_children_and_split_at_branches() -> None:
    # 1-2-3 a chain; 3 has children 4 and 5 (a branch); 6 hangs off a page not resident
    pages = [(k(3), k(2)), (k(1), None), (k(2), k(1)), (k(4), k(3)), (k(5), k(3)), (k(6), k(9))]
    runs = sorted(S.chain_runs(pages))
    assert runs == sorted(
        [([k(1), k(2), k(3)], None), ([k(4)], k(3)), ([k(5)], k(3)), ([k(6)], k(9))]
    )
    assert sorted(p for run, _ in runs for p in run) == sorted(key for key, _ in pages)


def test_a_cycle_in_a_damaged_table_cannot_spin() -> None:
    pages = [(k(1), k(2)), (k(2), k(1)), (k(3), None)]
    assert S.chain_runs(pages) == [([k(3)], None)]  # the cycle has no head: not announced


FP, FP2 = b"f" * 32, b"g" * 32
EMPTY = S.Loaded({}, {}, {})


def test_saved_state_reads_back_newest_first_within_the_bound(tmp_path: Path) -> None:
    path = tmp_path / S.FILE_NAME
    hashes = {(FP if i % 3 else FP2) + k(i): (i if i % 2 else k(i)[:8]) for i in range(10)}
    S.save(path, hashes, {FP: 16, FP2: 32}, {FP: "model/a", FP2: "b"})
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert S.load(path, 100) == S.Loaded(hashes, {FP: 16, FP2: 32}, {FP: "model/a", FP2: "b"})
    newest = S.load(path, 3).hashes
    assert [key[32:] for key in newest] == [k(7), k(8), k(9)]


def test_the_keys_that_left_l2_read_back_within_the_hashes_kept(tmp_path: Path) -> None:
    """``left_l2`` keeps the keys (among those with a hash) whose pages had left L2; a key
    without a hash is not saved, one whose hash falls past the bound is not read, and a file
    written without the field reads as none left."""
    path = tmp_path / S.FILE_NAME
    hashes = {FP + k(i): i for i in range(6)}
    S.save(path, hashes, {FP: 16}, {FP: "m"}, {FP + k(1), FP + k(4), FP + k(99)})
    assert S.load(path, 100).left_l2 == {FP + k(1), FP + k(4)}
    assert S.load(path, 3).left_l2 == {FP + k(4)}  # hashes 3, 4, 5 kept
    path.write_bytes(msgspec.msgpack.encode([2, [FP + k(1)], [11], {FP: 16}, {FP: "m"}]))
    assert S.load(path, 10) == S.Loaded({FP + k(1): 11}, {FP: 16}, {FP: "m"}, set())


def test_a_version_1_file_is_read_for_the_one_namespace_it_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Version 1 saved page keys without their namespace: with one namespace they are its;
    with several, whose each is cannot be told (the block sizes are kept, not the hashes)."""
    path = tmp_path / S.FILE_NAME
    path.write_bytes(msgspec.msgpack.encode([1, [k(1), k(2)], [11, 12], {FP: 16}]))
    assert S.load(path, 10) == S.Loaded({FP + k(1): 11, FP + k(2): 12}, {FP: 16}, {})
    path.write_bytes(msgspec.msgpack.encode([1, [k(1)], [11], {FP: 16, FP2: 16}]))
    with caplog.at_level(logging.WARNING, "kvtier.daemon.events"):
        assert S.load(path, 10) == S.Loaded({}, {FP: 16, FP2: 16}, {})
    assert "version 1 file of 2 namespaces" in caplog.text


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"\x00garbage", "Expected"),
        (msgspec.msgpack.encode([4, [], [], {}]), "version 4"),
        (msgspec.msgpack.encode([2, [k(1)], [], {}]), "1 keys but 0 hashes"),
        (msgspec.msgpack.encode([2, [b"x" * 65], [1], {}]), "length <= 64"),
        (msgspec.msgpack.encode([2, [], [], {b"short": 16}]), "length >= 32"),
        (msgspec.msgpack.encode([2, [k(1)], [b""], {}]), "length >= 1"),
        (msgspec.msgpack.encode([2, [], [], {}, {FP: "a\x00b"}]), "at `$[4]"),
    ],
)
def test_a_damaged_file_is_refused_whole_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: bytes, problem: str
) -> None:
    path = tmp_path / S.FILE_NAME
    path.write_bytes(body)
    with caplog.at_level(logging.WARNING, "kvtier.daemon.events"):
        assert S.load(path, 100) == EMPTY
    assert str(path) in caplog.text and problem in caplog.text


def test_a_file_larger_than_the_bound_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / S.FILE_NAME
    with path.open("wb") as f:
        f.truncate(2 << 20)  # sparse: costs no disk
    with caplog.at_level(logging.WARNING, "kvtier.daemon.events"):
        assert S.load(path, 10) == EMPTY
    assert "2097152 bytes, more than the" in caplog.text


def test_no_file_is_no_state(tmp_path: Path) -> None:
    assert S.load(tmp_path / "absent", 10) == EMPTY


def test_the_name_log_keeps_the_last_record_of_each_namespace(tmp_path: Path) -> None:
    """Each namespace named since the last clean stop is one appended record, the latest
    winning; a record torn by a crash ends the reading, the records before it kept."""
    log = S.NameLog(tmp_path / "st" / S.NAMES_FILE)
    assert log.load() == {}
    a, b = b"a" * 32, b"b" * 32
    log.append(a, 16, "org/m", dict)
    log.append(b, 32, "other", dict)
    log.append(a, 64, "org/m2", dict)
    assert log.load() == {b: (32, "other"), a: (64, "org/m2")}
    assert list(log.load()) == [b, a]  # the newest last
    assert (log.path.stat().st_mode & 0o777) == 0o600
    with open(log.path, "ab") as f:
        f.write((40).to_bytes(4, "big") + b"\x93")  # torn: its length promises more
    assert log.load() == {b: (32, "other"), a: (64, "org/m2")}
    log.remove()
    assert not log.path.exists() and log.load() == {}


def test_records_appended_after_a_torn_one_are_read_back(tmp_path: Path) -> None:
    """A crash tore the log's last record; the next start reads the log (cutting the torn
    tail off), names another namespace, crashes too: the new record is read back, not
    lost behind the torn one."""
    log = S.NameLog(tmp_path / S.NAMES_FILE)
    a, b = b"a" * 32, b"b" * 32
    log.append(a, 16, "m", dict)
    with open(log.path, "ab") as f:
        f.write((40).to_bytes(4, "big") + b"\x93")  # torn: its length promises more
    restarted = S.NameLog(log.path)
    assert restarted.load() == {a: (16, "m")}
    restarted.append(b, 32, "other", dict)
    assert S.NameLog(log.path).load() == {a: (16, "m"), b: (32, "other")}


def test_a_bad_name_record_is_refused_with_all_after_it(tmp_path: Path, caplog) -> None:
    """A record that does not decode against the wire limits (a short fingerprint, a block
    size of 0) is logged, naming the file; it and the records after it are ignored."""
    log = S.NameLog(tmp_path / S.NAMES_FILE)
    log.append(b"a" * 32, 16, "m", dict)
    bad = msgspec.msgpack.encode([b"short", 16, "m"])
    with open(log.path, "ab") as f:
        f.write(len(bad).to_bytes(4, "big") + bad)
    log.append(b"c" * 32, 8, "n", dict)
    with caplog.at_level(logging.WARNING, logger="kvtier.daemon.events"):
        assert log.load() == {b"a" * 32: (16, "m")}
    assert str(log.path) in caplog.text


def test_a_full_name_log_is_rewritten_with_what_is_kept(tmp_path: Path, monkeypatch) -> None:
    """Past its bound the log is rewritten with the namespaces kept now; when those alone
    fill half of it, it takes no more records (logged once) rather than rewrite at each."""
    monkeypatch.setattr(S, "NAMES_MAX_BYTES", 4096)
    log = S.NameLog(tmp_path / S.NAMES_FILE)
    kept = {bytes([i]) * 32: (16, f"m{i}") for i in range(3)}
    for i in range(200):
        log.append(bytes([i % 7]) * 32, 16, "x" * 40, lambda: kept)
        assert log.path.stat().st_size <= 4096
    assert set(log.load()) <= set(kept) | {bytes([i]) * 32 for i in range(7)}
    many = {bytes([i]) * 32: (16, "y" * 100) for i in range(60)}
    with open(log.path, "ab") as f:
        f.write(b"\0" * (4096 - log.path.stat().st_size))
    log.append(b"z" * 32, 16, "z", lambda: many)
    size = log.path.stat().st_size
    log.append(b"w" * 32, 16, "w", lambda: many)
    assert log.path.stat().st_size == size and b"w" * 32 not in log.load()


@pytest.mark.timeout(10)
def test_a_name_log_that_is_a_fifo_is_neither_read_nor_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO planted where the name log goes blocks nothing: it is refused at load and at
    the first record (logged once), and the daemon goes on without it."""
    path = tmp_path / S.NAMES_FILE
    os.mkfifo(path)
    log = S.NameLog(path)
    with caplog.at_level(logging.WARNING, "kvtier.daemon.events"):
        assert log.load() == {}
        log.append(bytes(32), 16, "m", dict)
        log.append(bytes([1]) * 32, 16, "m", dict)
    assert "not a regular file" in caplog.text
