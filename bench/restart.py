"""``kvtier bench restart``: how fast a restarted kvtierd takes back a warm host pool.

One run: a daemon is started, an engine stores ``mib`` MiB of pages (256 KiB each) into L2,
the daemon is killed with SIGKILL, a new daemon is started on the same runtime directory,
and the benchmark reports what the new daemon says about adopting the pool (pages adopted
and the seconds adoption took), the time from starting the process until its HEALTH says
``ok`` (``restart_to_healthy_seconds``: serving, the pool adopted; what ``DaemonProcess``
waits for), the time until it first answered HEALTH at all (``starting`` while it loads and
adopts: ``restart_to_first_answer_seconds``), and how many of the stored pages a LOOKUP then
finds in L2.
Both daemons run with L3 off (``--hicache-storage-backend none``, not the default ``file``):
what is measured is the adoption of the host pool, and no page may come back from disk instead.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from kvtier.client.admin import AdminClient, AdminError
from kvtier.client.connection import Connection
from kvtier.client.daemon_process import DaemonProcess
from kvtier.client.kv_pool import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P

# 256 KiB pages: 4 layers x K,V x 16 tokens x 8 heads x 128 dims x fp16.
GEOMETRY = P.Geometry(num_layers=4, page_size=16, kv_heads=8, head_dim=128, dtype="float16")
BATCH = 256


def run_restart_bench(mib: int = 1024) -> dict:
    """Store ``mib`` MiB, SIGKILL the daemon, restart it, and measure the adoption."""
    g = GEOMETRY
    pages = max(1, (mib << 20) // g.page_bytes)
    pool_bytes = pages * g.page_bytes + (256 << 20)
    with tempfile.TemporaryDirectory(prefix="kvr-", dir="/tmp") as tmp:
        rdir = Path(tmp)
        flags = ["--hicache-size", str(pool_bytes), "--log-level", "warning", "--extent-size",
                 str(32 << 20), "--hicache-storage-backend", "none"]  # the pool's adoption alone
        first = DaemonProcess(rdir, flags)
        first.start(timeout=300)
        second = DaemonProcess(rdir, flags)
        try:
            kv = SharedKVPool(g, BATCH)
            cfg = ClientConfig(runtime_dir=rdir, request_timeout_s=30, load_timeout_s=120)
            conn = Connection(kv, model_id="bench-restart", config=cfg)
            keys: list[bytes] = []
            try:
                parent = None
                for start in range(0, pages, BATCH):
                    n = min(BATCH, pages - start)
                    toks = list(range(start * g.page_size, (start + n) * g.page_size))
                    batch = conn.page_keys(toks, parent)
                    h = conn.store(batch, list(range(n)), parent_key=parent)
                    if h.count != n or not h.wait():
                        raise RuntimeError(f"store of pages {start}..{start + n} failed")
                    keys += batch
                    parent = batch[-1]
                first.kill()  # SIGKILL: no chance to save anything
                t0 = time.perf_counter()
                answered = _first_answer(second, t0)
                second.start(timeout=300)
                ready_s = time.perf_counter() - t0
                answered.join()
                with AdminClient(second.endpoint) as admin:
                    adopt = dict(admin.stats().get("adopt", {}))
                found = sum(conn.lookup(keys[i:i + 4096]).l2 for i in range(0, len(keys), 4096))
            finally:
                conn.close()
                kv.close()
        finally:
            second.stop()
            first.kill()
            first.remove_pool()
    return {
        "bytes_stored": pages * g.page_bytes,
        "pages_stored": pages,
        "page_bytes": g.page_bytes,
        "adopted": bool(adopt.get("adopted", False)),
        "pages_adopted": int(adopt.get("pages_adopted", 0)),
        "adopt_seconds": round(float(adopt.get("seconds", float("nan"))), 4),
        "restart_to_healthy_seconds": round(ready_s, 3),
        "restart_to_first_answer_seconds": round(answered.seconds, 3),
        "pages_found_in_l2_after_restart": found,
    }


class _FirstAnswer(threading.Thread):
    """Polls the daemon's socket until HEALTH gets any answer; ``seconds`` after ``t0``."""

    def __init__(self, d: DaemonProcess, t0: float) -> None:
        super().__init__(name="first-answer", daemon=True)
        self.d, self.t0, self.seconds = d, t0, float("nan")
        self.stale = _inode(d.socket)  # the killed daemon's socket, until the new one binds

    def run(self) -> None:
        deadline = self.t0 + 300
        while time.perf_counter() < deadline:
            if _inode(self.d.socket) not in (None, self.stale):
                try:
                    with AdminClient(self.d.endpoint, timeout_s=1.0) as admin:
                        admin.health()
                    self.seconds = time.perf_counter() - self.t0
                    return
                except AdminError:
                    pass
            time.sleep(0.005)


def _inode(path: Path) -> tuple[int, int] | None:
    """The file at ``path``, told apart from an earlier one there (an inode may be reused)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def _first_answer(d: DaemonProcess, t0: float) -> _FirstAnswer:
    """Start watching for the first HEALTH answer of ``d`` (started at ``t0``)."""
    watcher = _FirstAnswer(d, t0)
    watcher.start()
    return watcher


def print_table(r: dict) -> None:
    """Print the results as a table with the target."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvtier bench restart ({r['bytes_stored'] >> 20} MiB of READY pages, SIGKILL)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    t.add_row("pages_stored", str(r["pages_stored"]), "")
    t.add_row("pages_adopted", str(r["pages_adopted"]), "= pages_stored")
    t.add_row("adopt_seconds", f"{r['adopt_seconds']:.3f}", "< 1.0")
    t.add_row("restart_to_healthy_seconds", f"{r['restart_to_healthy_seconds']:.2f}", "< 0.5")
    t.add_row("restart_to_first_answer_seconds",
              f"{r['restart_to_first_answer_seconds']:.2f}", "")
    t.add_row("pages_found_in_l2_after_restart", str(r["pages_found_in_l2_after_restart"]),
              "= pages_stored")
    Console().print(t)
