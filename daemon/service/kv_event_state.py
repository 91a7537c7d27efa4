"""What KV events need to outlive a kvtierd restart: the engines' block hashes of the pages
it holds, and which runs of pages to announce again.

A router matches kvtierd's events against the hashes the engine computes, which kvtierd
learns only from STOREs (:class:`~kvtier.ipc.protocol.EngineBlocks`). The pages themselves
survive a restart (the pool is adopted); so that their names do too, the publisher saves
the hashes it remembers (each under its namespace's fingerprint and its page key: engines
of several namespaces may name pages by the same keys), each namespace's block size and
model id (its topic), to ``<state_dir>/kv-event-hashes.msgpack`` when the daemon stops
(:func:`save`), and reads them back at start (:func:`load`). A restarted daemon then announces the pages it adopted
(:func:`chain_runs`) under the same names on its new stream. After a crash the file is the
one the previous clean stop wrote: a key's hash never changes (the key is a digest of the
same tokens), so what it has is still true, and pages stored since are named by their keys.
A namespace's model id and block size cannot wait for a clean stop (without them a crash
would move its pages to another topic): each one named since is appended to
``<state_dir>/kv-event-namespaces.log`` at once (:class:`NameLog`), read after the saved
state at start, and removed by the next clean stop, whose file then holds them.

The file is read as untrusted input: bounded in size, decoded against the wire limits of
keys and hashes, and refused whole (logged, naming the file and what is wrong) on any
error; the daemon then starts without it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import msgspec
from kvtier.daemon.state_files import read_state_file
from kvtier.ipc.limits import KEY_BYTES, MAX_TEXT, BlockHash, BlockSize, Text

__all__ = ["FILE_NAME", "NAMES_FILE", "Loaded", "NameLog", "Saved", "chain_runs", "load", "save"]

log = logging.getLogger("kvtier.daemon.events")

FILE_NAME = "kv-event-hashes.msgpack"
"""The file in the state directory."""

NAMES_FILE = "kv-event-namespaces.log"
"""The namespaces named since the last clean stop, beside :data:`FILE_NAME`."""

NAMES_MAX_BYTES = 16 << 20
"""The name log's bound: past it, it is rewritten with the namespaces kept now."""

_VERSION = 3
_BYTES_PER_ENTRY = 160  # a generous bound on one saved (key, hash) pair, for the size check
FP_BYTES = 32
"""A namespace fingerprint's length: a saved key is the fingerprint then the page key."""

MAX_NAMESPACES = 65536
"""The most namespaces whose block size and model id are kept (those whose engine hashes are
kept, and the open sessions'); past it the oldest without a kept hash are forgotten."""
_BYTES_PER_NAMESPACE = 4 * MAX_TEXT + 64  # a model id's bound (4 bytes a character), and more

NamespacedKey = Annotated[bytes, msgspec.Meta(min_length=1, max_length=FP_BYTES + KEY_BYTES)]
NamespaceId = Annotated[bytes, msgspec.Meta(min_length=FP_BYTES, max_length=FP_BYTES)]
"""A namespace fingerprint (SHA-256)."""


class Saved(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The saved state (a MessagePack array).

    Attributes:
        version: the format (3; a version 2 file has no ``left_l2``; a version 1 file
            has keys without fingerprints and no models: its hashes are taken only when it
            names one namespace). An older kvtierd refuses a newer file (logged) and
            starts without the hashes.
        keys / hashes: namespace fingerprint ‖ page key -> the engine's hash, oldest first,
            as long as each other.
        block_sizes: namespace fingerprint -> the tokens per block its sessions named.
        models: namespace fingerprint -> the model id its sessions named (the topic).
        left_l2: the keys among ``keys`` whose pages had left L2 (their hashes kept for
            L3's events): a restart does not announce their removal again.
    """

    version: int
    keys: list[NamespacedKey]
    hashes: list[BlockHash]
    block_sizes: dict[NamespaceId, BlockSize]
    models: dict[NamespaceId, Text] = {}
    left_l2: list[NamespacedKey] = []


class Loaded(msgspec.Struct):
    """What :func:`load` read: ``hashes`` (fingerprint ‖ page key -> engine hash, oldest
    first), ``block_sizes`` and ``models`` per namespace fingerprint, and ``left_l2``: the
    keys of ``hashes`` whose pages had left L2."""

    hashes: dict[bytes, BlockHash]
    block_sizes: dict[bytes, int]
    models: dict[bytes, str]
    left_l2: set[bytes] = set()


def save(
    path: Path,
    hashes: dict[bytes, BlockHash],
    block_sizes: dict[bytes, int],
    models: dict[bytes, str] | None = None,
    left_l2: set[bytes] | None = None,
) -> None:
    """Write the state to ``path`` atomically (a temporary file renamed over it, mode 0600);
    of ``left_l2``, the keys ``hashes`` holds.

    Raises:
        OSError: the directory cannot be written.
    """
    gone = [k for k in left_l2 or () if k in hashes]
    body = msgspec.msgpack.encode(
        Saved(_VERSION, list(hashes), list(hashes.values()), block_sizes, models or {}, gone)
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load(path: Path, max_hashes: int) -> Loaded:
    """Read the state :func:`save` wrote; empty when there is none or it is refused (logged,
    naming the file and the problem). At most ``max_hashes`` hashes, the newest."""
    empty = Loaded({}, {}, {})
    try:
        bound = (
            max(1, max_hashes) * _BYTES_PER_ENTRY
            + min(max(1, max_hashes), MAX_NAMESPACES) * _BYTES_PER_NAMESPACE
            + (1 << 20)
        )
        saved = msgspec.msgpack.decode(read_state_file(path, bound), type=Saved)
        if saved.version not in (1, 2, _VERSION):
            raise ValueError(f"version {saved.version}, not {_VERSION} or older")
        if len(saved.keys) != len(saved.hashes):
            raise ValueError(f"{len(saved.keys)} keys but {len(saved.hashes)} hashes")
    except FileNotFoundError:
        return empty
    except (OSError, ValueError, msgspec.DecodeError) as err:
        log.warning("KV events: ignoring %s: %s", path, err)
        return empty
    start = max(0, len(saved.keys) - max_hashes)
    keys = saved.keys[start:]
    if saved.version == 1:  # page keys alone: whose they are is known with one namespace
        if len(saved.block_sizes) != 1:
            log.warning(
                "KV events: ignoring the hashes of %s: a version 1 file of %d namespaces",
                path,
                len(saved.block_sizes),
            )
            return Loaded({}, dict(saved.block_sizes), {})
        fp = next(iter(saved.block_sizes))
        keys = [fp + k for k in keys]
    hashes = dict(zip(keys, saved.hashes[start:]))
    left = {k for k in saved.left_l2 if k in hashes} if saved.version != 1 else set()
    return Loaded(hashes, dict(saved.block_sizes), dict(saved.models), left)


class Named(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One record of :class:`NameLog`: a namespace's fingerprint, block size and model id."""

    fingerprint: NamespaceId
    block_size: BlockSize
    model: Text


class NameLog:
    """The namespaces named since the last clean stop, in a file of records appended as
    they come: each a 4-byte big-endian length, then a :class:`Named` (MessagePack). A
    crash may leave a torn last record: reading stops there, and cuts the file back to the
    records before it so that the next ones are read after them (a write that a full file
    system takes in part is cut back at once). A record that does not decode is left in
    place, with the ones after it (a newer version's, say). The file is untrusted input as
    the saved state is: bounded, each record decoded against the wire limits, the rest
    refused (logged) from the first bad record on.

    Args:
        path: the file (its directory is made when the first record is written).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._warned = False
        self._full = False  # the namespaces kept fill the file: no more records

    def load(self) -> dict[bytes, tuple[int, str]]:
        """Fingerprint -> (block size, model id), the last record of each winning."""
        out: dict[bytes, tuple[int, str]] = {}
        try:
            data = read_state_file(self.path, NAMES_MAX_BYTES)
        except FileNotFoundError:
            return out
        except (OSError, ValueError) as err:
            log.warning("KV events: ignoring %s: %s", self.path, err)
            return out
        at, decoder = 0, msgspec.msgpack.Decoder(Named)
        while at + 4 <= len(data):
            n = int.from_bytes(data[at : at + 4], "big")
            if at + 4 + n > len(data):
                break  # torn by a crash while it was written
            try:
                rec = decoder.decode(data[at + 4 : at + 4 + n])
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                log.warning("KV events: %s: ignoring it from byte %d on: %s", self.path, at, err)
                return out  # kept as it is: not a torn tail
            out.pop(rec.fingerprint, None)  # re-inserted: the newest
            out[rec.fingerprint] = (rec.block_size, rec.model)
            at += 4 + n
        if at < len(data):
            self._cut(at)  # a torn tail: records appended from here on are read back
        return out

    def _cut(self, size: int) -> None:
        """Truncate the file to its first ``size`` bytes (a torn or refused tail)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
        except OSError as err:
            log.warning("KV events: cannot cut %s back to %d bytes: %s", self.path, size, err)

    def append(
        self,
        fingerprint: bytes,
        block_size: int,
        model: str,
        kept: Callable[[], dict[bytes, tuple[int, str]]],
    ) -> None:
        """Add one namespace's record; past :data:`NAMES_MAX_BYTES`, rewrite the file with
        what ``kept()`` returns (every namespace to keep, this one included) instead. A file that cannot be
        written is logged once; the daemon goes on without it."""
        if self._full:
            return
        body = msgspec.msgpack.encode(Named(fingerprint, block_size, model))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size + 4 + len(body) > NAMES_MAX_BYTES:
                self._rewrite(kept())
                return
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o600)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):  # a FIFO would block the loop
                    raise OSError(errno.EINVAL, "not a regular file")
                record = len(body).to_bytes(4, "big") + body
                written = os.write(fd, record)
                if written < len(record):  # a full file system: no torn record is left
                    end = os.lseek(fd, 0, os.SEEK_CUR)  # for the next ones to follow
                    os.ftruncate(fd, end - written)
                    raise OSError(errno.ENOSPC, "record written in part (cut back)")
            finally:
                os.close(fd)
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning("KV events: cannot record namespaces in %s: %s", self.path, err)

    def _rewrite(self, kept: dict[bytes, tuple[int, str]]) -> None:
        enc, room = msgspec.msgpack.encode, NAMES_MAX_BYTES // 2
        newest: list[bytes] = []  # the newest names first, as many as half the bound holds
        size = 0
        for fp, (bs, m) in reversed(kept.items()):
            r = enc(Named(fp, bs, m))
            if size + 4 + len(r) > room:
                # rewriting it again at every name would cost more than it is worth
                self._full = True
                log.warning(
                    "KV events: %s holds no more namespaces (%d kept); a crash names the "
                    "pages of the oldest left out by their keys, on an empty model id's topic",
                    self.path,
                    len(kept),
                )
                break
            newest.append(len(r).to_bytes(4, "big") + r)
            size += 4 + len(r)
        body = b"".join(reversed(newest))  # oldest first: the newest wins at a read
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def remove(self) -> None:
        """Drop the file (a clean stop saved what it held)."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("KV events: cannot remove %s: %s", self.path, err)


def chain_runs(
    pages: Sequence[tuple[bytes, bytes | None]],
) -> list[tuple[list[bytes], bytes | None]]:
    """The resident pages ``(key, parent key)`` as maximal chains: ``(keys in chain order,
    the parent of the first)``, each page in exactly one.

    A chain runs on while a page has exactly one resident child; a page whose parent is not
    resident, or whose parent has several children, starts one.
    """
    parent_of = dict(pages)
    children: dict[bytes, list[bytes]] = {}
    for key, parent in pages:
        if parent is not None and parent in parent_of:
            children.setdefault(parent, []).append(key)
    runs: list[tuple[list[bytes], bytes | None]] = []
    none: list[bytes] = []
    for key, parent in pages:
        if parent is not None and len(children.get(parent, none)) == 1:
            continue  # inside its parent's chain
        run = [key]
        while len(nxt := children.get(run[-1], none)) == 1 and len(run) <= len(pages):
            run.append(nxt[0])  # (bounded: a damaged table's cycle cannot spin)
        runs.append((run, parent))
    return runs
