"""The saved map of namespaces to tenants: read back as written, bounded, and a damaged
file refused whole (the daemon then starts without it)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest
from kvtier.daemon.tier import tenant_namespaces as tn
from kvtier.daemon.tier.tenant_namespaces import TenantNamespaces


def fp(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_the_map_is_read_back_as_saved(tmp_path: Path) -> None:
    path = tmp_path / "state" / tn.FILE_NAME
    m = TenantNamespaces(path)
    m.note(fp(1), "a")  # no running loop: written at once
    m.note(fp(2), "b")
    m.note(fp(1), "c")  # a fingerprint registered again under another tenant moves
    assert path.stat().st_mode & 0o777 == 0o600
    again = TenantNamespaces(path)
    assert (again.of("a"), again.of("b"), again.of("c")) == ([], [fp(2)], [fp(1)])
    assert again.of(None) == [fp(2), fp(1)]


def test_the_map_keeps_the_latest_namespaces(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tn, "MAX_ENTRIES", 3)
    m = TenantNamespaces(tmp_path / tn.FILE_NAME)
    for i in range(5):
        m.note(fp(i), "a")
    assert TenantNamespaces(tmp_path / tn.FILE_NAME).of("a") == [fp(2), fp(3), fp(4)]


def test_the_tenant_holding_the_most_gives_up_its_longest_unseen(
    tmp_path: Path, monkeypatch
) -> None:
    """Past the bound, the tenant holding the most gives up its longest unseen namespace
    (a churning tenant pushes out its own first); a namespace seen again is the newest."""
    monkeypatch.setattr(tn, "MAX_ENTRIES", 4)
    m = TenantNamespaces(None)
    m.note(fp(0), "a")
    m.note(fp(1), "b")
    m.note(fp(2), "a")
    m.note(fp(0), "a")  # seen again: a's newest
    for i in range(10, 14):
        m.note(fp(i), "b")
    assert m.of("a") == [fp(2), fp(0)]
    assert m.of("b") == [fp(12), fp(13)]
    m.note(fp(20), "a")  # a and b hold two each: a tie gives up the first found's oldest
    assert len(m.of(None)) == 4


def test_a_new_namespace_is_saved_before_the_next_l3_write(tmp_path: Path) -> None:
    """On a running loop a new pair is saved a second later, or at once by ``on_disk``
    (what the L3 writer asks before each batch); a namespace the file does not name is
    not on disk, nor is one while the save fails."""
    state = tmp_path / "state"
    path = state / tn.FILE_NAME

    async def main() -> None:
        m = TenantNamespaces(path)
        m.note(fp(1), "a")  # the save is due a second later
        assert not path.exists()
        assert m.on_disk(fp(1))
        assert TenantNamespaces(path).of("a") == [fp(1)]
        assert m.on_disk(fp(1))  # nothing new: nothing written
        path.unlink()
        assert m.on_disk(fp(1)) and not path.exists()
        state.rename(tmp_path / "away")
        state.write_bytes(b"")  # state_dir is not a directory now: every save fails
        m.note(fp(2), "b")
        assert not m.on_disk(fp(2)) and m.on_disk(fp(1))
        assert m.error is not None and str(path) in m.error
        saved: list[int] = []
        m.on_saved = lambda: saved.append(1)
        state.unlink()
        assert not m.on_disk(fp(2))  # while failing, the retry timer saves, not each write
        m.save()  # what the timer does
        assert m.on_disk(fp(2)) and m.error is None and saved == [1]
        assert TenantNamespaces(path).of("b") == [fp(2)]
        m.learn({fp(2): "c", fp(3): "c"})  # an adopted pool's owners: only what is unknown
        assert (m.tenant_of(fp(2)), m.tenant_of(fp(3))) == ("b", "c")

    asyncio.run(main())


@pytest.mark.parametrize(
    "body",
    [
        b"\x00not msgpack",
        msgspec.msgpack.encode([1, [b"short"], ["a"]]),
        msgspec.msgpack.encode([1, [fp(1)], ["a", "b"]]),
        msgspec.msgpack.encode([2, [fp(1)], ["a"]]),
        msgspec.msgpack.encode([1, [fp(1)], ["x" * 300]]),
    ],
)
def test_a_damaged_file_is_refused_whole(tmp_path: Path, caplog, body: bytes) -> None:
    path = tmp_path / tn.FILE_NAME
    path.write_bytes(body)
    with caplog.at_level(logging.WARNING, logger="kvtier.daemon"):
        assert TenantNamespaces(path).of(None) == []
    assert str(path) in caplog.text
