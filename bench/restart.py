"""``kvtier bench restart``: how fast a restarted kvtierd takes back a warm host pool.

One run: a daemon is started, an engine stores ``mib`` MiB of pages (256 KiB each) into L2,
the daemon is killed with SIGKILL, a new daemon is started on the same runtime directory,
and the benchmark reports what the new daemon says about adopting the pool (pages adopted
and the seconds adoption took), the time from starting the process until its HEALTH says
``ok`` (``restart_to_healthy_seconds``: serving, the pool adopted; what ``DaemonProcess``
waits for), the time until it first answered HEALTH at all (``starting`` while it loads and
adopts: ``restart_to_first_answer_seconds``), the CPU time the new daemon had used by then
(``restart_cpu_seconds``, from ``/proc``: what a loaded machine stretches, it does not
inflate), and how many of the stored pages a LOOKUP then finds in L2. Both times are taken
by a watcher that asks HEALTH every few milliseconds on the new daemon's socket, so they do
not include ``DaemonProcess``'s 50 ms polling.

Python bytecode: an installed kvtier has its modules compiled (``pip`` compiles them at
install), so the timed restart reads cached bytecode, which the first daemon (not timed)
wrote into a private cache (``PYTHONPYCACHEPREFIX``). The daemon is then killed once more and
restarted with kvtier's own bytecode removed from that cache and none written
(``PYTHONDONTWRITEBYTECODE=1``): every kvtier module is compiled from source, as in a
checkout run with that setting (``restart_to_healthy_compiling_seconds``).

Both daemons run with L3 off (``--hicache-storage-backend none``, not the default ``file``):
what is measured is the adoption of the host pool, and no page may come back from disk instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.client.connection.admin import AdminClient, AdminError
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

# 256 KiB pages: 4 layers x K,V x 16 tokens x 8 heads x 128 dims x fp16.
GEOMETRY = P.Geometry(num_layers=4, page_size=16, kv_heads=8, head_dim=128, dtype="float16")
BATCH = 256
POLL_S = 0.005
"""How often the watcher asks HEALTH while the daemon starts."""
KVTIER_ROOT = Path(__file__).resolve().parents[1]
"""kvtier's source tree (its bytecode is removed from the cache for the compiling restart)."""


def run_restart_bench(mib: int = 1024) -> dict:
    """Store ``mib`` MiB, SIGKILL the daemon, restart it (twice), and measure the adoption."""
    g = GEOMETRY
    pages = max(1, (mib << 20) // g.page_bytes)
    pool_bytes = pages * g.page_bytes + (256 << 20)
    with tempfile.TemporaryDirectory(prefix="kvr-", dir="/tmp") as tmp:
        rdir = Path(tmp)
        cache = rdir / "pycache"
        cached = {"PYTHONPYCACHEPREFIX": str(cache), "PYTHONDONTWRITEBYTECODE": ""}
        flags = [
            "--hicache-size",
            str(pool_bytes),
            "--log-level",
            "warning",
            "--extent-size",
            str(32 << 20),
            "--hicache-storage-backend",
            "none",
        ]  # the pool's adoption alone
        first = DaemonProcess(rdir, flags, env=cached)
        first.start(timeout=300)
        second = DaemonProcess(rdir, flags, env=cached)
        third = DaemonProcess(
            rdir, flags, env={"PYTHONPYCACHEPREFIX": str(cache), "PYTHONDONTWRITEBYTECODE": "1"}
        )
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
                warm = _restart(second)
                with AdminClient(second.endpoint) as admin:
                    said = admin.stats().get("adopt")
                    adopt: dict[str, Any] = dict(said) if isinstance(said, dict) else {}
                second.kill()
                _drop_kvtier_bytecode(cache)
                compiling = _restart(third)
                found = sum(conn.lookup(keys[i : i + 4096]).l2 for i in range(0, len(keys), 4096))
            finally:
                conn.close()
                kv.close()
        finally:
            third.stop()
            second.kill()
            first.kill()
            first.remove_pool()
    return {
        "bytes_stored": pages * g.page_bytes,
        "pages_stored": pages,
        "page_bytes": g.page_bytes,
        "adopted": bool(adopt.get("adopted", False)),
        "pages_adopted": int(adopt.get("pages_adopted", 0)),
        "adopt_seconds": round(float(adopt.get("seconds", float("nan"))), 4),
        "restart_to_healthy_seconds": round(warm.healthy, 3),
        "restart_to_first_answer_seconds": round(warm.first, 3),
        "restart_cpu_seconds": round(warm.cpu, 3),
        "restart_to_healthy_compiling_seconds": round(compiling.healthy, 3),
        "restart_cpu_compiling_seconds": round(compiling.cpu, 3),
        "pages_found_in_l2_after_restart": found,
        "load_average": round(os.getloadavg()[0], 2),
    }


def _drop_kvtier_bytecode(cache: Path) -> None:
    """Remove kvtier's own modules from the bytecode cache ``cache`` (a checkout's hidden
    directories, such as a virtualenv inside it, keep theirs: those are installed packages)."""
    mirror = cache / KVTIER_ROOT.relative_to(KVTIER_ROOT.anchor)
    for sub in mirror.iterdir() if mirror.is_dir() else ():
        if sub.name.startswith("."):
            continue
        if sub.is_dir():
            shutil.rmtree(sub)
        else:
            sub.unlink()


def _restart(d: DaemonProcess) -> _Watcher:
    """Start ``d`` on the killed daemon's runtime directory and time it (see the module)."""
    watcher = _Watcher(d, time.perf_counter())
    watcher.start()
    d.start(timeout=300)
    watcher.join()
    if watcher.error is not None:
        raise RuntimeError(f"timing the restart failed: {watcher.error}")
    return watcher


class _Watcher(threading.Thread):
    """Asks the new daemon's socket for HEALTH until it says ``ok``; times after ``t0``.

    Attributes:
        first: seconds until HEALTH got any answer.
        healthy: seconds until it said ``ok``.
        cpu: the daemon's CPU seconds (user + system) when it said ``ok``.
        error: why the watch failed, or None.
    """

    def __init__(self, d: DaemonProcess, t0: float) -> None:
        super().__init__(name="restart-watch", daemon=True)
        self.d, self.t0 = d, t0
        self.first = self.healthy = self.cpu = float("nan")
        self.error: str | None = None
        self.stale = _inode(d.socket)  # the killed daemon's socket, until the new one binds

    def run(self) -> None:
        deadline = self.t0 + 300
        while _inode(self.d.socket) in (None, self.stale):
            if time.perf_counter() > deadline:
                self.error = "no new socket"
                return
            time.sleep(POLL_S)
        with AdminClient(self.d.endpoint, timeout_s=1.0) as admin:
            while time.perf_counter() < deadline:
                try:
                    status = admin.health().status
                except AdminError:
                    continue  # the reply timed out: ask again
                now = time.perf_counter() - self.t0
                if self.first != self.first:  # NaN: the first answer
                    self.first = now
                if status == "ok":
                    self.healthy, self.cpu = now, _cpu_seconds(self.d.pid)
                    return
                time.sleep(POLL_S)
        self.error = "never healthy"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _inode(path: Path) -> tuple[int, int] | None:
    """The file at ``path``, told apart from an earlier one there (an inode may be reused)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


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
    t.add_row("restart_to_first_answer_seconds", f"{r['restart_to_first_answer_seconds']:.2f}", "")
    t.add_row("restart_cpu_seconds", f"{r['restart_cpu_seconds']:.2f}", "")
    t.add_row(
        "restart_to_healthy_compiling_seconds",
        f"{r['restart_to_healthy_compiling_seconds']:.2f}",
        "",
    )
    t.add_row("restart_cpu_compiling_seconds", f"{r['restart_cpu_compiling_seconds']:.2f}", "")
    t.add_row(
        "pages_found_in_l2_after_restart",
        str(r["pages_found_in_l2_after_restart"]),
        "= pages_stored",
    )
    Console().print(t)
    print(f"load average {r['load_average']}")
