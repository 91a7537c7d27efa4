"""Checks of a request's fields, shared by the handlers: each refuses with a RequestError.

Only what the decoder cannot know is checked here: every field's own bounds, choices and
key lengths are enforced when the request is decoded (``ipc/limits.py``); these checks
compare fields with the daemon's settings and a session's state. A check changes nothing;
the handler calls it before it touches the pool, a session or the tier, so a refused
request leaves no trace but its error reply (and the error counters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvtier.config import KvtierError
from kvtier.daemon.service.sessions import Session
from kvtier.ipc import protocol as P
from kvtier.ipc._packkeys import check_pages
from kvtier.ipc.limits import PAGE_INDEX_BYTES


class RequestError(KvtierError):
    """A request refused with an error code; nothing was changed.

    Args:
        code: the error code of the reply.
        message: what was wrong, naming the field.
    """

    def __init__(self, code: P.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_keys(
    keys: list[bytes], max_keys: int, pages: list[int] | None = None, num_pages: int = 0
) -> None:
    """Check a request's page keys and, when given, the engine pages they map to.

    Args:
        keys: the page keys (their length was checked at decode).
        max_keys: ``max_keys_per_request``.
        pages: engine page indexes, one per key, all different (STORE, LOAD).
        num_pages: pages of the engine's registered memory.

    Raises:
        RequestError: BAD_MESSAGE (count, duplicate page) or OUT_OF_RANGE.
    """
    if len(keys) > max_keys:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE, f"{len(keys)} keys exceed max_keys_per_request ({max_keys})"
        )
    if pages is None:
        return
    if len(pages) != len(keys):
        raise RequestError(P.ErrorCode.BAD_MESSAGE, f"{len(keys)} keys but {len(pages)} pages")
    if pages and (min(pages) < 0 or max(pages) >= num_pages):
        i, p = next((i, p) for i, p in enumerate(pages) if not 0 <= p < num_pages)
        raise RequestError(
            P.ErrorCode.OUT_OF_RANGE,
            f"pages[{i}] = {p!r} is outside the engine's {num_pages} pages",
        )
    if len(set(pages)) != len(pages):
        raise RequestError(P.ErrorCode.BAD_MESSAGE, "pages contains the same page twice")


def transfer_keys(
    m: P.Load | P.Store, max_keys: int, num_pages: int
) -> tuple[Sequence[bytes], Sequence[int]]:
    """Check a LOAD's or STORE's keys and pages, in either form (lists, or ``packed_keys``
    and ``packed_pages``), and return them: the lists as they came, or the packed keys as a
    :class:`~kvtier.ipc.protocol.PackedKeyList` and the pages as a uint32 numpy array (no
    object per key or page is made for them).

    Raises:
        RequestError: BAD_MESSAGE (both forms, lengths that do not make whole keys with one
            page each, too many keys, a page twice) or OUT_OF_RANGE (a page outside the
            engine's ``num_pages``, named by its index).
    """
    if not (m.packed_keys or m.packed_pages):
        check_keys(m.keys, max_keys, m.pages, num_pages)
        return m.keys, m.pages
    if m.keys or m.pages:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE, "keys or pages given beside packed_keys or packed_pages"
        )
    kb, pb = len(m.packed_keys), len(m.packed_pages)
    if kb % P.KEY_BYTES:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE, f"packed_keys has {kb} bytes, not a multiple of {P.KEY_BYTES}"
        )
    n = kb // P.KEY_BYTES
    if n > max_keys:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE, f"{n} keys exceed max_keys_per_request ({max_keys})"
        )
    if pb != n * PAGE_INDEX_BYTES:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE,
            f"packed_pages has {pb} bytes; {n} keys need {n * PAGE_INDEX_BYTES} "
            f"(one little-endian uint{8 * PAGE_INDEX_BYTES} page each)",
        )
    fault = check_pages(m.packed_pages, num_pages)  # in C, linear in the pages
    if fault is not None:
        reason, i = fault
        page = int.from_bytes(
            m.packed_pages[i * PAGE_INDEX_BYTES : (i + 1) * PAGE_INDEX_BYTES], "little"
        )
        if reason == 1:
            raise RequestError(
                P.ErrorCode.OUT_OF_RANGE,
                f"packed_pages[{i}] = {page} is outside the engine's {num_pages} pages",
            )
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE,
            f"packed_pages contains the same page twice (packed_pages[{i}] = {page})",
        )
    import numpy as np  # here, not at import: the control socket binds before numpy loads

    pages = np.frombuffer(m.packed_pages, dtype=f"<u{PAGE_INDEX_BYTES}")
    return P.PackedKeyList(m.packed_keys), cast("Sequence[int]", pages)  # an array serves as one


def check_lookup_keys(m: P.Lookup, max_keys: int) -> None:
    """Check a LOOKUP's keys, in either form (``keys`` or ``packed_keys``, not both).

    Raises:
        RequestError: BAD_MESSAGE (both forms, a partial packed key, too many keys).
    """
    if m.packed_keys:
        if m.keys:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, "keys and packed_keys are both given")
        if len(m.packed_keys) % P.KEY_BYTES:
            raise RequestError(
                P.ErrorCode.BAD_MESSAGE,
                f"packed_keys has {len(m.packed_keys)} bytes, not a multiple of {P.KEY_BYTES}",
            )
    n = m.key_count()
    if n > max_keys:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE, f"{n} keys exceed max_keys_per_request ({max_keys})"
        )


def check_slot(s: Session, slot: int) -> None:
    """Check that ``slot`` is a completion slot of ``s`` with no transfer running.

    Raises:
        RequestError: OUT_OF_RANGE, or BUSY when a transfer still uses the slot.
    """
    if not 0 <= slot < s.completion.slots:
        raise RequestError(
            P.ErrorCode.OUT_OF_RANGE, f"slot = {slot!r} is outside [0, {s.completion.slots})"
        )
    if slot in s.transfers:
        raise RequestError(P.ErrorCode.BUSY, f"slot = {slot!r} has a transfer running")


def check_engine_blocks(engine: P.EngineBlocks, n_keys: int, page_size: int) -> None:
    """Check a STORE's engine block description against its keys.

    Args:
        engine: the STORE's ``engine`` (each value's bounds were checked at decode).
        n_keys: the STORE's keys.
        page_size: the session's tokens per page (``engine.block_size`` by default).

    Raises:
        RequestError: BAD_MESSAGE naming the field and its value: not one hash per key, or
            ``token_ids`` neither empty nor ``block_size`` per key.
    """
    if len(engine.hashes) != n_keys:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE,
            f"engine.hashes has {len(engine.hashes)} hashes for {n_keys} keys (one per key)",
        )
    bs = engine.block_size or page_size
    if engine.token_ids and len(engine.token_ids) != n_keys * bs * 4:
        raise RequestError(
            P.ErrorCode.BAD_MESSAGE,
            f"engine.token_ids has {len(engine.token_ids)} bytes, not "
            f"{n_keys} keys x block_size {bs} x 4 = {n_keys * bs * 4} (or none)",
        )
