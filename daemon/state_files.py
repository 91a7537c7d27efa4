"""Reading kvtierd's own state files (in ``state_dir``) as the untrusted input they are.

A state file is read only when it is a regular file of the daemon's own user and within the
size its contents can take: a FIFO (an open would block the start for good), a symlink (to
``/dev/zero``: a read without end), another user's file or an oversized one is refused with
an error naming what it is, and the caller starts without it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["read_state_file"]


def read_state_file(path: Path, limit: int) -> bytes:
    """The bytes of the state file ``path``: a regular file of this process's user, of at
    most ``limit`` bytes.

    Raises:
        FileNotFoundError: there is none.
        ValueError: it is not a regular file, belongs to another user or holds more than
            ``limit`` bytes (the message says which).
        OSError: it cannot be opened or read (a symlink: ``ELOOP``).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"owned by uid {st.st_uid}, not by this daemon's ({os.geteuid()})")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than the {limit} its contents can take")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:  # grown since: refused as an oversized one is
            raise ValueError(f"more than the {limit} bytes its contents can take")
        return b"".join(chunks)
    finally:
        os.close(fd)
