"""Packed keys and pages (``ipc/packed.py``), the requests a connection builds from them
(``client/connection/request_codec.py``) and the daemon's check of a packed LOAD or STORE
(``daemon/service/validation.py: transfer_keys``), without a daemon.

The C packer (``ipc/_packkeys.c``, the one implementation) is held to ``b"".join`` and to
its own refusals (anything but a sequence of 32-byte bytes objects); the codec to one form
for every length of request; :class:`PackedKeyList` to the list it stands for;
``transfer_keys`` to the list form's refusals, each naming the field and the value.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from kvtier.client.connection.request_codec import lookup_request, transfer_request
from kvtier.daemon.pool import keytable
from kvtier.daemon.service.validation import RequestError, transfer_keys
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import KEY_BYTES

RNG = random.Random(5)
KEYS = [RNG.randbytes(KEY_BYTES) for _ in range(300)]


class _Keys(Sequence[bytes]):
    """A sequence that is neither a list nor a tuple (as a caller's own may be)."""

    def __init__(self, keys: list[bytes]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i):
        return self._keys[i]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._keys)


def test_c_packer_equals_join_and_refuses_what_is_not_a_key() -> None:
    from kvtier.ipc._packkeys import pack_keys

    for form in (list, tuple, _Keys, P.PackedKeyList):
        keys = form(b"".join(KEYS)) if form is P.PackedKeyList else form(KEYS)
        assert pack_keys(keys) == P.pack_keys(keys) == b"".join(KEYS), form
        bad = KEYS[:5] + [KEYS[5][:31]]
        if form is not P.PackedKeyList:
            assert pack_keys(form(bad)) is None, form  # a short key, whatever the sequence
    assert pack_keys([]) == pack_keys(()) == b""
    assert pack_keys(KEYS[:1]) == KEYS[0]
    assert pack_keys(KEYS[:5] + [KEYS[5][:31]]) is None  # short
    assert pack_keys(KEYS[:5] + [KEYS[5] + b"\0"]) is None  # long
    assert pack_keys(KEYS[:5] + [bytearray(KEYS[5])]) is None  # not bytes
    assert pack_keys(KEYS[:5] + [None]) is None
    assert pack_keys([KEYS[0][:16], KEYS[0][:48]]) is None  # lengths adding up are no keys
    assert pack_keys((KEYS[0][:16], KEYS[0][:48])) is None  # in a tuple too
    with pytest.raises(TypeError, match="sequence of bytes"):
        pack_keys(5)


@pytest.mark.parametrize("n", [1, 2, 31, 255, 256, 257, 1000])
def test_the_codec_packs_every_length_of_request(n: int) -> None:
    """One key or a thousand: a LOOKUP, LOAD or STORE goes packed to a daemon that takes
    packed requests (no length sends lists), with the keys and pages it was given."""
    keys = [RNG.randbytes(KEY_BYTES) for _ in range(n)]
    pages = list(range(n))
    look = lookup_request(7, keys, True)
    assert bytes(look.packed_keys) == b"".join(keys) and not look.keys
    assert look.key_count() == n
    for kind in (P.Load, P.Store):
        req = transfer_request(kind, 7, keys, pages, 3, 9, True, parent_key=None)
        assert isinstance(req, kind) and not req.keys and not req.pages
        assert bytes(req.packed_keys) == b"".join(keys)
        assert np.frombuffer(req.packed_pages, dtype="<u4").tolist() == pages
        assert (req.session_id, req.slot, req.seq) == (7, 3, 9)
        # as the daemon checks it: the same keys and pages
        m = P.decode_request(P.encode(req))
        assert isinstance(m, kind)
        got_keys, got_pages = transfer_keys(m, 2000, 2000)
        assert list(got_keys) == keys and list(got_pages) == pages


def test_the_codec_sends_lists_only_to_an_older_daemon_or_for_items_it_cannot_pack() -> None:
    """Lists go to a daemon that did not say it takes packed requests, and for a key or a
    page the packed form cannot carry (the daemon then refuses it naming the item)."""
    keys = KEYS[:3]
    assert lookup_request(1, keys, False).keys == keys
    req = transfer_request(P.Load, 1, keys, [0, 1, 2], 0, 1, False)
    assert req.keys == keys and req.pages == [0, 1, 2] and not req.packed_keys
    short = [*keys[:2], keys[2][:31]]
    assert lookup_request(1, short, True).keys == short
    req = transfer_request(P.Store, 1, short, [0, 1, 2], 0, 1, True)
    assert req.keys == short and not req.packed_keys
    req = transfer_request(P.Store, 1, keys, [0, -1, 2], 0, 1, True)
    assert req.pages == [0, -1, 2] and not req.packed_pages
    # counts that differ still go packed: the daemon refuses them (packed_pages' length)
    req = transfer_request(P.Load, 1, keys, [0, 1], 0, 1, True)
    assert bytes(req.packed_keys) == b"".join(keys) and len(req.packed_pages) == 8


def test_pack_pages_is_little_endian_uint32_or_none() -> None:
    pages = [0, 1, 255, 256, 65536, 2**32 - 1]
    packed = P.pack_pages(pages)
    assert packed is not None
    assert np.frombuffer(packed, dtype="<u4").tolist() == pages
    assert P.pack_pages(range(3)) == np.arange(3, dtype="<u4").tobytes()
    assert P.pack_pages(np.arange(4)) == np.arange(4, dtype="<u4").tobytes()
    assert P.pack_pages([1, -1]) is None
    assert P.pack_pages([2**32]) is None
    assert P.pack_pages([1.5]) is None
    assert P.pack_pages([]) == b""


def test_packed_key_list_is_the_list_it_stands_for() -> None:
    keys = P.PackedKeyList(memoryview(b"".join(KEYS)))
    assert len(keys) == len(KEYS)
    assert list(keys) == KEYS
    assert keys[0] == KEYS[0] and keys[-1] == KEYS[-1] and keys[123] == KEYS[123]
    assert list(keys[10:20]) == KEYS[10:20] and list(keys[:0]) == []
    assert list(keys[-5:]) == KEYS[-5:] and list(keys[290:400]) == KEYS[290:]
    assert list(keys[::7]) == KEYS[::7] and list(keys[20:10]) == []
    assert KEYS[7] in keys and keys.index(KEYS[9]) == 9
    for bad in (300, -301):
        with pytest.raises(IndexError):
            keys[bad]
    with pytest.raises(ValueError, match="not whole 32-byte keys"):
        P.PackedKeyList(b"\0" * 33)
    # the key table probes it as it came, without packing it again
    packed, lengths = keytable.table_keys(keys)
    assert packed is keys.packed and lengths is None
    assert keytable.table_keys(keys[:1])[0] == KEYS[0]
    assert keytable.table_keys(KEYS) == (b"".join(KEYS), None)
    short = KEYS[:-1] + [KEYS[-1][:31]]  # a shorter key: each padded, with the lengths
    assert keytable.table_keys(short) == (
        b"".join(KEYS[:-1]) + KEYS[-1][:31] + b"\0",
        bytes([32] * (len(KEYS) - 1) + [31]),
    )


def load(**fields: object) -> P.Load:
    """A LOAD as the daemon decodes it (packed fields are views of the message)."""
    m = P.decode_request(P.encode(P.Load(req_id=1, session_id=1, slot=0, seq=1, **fields)))
    assert isinstance(m, P.Load)
    return m


def refused(
    m: P.Load, code: P.ErrorCode, match: str, max_keys: int = 1000, num_pages: int = 512
) -> None:
    with pytest.raises(RequestError, match=match) as err:
        transfer_keys(m, max_keys, num_pages)
    assert err.value.code == code


def test_transfer_keys_takes_either_form() -> None:
    keys, pages = transfer_keys(load(keys=KEYS[:3], pages=[4, 5, 6]), 1000, 512)
    assert keys == KEYS[:3] and pages == [4, 5, 6]
    m = load(packed_keys=b"".join(KEYS), packed_pages=P.pack_pages(range(511, 211, -1)))
    keys, pages = transfer_keys(m, 1000, 512)
    assert isinstance(keys, P.PackedKeyList) and list(keys) == KEYS
    assert isinstance(pages, np.ndarray) and pages.tolist() == list(range(511, 211, -1))
    keys, pages = transfer_keys(load(packed_keys=b"", packed_pages=b""), 1000, 512)
    assert len(keys) == 0 and len(pages) == 0


def test_transfer_keys_refusals_name_the_field_and_value() -> None:
    packed = b"".join(KEYS)
    pages = P.pack_pages(range(300))
    assert pages is not None
    refused(
        load(packed_keys=packed[:-1], packed_pages=pages),
        P.ErrorCode.BAD_MESSAGE,
        f"packed_keys has {len(packed) - 1} bytes, not a multiple of 32",
    )
    refused(
        load(packed_keys=packed, packed_pages=pages[:-4]),
        P.ErrorCode.BAD_MESSAGE,
        "packed_pages has 1196 bytes; 300 keys need 1200",
    )
    refused(
        load(packed_keys=b"", packed_pages=pages[:4]),
        P.ErrorCode.BAD_MESSAGE,
        "packed_pages has 4 bytes; 0 keys need 0",
    )
    refused(
        load(packed_keys=packed, packed_pages=pages),
        P.ErrorCode.BAD_MESSAGE,
        "300 keys exceed max_keys_per_request \\(299\\)",
        max_keys=299,
    )
    refused(
        load(packed_keys=packed, packed_pages=pages),
        P.ErrorCode.OUT_OF_RANGE,
        "packed_pages\\[299\\] = 299 is outside the engine's 299 pages",
        num_pages=299,
    )
    refused(
        load(packed_keys=packed[:64], packed_pages=P.pack_pages([2**32 - 1, 0])),
        P.ErrorCode.OUT_OF_RANGE,
        "packed_pages\\[0\\] = 4294967295 is outside",
    )
    refused(
        load(packed_keys=packed, packed_pages=P.pack_pages([*range(299), 17])),
        P.ErrorCode.BAD_MESSAGE,
        "packed_pages contains the same page twice \\(packed_pages\\[299\\] = 17\\)",
    )
    refused(
        load(keys=KEYS[:1], packed_keys=packed[32:64], packed_pages=pages[:4]),
        P.ErrorCode.BAD_MESSAGE,
        "beside packed_keys",
    )
    refused(load(pages=[1], packed_pages=pages[:4]), P.ErrorCode.BAD_MESSAGE, "beside packed")
    # the list form keeps its own refusals
    refused(load(keys=KEYS[:2], pages=[1]), P.ErrorCode.BAD_MESSAGE, "2 keys but 1 pages")
    refused(load(keys=KEYS[:2], pages=[1, 1]), P.ErrorCode.BAD_MESSAGE, "same page twice")


def pages_bytes(pages: list[int]) -> bytes:
    out = P.pack_pages(pages)
    assert out is not None
    return out


def test_check_pages_names_the_first_page_out_of_range_else_the_first_repeat():
    from kvtier.ipc._packkeys import check_pages

    assert check_pages(pages_bytes([]), 0) is None
    assert check_pages(pages_bytes([0]), 1) is None
    assert check_pages(pages_bytes(list(range(5000))[::-1]), 5000) is None
    assert check_pages(pages_bytes([3, 1, 4, 5]), 5) == (1, 3)  # 5 of 5 pages: out
    assert check_pages(pages_bytes([3, 1, 3, 9]), 5) == (1, 3)  # range first, whole pass
    assert check_pages(pages_bytes([3, 1, 4, 1, 4]), 5) == (2, 3)  # the second 1
    assert check_pages(pages_bytes([7, *range(100, 9000), 7]), 9000) == (2, 8901)
    top = 2**32 - 1  # the largest page index the wire carries, and its neighbours
    assert check_pages(pages_bytes([top, top - 1, 0]), 2**32) is None
    assert check_pages(pages_bytes([top, 0, top]), 2**32) == (2, 2)
    assert check_pages(pages_bytes([top]), top) == (1, 0)
    assert check_pages(memoryview(pages_bytes([2, 2])), 3) == (2, 1)  # any buffer
    with pytest.raises(ValueError, match="packed pages of 6 bytes"):
        check_pages(b"\0" * 6, 10)


def test_check_pages_agrees_with_a_set_on_random_pages():
    from kvtier.ipc._packkeys import check_pages

    rng = random.Random(7)
    for _ in range(300):
        n, limit = rng.randrange(0, 80), rng.randrange(1, 120)
        pages = [rng.randrange(0, limit + 3) for _ in range(n)]
        seen: set[int] = set()
        want = None
        bad = next((i for i, pg in enumerate(pages) if pg >= limit), None)
        if bad is not None:
            want = (1, bad)
        else:
            for i, pg in enumerate(pages):
                if pg in seen:
                    want = (2, i)
                    break
                seen.add(pg)
        assert check_pages(pages_bytes(pages), limit) == want, (pages, limit)
