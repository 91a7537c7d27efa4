"""The pool files in a shared-memory directory, as ``kvtier pools`` lists them.

A pool file is named ``kvtier-pool-<hash of its runtime directory>``
(:func:`~kvtier.config.loader.pool_path`); its header says whether it is a kvtier pool of
this format and how large its arena is, and the tag a daemon writes at start
(:func:`~kvtier.daemon.pool.poolfile.write_owner_tag`) names the runtime directory it belongs
to. Reading a file's first bytes needs read access to it: a pool file is mode 0600, so
another user (not root) sees only its name, size, owner and age.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from kvtier.config.sizes import format_size
from kvtier.daemon.pool.layout import FORMAT_VERSION, HEADER_REGION, MAGIC
from kvtier.daemon.pool.poolfile import read_owner_tag

__all__ = ["POOL_PREFIX", "PoolFileInfo", "inspect_pool_file", "list_pool_files"]

POOL_PREFIX = "kvtier-pool-"
"""Name prefix of every pool file."""

_HEAD = struct.Struct("<8sIIQ")  # magic, version, header bytes, capacity (the header's start)


@dataclass(frozen=True, slots=True)
class PoolFileInfo:
    """What a pool file says about itself.

    Attributes:
        path: the file.
        size: its size in bytes.
        mtime: its last modification (seconds since the epoch).
        uid: its owner.
        mode: its permission bits.
        kind: ``"file"``, ``"symlink"`` or ``"other"`` (only regular files are pools).
        runtime_dir: the runtime directory recorded in it (None: none recorded, or unread).
        header: ``"kvtier v2, 1.0 GiB"``-style summary, or why there is none
            (``"unreadable: Permission denied"``, ``"no kvtier header"``).
    """

    path: Path
    size: int
    mtime: float
    uid: int
    mode: int
    kind: str
    runtime_dir: Path | None
    header: str


def list_pool_files(pool_dir: str | Path) -> list[PoolFileInfo]:
    """Return every ``kvtier-pool-*`` entry of ``pool_dir``, by name.

    Raises:
        OSError: ``pool_dir`` cannot be listed.
    """
    names = sorted(n for n in os.listdir(pool_dir) if n.startswith(POOL_PREFIX))
    out = []
    for name in names:
        try:
            out.append(inspect_pool_file(Path(pool_dir) / name))
        except FileNotFoundError:
            continue  # removed meanwhile
    return out


def inspect_pool_file(path: str | Path) -> PoolFileInfo:
    """Describe one pool file (its first bytes are read when this user may read them).

    Raises:
        FileNotFoundError: there is no such file.
    """
    path = Path(path)
    st = os.lstat(path)
    kind = (
        "file" if stat.S_ISREG(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "other"
    )
    rdir: Path | None = None
    if kind != "file":
        header = f"not a regular file ({kind})"
    else:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            header = f"unreadable: {err.strerror}"
        else:
            try:
                head = os.pread(fd, HEADER_REGION, 0)
            finally:
                os.close(fd)
            header = _describe_header(head)
            rdir = read_owner_tag(head)
    return PoolFileInfo(
        path, st.st_size, st.st_mtime, st.st_uid, stat.S_IMODE(st.st_mode), kind, rdir, header
    )


def _describe_header(head: bytes) -> str:
    if len(head) < _HEAD.size:
        return "no kvtier header (file too small)"
    magic, version, _, capacity = _HEAD.unpack_from(head)
    if magic != MAGIC:
        return "no kvtier header" if any(head[: _HEAD.size]) else "no kvtier header (empty)"
    if version != FORMAT_VERSION:
        return f"kvtier format v{version} (this build reads v{FORMAT_VERSION})"
    return f"kvtier v{version}, {format_size(capacity)} arena"
