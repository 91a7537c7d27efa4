"""kvtier benchmarks (`kvtier bench ...`)."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["write_json"]


def write_json(path: str, result: Any) -> None:
    """Write a benchmark's result to ``path`` as indented JSON, making its folder first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
