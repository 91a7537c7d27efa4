"""Requests that race with each other or with their session's end, against a real kvtierd.

Sent over a bare DEALER (the raw protocol), so that a request can be pipelined with the one
that ends it (an UNREGISTER, a RELEASE of its slot) as no well-behaved client would, and the
engine's completion block is mapped by the test itself to read what the daemon wrote there.

- A STORE's slot says DONE only once its pages are visible in L2 (docs/protocol.md,
  "Completion block"; docs/architecture.md, "DONE means visible"). A STORE whose copy ended
  after its session began closing has its pages discarded, so its slot must not say DONE.
- Every page a STORE names is counted once: copied, skipped or failed (docs/metrics.md,
  ``kvtier_store_pages_total``), a long STORE cancelled between two of its slices included.
"""

from __future__ import annotations

import os
import secrets
import time

import pytest
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import CompletionBlock, TransferStatus
from kvtier.ipc.fdpass import hand_over, handover_path
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES

from tests.engines import SMALL
from tests.integration.test_pipelined_requests import (
    BIG,
    Dealer,
    RawEngine,
    key,
    register_msg,
    settled,
    stats,
)

pytestmark = pytest.mark.timeout(120)

TRIES = 5
WAIT_S = 10.0


class BlockEngine:
    """A SharedKVPool registered over a bare DEALER, its completion block mapped here."""

    def __init__(self, d, num_pages: int, model: str, geometry=BIG) -> None:
        self.pool = SharedKVPool(geometry, num_pages)
        token = secrets.token_bytes(HANDOVER_TOKEN_BYTES)
        self.fd = hand_over(handover_path(d.runtime_dir), token, self.pool.memory_fds(), 5.0)
        self.raw = Dealer(d.endpoint)
        reg = self.raw.ask(register_msg(self.pool, token, model=model))
        assert isinstance(reg, P.Registered), reg
        self.sid = reg.session_id
        self.block = CompletionBlock.from_fd(self.fd, reg.completion_slots)
        self._req = 100

    def req(self) -> int:
        self._req += 1
        return self._req

    def final_status(self, slot: int, seq: int) -> TransferStatus:
        """The slot's status once the transfer ``seq`` has ended (bounded wait)."""
        end = time.monotonic() + WAIT_S
        while True:
            got_seq, _, status = self.block.read(slot)
            if got_seq == seq and status != TransferStatus.RUNNING:
                return TransferStatus(status)
            assert time.monotonic() < end, f"slot {slot} still {self.block.read(slot)}"
            time.sleep(0.005)

    def close(self) -> None:
        self.block.close()
        os.close(self.fd)
        self.raw.close()
        self.pool.close()


def counters(d) -> dict:
    return stats(d)["counters"]


def test_a_store_discarded_at_its_sessions_end_is_never_reported_done(daemon_factory):
    """A STORE copying on a copy thread when its session is UNREGISTERed: the copy may run to
    its end, but the closing session's pages are discarded, never committed. Its slot must
    then say CANCELLED or FAILED; DONE would tell the engine (one whose lease ran out while
    it waited, say) that pages are in L2 which no LOOKUP will ever find."""
    d = daemon_factory("--hicache-size", "256MiB", "--copy-threads", "1")
    n = 96  # 48 MiB: one whole copy on the one copy thread, running when UNREGISTER comes
    watcher = RawEngine(d, num_pages=8, geometry=BIG, model="discarded")  # same namespace
    seen = []
    try:
        for attempt in range(TRIES):
            e = BlockEngine(d, n, model="discarded")
            try:
                keys = [key(i, salt=300 + attempt) for i in range(n)]
                rep = e.raw.ask(
                    P.Store(
                        req_id=e.req(),
                        session_id=e.sid,
                        packed_keys=P.pack_keys(keys),
                        packed_pages=P.pack_pages(list(range(n))),
                        slot=3,
                        seq=77,
                    )
                )
                assert isinstance(rep, P.StoreAccepted) and rep.writing == n, rep
                ack = e.raw.ask(P.Unregister(req_id=e.req(), session_id=e.sid))
                assert isinstance(ack, P.Ack), ack
                status = e.final_status(3, 77)
                l2 = watcher.raw.ask(
                    P.Lookup(
                        req_id=watcher.req(),
                        session_id=watcher.sid,
                        packed_keys=P.pack_keys(keys),
                    )
                ).l2
                seen.append((status.name, l2))
            finally:
                e.close()
        settled(d)
        assert d.proc.poll() is None, d.log_tail()
        wrong = [(st, l2) for st, l2 in seen if st == "DONE" and l2 != n]
        assert not wrong, (
            f"slot said DONE for a STORE whose pages are not in L2 (status, l2 of {n}): {seen}"
        )
    finally:
        watcher.close()


def test_a_long_store_cancelled_between_slices_counts_its_pages_failed(daemon_factory):
    """A long STORE (in slices) and a RELEASE of its slot in one burst: the STORE stops at
    the next slice, aborts what it allocated and is answered count 0. Its pages were named
    by a STORE, so each is counted once: copied, skipped or failed (here failed)."""
    d = daemon_factory("--slice-pages", "2")
    n = 40
    e = RawEngine(d, num_pages=n, geometry=SMALL, model="cancelled")
    try:
        before = counters(d)
        named = 0
        cancelled = False
        for attempt in range(TRIES):
            keys = [key(i, salt=500 + attempt) for i in range(n)]
            store = P.Store(
                req_id=e.req(),
                session_id=e.sid,
                packed_keys=P.pack_keys(keys),
                packed_pages=P.pack_pages(list(range(n))),
                slot=attempt,
                seq=1,
            )
            e.raw.send(store)
            e.raw.send(P.Release(req_id=e.req(), session_id=e.sid, slots=[attempt]))
            replies = {r.req_id: r for r in (e.raw.recv(), e.raw.recv())}
            rep = replies[store.req_id]
            assert isinstance(rep, P.StoreAccepted), rep
            named += n
            settled(d)
            if rep.count == 0 and rep.writing == 0:
                cancelled = True
                break
        assert cancelled, "the RELEASE never caught the long STORE between two slices"
        after = counters(d)
        counted = sum(
            after[k] - before[k]
            for k in ("store_pages", "store_skipped_pages", "store_failed_pages")
        )
        assert counted == named, (
            f"STOREs named {named} pages but the counters account for {counted}: "
            f"{ {k: after[k] - before[k] for k in after if k.startswith('store')} }"
        )
    finally:
        e.close()
