"""The daemon's counters: what ``STATS``, ``kvtier stats`` and the metrics endpoint report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class Counters:
    """Monotonic counters since the daemon started (pages and bytes, per direction)."""

    requests: int = 0
    errors: int = 0
    lookups: int = 0
    lookup_keys: int = 0
    lookup_hit_keys: int = 0
    lookup_hits: int = 0  # lookups with at least one key in L2
    lookup_l3_keys: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    loaded_tokens: int = 0  # tokens whose KV an engine got from L2 instead of computing
    stores: int = 0
    store_pages: int = 0  # pages copied engine → host
    store_skipped_pages: int = 0  # already present
    store_failed_pages: int = 0  # cancelled / failed / no room
    loads: int = 0
    load_pages: int = 0  # pages copied host → engine
    load_failed_pages: int = 0
    bytes_to_host: int = 0
    bytes_to_engine: int = 0
    sessions_opened: int = 0
    sessions_closed: int = 0
    sessions_expired: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """Return the counters as a plain dict."""
        return asdict(self)
