"""The pool file is the daemon's alone: checked before it is mapped, created exclusively.

Real files in a temp dir (and, as root, a size-limited tmpfs); a file "of another user"
is made by ``os.chown`` to uid 4343, which needs root (those tests skip otherwise).
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.config import DaemonConfig, load_config
from kvtier.config.errors import ConfigError
from kvtier.daemon.pool.host_pool import HostPool
from kvtier.daemon.pool.inventory import inspect_pool_file, list_pool_files
from kvtier.daemon.pool.layout import PoolLayout, map_pool_file
from kvtier.daemon.pool.poolfile import PoolFileError, PoolSpaceError, read_owner_tag

from tests.unit.test_pool_persistence import EXTENT, KIB, chain, new_pool, store

OTHER_UID = 4343
needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="making a file of another uid (os.chown) and mounting a tmpfs need root",
)


def layout() -> PoolLayout:
    return PoolLayout.plan(3 * EXTENT, EXTENT, 4 * KIB)


def adoptable_pool(path: Path, rdir: Path | None = None) -> int:
    """Make a pool file at ``path`` holding two READY pages; return its inode."""
    lay = layout()
    tag = {} if rdir is None else {"runtime_dir": rdir}
    seg, why = map_pool_file(path, lay, prefault=False, **tag)
    pool = new_pool(lay, meta=seg.view[: lay.meta_bytes], cold_start=why)
    arena = seg.view[lay.arena_offset :]
    store(pool, arena, chain("a", 2))
    pool.close()
    arena.release()
    seg.close()
    return os.stat(path).st_ino


def adopted_pages(path: Path) -> tuple[int, str | None]:
    """Map ``path`` as a restarted daemon would; return (pages adopted, why new)."""
    lay = layout()
    seg, why = map_pool_file(path, lay, prefault=False)
    pool = new_pool(lay, meta=seg.view[: lay.meta_bytes], cold_start=why)
    try:
        assert pool.adopted is not None
        return pool.adopted.pages_adopted, why
    finally:
        pool.close()
        seg.close()


def test_a_new_pool_file_is_0600_with_one_link_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        adoptable_pool(tmp_path / "kvtier-pool-x")
    finally:
        os.umask(old)
    st = os.stat(tmp_path / "kvtier-pool-x")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_nlink) == (0o600, os.geteuid(), 1)
    assert adopted_pages(tmp_path / "kvtier-pool-x") == (2, None)  # and it is adopted


@pytest.mark.parametrize("mode", [0o666, 0o640, 0o604])
def test_our_pool_file_with_group_or_other_bits_is_discarded_not_adopted(
    tmp_path: Path, mode: int
) -> None:
    """Whoever could write it may have rewritten its pages: never adopt it."""
    path = tmp_path / "kvtier-pool-x"
    adoptable_pool(path)
    os.chmod(path, mode)
    pages, why = adopted_pages(path)
    assert pages == 0
    assert why == f"pool file {path} has mode {mode:04o}, not 0600: discarded"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # recreated (inodes may be reused)


def test_a_second_link_to_our_pool_file_makes_it_discarded(tmp_path: Path) -> None:
    path = tmp_path / "kvtier-pool-x"
    ino = adoptable_pool(path)
    os.link(path, tmp_path / "elsewhere")
    pages, why = adopted_pages(path)
    assert pages == 0 and why == f"pool file {path} has 2 links, not 1: discarded"
    assert os.stat(path).st_ino != ino and os.stat(path).st_nlink == 1
    assert os.stat(tmp_path / "elsewhere").st_ino == ino  # the other name is left alone


@needs_root
def test_a_pool_file_of_another_uid_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "kvtier-pool-x"
    ino = adoptable_pool(path)
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, 0o666)
    with pytest.raises(PoolFileError) as err:
        adopted_pages(path)
    text = str(err.value)
    assert str(path) in text and f"owner uid {OTHER_UID}" in text and "mode 0666" in text
    assert f"kvtier pools --remove {path}" in text
    st = os.stat(path)
    assert (st.st_ino, st.st_uid) == (ino, OTHER_UID)  # not unlinked, not rewritten


@needs_root
def test_a_symlink_of_another_uid_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    path = tmp_path / "kvtier-pool-x"
    path.symlink_to(target)
    os.lchown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(PoolFileError, match="is a symlink"):
        map_pool_file(path, layout(), prefault=False)
    assert path.is_symlink() and target.read_bytes() == b"precious"


def test_our_symlink_is_removed_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x" * layout().file_bytes)  # even of the right size: never mapped
    path = tmp_path / "kvtier-pool-x"
    path.symlink_to(target)
    pages, why = adopted_pages(path)
    assert pages == 0 and why == f"pool file {path} is a symlink: discarded"
    assert not path.is_symlink() and path.is_file()
    assert target.read_bytes() == b"x" * layout().file_bytes


def test_a_fifo_in_place_of_the_pool_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "kvtier-pool-x"
    os.mkfifo(path, 0o600)
    with pytest.raises(PoolFileError, match="is not a regular file"):
        map_pool_file(path, layout(), prefault=False)


def test_the_runtime_dir_tag_is_listed_and_adoption_still_works(tmp_path: Path) -> None:
    path = tmp_path / "kvtier-pool-x"
    rdir = tmp_path / "some runtime dir"
    adoptable_pool(path, rdir)
    assert adopted_pages(path) == (2, None)  # the tag is outside the header's checksum
    info = inspect_pool_file(path)
    assert info.runtime_dir == rdir and info.header.startswith("kvtier v2,"), info
    assert [i.path for i in list_pool_files(tmp_path)] == [path]
    with open(path, "rb") as fh:
        assert read_owner_tag(fh.read(4096)) == rdir


def test_ten_terabytes_names_hicache_size_and_the_largest_allowed() -> None:
    cfg = load_config(DaemonConfig, cli={"hicache_size": "10TB"}, env={})
    with pytest.raises(ConfigError) as err:
        HostPool.from_config(cfg)
    text = str(err.value)
    assert "hicache_size" in text and "10000000000000 bytes" in text
    largest = PoolLayout.max_capacity(cfg.extent_size)
    assert f"{largest} bytes" in text and "min_page_bytes" not in text
    PoolLayout.plan(largest, cfg.extent_size)  # the largest named is accepted
    with pytest.raises(Exception, match="slot ids"):
        PoolLayout.plan(largest + cfg.extent_size, cfg.extent_size)


@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on a temp dir (skips when it cannot be mounted)."""
    mnt = Path(tempfile.mkdtemp(prefix="kvt-tmpfs-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
        mnt.rmdir()


@needs_root
def test_a_pool_larger_than_the_free_space_names_hicache_size_and_pool_dir() -> None:
    lay = PoolLayout.plan(64 << 20, 4 << 20)
    with small_tmpfs("16m") as mnt:
        path = mnt / "kvtier-pool-x"
        with pytest.raises(PoolSpaceError) as err:
            map_pool_file(path, lay, prefault=True)
        text = str(err.value)
        assert "hicache_size = 64.0 MiB" in text and f"pool_dir {mnt}" in text
        assert "16.0 MiB" in text and "free" in text, text
        assert not path.exists()  # nothing left behind
