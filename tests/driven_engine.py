"""An engine process driven line by line over its stdin, for tests that stop and continue
it (SIGSTOP / SIGCONT) or kill it: a real process running the client library, one command a
line, one answer a line (``fill``, ``store``, ``load``, ``load_nowait`` / ``wait``,
``lookup``, ``sid``, ``quit``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys
from pathlib import Path
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from tests.engines import SMALL, client_config, fill_page, page_bytes, tokens

args = json.loads(sys.argv[1])
pool = SharedKVPool(SMALL, args.get("pages", 32))
conn = Connection(pool, model_id=args["model"], config=client_config(Path(args["rdir"]), **args["cfg"]),
                  tp_rank=args.get("rank", 0), tp_size=args.get("tp", 1))
held = {}

def digest(p0, n):
    return hashlib.sha256(b"".join(page_bytes(pool, p) for p in range(p0, p0 + n))).hexdigest()

def keys(salt, n):
    return conn.page_keys(tokens(n * SMALL.page_size, salt=salt))

print("ready", conn.session_id, flush=True)
for line in sys.stdin:
    op, *a = line.split()
    if op == "fill":
        salt, p0, n = map(int, a)
        for i in range(n):
            fill_page(pool, p0 + i, salt * 1000 + i)
        print(digest(p0, n), flush=True)
    elif op == "store":
        salt, p0, n = map(int, a)
        h = conn.store(keys(salt, n), list(range(p0, p0 + n)))
        print(h.count, h.wait(), flush=True)
    elif op == "load":
        salt, p0, n = map(int, a)
        h = conn.load(keys(salt, n), list(range(p0, p0 + n)))
        ok = h.wait()
        print(h.count, ok, digest(p0, n), flush=True)
    elif op == "load_nowait":
        salt, p0, n = map(int, a)
        held["h"] = (conn.load(keys(salt, n), list(range(p0, p0 + n))), p0, n)
        print(held["h"][0].count, flush=True)
    elif op == "wait":
        h, p0, n = held.pop("h")
        ok = h.wait()
        h.until_ended()
        print(ok, digest(p0, n), flush=True)
    elif op == "lookup":
        salt, n = map(int, a)
        print(conn.lookup(keys(salt, n)).l2, flush=True)
    elif op == "sid":
        print(conn.session_id, flush=True)
    elif op == "quit":
        conn.close()
        pool.close()
        print("bye", flush=True)
        break
"""


class Child:
    """An engine process running :data:`CHILD`."""

    def __init__(self, rdir: Path, model: str, **kw: object) -> None:
        cfg = dict(request_timeout_s=2.0, load_timeout_s=5.0, heartbeat_interval_s=0.2)
        cfg.update(kw.pop("cfg", {}))  # type: ignore[arg-type]
        args = dict(rdir=str(rdir), model=model, cfg=cfg, **kw)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.session_id = int(self._line().split()[1])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"engine process {self.pid} ended (rc {self.proc.poll()})"
        return line.strip()

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: str) -> list[str]:
        self.send(cmd)
        return self._line().split()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGCONT)
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask("quit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                f.close()  # type: ignore[union-attr]
