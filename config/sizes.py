"""Byte sizes written the way people write them: ``"4GiB"``, ``"512MiB"``, ``"1.5G"``, ``4096``."""

from __future__ import annotations

import math

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Parse a byte size.

    Args:
        value: an int, or a string such as ``"4GiB"``, ``"256 MiB"``, ``"1.5G"``, ``"4096"``.
            Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (K, M, G, T)
            powers of 1000.

    Returns:
        The size in bytes.

    Raises:
        ValueError: the value is not a size (the message quotes it).
    """
    if isinstance(value, bool):
        # ValueError on purpose: pydantic wraps it in a ValidationError (a TypeError escapes)
        raise ValueError(f"expected a size like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value!r}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if not math.isfinite(size):  # more digits than a float holds
                raise ValueError(f"size {value[:40]!r}... is too large")
            return int(size)
    raise ValueError(f"expected a size like '4GiB', got {value!r}")


def format_size(n: int) -> str:
    """Return ``n`` bytes in the largest binary unit that keeps it readable (``"1.5 GiB"``)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


ByteSize = Annotated[int, BeforeValidator(parse_size), PlainSerializer(int)]
"""A pydantic field type holding bytes, accepting ``"4GiB"``-style strings."""
