"""Namespace fingerprints: what makes KV bytes interchangeable, hashed canonically.

The fingerprint seeds every page-key chain (ARCHITECTURE §4), so engines whose KV differs
in any of these fields can never name each other's pages. The daemon computes it at
registration (tenant included) and returns it to the client.
"""

from __future__ import annotations

import hashlib
import json

from kvtier.ipc.protocol import Geometry, NamespaceSpec

LAYOUT_VERSION = 1


def namespace_fingerprint(
    spec: NamespaceSpec, geometry: Geometry, tp_rank: int, tp_size: int, tenant: str
) -> bytes:
    """Return the 32-byte SHA-256 fingerprint of a namespace.

    Args:
        spec: model id, revision and cache salt.
        geometry: the KV page geometry (dtype, attention kind, layers, heads, dims, page size).
        tp_rank / tp_size: tensor-parallel position; MLA pages are the same on every rank
            and at every tensor-parallel size, so MLA namespaces leave both out.
        tenant: the tenant the session authenticated as.
    """
    doc = {
        "model_id": spec.model_id,
        "revision": spec.revision,
        "cache_salt": spec.cache_salt,
        "tenant": tenant,
        "dtype": geometry.dtype,
        "attention": geometry.attention,
        "num_layers": geometry.num_layers,
        "kv_heads": geometry.kv_heads,
        "head_dim": geometry.head_dim,
        "page_size": geometry.page_size,
        "layout": geometry.layout,
        "layout_version": LAYOUT_VERSION,
        "tp_size": tp_size if geometry.attention == "mha" else None,
        "tp_rank": tp_rank if geometry.attention == "mha" else None,
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).digest()
