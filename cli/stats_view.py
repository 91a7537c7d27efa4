"""What ``kvtier stats`` and ``kvtier sessions`` print: rich tables built from one STATS
snapshot (``Daemon.snapshot()``, or a tenant's scoped snapshot, which carries ``scope``
and shows that tenant's sessions and pages only). Pure functions of the snapshot: no I/O
here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.config import format_size
from kvtier.daemon.log_lines import escape_controls

__all__ = ["render_namespaces", "render_sessions", "render_stats"]


def _num(section: Mapping[str, Any], key: str) -> float | None:
    """A numeric field of a snapshot section, None when absent."""
    value = section.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _ratio(part: float | None, whole: float | None) -> str:
    """``part of whole (pct)``, or an em dash when either is unknown."""
    if part is None or whole is None:
        return "—"
    pct = f"{100.0 * part / whole:.1f}%" if whole > 0 else "—"
    return f"{int(part):,} of {int(whole):,} ({pct})"


def _duration(seconds: float) -> str:
    """``3d 04h``, ``2h 05m``, ``4m 09s`` or ``12.3s``."""
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{seconds:.1f}s"


_DIRECTIONS = (
    ("to_host", "engine → L2", "bytes_to_host", None),
    ("to_engine", "L2 → engine", "bytes_to_engine", None),
    ("to_l3", "L2 → L3", "bytes_to_l3", "put_bytes"),
    ("from_l3", "L3 → L2", "bytes_from_l3", "get_bytes"),
)


def _bytes_moved(snap: Mapping[str, Any]) -> dict[str, float]:
    """Bytes per direction (the same sources as ``kvtier_transfer_bytes_total``)."""
    counters = snap.get("counters") or {}
    l3 = snap.get("l3") or {}
    out: dict[str, float] = {}
    for direction, _, key, l3_key in _DIRECTIONS:
        value = _num(counters, key)
        if value is None and l3_key is not None:
            value = _num(l3, l3_key)
        if value is not None:
            out[direction] = value
    return out


def _adoption(adopt: Mapping[str, Any]) -> str:
    """What the daemon made of the pool file it found at start (``AdoptResult``), one line."""
    if not adopt:
        return "—"
    if not adopt.get("adopted"):
        return f"none, started empty ({adopt.get('reason', '—')})"
    pages, dropped = int(adopt.get("pages_adopted", 0)), int(adopt.get("pages_dropped", 0))
    size = format_size(int(adopt.get("bytes_adopted", 0)))
    ms = 1e3 * float(adopt.get("seconds", 0.0))
    return (
        f"{pages:,} pages ({size}) in {ms:.0f} ms, {dropped:,} dropped, "
        f"generation {adopt.get('generation', '—')}"
    )


def render_stats(
    snap: Mapping[str, Any], endpoint: str = "", previous: Mapping[str, Any] | None = None
) -> Any:
    """Build the ``kvtier stats`` view of one snapshot as a rich renderable.

    Args:
        snap: the STATS snapshot (``Daemon.snapshot()``); missing sections show as "—".
        endpoint: shown in the title.
        previous: an earlier snapshot of the same daemon epoch; when given, bytes moved
            also show a per-second rate over the daemon's own clock.

    Returns:
        A :class:`rich.console.Group` of tables.
    """
    from rich.console import Group
    from rich.table import Table

    pool: Mapping[str, Any] = snap.get("pool") or {}
    c: Mapping[str, Any] = snap.get("counters") or {}
    sessions = snap.get("sessions") or []
    l3: Mapping[str, Any] = snap.get("l3") or {}

    head = Table(title="kvtierd", show_header=False, box=None, title_justify="left", padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    if endpoint:
        head.add_row("endpoint", _plain(endpoint))
    uptime = _num(snap, "uptime_s")
    head.add_row("epoch", str(snap.get("epoch", "—")))
    head.add_row("uptime", _duration(uptime) if uptime is not None else "—")
    head.add_row("sessions", f"{len(sessions)}")
    scope = snap.get("scope")
    if isinstance(scope, Mapping):  # a tenant's view: its own numbers, nothing daemon-wide
        head.add_row("scope", _plain("tenant " + ", ".join(map(str, scope.get("tenants") or ()))))
        return Group(head, _tenant_table(snap.get("tenants") or {}))
    head.add_row("requests", f"{int(_num(c, 'requests') or 0):,}")
    errors = c.get("errors_by_code") or {}
    head.add_row("errors", ", ".join(f"{k} {v:,}" for k, v in sorted(errors.items())) or "0")

    pt = Table(title="L2 host pool", show_header=False, title_justify="left")
    pt.add_column(style="bold")
    pt.add_column(justify="right")
    used, cap = _num(pool, "used_bytes"), _num(pool, "capacity_bytes")
    if used is not None and cap is not None:
        pct = f" ({100.0 * used / cap:.1f}%)" if cap > 0 else ""
        pt.add_row("used", f"{format_size(int(used))} of {format_size(int(cap))}{pct}")
    for label, key in (
        ("pages ready", "pages_ready"),
        ("pages writing", "pages_writing"),
        ("pages pinned", "pages_pinned"),
        ("evictions", "evictions"),
    ):
        value = _num(pool, key)
        pt.add_row(label, f"{int(value):,}" if value is not None else "—")
    free, total = _num(pool, "extents_free"), _num(pool, "extents_total")
    if free is not None and total is not None:
        pt.add_row("extents free", f"{int(free)} of {int(total)}")
    pt.add_row("adopted at start", _adoption(snap.get("adopt") or {}))

    ht = Table(title="Hit rates", title_justify="left")
    ht.add_column("tier", style="bold")
    ht.add_column("lookups hit", justify="right")
    ht.add_column("pages hit", justify="right")
    ht.add_column("tokens hit", justify="right")
    lookups, pages, toks = _num(c, "lookups"), _num(c, "lookup_keys"), _num(c, "lookup_tokens")
    ht.add_row(
        "L2",
        _ratio(_num(c, "lookup_hits"), lookups),
        _ratio(_num(c, "lookup_hit_keys"), pages),
        _ratio(_num(c, "lookup_hit_tokens"), toks),
    )
    ht.add_row(
        "L3",
        _ratio(_num(c, "lookup_l3_hits"), lookups),
        _ratio(_num(c, "lookup_l3_keys"), pages),
        _ratio(_num(c, "lookup_l3_tokens"), toks),
    )
    saved = _num(c, "loaded_tokens")
    ht.add_row("saved", "", "", f"{int(saved):,} tokens loaded" if saved is not None else "—")

    bt = Table(title="Bytes moved", title_justify="left")
    bt.add_column("direction", style="bold")
    bt.add_column("total", justify="right")
    moved = _bytes_moved(snap)
    rates: dict[str, float] = {}
    if previous is not None and previous.get("epoch") == snap.get("epoch"):
        dt = (_num(snap, "uptime_s") or 0.0) - (_num(previous, "uptime_s") or 0.0)
        before = _bytes_moved(previous)
        if dt > 0:
            rates = {d: (v - before[d]) / dt for d, v in moved.items() if d in before}
    if rates:
        bt.add_column("per second", justify="right")
    for direction, label, _, _ in _DIRECTIONS:
        if direction not in moved:
            continue
        row = [label, format_size(int(moved[direction]))]
        if rates:
            row.append(format_size(int(max(0.0, rates.get(direction, 0.0)))) + "/s")
        bt.add_row(*row)
    bt.add_row(
        "pages stored",
        f"{int(_num(c, 'store_pages') or 0):,}"
        f" (+{int(_num(c, 'store_failed_pages') or 0):,} failed)",
        *([""] if rates else []),
    )
    bt.add_row(
        "pages loaded",
        f"{int(_num(c, 'load_pages') or 0):,} (+{int(_num(c, 'load_failed_pages') or 0):,} failed)",
        *([""] if rates else []),
    )

    lt = Table(title="L3 storage", show_header=False, title_justify="left")
    lt.add_column(style="bold")
    lt.add_column(justify="right")
    if not l3 or l3.get("backend") == "none":
        lt.add_row("backend", "none")
    else:
        healthy = l3.get("healthy")
        lt.add_row("backend", _plain(l3.get("backend", "—")))
        lt.add_row(
            "health", "—" if healthy is None else ("[green]ok[/]" if healthy else "[red]failing[/]")
        )
        for label, key in (
            ("write policy", "write_policy"),
            ("prefetch policy", "prefetch_policy"),
        ):
            if key in l3:
                lt.add_row(label, str(l3[key]))
        for label, key in (
            ("write queue", "write_queue"),
            ("prefetching", "prefetching"),
            ("errors", "errors"),
            ("corrupt objects", "corrupt"),
            ("misses", "misses"),
        ):
            value = _num(l3, key)
            if value is not None:
                lt.add_row(label, f"{int(value):,}")
        unused = _num(c, "l3_prefetch_unused_pages")
        if unused is not None:
            lt.add_row("prefetched, unused", f"{int(unused):,} pages")
    ut = _users_table(snap.get("limits") or {})
    return Group(head, pt, ht, bt, lt, *([ut] if ut is not None else []))


def _users_table(limits: Mapping[str, Any]) -> Any:
    """What each user id holds against its bounds, and the refusals (None: no section)."""
    from rich.table import Table

    if not isinstance(limits, Mapping) or not limits:
        return None
    bounds: Mapping[str, Any] = limits.get("bounds") or {}
    t = Table(title="Users (per-user bounds)", title_justify="left")
    columns = ("uid", "sessions", "mapped", "mappings", "connections", "handover conns")
    for name in (*columns, "handovers waiting"):
        t.add_column(
            name,
            style="bold" if name == "uid" else None,
            justify="left" if name == "uid" else "right",
        )

    def of(use: Mapping[str, Any], key: str, bound: str, size: bool = False) -> str:
        value, top = int(use.get(key, 0)), bounds.get(bound)
        shown = format_size(value) if size else f"{value:,}"
        return (
            f"{shown} / {format_size(int(top)) if size else f'{int(top):,}'}"
            if top is not None
            else shown
        )

    for uid, use in sorted((limits.get("users") or {}).items()):
        if isinstance(use, Mapping):
            t.add_row(
                str(uid),
                of(use, "sessions", "max_sessions_per_user"),
                of(use, "mapped_bytes", "max_mapped_bytes_per_user", size=True),
                of(use, "mapped_segments", "max_mapped_segments_per_user"),
                of(use, "connections", "connections_per_user"),
                of(use, "handover_connections", "max_handover_connections_per_user"),
                of(use, "handovers_waiting", "max_handovers_waiting_per_user"),
            )
    refused = limits.get("refusals") or {}
    if refused:
        t.caption = "refused: " + ", ".join(f"{k} {int(v):,}" for k, v in sorted(refused.items()))
    return t


def _tenant_table(tenants: Mapping[str, Any]) -> Any:
    """The pages each tenant of a scoped snapshot holds in L2, against its quota."""
    from rich.table import Table

    t = Table(title="Tenants", title_justify="left")
    t.add_column("tenant", style="bold")
    t.add_column("L2 pages", justify="right")
    t.add_column("quota", justify="right")
    for name, row in sorted(tenants.items()):
        row = row if isinstance(row, Mapping) else {}
        pages, quota = _num(row, "pages"), _num(row, "quota_pages")
        t.add_row(
            _plain(name),
            f"{int(pages):,}" if pages is not None else "—",
            f"{int(quota):,}" if quota is not None else "none",
        )
    return t


def render_sessions(sessions: Sequence[Mapping[str, Any]]) -> Any:
    """Build the ``kvtier sessions`` table (a rich renderable) from the snapshot's sessions."""
    t = _listing(
        f"{len(sessions)} session{'s' if len(sessions) != 1 else ''}",
        "id> tenant< model< namespace< pid> rank> state< page> pages> transfers>",
    )
    for s in sessions:
        page = s.get("page_bytes")
        t.add_row(
            _plain(s.get("session_id", "")),
            _plain(s.get("tenant", "")),
            _plain(s.get("model_id", "")),
            _plain(str(s.get("namespace", ""))[:12] + "…") if s.get("namespace") else "—",
            _plain(s.get("pid", "")),
            _plain(f"{s.get('tp_rank', 0)}/{s.get('tp_size', 1)}"),
            _plain(s.get("state", "")),
            format_size(int(page)) if isinstance(page, int) else "—",
            _plain(s.get("num_pages", "")),
            _plain(s.get("transfers", "")),
        )
    return t


def render_namespaces(rows: Sequence[Mapping[str, Any]], total: int | None = None) -> Any:
    """Build the ``kvtier namespaces`` table (a rich renderable) from the snapshot's
    namespaces (the namespace whole: what ``kvtier flush --namespace`` takes); ``total``:
    how many there are when the daemon listed only some."""
    n = len(rows) if total is None else total
    shown = "" if n == len(rows) else f"{len(rows)} of "
    t = _listing(
        f"{shown}{n} namespace{'s' if n != 1 else ''}",
        "namespace< pages> sessions> tenant< model<",
        overflow="fold",  # the namespace whole: what flush --namespace takes
    )
    for r in rows:
        models = r.get("models")
        t.add_row(
            _plain(r.get("namespace", "")),
            _plain(r.get("pages", "")),
            _plain(r.get("sessions", "")),
            _plain(r.get("tenant", "")) if r.get("tenant") else "—",
            _plain(", ".join(map(str, models))) if isinstance(models, list) and models else "—",
        )
    return t


def _listing(title: str, columns: str, **column: Any) -> Any:
    """A rich table titled ``title`` with ``columns``: names, each followed by ``<`` (left
    justified) or ``>`` (right), separated by spaces; ``column``: more ``add_column``
    options for every column."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for spec in columns.split():
        t.add_column(spec[:-1], justify="left" if spec[-1] == "<" else "right", **column)
    return t


def _plain(value: object) -> Any:
    """``value`` as text shown as it is: never read as rich markup (a tenant named
    ``ops[/]``), its control characters written as escapes (never sent to the terminal)."""
    from rich.text import Text

    return Text(escape_controls(str(value)))
