"""Names of pages in a shared key space (Redis keys, Mooncake object keys).

A page ``key`` of namespace fingerprint ``ns`` is named ``<prefix>:<ns hex>:<key hex>``;
the prefix lets several kvtier deployments share one store. Backends with a flat key space
name, list and parse objects through :class:`ObjectNames` so that they all agree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["ObjectNames"]

_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_NS_HEX = re.compile(r"[0-9a-f]{64}")
"""A namespace is its 32-byte fingerprint: a name with another is not one of ours."""
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class ObjectNames:
    """Builds and parses ``<prefix>:<ns hex>:<key hex>`` names.

    Args:
        prefix: the first component (no whitespace; may itself contain ``:``).
    """

    __slots__ = ("prefix",)

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def name(self, ns: bytes, key: bytes) -> str:
        """Return the name of page ``key`` in ``ns``."""
        return f"{self.prefix}:{ns.hex()}:{key.hex()}"

    def names(self, ns: bytes, keys: Sequence[bytes]) -> list[str]:
        """Return the name of each of ``keys`` in ``ns`` (the namespace part built once)."""
        head = f"{self.prefix}:{ns.hex()}:"
        return [head + key.hex() for key in keys]

    def encoded(self, ns: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """:meth:`names`, as ASCII bytes (for stores whose keys are bytes)."""
        head = f"{self.prefix}:{ns.hex()}:".encode()
        return [head + key.hex().encode() for key in keys]

    def pattern(self, ns: bytes | None = None) -> str:
        """Return a glob (Redis ``SCAN MATCH``) for every page, or every page of ``ns``.

        Glob characters in the prefix are escaped, so they match only themselves.
        """
        head = _GLOB_SPECIAL.sub(r"\\\1", self.prefix)
        return f"{head}:*" if ns is None else f"{head}:{ns.hex()}:*"

    def parse(self, name: str | bytes) -> tuple[bytes, bytes] | None:
        """Return ``(ns, key)`` of a page's name; None for a name that is not one of ours
        (another prefix, or not two lowercase hex components after it, the first of a
        namespace's 32 bytes): another application's keys in the same key space are never
        listed, hence never flushed."""
        if isinstance(name, bytes):
            try:
                name = name.decode("ascii")
            except UnicodeDecodeError:
                return None
        if not name.startswith(self.prefix + ":"):
            return None
        ns_hex, sep, key_hex = name[len(self.prefix) + 1 :].partition(":")
        if not sep or not _NS_HEX.fullmatch(ns_hex) or not _HEX.fullmatch(key_hex):
            return None
        return bytes.fromhex(ns_hex), bytes.fromhex(key_hex)
