"""The daemon's counters: what ``STATS``, ``kvtier stats`` and the metrics endpoint report.

Every field is a monotonic count since the daemon started, except ``errors_by_code``
(a count per error code name). Field names are part of the ``STATS`` reply and of the
metric names derived from it: add fields, never rename them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class Counters:
    """Monotonic counters since the daemon started (pages and bytes, per direction).

    L2 (host pool) counters come first, then L3 (storage) and tensor-parallel groups:

    - ``lookup_l3_keys`` / ``lookup_l3_tokens``: keys (tokens) LOOKUP found in L3 right
      after the L2 run; ``lookup_l3_hits``: LOOKUPs that found at least one;
      ``l3_lookups``: LOOKUPs that asked L3 at all (the L2 run was not the whole chain).
    - ``l3_prefetch_*_pages``: pages a PREFETCH allocated (``started``), committed to L2
      after a verified read (``completed``), gave up because a CLAIM or the session ended
      first (``cancelled``), or lost to a read that did not verify, the chain after it
      included (``failed``). ``l3_prefetch_unused_pages``: pages read from L3 that no LOAD
      used: evicted or flushed before any load, or read and then discarded at a claim.
    - ``l3_write_*_pages``: pages queued for L3 (``queued``), written (``written``), found
      there already (``skipped``), given up after retries (``failed``), not queued because
      the queue was full or gone from L2 before their turn (``dropped``);
      ``l3_write_retries``: batches tried again after a failure.
    - ``l3_backend_errors``: backend calls that raised or timed out (each read as a miss).
    - ``tp_rounds`` / ``tp_round_timeouts``: rank-group agreements, and those a missing
      rank ended with a 0 answer.
    - ``kv_events_*``: KV event batches published (``batches``; a subscriber whose queue is
      full misses some, and replays them), blocks announced
      stored and removed (one per page and medium), clears, replay requests answered
      (``replays``) and refused as malformed (``replays_refused``).
    """

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
    transfers_split: int = 0  # STOREs and LOADs copied in parts by several copy threads
    transfers_shared: int = 0  # STOREs and LOADs copied half on the event loop, half on a thread
    transfers_inline: int = 0  # STOREs and LOADs copied on the event loop before the reply
    transfers_expired: int = 0  # STOREs and LOADs whose engine stopped waiting: nothing copied
    transfers_cuda: int = 0  # STOREs and LOADs of CUDA sessions (copied on the session's stream)
    cuda_held_pages: int = 0  # host slots of failed CUDA stores kept out of use (see docs/gpu.md)
    requests_sliced: int = 0  # STOREs and LOADs of more than slice_pages pages, done in slices
    bytes_to_host: int = 0
    bytes_to_engine: int = 0
    sessions_opened: int = 0
    sessions_closed: int = 0
    sessions_expired: int = 0
    l3_lookups: int = 0
    lookup_l3_hits: int = 0
    lookup_l3_tokens: int = 0
    prefetches: int = 0
    claims: int = 0
    claim_pages: int = 0  # L2 run answered to claims
    l3_prefetch_started_pages: int = 0
    l3_prefetch_completed_pages: int = 0
    l3_prefetch_cancelled_pages: int = 0
    l3_prefetch_failed_pages: int = 0
    l3_prefetch_unused_pages: int = 0
    bytes_from_l3: int = 0
    l3_write_queued_pages: int = 0
    l3_write_written_pages: int = 0
    l3_write_skipped_pages: int = 0
    l3_write_failed_pages: int = 0
    l3_write_dropped_pages: int = 0
    l3_write_retries: int = 0
    bytes_to_l3: int = 0
    l3_flushed_pages: int = 0
    l3_backend_errors: int = 0
    tp_rounds: int = 0
    tp_round_timeouts: int = 0
    kv_events_batches: int = 0
    kv_events_stored_blocks: int = 0
    kv_events_removed_blocks: int = 0
    kv_events_cleared: int = 0
    kv_events_replays: int = 0
    kv_events_replays_refused: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """Return the counters as a plain dict."""
        return asdict(self)


class HitWindow:
    """Page keys looked up and found in L2 over the last ``seconds``, in 1-second buckets:
    the hit rate the pool gives now (the counters' ratio is since the daemon started).

    Args:
        seconds: the window.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, seconds: int = 60, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [second, keys, hit keys], oldest first

    def add(self, keys: int, hits: int) -> None:
        """Record one LOOKUP of ``keys`` keys with ``hits`` found in L2."""
        sec = int(self._clock())
        b = self._buckets
        if b and b[-1][0] == sec:
            b[-1][1] += keys
            b[-1][2] += hits
        else:
            b.append([sec, keys, hits])
            self._trim(sec)

    def _trim(self, sec: int) -> None:
        b = self._buckets
        while b and b[0][0] <= sec - self.seconds:
            b.popleft()

    def as_dict(self) -> dict[str, object]:
        """``seconds``, ``lookup_keys``, ``lookup_hit_keys`` and ``l2_page_hit_ratio``
        (None before any lookup in the window) over the window ending now."""
        self._trim(int(self._clock()))
        keys = sum(x[1] for x in self._buckets)
        hits = sum(x[2] for x in self._buckets)
        return {
            "seconds": self.seconds,
            "lookup_keys": keys,
            "lookup_hit_keys": hits,
            "l2_page_hit_ratio": hits / keys if keys else None,
        }
