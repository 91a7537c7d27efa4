"""``kvtier pools``: list the host pool files in the shared-memory directory, remove stale ones.

A pool file outlives its daemon on purpose (the next daemon on the same runtime directory
adopts it), so the pools of throwaway runtime directories stay in ``/dev/shm`` until
someone removes them. For each ``kvtier-pool-*`` file this shows its size, age, owner, the
runtime directory its header names and whether a daemon holds it::

    held  yes (pid N)   the runtime directory's lock is held, a process maps the file, or
                        a kvtierd holds the pool file's own lock (``/proc/locks``)
          no            neither: nothing uses it, ``--remove`` / ``--stale`` may remove it
          unknown       this user cannot tell (no runtime directory recorded and the
                        processes' mappings are not all readable, or the runtime
                        directory cannot be entered): never removed

``kvtier pools --remove PATH`` removes one pool no daemon holds; ``--stale`` removes all
of them. A held pool is never removed (the command refuses, exit 1). The removal holds the
runtime directory's lock while it asks again and unlinks, so a daemon starting there at
that moment cannot adopt the file and lose it (its start fails on the lock instead).

Exit codes: 0 success; 1 a pool could not be removed (held, unknown, permission); 2 bad
usage.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvtier.config import ConfigError, DaemonConfig, load_config
from kvtier.config.loader import add_version_flag
from kvtier.config.sizes import format_size
from kvtier.daemon.log_lines import escape_controls
from kvtier.daemon.pool.inventory import (
    POOL_PREFIX,
    PoolFileInfo,
    inspect_pool_file,
    list_pool_files,
)
from kvtier.daemon.service.runtime import last_pool_file, lock_holder, lock_path

__all__ = ["Holder", "build_parser", "holder_of", "main"]


@dataclass(frozen=True, slots=True)
class Holder:
    """Whether a daemon holds a pool file.

    Attributes:
        state: ``"yes"``, ``"no"`` or ``"unknown"``.
        pid: the holder's pid when known (0: unknown).
        why: how that was found out, or why it could not be.
    """

    state: str
    pid: int = 0
    why: str = ""

    def __str__(self) -> str:
        if self.state == "yes":
            return f"yes (pid {self.pid})" if self.pid else "yes"
        return self.state


def holder_of(info: PoolFileInfo) -> Holder:
    """Find out whether a daemon holds the pool file ``info`` describes.

    Held when the lock of the runtime directory its header names is held (unless that
    daemon recorded another pool file as the one it serves from), when a daemon holds the
    file's own lock (a kvtierd locks the pool file it maps), or when a process
    maps the file (``/proc/<pid>/maps``). A symlink or anything else that is not a regular
    file is no pool and held by nobody (a daemon refuses it): what it points at is not asked.
    """
    if info.kind != "file":
        return Holder("no", why=f"not a regular file ({info.kind})")
    if info.runtime_dir is not None:
        try:
            pid = lock_holder(info.runtime_dir)
        except OSError as err:
            return Holder(
                "unknown", why=f"cannot read the lock of {info.runtime_dir}: {err.strerror}"
            )
        # that daemon serves from this file unless it recorded another (pool_dir changed)
        served = last_pool_file(info.runtime_dir) if pid is not None else None
        if pid is not None and (served is None or served == Path(info.path).absolute()):
            return Holder("yes", pid, f"the lock of {info.runtime_dir} is held")
    pids, complete = _mapped_by(info.path, info.uid)
    if pids:
        return Holder("yes", pids[0], "a process maps it")
    pid = _flock_holder(info.path)
    if pid is not None:
        return Holder("yes", pid, "a kvtierd holds the pool file's lock")
    if info.runtime_dir is None and not complete:
        return Holder(
            "unknown",
            why="no runtime directory recorded in it, and the mappings "
            f"of some processes of uid {info.uid} are not readable "
            "by this user",
        )
    return Holder("no")


def _mapped_by(path: Path, owner: int) -> tuple[list[int], bool]:
    """Pids whose mappings name ``path``, and whether every process that may map it (those
    of the file's ``owner``: a pool file is mode 0600) could be read."""
    target = str(path)
    pids, complete = [], True
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    name = line.rstrip("\n").split(maxsplit=5)[5:]
                    if name and name[0].removesuffix(" (deleted)") == target:
                        pids.append(int(entry.name))
                        break
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        except OSError:
            try:
                complete = complete and entry.stat().st_uid != owner
            except OSError:
                continue
    return pids, complete


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``kvtier pools``."""
    p = argparse.ArgumentParser(
        prog="kvtier pools",
        description="List kvtier's host pool files and which daemon "
        "holds each; remove the ones no daemon holds.",
    )
    add_version_flag(p, "kvtier")
    p.add_argument(
        "--pool-dir",
        metavar="DIR",
        type=Path,
        default=None,
        help="where the pool files are (default: pool_dir of the daemon's config: "
        "$KVTIER_POOL_DIR, else the --config file's, else /dev/shm)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=os.environ.get("KVTIER_CONFIG"),
        help="the kvtierd config file whose pool_dir to list (default: $KVTIER_CONFIG, "
        "else none); a systemd service's is /etc/kvtier/kvtierd.toml",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--remove",
        metavar="PATH",
        type=Path,
        help="remove this pool file, unless a daemon holds it",
    )
    what.add_argument("--stale", action="store_true", help="remove every pool file no daemon holds")
    p.add_argument("--json", action="store_true", help="list as JSON")
    return p


def _row(info: PoolFileInfo, holder: Holder, now: float) -> dict[str, object]:
    return {
        "path": str(info.path),
        "size": info.size,
        "age_s": max(0.0, now - info.mtime),
        "uid": info.uid,
        "mode": f"{info.mode:04o}",
        "kind": info.kind,
        "runtime_dir": None if info.runtime_dir is None else str(info.runtime_dir),
        "header": info.header,
        "held": holder.state,
        "holder_pid": holder.pid or None,
        "why": holder.why,
    }


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def _print_table(rows: list[dict[str, object]]) -> None:
    if not rows:
        _say("no kvtier pool files")
        return
    _say(f"{'PATH':<36} {'SIZE':>10} {'AGE':>5} {'UID':>6} {'HELD':<14} RUNTIME DIR")
    for r in rows:
        rdir = r["runtime_dir"] or f"? ({r['header']})"
        held = "yes (pid {})".format(r["holder_pid"]) if r["holder_pid"] else str(r["held"])
        _say(
            f"{r['path']:<36} {format_size(int(r['size'])):>10} "  # type: ignore[call-overload]
            f"{_age(float(r['age_s'])):>5} {r['uid']:>6} {held:<14} {rdir}"  # type: ignore[arg-type]
        )


def _remove(info: PoolFileInfo, holder: Holder) -> str | None:
    """Remove one pool file; return None, or why it was not removed."""
    if holder.state == "yes":
        return (
            f"{info.path} is held by a running kvtierd ({holder}: {holder.why}); stop that "
            "daemon first (with keep_pool_on_stop false it removes its pool itself)"
        )
    if holder.state != "no":
        return f"{info.path}: cannot tell whether a daemon holds it ({holder.why}); not removed"
    if info.kind != "file":  # the link itself goes, never what it points at
        return _unlink(info)
    with contextlib.ExitStack() as held:
        if info.runtime_dir is not None:
            try:
                fd = _lock_runtime_dir(info.runtime_dir, info.uid)
            except BlockingIOError:
                served = last_pool_file(info.runtime_dir)
                if served is None or served == Path(info.path).absolute():
                    return (
                        f"{info.path}: a kvtierd took the lock of {info.runtime_dir} "
                        "meanwhile; not removed"
                    )
                fd = None  # its daemon serves from another file: this one's lock suffices
            except OSError as err:
                return f"{info.path}: cannot lock {info.runtime_dir}: {err.strerror}; not removed"
            if fd is not None:
                held.callback(os.close, fd)
        # no daemon can start on the runtime directory now, nor adopt the file while its
        # lock is held here: ask once more whether any process maps the file
        fd = _lock_pool_file(info.path)
        if fd == -1:
            return f"{info.path}: a kvtierd holds the pool file's lock; not removed"
        if fd is not None:
            held.callback(os.close, fd)
        pids, _ = _mapped_by(info.path, info.uid)
        if pids:
            return f"{info.path} is mapped by pid {pids[0]} (a kvtierd started meanwhile)"
        if fd is not None and not _same_file(fd, info.path):
            return f"{info.path} was replaced meanwhile (a kvtierd made it anew); not removed"
        return _unlink(info)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (the one locked and checked),
    or names nothing any more (gone: nothing to remove)."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _unlink(info: PoolFileInfo) -> str | None:
    """Unlink ``info.path`` (a symlink itself, not its target); None, or why not."""
    try:
        os.unlink(info.path)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot remove {info.path}: {err.strerror} (owner uid {info.uid})"
    return None


def _flock_holder(path: Path) -> int | None:
    """The pid holding a ``flock`` on ``path`` (``/proc/locks``, which takes no lock
    itself), or None when nobody does or it cannot be told."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == want and f[4].isdigit():
            return int(f[4])
    return None


def _lock_pool_file(path: Path) -> int | None:
    """Take the exclusive lock a kvtierd holds on the pool file it maps, without waiting:
    its descriptor (closing it lets go), -1 when a daemon holds it, None when this user
    cannot open the file (or it is gone): the other checks decide then."""
    try:  # a read-only descriptor takes a flock too; O_NONBLOCK: never hang on a FIFO
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    except OSError:
        os.close(fd)
        return None
    return fd


def _lock_runtime_dir(rdir: Path, owner: int) -> int | None:
    """Take the lock a kvtierd on ``rdir`` holds (without waiting); its descriptor (closing
    it lets go), or None when ``rdir`` does not exist (no daemon runs there).

    A missing lock file is created as a daemon would create it, owned by the runtime
    directory's owner (when this user may give it away), so the daemon can open it later;
    only in a directory of the pool file's ``owner`` (a daemon's runtime directory is its
    user's): a tag in a file anyone may plant names any directory, and nothing is created
    in one of another user's (None: no daemon of that pool runs there).

    Raises:
        BlockingIOError: a daemon holds it.
        OSError: it cannot be opened or created.
    """
    path = lock_path(rdir)
    try:
        dir_st = os.stat(rdir)
    except FileNotFoundError:
        return None
    try:  # a read-only descriptor takes a flock too: no write permission needed
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if dir_st.st_uid != owner:
            return None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        st = os.fstat(fd)
        if st.st_uid != dir_st.st_uid and os.geteuid() == 0:
            os.fchown(fd, dir_st.st_uid, dir_st.st_gid)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def main(argv: Sequence[str]) -> int:
    """Run ``kvtier pools`` with ``argv`` (its arguments) and return the exit status."""
    try:
        args = build_parser().parse_args(list(argv))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0
    try:
        cli = {"pool_dir": args.pool_dir} if args.pool_dir is not None else {}
        # the file only when it decides: an unreadable or unrelated one stops nothing else
        decided = args.pool_dir is not None or os.environ.get("KVTIER_POOL_DIR")
        file = None if decided or args.remove is not None else args.config or None
        pool_dir = load_config(DaemonConfig, file=file, cli=cli).pool_dir
    except ConfigError as err:
        _say(f"kvtier pools: {err}", file=sys.stderr)
        return 2
    if args.remove is not None:
        return _remove_one(args.remove, pool_dir)
    try:
        infos = list_pool_files(pool_dir)
    except OSError as err:
        _say(f"kvtier pools: cannot list {pool_dir}: {err.strerror}", file=sys.stderr)
        return 1
    now = time.time()
    pairs = [(info, holder_of(info)) for info in infos]
    if args.stale:
        rc = 0
        for info, holder in pairs:
            if holder.state == "unknown":
                _say(
                    f"kvtier pools: left {info.path}: cannot tell whether a daemon holds it "
                    f"({holder.why})",
                    file=sys.stderr,
                )
            if holder.state != "no":
                continue
            why = _remove(info, holder)
            if why is None:
                _say(f"removed {info.path} ({format_size(info.size)})")
            else:
                _say(f"kvtier pools: {why}", file=sys.stderr)
                rc = 1
        return rc
    rows = [_row(info, holder, now) for info, holder in pairs]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows)
    return 0


def _remove_one(path: Path, pool_dir: Path) -> int:
    if not path.name.startswith(POOL_PREFIX):
        _say(
            f"kvtier pools: {path} is not a kvtier pool file (its name does not start "
            f"with {POOL_PREFIX}); see kvtier pools",
            file=sys.stderr,
        )
        return 2
    try:
        info = inspect_pool_file(path)
    except FileNotFoundError:
        _say(
            f"kvtier pools: no such pool file: {path} (see kvtier pools --pool-dir {pool_dir})",
            file=sys.stderr,
        )
        return 1
    except OSError as err:
        _say(f"kvtier pools: cannot inspect {path}: {err.strerror}", file=sys.stderr)
        return 1
    why = _remove(info, holder_of(info))
    if why is not None:
        _say(f"kvtier pools: {why}", file=sys.stderr)
        return 1
    _say(f"removed {path} ({format_size(info.size)})")
    return 0


def _say(text: str, file: TextIO | None = None) -> None:
    """Print ``text`` with its control characters written as escapes: paths and runtime
    directories come from files anyone may put into the pool directory, and a newline or an
    escape sequence in one must not forge a row or drive the terminal."""
    print(escape_controls(text), file=file or sys.stdout)
