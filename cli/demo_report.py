"""What ``kvtier demo`` prints and draws: one table, a row per turn printed as the turn ends,
a labelled summary, and a PNG of time to first token and tokens per tier.

Plain fixed-width text (no terminal tricks), so the output reads the same in a terminal, a
log file or ``make demo | tee``; every line fits in 80 columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np

__all__ = [
    "COLUMNS",
    "header",
    "print_lines",
    "restart_banner",
    "row_line",
    "summary_lines",
    "write_plot",
]

# (title, width, row key): the per-turn table; the titles are the column legend in the README.
COLUMNS: tuple[tuple[str, int, str], ...] = (
    ("conv", 4, "conversation"),
    ("turn", 4, "turn"),
    ("engine", 6, "engine"),
    ("kvtierd", 7, "daemon"),
    ("prompt", 6, "prompt_tokens"),
    ("L1", 5, "cached_l1"),
    ("L2", 5, "cached_l2"),
    ("L3", 4, "cached_l3"),
    ("computed", 8, "computed"),
    ("TTFT ms", 8, "ttft_ms"),
    ("uncached", 8, "uncached_ttft_ms"),
    ("same", 4, "matches_uncached"),
)


def header() -> list[str]:
    """The table's title lines: column names and a rule."""
    names = " ".join(f"{title:>{width}}" for title, width, _ in COLUMNS)
    return [names, "-" * len(names)]


def row_line(row: Mapping[str, Any]) -> str:
    """One turn as a table line.

    Args:
        row: a turn of :func:`kvtier.cli.demo.run_demo` (``engine`` and ``daemon`` count the
            restarts: 0 before, 1 after).
    """
    cells = []
    for _, width, key in COLUMNS:
        value = row[key]
        if isinstance(value, bool):
            text = "yes" if value else "NO"
        elif isinstance(value, float):
            text = f"{value:.1f}"
        else:
            text = str(value)
        cells.append(f"{text:>{width}}")
    return " ".join(cells)


def restart_banner(restart: str) -> str:
    """The line printed into the table where the restart happens."""
    if restart == "daemon":
        what = "engine and kvtierd SIGKILLed; kvtierd restarted on its pool, then a new engine"
    else:
        what = "engine SIGKILLed; a new engine (empty L1) on the same kvtierd"
    return f"-- {what}"


def summary_lines(result: Mapping[str, Any], outputs: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The labelled summary printed after the table.

    Args:
        result: from :func:`kvtier.cli.demo.run_demo`.
        outputs: ``(label, path)`` of the files written (plot, JSON).

    Returns:
        Lines of at most 80 characters, each starting with its label.
    """
    turns = result["turns"]
    same = sum(1 for t in turns if t["matches_uncached"])
    ratio = result["restart_reuse_ratio"]
    lines = []
    if isinstance(ratio, float):
        lines.append(
            f"{'restart reuse':<15} {ratio:.3f}: {result['restart_reused_tokens']:,} of "
            f"{result['restart_stored_tokens']:,} tokens L2 held before the restart"
        )
        lines.append(f"{'':<15} were loaded from L2 by the first turn after it")
    else:
        lines.append(f"{'restart reuse':<15} n/a (no restart, or L2 held nothing before it)")
    lines.append(f"{'same output':<15} {same} of {len(turns)} turns equal the uncached run")
    lines.append(f"{'run time':<15} {result['elapsed_s']:.1f} s")
    lines.extend(f"{label:<15} {path}" for label, path in outputs)
    return lines


def print_lines(lines: Sequence[str], out: TextIO) -> None:
    """Write ``lines`` to ``out`` and flush (progress shows while the demo runs)."""
    out.writelines(line + "\n" for line in lines)
    out.flush()


def write_plot(result: Mapping[str, Any], path: str) -> None:
    """Write a PNG of TTFT and tokens per tier, turn by turn.

    The x axis has one tick per turn of each conversation, labelled with the turn number
    (whole numbers only); the red line marks the restart.

    Args:
        result: from :func:`kvtier.cli.demo.run_demo`.
        path: the PNG's path.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'kvtier[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[Mapping[str, Any]] = result["turns"]
    x = np.arange(len(rows))

    def get(key: str) -> np.ndarray:
        return np.array([float(r[key]) for r in rows])

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax1.plot(x, get("ttft_ms"), "o-", label="kvtier on")
    ax1.plot(x, get("uncached_ttft_ms"), "s--", label="kvtier off")
    ax1.set_ylabel("TTFT (ms)")
    ax1.legend()
    bottom = np.zeros(len(x))
    for key, label in (
        ("cached_l1", "L1"),
        ("cached_l2", "L2"),
        ("cached_l3", "L3"),
        ("computed", "computed"),
    ):
        ax2.bar(x, get(key), bottom=bottom, label=label)
        bottom += get(key)
    ax2.set_ylabel("prompt tokens")
    ax2.set_xticks(x, [str(r["turn"]) for r in rows])
    ax2.set_xlabel("turn (each turn: conversations 0, 1, ... side by side)")
    ax2.legend()
    for i, r in enumerate(rows):
        if r["first_after_restart"]:
            for ax in (ax1, ax2):
                ax.axvline(i - 0.5, color="red", linestyle=":")
    fig.suptitle(f"kvtier demo: {result['restart']} restart at the red line")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
