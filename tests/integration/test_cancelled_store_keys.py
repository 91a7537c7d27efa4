"""STOREs of the same keys by two sessions when the first one's STORE is being thrown away,
against a real kvtierd.

A STORE's reply counts the leading keys "now in L2 or being written by this STORE"
(docs/protocol.md, "STORE and LOAD"), and the reference client treats a STORE that writes nothing as done. Once
a session's STORE has been cancelled (its slot RELEASEd) or its session UNREGISTERed, the
pages it was writing are discarded (docs/protocol.md, "Failure semantics"): nothing is
written there any more. Another session's STORE of the same keys, read after that, must
therefore write them itself, so that they are in L2 once its slot says DONE.

The first session's copy is kept from ending quickly by queueing it behind a large copy of
a third session on the daemon's one copy thread, so its pages are still WRITING (being
discarded) when the second STORE is read.
"""

from __future__ import annotations

import pytest
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import TransferStatus

from tests.integration.test_pipelined_requests import key, settled
from tests.integration.test_request_races import BlockEngine

pytestmark = pytest.mark.timeout(90)

N = 96  # 48 MiB of 512 KiB pages: a copy on the copy thread, never inline or shared
AHEAD = 192  # 96 MiB copied first by a third session, holding the one copy thread


def store(e: BlockEngine, keys: list[bytes], slot: int, seq: int) -> P.Store:
    return P.Store(
        req_id=e.req(),
        session_id=e.sid,
        packed_keys=P.pack_keys(keys),
        packed_pages=P.pack_pages(list(range(len(keys)))),
        slot=slot,
        seq=seq,
    )


@pytest.mark.parametrize("stop", ["unregister", "release"])
def test_a_store_read_after_anothers_was_stopped_writes_the_shared_keys_itself(
    daemon_factory, stop
):
    """Session A STOREs a chain (its copy queued on the copy thread), then its STORE is
    stopped (UNREGISTER of A, or RELEASE of A's slot), acknowledged. Session C's STORE of the
    same chain, read after that acknowledgement, writes every page (``writing == N``) and,
    once C's slot says DONE, a LOOKUP finds the whole chain in L2."""
    d = daemon_factory("--hicache-size", "512MiB", "--copy-threads", "1")
    b = BlockEngine(d, AHEAD, model="shared-keys")
    seen = []
    try:
        for attempt in range(5):
            a = BlockEngine(d, N, model="shared-keys")
            c = BlockEngine(d, N, model="shared-keys")
            try:
                keys = [key(i, salt=700 + attempt) for i in range(N)]
                ahead = [key(i, salt=900 + attempt) for i in range(AHEAD)]
                rb = b.raw.ask(store(b, ahead, slot=attempt, seq=1))
                assert isinstance(rb, P.StoreAccepted) and rb.writing == AHEAD, rb
                ra = a.raw.ask(store(a, keys, slot=1, seq=1))
                assert isinstance(ra, P.StoreAccepted) and ra.writing == N, ra
                if stop == "unregister":
                    ack = a.raw.ask(P.Unregister(req_id=a.req(), session_id=a.sid))
                else:
                    ack = a.raw.ask(P.Release(req_id=a.req(), session_id=a.sid, slots=[1]))
                assert isinstance(ack, P.Ack), ack
                rc = c.raw.ask(store(c, keys, slot=2, seq=7))
                assert isinstance(rc, P.StoreAccepted), rc
                status = c.final_status(2, 7).name if rc.writing else "no transfer"
                settled(d, 30)
                l2 = c.raw.ask(
                    P.Lookup(req_id=c.req(), session_id=c.sid, packed_keys=P.pack_keys(keys))
                ).l2
                # A's copy may have ended before its RELEASE or UNREGISTER came (the copy
                # thread ran ahead of the request): then A stored the chain, its slot says
                # DONE, and the attempt tells nothing
                a_seq, _, a_status = a.block.read(1)
                if (a_seq, a_status) != (1, TransferStatus.DONE):
                    seen.append((rc.count, rc.writing, status, l2))
            finally:
                a.close()
                c.close()
        assert d.proc.poll() is None, d.log_tail()
        assert seen, f"A's copy ended before its {stop} in every attempt"
        wrong = [s for s in seen if s[1] != N or s[3] != N]
        assert not wrong, (
            f"a STORE read after the other session's STORE was stopped ({stop}) did not "
            f"store the shared keys (count, writing, C's status, LOOKUP l2) of {N}: {seen}"
        )
    finally:
        b.close()
