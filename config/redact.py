"""Secrets out of messages: what an error or a log line may quote of a value from outside.

Used by the configuration loader (a refused key or value, as the journal shows it) and by
the L3 backends (their URLs and extra configs): passwords in URLs and the values of keys
naming a secret are replaced by ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["SECRET_WORDS", "redact_text", "redact_url", "redact_value"]


def redact_url(url: str) -> str:
    """Drop a password from a URL before it reaches a log line or an error: the one after
    ``user:`` and a ``password=`` query parameter (redis-py reads both)."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # no scheme (a refused value): still no password before an '@'
        creds, at, host = url.rpartition("@")
        if at and ":" in creds:
            return f"{creds.split(':', 1)[0]}:***@{host}"
        return url
    rest, qmark, query = rest.partition("?")
    if qmark:
        params = [
            f"{k}=***" if k.lower() == "password" else f"{k}={v}" if eq else k
            for k, eq, v in (part.partition("=") for part in query.split("&"))
        ]
        query = "&".join(params)
    if "@" in rest:
        creds, _, host = rest.rpartition("@")
        user = creds.split(":", 1)[0]
        rest = f"{user}:***@{host}" if ":" in creds else f"{user}@{host}"
    return f"{scheme}://{rest}{qmark}{query}"


SECRET_WORDS = ("password", "passwd", "secret", "token", "credential")
"""A key holding one of these (any case) holds a secret."""

_URL_PASSWORD = re.compile(r"(://[^:/@\s\"']*:)[^@\s\"']*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&\s\"']*", re.IGNORECASE)
_SECRET_ITEM = re.compile(
    r"(\"[^\"]*(?:" + "|".join(SECRET_WORDS) + r")[^\"]*\"\s*[:=]\s*)(\"[^\"]*\"?|[^,}\s]*)",
    re.IGNORECASE,
)


def redact_text(text: str) -> str:
    """Text that did not parse (a broken JSON extra config), as an error may quote it: the
    passwords of URLs in it, and the values of keys naming a secret, as ``***``."""
    text = _URL_PASSWORD.sub(r"\1***@", text)
    text = _QUERY_PASSWORD.sub(r"\1***", text)
    return _SECRET_ITEM.sub(r'\1"***"', text)


def redact_value(value: Any, key: str = "") -> Any:
    """``value`` as an error or a log line may quote it: under a key naming a secret
    (``password``, ``token``, ...) ``***``; a string holding a URL without its password
    (:func:`redact_url`); mappings and lists item by item."""
    if any(word in key.lower() for word in SECRET_WORDS):
        return "***"
    if isinstance(value, str):
        return redact_url(value) if "://" in value or "@" in value else value
    if isinstance(value, Mapping):
        return {k: redact_value(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(v, key) for v in value]
    return value
