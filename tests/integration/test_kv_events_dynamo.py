"""A router's own index fed kvtierd's stream: Dynamo's KV indexer (``dynamo._core.RadixTree``
from the ``ai-dynamo-runtime`` wheel), the events converted as Dynamo's vLLM listener does
(``tokens_hash`` from the event's token ids, ``block_hash`` the engine's). Its overlap score
for each prompt must equal the pages kvtierd holds of it, evicted tails included.

Dynamo is not one of kvtier's dependencies (a 75 MB wheel with its own runtime): the test
runs when ``DYNAMO_INDEXER_PYTHON`` names a Python that imports ``dynamo._core``
(``python -m venv v && v/bin/pip install --no-deps ai-dynamo-runtime``) and is skipped,
saying so, otherwise."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from kvtier.client.connection.events import EventSubscriber
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import engine
from tests.integration.test_kv_events import event_flags

pytestmark = pytest.mark.timeout(120)

DYNAMO = os.environ.get("DYNAMO_INDEXER_PYTHON")

_APPLY = """
import json, sys
from dynamo._core import RadixTree, compute_block_hash_for_seq
d = json.load(sys.stdin)
t = RadixTree()
for i, e in enumerate(d["events"]):
    if "stored" in e:
        s = e["stored"]
        local = compute_block_hash_for_seq(s["tokens"], s["bs"])
        data = {"stored": {"parent_hash": s["parent"], "blocks": [
            {"block_hash": h, "tokens_hash": x} for h, x in zip(s["hashes"], local)]}}
    else:
        data = {"removed": {"block_hashes": e["removed"]}}
    t.apply_event(1, json.dumps({"event_id": i, "data": data, "dp_rank": 0}).encode())
print(json.dumps([sum(t.find_matches(compute_block_hash_for_seq(p, 16)).scores.values())
                  for p in d["prompts"]]))
"""


@pytest.mark.skipif(
    DYNAMO is None,
    reason="DYNAMO_INDEXER_PYTHON is not set: no Python with "
    "Dynamo's KV indexer (ai-dynamo-runtime) to feed the stream to",
)
def test_dynamos_indexer_scores_the_nodes_overlap(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp), "--hicache-size", "8MiB", "--extent-size", "4MiB")
    pool, conn = engine(d.runtime_dir, num_pages=200)
    try:
        prompts = [[(c * 100003 + i * 7) % 32000 for i in range(200 * 16)] for c in range(4)]
        for c, toks in enumerate(prompts):  # 800 pages through 512: the old ones lose tails
            eng = P.EngineBlocks(
                hashes=[(c << 32) + i for i in range(200)], token_ids=P.pack_tokens(toks)
            )
            assert conn.store(conn.page_keys(toks), list(range(200)), engine=eng).wait()
        resident = [conn.lookup(conn.page_keys(t)).l2 for t in prompts]
        with EventSubscriber(
            f"ipc://{short_tmp}/ev.sock", replay=f"ipc://{short_tmp}/evr.sock"
        ) as sub:
            msgs = sub.replay(0)
        events: list[dict] = []
        for m in msgs:
            for ev in m.batch.events:
                if isinstance(ev, E.BlockStored):
                    events.append(
                        {
                            "stored": {
                                "parent": ev.parent_block_hash,
                                "tokens": ev.token_ids,
                                "hashes": ev.block_hashes,
                                "bs": ev.block_size,
                            }
                        }
                    )
                elif isinstance(ev, E.BlockRemoved):
                    events.append({"removed": ev.block_hashes})
        assert DYNAMO is not None
        out = subprocess.run(
            [DYNAMO, "-c", _APPLY],
            input=json.dumps({"events": events, "prompts": prompts}),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(out.stdout) == resident
        assert resident[0] < 200 and resident[-1] == 200  # evictions happened
    finally:
        conn.close()
        pool.close()
