"""kvtierd's KV events name the pages SGLang stored as SGLang's own KV events do, so a router
that indexes SGLang's stream matches kvtierd's: the hashes come from SGLang's real radix
cache with events on, in the instance process (``sglang_instance.py``)."""

from __future__ import annotations

import time

import pytest
from kvtier.client.connection.events import EventSubscriber
from kvtier.ipc import kv_events as E
from sglang_harness import extra_config

pytestmark = pytest.mark.timeout(600)


def test_stored_pages_carry_sglangs_event_hashes(daemons, instances, module_tmp) -> None:
    """The L2 BlockStored events for a STORE of 6 pages carry, in order, the hashes SGLang's
    own radix cache publishes for them. Every round of reading first asks the replay socket
    for each batch from the next one expected, so a batch published before the subscription
    reached the publisher is read all the same: the wait ends on the events, bounded only
    by a generous limit."""
    ev, replay = f"ipc://{module_tmp}/ev.sock", f"ipc://{module_tmp}/evr.sock"
    d = daemons("events", "--kv-events-endpoint", ev, "--kv-events-replay-endpoint", replay)
    inst = instances("events", "page_first", extra_config(d.runtime_dir, model_id="events"))
    with EventSubscriber(ev, replay=replay) as sub:
        assert inst.call("store", seq=3, pages=6)["tokens"] > 0
        stored: list = []
        deadline = time.monotonic() + 60
        while len(stored) < 6:
            assert time.monotonic() < deadline, f"6 pages stored in L2, events for {stored}"
            for m in sub.iter(0.5, start_seq=sub.next_seq or 0):
                for e in m.batch.events:
                    if isinstance(e, E.BlockStored) and e.medium == E.MEDIUM_L2:
                        stored.extend(e.block_hashes)
    want = inst.call("event_hashes", seq=3, pages=6)["hashes"]
    assert len(want) == 6 and all(isinstance(h, int) for h in want)
    assert stored == want
