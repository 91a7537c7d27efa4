"""kvtier's SGLang HiCache backend driven by SGLang 0.5.23's own classes, live.

Every SGLang "instance" is a process of its own (``sglang_instance.py``: SGLang's host pool
and ``HiCacheController``, the backend loaded by SGLang's dynamic loader with README's extra
config), against real kvtierd processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from sglang_harness import HERE, Instance, both_ranks, extra_config, start_daemon

PAGE = 16


class NsInstance(Instance):
    """An instance process started under a command prefix (``unshare --pid --fork``)."""

    def __init__(self, log_dir, name, layout, extra, prefix, **cfg) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        config = {"layout": layout, "extra": extra, **cfg}
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(HERE / "sglang_instance.py"), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=dict(os.environ),
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        self._ready = False


@pytest.mark.timeout(120)
def test_sglang_in_its_own_pid_namespace_gets_its_pages(daemons, module_tmp) -> None:
    """SGLang in a container (its own PID namespace) reaching the node's kvtierd through
    the mounted runtime dir: backups and prefetches work as on the host: 8 pages stored, 8
    pages prefetched byte for byte."""
    d = daemons("pidns")
    extra = extra_config(d.runtime_dir, model_id="pidns", retry_interval_s=0.2)
    inst = NsInstance(module_tmp, "pidns", "page_first", extra, ["unshare", "--pid", "--fork"])
    try:
        stored = inst.call("store", seq=1, pages=8)["tokens"]
        got = inst.call("prefetch", seq=1, pages=8)
        stats = inst.call("stats")
        assert (stored, got["hit"], got["done"], got["bad"]) == (8 * PAGE, 8 * PAGE, 8 * PAGE, 0), (
            stored,
            got,
            stats,
        )
    finally:
        inst.close()


@pytest.mark.timeout(120)
def test_mla_pages_are_shared_between_tp_sizes(daemons, instances) -> None:
    """MLA pages are the same on every rank whatever the TP size (SGLang's own file backend
    keys them without rank or TP size). An MLA server with TP=1 backs up 8 pages; a server
    of the same model with TP=2 (both ranks asking) finds and loads all 8, byte for byte."""
    d = daemons("mla-tp")
    extra = extra_config(d.runtime_dir, model_id="mla-tp")
    one = instances("mla-tp1", "page_first", extra, mla=True)
    assert one.call("store", seq=3, pages=8)["tokens"] == 8 * PAGE
    ranks = [
        instances(f"mla-tp2-{r}", "page_first", extra, mla=True, tp_rank=r, tp_size=2)
        for r in (0, 1)
    ]
    got = both_ranks(ranks, "prefetch", seq=3, pages=8)
    assert [(g["hit"], g["done"], g["bad"]) for g in got] == [(8 * PAGE, 8 * PAGE, 0)] * 2, got


@pytest.mark.timeout(120)
def test_sigterm_restart_keeps_serving_the_pages(instances, module_tmp) -> None:
    """kvtierd stopped cleanly (SIGTERM, as systemd restarts it) and started again while
    SGLang keeps running: SGLang gets misses meanwhile, never an exception, then the
    restarted kvtierd adopts its pool and serves the same pages, byte for byte."""
    rd = module_tmp / "term"
    rd.mkdir()
    extra = extra_config(rd, retry_interval_s=0.2, request_timeout_s=1.0, model_id="term")
    d = start_daemon(rd)
    try:
        inst = instances("term", "layer_first", extra)
        assert inst.call("store", seq=1, pages=8)["tokens"] == 8 * PAGE
        d.stop()
        got = inst.call("prefetch", seq=1, pages=8)
        assert (got["hit"], got["done"]) == (0, 0), got
        assert inst.call("store", seq=2, pages=2)["tokens"] == 0
        d = start_daemon(rd)
        seen = []
        for _ in range(20):
            got = inst.call("prefetch", seq=1, pages=8)
            seen.append(got)
            if got["done"]:
                break
            time.sleep(0.3)
        assert (got["hit"], got["done"], got["bad"]) == (8 * PAGE, 8 * PAGE, 0), seen
        assert inst.call("stats")["counters"].get("errors", 0) == 0
    finally:
        d.stop()
        d.remove_pool()


@pytest.mark.timeout(120)
def test_tp_ranks_started_before_kvtierd_agree_once_both_registered(instances, module_tmp) -> None:
    """A TP=2 SGLang server started before kvtierd (the docs: it registers by itself once a
    kvtierd answers). Its ranks started a moment apart, so one registers a few hit queries
    before the other. Once both are registered and both backed up 8 pages, a prefetch on
    both ranks finds all 8 on both (the ranks' hit queries are paired again), and no rank's
    hit query waits for a round the other never joins."""
    rd = module_tmp / "tp-late"
    rd.mkdir()
    extra = extra_config(rd, retry_interval_s=3.0, model_id="tp-late")
    r0 = instances("tp-late-0", "page_first", extra, tp_rank=0, tp_size=2).wait_ready()
    time.sleep(1.5)
    r1 = instances("tp-late-1", "page_first", extra, tp_rank=1, tp_size=2).wait_ready()
    d = start_daemon(rd)
    try:
        regs = []
        for _ in range(60):  # hit queries on both ranks, as SGLang's scheduler sends them
            both_ranks([r0, r1], "prefetch", seq=1, pages=2)
            regs = [r.call("stats")["registrations"] for r in (r0, r1)]
            if regs == [1, 1]:
                break
            time.sleep(0.2)
        assert regs == [1, 1], regs
        assert [g["tokens"] for g in both_ranks([r0, r1], "store", seq=5, pages=8)] == [
            8 * PAGE
        ] * 2
        seen = [both_ranks([r0, r1], "prefetch", seq=5, pages=8) for _ in range(3)]
        assert [[(g["hit"], g["done"], g["bad"]) for g in got] for got in seen] == [
            [(8 * PAGE, 8 * PAGE, 0)] * 2
        ] * 3, seen
    finally:
        d.stop()
        d.remove_pool()


@pytest.mark.timeout(120)
def test_two_tp_servers_on_the_same_port_number_keep_their_own_hit_counts(
    daemons, module_tmp
) -> None:
    """Two TP=2 SGLang servers of one model on one node, each in its own container (network
    namespace), both on the same port, neither naming ``tp_group``. Server A backed up
    request 1; at the same moment A prefetches request 1 and B prefetches request 2 (never
    stored). Each server's ranks agree among themselves: A finds its 8 pages on both ranks,
    B finds nothing; neither server's hit query is answered with the other server's."""
    names = [f"kvt-{tag}-{os.getpid()}" for tag in ("a", "b")]
    made = []
    try:
        for ns in names:
            if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode:
                pytest.skip("ip netns add cannot make a network namespace here (needs root)")
            made.append(ns)
        d = daemons("sameport")
        extra = extra_config(d.runtime_dir, model_id="sameport")

        def server(ns: str, tag: str) -> list[NsInstance]:
            prefix = ["ip", "netns", "exec", ns]
            return [
                NsInstance(
                    module_tmp, f"sp-{tag}{r}", "page_first", extra, prefix, tp_rank=r, tp_size=2
                )
                for r in (0, 1)
            ]

        a, b = server(names[0], "a"), server(names[1], "b")
        try:
            for r in (*a, *b):
                r.wait_ready()
            assert [g["tokens"] for g in both_ranks(a, "store", seq=1, pages=8)] == [8 * PAGE] * 2
            seen = []
            for _ in range(3):
                for r in a:
                    r.send("prefetch", seq=1, pages=8)
                for r in b:
                    r.send("prefetch", seq=2, pages=8)
                got = [(g["hit"], g["done"], g["bad"]) for g in (r.reply() for r in (*a, *b))]
                seen.append(got)
            assert seen == [[(8 * PAGE, 8 * PAGE, 0)] * 2 + [(0, 0, 0)] * 2] * 3, seen
        finally:
            for r in (*a, *b):
                r.close()
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


EXACT_DRIVER = r"""
import json, sys
from kvtier.bench.sglang_stack import build_stack
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

cfg = json.loads(sys.argv[1])
stack = build_stack(cfg["layout"], "dynamic", cfg["extra"], mla=cfg["mla"], host_tokens=512)
host, page, be = stack.host, stack.page, stack.backend
buf = host.kv_buffer.view(-1).view(torch.int16)
gen = torch.Generator().manual_seed(7)
buf.copy_(torch.randint(-32768, 32768, buf.shape, dtype=torch.int16, generator=gen))
tokens = list(range(1, 8 * page + 1))
keys = stack.keys(tokens)
src = stack.alloc(8 * page)
stored = [host.get_data_page(int(src[i * page]), flat=True).view(torch.int16).clone()
          for i in range(5)]
ok_set = be.batch_set_v1(keys[:5], src[: 5 * page], HiCacheStorageExtraInfo())
dst = stack.alloc(8 * page)
buf.copy_(torch.randint(-32768, 32768, buf.shape, dtype=torch.int16, generator=gen))
before = buf.clone()
hit = be.batch_exists(keys, HiCacheStorageExtraInfo())
ok_get = be.batch_get_v1(keys, dst, HiCacheStorageExtraInfo())
after = buf.clone()
# where each host page's bytes lie: mark them by writing through SGLang's own page API
owner = torch.full(buf.shape, -1, dtype=torch.int64)
probe = buf.clone()
n_pages = host.size // page
pages_got = [int(dst[i * page]) // page for i in range(8)]
for p in range(n_pages):
    buf.zero_()
    host.set_from_flat_data_page(p * page, torch.ones(host.get_dummy_flat_data_page().numel(),
                                 dtype=torch.int16).view(host.dtype))
    owner[buf != 0] = p
buf.copy_(probe)
changed = (before != after)
changed_pages = sorted({int(x) for x in owner[changed].unique().tolist()})
bad = [i for i in range(5) if not torch.equal(
    host.get_data_page(pages_got[i] * page, flat=True).view(torch.int16), stored[i])]
print("@@" + json.dumps({"set": ok_set, "hit": hit, "get": ok_get, "bad": bad,
      "changed_pages": changed_pages, "expected_pages": pages_got[:5],
      "unowned_changed": int((changed & (owner < 0)).sum())}), flush=True)
stack.close()
"""


def _run_driver(module_tmp, name: str, cfg: dict) -> dict:
    script = module_tmp / f"{name}.py"
    script.write_text(EXACT_DRIVER)
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ),
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1][2:])


@pytest.mark.parametrize(
    ("layout", "mla"), [("layer_first", False), ("page_head", False), ("layer_first", True)]
)
@pytest.mark.timeout(120)
def test_partial_hit_writes_only_the_hit_pages(daemons, module_tmp, layout, mla) -> None:
    """5 of 8 pages stored; batch_exists answers 5, batch_get_v1 answers 5 True then
    3 False, and of SGLang's whole host pool only the bytes of those 5 host pages changed,
    to exactly what was stored (nothing written into the 3 missed pages or any other)."""
    d = daemons(f"exact-{layout}-{mla}")
    extra = extra_config(d.runtime_dir, model_id=f"exact-{mla}")
    rep = _run_driver(
        module_tmp, f"exact-{layout}-{mla}", {"layout": layout, "extra": extra, "mla": mla}
    )
    assert rep["set"] == [True] * 5 and rep["hit"] == 5, rep
    assert rep["get"] == [True] * 5 + [False] * 3, rep
    assert rep["bad"] == [] and rep["unowned_changed"] == 0, rep
    assert rep["changed_pages"] == sorted(rep["expected_pages"]), rep


CONC_DRIVER = r"""
import json, sys, threading, time
from kvtier.bench.sglang_stack import build_stack
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

cfg = json.loads(sys.argv[1])
stack = build_stack("page_first", "dynamic", cfg["extra"], host_tokens=2048)
host, page, be = stack.host, stack.page, stack.backend
numel = host.get_dummy_flat_data_page().numel()
def expected(key):
    g = torch.Generator().manual_seed(int(key[:15], 16))
    return torch.randint(-32768, 32768, (numel,), dtype=torch.int16, generator=g)
lock = threading.Lock()
res = {"exc": [], "max_s": 0.0, "wrong": 0, "loaded": 0, "stored": 0, "calls": 0}
stop = time.monotonic() + cfg["run_s"]
def timed(fn, *a):
    t = time.monotonic()
    try:
        return fn(*a)
    except Exception as e:
        with lock: res["exc"].append(repr(e))
        return None
    finally:
        with lock:
            res["max_s"] = max(res["max_s"], time.monotonic() - t); res["calls"] += 1
def writer():
    seq = 0
    while time.monotonic() < stop:
        seq += 1
        toks = [(seq * 7919 + i) % 50000 + 1 for i in range(4 * page)]
        keys = stack.keys(toks)
        with lock: idx = host.alloc(4 * page)
        for i, k in enumerate(keys):
            host.set_from_flat_data_page(int(idx[i * page]), expected(k).view(host.dtype))
        ok = timed(be.batch_set_v1, keys, idx, HiCacheStorageExtraInfo())
        with lock:
            res["stored"] += sum(bool(x) for x in (ok or []))
            host.free(idx)
def reader():
    seq = 0
    while time.monotonic() < stop:
        seq = seq % 50 + 1
        toks = [(seq * 7919 + i) % 50000 + 1 for i in range(4 * page)]
        keys = stack.keys(toks)
        n = timed(be.batch_exists, keys, HiCacheStorageExtraInfo()) or 0
        if not n:
            time.sleep(0.002); continue
        with lock: idx = host.alloc(n * page)
        ok = timed(be.batch_get_v1, keys[:n], idx, HiCacheStorageExtraInfo()) or []
        for i, f in enumerate(ok):
            if not f: break
            got = host.get_data_page(int(idx[i * page]), flat=True).view(torch.int16)
            with lock:
                res["loaded"] += 1
                res["wrong"] += int(not torch.equal(got, expected(keys[i])))
        with lock: host.free(idx)
ts = [threading.Thread(target=writer), threading.Thread(target=reader)]
[t.start() for t in ts]
[t.join() for t in ts]
b = getattr(be, "_backend", be)
res["errors"] = b.counters.get("errors", 0)
res["registrations"] = b.registrations
print("@@" + json.dumps(res), flush=True)
stack.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["kill"])
def test_concurrent_backup_and_prefetch_across_a_restart(module_tmp, how) -> None:
    """SGLang's backup thread (batch_set_v1) and prefetch threads (batch_exists,
    batch_get_v1) run at once while kvtierd is killed (SIGKILL / SIGTERM) and started
    again: nothing raises, no call hangs (the test's timeout), no page reported loaded has wrong bytes, and the
    backend registers again and loads pages."""
    rd = module_tmp / f"conc-{how}"
    rd.mkdir()
    extra = extra_config(rd, retry_interval_s=0.2, request_timeout_s=1.0, model_id="conc")
    d = start_daemon(rd)
    script = module_tmp / f"conc-{how}.py"
    script.write_text(CONC_DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps({"extra": extra, "run_s": 20})],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(10)
        if how == "kill":
            d.kill()
        else:
            d.stop()
        time.sleep(2)
        d = start_daemon(rd)
        out, err = proc.communicate(timeout=80)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        d.stop()
        d.remove_pool()
    lines = [ln for ln in out.splitlines() if ln.startswith("@@")]
    assert lines, err[-3000:]
    res = json.loads(lines[-1][2:])
    assert res["exc"] == [] and res["errors"] == 0 and res["wrong"] == 0, res
    assert res["registrations"] == 2 and res["loaded"] > 0, res
