"""Adapters that plug kvtier into inference engines: an SGLang HiCache storage backend
(:mod:`kvtier.client.adapters.sglang`) and a vLLM KV connector
(:mod:`kvtier.client.adapters.vllm`), and the link to kvtierd both keep
(:mod:`kvtier.client.adapters.daemon_link`)."""

from __future__ import annotations

import math

__all__ = ["positive_seconds"]


def positive_seconds(raw: object) -> float | None:
    """``raw`` (an extra-config value) as a finite number of seconds > 0; None when it is
    not one (not a number, a bool, 0 or less, infinite, NaN): the caller refuses it by name."""
    if isinstance(raw, bool):
        return None
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return None
    return value if value > 0 and math.isfinite(value) else None
