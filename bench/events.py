"""``kvtier bench events``: what publishing KV events costs and whether the stream is whole.

Two kvtierd processes with the same settings, one publishing KV events (with a replay
socket), one not; one engine process per daemon stores chains of pages with engine block
hashes, rounds alternating between the two daemons, through a pool small enough that later
rounds evict. Two subscribers follow the publishing daemon: a collector (its queue holds the
run; it reads after it and fills gaps by replay) and a late one, which connects halfway and
wants the node's whole history: its first batch shows the gap, and it replays it. Fields:

- ``decoded_by_vllm``: every batch collected decodes with vLLM's own
  ``vllm.distributed.kv_events.KVEventBatch`` (null, with ``decoded_by_vllm_note``, when
  vLLM is not installed: ``make engines`` installs it);
- ``stored_events_over_pages_stored``: blocks announced stored in L2 over the pages the
  daemon stored (its ``store_pages`` counter); ``removed_events_over_evictions``: blocks
  announced removed from L2 over the pool's evictions (both 1.0 when nothing is missed and
  nothing invented);
- ``store_throughput_events_on_over_off``: STORE throughput (pages/s) of the publishing
  daemon over the other's: the median over rounds of the ratio within a round (a round: a
  few STOREs to each daemon, in alternating order, so drift on a shared machine hits both);
  ``daemon_cpu_per_page_events_on_over_off``: the daemons' CPU seconds over the measured
  rounds (both stored the same pages), publishing over not, less sensitive to other load
  (but counted in 10 ms clock ticks: coarse over a short run); ``load_average_1m`` says how
  busy the machine was;
- ``replay_recovered``: the late subscriber saw a gap and, by replay, got every batch the
  daemon published.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, cast

from kvtier.bench import report
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.events import EventSubscriber
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["TARGETS", "main", "run_events_bench"]

TARGETS = {
    "decoded_by_vllm": ("==", True),
    "stored_events_over_pages_stored": ("==", 1.0),
    "removed_events_over_evictions": ("==", 1.0),
    "store_throughput_events_on_over_off": (">=", 0.95),
    "replay_recovered": ("==", True),
}
"""The issue's targets, printed beside the results."""

GEOMETRY = P.Geometry(num_layers=4, page_size=16, kv_heads=2, head_dim=32, dtype="float32")
"""32 KiB pages (float32)."""


def _flags(root: Path, pool_mib: int, events: bool, hwm: int) -> list[str]:
    out = [
        "--hicache-storage-backend",
        "none",
        "--state-dir",
        str(root / "state"),
        "--hicache-size",
        f"{pool_mib}MiB",
        "--extent-size",
        "4MiB",
        "--log-level",
        "warning",
    ]
    if events:
        out += [
            "--kv-events-endpoint",
            f"ipc://{root}/ev.sock",
            "--kv-events-replay-endpoint",
            f"ipc://{root}/evr.sock",
            "--kv-events-hwm",
            str(hwm),
        ]
    return out


def _round(conn: Connection, chains: int, pages: int, salt: int) -> float:
    """Store ``chains`` chains of ``pages`` pages; pages stored per second."""
    n = 0
    t0 = time.perf_counter()
    for c in range(chains):
        base = (salt * chains + c) * pages
        toks = list(range(base * 16, (base + pages) * 16))
        keys = conn.page_keys(toks)
        # what the vLLM connector sends: a hash per page and the pages' tokens
        eng = P.EngineBlocks(hashes=[base + i for i in range(pages)], token_ids=P.pack_tokens(toks))
        h = conn.store(keys, list(range(pages)), engine=eng)
        if not h.wait():
            raise RuntimeError("a STORE failed")
        n += h.count
    return n / (time.perf_counter() - t0)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _vllm_decodes(payloads: list[bytes]) -> tuple[bool | None, str]:
    try:
        with warnings.catch_warnings():  # vLLM's import chain warns (torch.jit deprecations)
            warnings.simplefilter("ignore")
            import msgspec
            from vllm.distributed.kv_events import KVEventBatch
    except ImportError as err:
        return None, f"vLLM is not installed here ({err}); run under .venv-engines"
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    for p in payloads:
        dec.decode(p)  # raises on the first one vLLM cannot read
    return True, f"{len(payloads)} batches decoded by vllm.distributed.kv_events"


def run_events_bench(
    rounds: int = 40, chains: int = 2, pages: int = 64, pool_mib: int = 16, hwm: int = 10_000
) -> dict[str, Any]:
    """Run the bench (see the module docstring) and return its fields."""
    with tempfile.TemporaryDirectory(prefix="kve-", dir="/tmp") as tmp:
        roots = {on: Path(tmp) / ("on" if on else "off") for on in (True, False)}
        daemons = {
            on: DaemonProcess(roots[on], _flags(roots[on], pool_mib, on, hwm))
            for on in (True, False)
        }
        kvs: list[SharedKVPool] = []
        conns: dict[bool, Connection] = {}
        try:
            for on, d in daemons.items():
                d.start(timeout=120)
                kv = SharedKVPool(GEOMETRY, pages)
                kvs.append(kv)
                conns[on] = Connection(
                    kv,
                    model_id="bench-events",
                    config=ClientConfig(
                        runtime_dir=roots[on], request_timeout_s=30, load_timeout_s=60
                    ),
                )
            on_root = roots[True]
            # the collector's queue holds the whole run (read after it: the subscriber's
            # decoding is a router's CPU, not the daemon's)
            collector = EventSubscriber(
                f"ipc://{on_root}/ev.sock", replay=f"ipc://{on_root}/evr.sock", hwm=0
            )
            time.sleep(0.3)
            for on in (True, False):  # warm-up, not measured
                _round(conns[on], chains, pages, salt=rounds + 1)
            speeds: dict[bool, list[float]] = {True: [], False: []}
            pids = {on: d.proc.pid for on, d in daemons.items() if d.proc is not None}
            cpu0 = {on: _cpu_s(pid) for on, pid in pids.items()}
            late: EventSubscriber | None = None
            for r in range(rounds):
                if r == rounds // 2:  # joins halfway: it missed every batch so far
                    late = EventSubscriber(
                        f"ipc://{on_root}/ev.sock", replay=f"ipc://{on_root}/evr.sock", hwm=0
                    )
                    late.next_seq = 0  # it wants the node's whole history
                    time.sleep(0.3)
                for on in (True, False) if r % 2 == 0 else (False, True):
                    speeds[on].append(_round(conns[on], chains, pages, salt=r))
            assert late is not None
            cpu = {on: _cpu_s(pid) - cpu0[on] for on, pid in pids.items()}
            caught_up = list(late.iter(1.0))
            msgs = list(collector.iter(1.0))
            if collector.next_seq is not None:  # refused after the last batch it saw
                msgs += collector.replay(collector.next_seq)
            # counted once the stream went quiet: the last STORE's batch goes out
            # kv_events_interval_s after it, so counting at once would miss it
            with AdminClient(daemons[True].endpoint, timeout_s=10) as admin:
                st = cast("dict[str, Any]", admin.stats())
            late.close()
            collector.close()
        finally:
            for c in conns.values():
                c.close()
            for kv in kvs:
                kv.close()
            for d in daemons.values():
                d.discard()
    published = st["counters"]["kv_events_batches"]
    stored = sum(
        len(e.block_hashes)
        for m in msgs
        for e in m.batch.events
        if isinstance(e, E.BlockStored) and e.medium == E.MEDIUM_L2
    )
    removed = sum(
        len(e.block_hashes)
        for m in msgs
        for e in m.batch.events
        if isinstance(e, E.BlockRemoved) and e.medium == E.MEDIUM_L2
    )
    decoded, note = _vllm_decodes([m.payload for m in msgs])
    seen = {m.seq for m in caught_up}
    speed_on, speed_off = statistics.median(speeds[True]), statistics.median(speeds[False])
    pairs = [a / b for a, b in zip(speeds[True], speeds[False])]
    return {
        "decoded_by_vllm": decoded,
        "decoded_by_vllm_note": note,
        "stored_events_over_pages_stored": round(stored / max(1, st["counters"]["store_pages"]), 4),
        "removed_events_over_evictions": round(removed / max(1, st["pool"]["evictions"]), 4),
        "store_throughput_events_on_over_off": round(statistics.median(pairs), 4),
        "daemon_cpu_per_page_events_on_over_off": round(cpu[True] / cpu[False], 4)
        if cpu.get(False)
        else None,
        "replay_recovered": bool(late.gaps) and seen == set(range(published)),
        "pages_stored": st["counters"]["store_pages"],
        "evictions": st["pool"]["evictions"],
        "batches_published": published,
        "late_subscriber_replayed": late.replayed,
        "daemon_cpu_s_events_on": round(cpu[True], 2),
        "daemon_cpu_s_events_off": round(cpu[False], 2),
        "store_pages_per_s_events_on": round(speed_on),
        "store_pages_per_s_events_off": round(speed_off),
        "rounds_per_daemon": rounds,
        "pages_per_round": chains * pages,
        "page_bytes": GEOMETRY.page_bytes,
        "pool_mib": pool_mib,
        "kv_events_hwm": hwm,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    """``kvtier bench events [--json [PATH]]``: run it, print the fields (exit 0)."""
    ap = argparse.ArgumentParser(prog="kvtier bench events", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print the result as JSON (to PATH, or stdout without one)",
    )
    ap.add_argument("--rounds", type=int, default=40, help="rounds per daemon (default 40)")
    args = ap.parse_args(argv)
    result = run_events_bench(rounds=args.rounds)
    report(result, args.json, TARGETS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
