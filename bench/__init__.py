"""kvtier benchmarks (`kvtier bench ...`)."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["report", "write_json"]


def write_json(path: str, result: Any) -> None:
    """Write a benchmark's result to ``path`` as indented JSON, making its folder first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)


def report(result: dict[str, Any], json_arg: str | None, targets: dict[str, Any]) -> None:
    """Print a benchmark's result: as JSON on stdout for ``--json -``; otherwise one line per
    figure (its target beside it, from ``targets``: name -> (operator, value)), after writing
    the JSON to ``json_arg`` when given."""
    if json_arg == "-":
        print(json.dumps(result, indent=2))
        return
    if json_arg:
        write_json(json_arg, result)
    width = max((len(name) for name in result), default=0) + 2
    for name, value in result.items():
        target = targets.get(name)
        note = f"   (target {target[0]} {target[1]})" if target else ""
        print(f"{name:{width}} {value}{note}")
