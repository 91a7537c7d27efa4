"""Expected page keys and namespace fingerprints, derived from the documents, not the code.

Tests that check keys must not compute the expectation with the function under test
(``kvtier.client.page_keys.page_keys``, ``kvtier.ipc.namespace.namespace_fingerprint``): a
bug there would then agree with itself. These follow the written spec instead:

- docs/protocol.md "Keys": ``k0 = SHA-256(ns_fingerprint ‖ tokens[0:P])``,
  ``ki = SHA-256(k(i-1) ‖ tokens[iP:(i+1)P])``, tokens as uint32 little-endian, only full
  pages keyed.
- ipc/namespace.py: the fingerprint is the SHA-256 of the canonical JSON (keys sorted, no
  spaces) of model id, revision, cache salt, tenant, dtype, attention, layers, KV heads,
  head dim, page size, layout, layout version 1, TP size, and TP rank for MHA (null for MLA,
  whose pages are the same on every rank).

tests/unit/test_key_chain.py pins known answers of both, so this module cannot drift either.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvtier.ipc.protocol import Geometry


def spec_page_keys(seed: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The keys of the full pages of ``tokens``, chained from ``seed``, one token at a time."""
    keys: list[bytes] = []
    prev = seed
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = b"".join(struct.pack("<I", int(t)) for t in tokens[start : start + page_size])
        prev = hashlib.sha256(prev + page).digest()
        keys.append(prev)
    return keys


def _json_str(s: str) -> str:
    """A JSON string literal of ``s`` (ASCII names only: what the tests use)."""
    assert s.isascii() and '"' not in s and "\\" not in s, s
    return f'"{s}"'


def spec_fingerprint_json(
    geometry: Geometry,
    *,
    model_id: str,
    revision: str = "",
    cache_salt: str = "",
    tenant: str = "default",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> str:
    """The canonical JSON text the fingerprint hashes, written out field by field in sorted
    key order."""
    rank = str(tp_rank) if geometry.attention == "mha" else "null"
    size = str(tp_size) if geometry.attention == "mha" else "null"
    return (
        "{"
        f'"attention":{_json_str(geometry.attention)},'
        f'"cache_salt":{_json_str(cache_salt)},'
        f'"dtype":{_json_str(geometry.dtype)},'
        f'"head_dim":{geometry.head_dim},'
        f'"kv_heads":{geometry.kv_heads},'
        f'"layout":{_json_str(geometry.layout)},'
        '"layout_version":1,'
        f'"model_id":{_json_str(model_id)},'
        f'"num_layers":{geometry.num_layers},'
        f'"page_size":{geometry.page_size},'
        f'"revision":{_json_str(revision)},'
        f'"tenant":{_json_str(tenant)},'
        f'"tp_rank":{rank},'
        f'"tp_size":{size}'
        "}"
    )


def spec_fingerprint(geometry: Geometry, **names: object) -> bytes:
    """The 32-byte namespace fingerprint (same arguments as :func:`spec_fingerprint_json`)."""
    return hashlib.sha256(spec_fingerprint_json(geometry, **names).encode()).digest()  # type: ignore[arg-type]
