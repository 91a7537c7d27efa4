"""The SGLang backend's L3 hits, driven through SGLang's own HiCacheController (in this
process: its prefetch and backup threads call the backend) against real kvtierd processes:
every page ``batch_exists`` reports as a hit is then delivered by ``batch_get_v1``, byte for
byte, when two requests share an L3 prefix and when L2 cannot take a whole L3 run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from kvtier.launch.daemon_process import DaemonProcess
from sglang_harness import DAEMON_ARGS, admin_stats, extra_config, flush_l2

pytestmark = [
    pytest.mark.timeout(300),
    # SGLang and torch warn while importing (the other SGLang tests keep them in subprocesses)
    pytest.mark.filterwarnings("ignore"),
]

REPO = str(Path(__file__).resolve().parents[3])
PAGE = 16
DEADLINE_S = 60.0

_published = False


def _stack(layout: str, extra: dict[str, Any], **kw: Any) -> Any:
    """SGLang's host pool + HiCacheController with the kvtier backend, in this process."""
    global _published
    from kvtier.bench.sglang_stack import build_stack

    stack = build_stack(layout, "dynamic", extra, publish=not _published, **kw)
    _published = True
    return stack


def _tokens(seq: int, pages: int) -> list[int]:
    return [(seq * 7919 + i) % 50000 + 1 for i in range(pages * PAGE)]


def _expected(stack: Any, key: str) -> Any:
    import torch

    numel = stack.host.get_dummy_flat_data_page().numel()
    gen = torch.Generator().manual_seed(int(key[:15], 16))
    return torch.randint(-32768, 32768, (numel,), dtype=torch.int16, generator=gen)


def _store(stack: Any, seq: int, pages: int, chunk: int | None = None, sync: Any = None) -> int:
    """Fill host pages of sequence ``seq`` with key-derived bytes, back them up through the
    controller's backup thread (``chunk`` pages per write_storage); tokens backed up."""
    tokens = _tokens(seq, pages)
    keys = stack.keys(tokens)
    chunk = chunk or pages
    done = 0
    for a in range(0, pages, chunk):
        b = min(pages, a + chunk)
        idx = stack.alloc((b - a) * PAGE)
        for i, key in enumerate(keys[a:b]):
            stack.host.set_from_flat_data_page(
                int(idx[i * PAGE]), _expected(stack, key).view(stack.host.dtype)
            )
        done += stack.backup(idx, tokens[a * PAGE : b * PAGE], keys[a:b])
        stack.host.free(idx)
        if sync is not None:
            sync()
    return done


def _prefetch_many(stack: Any, token_lists: list[list[int]]) -> list[dict[str, Any]]:
    """Queue one prefetch per token list at once (as SGLang's scheduler does for concurrent
    requests), then give each its host pages and let the IO thread read them; per request:
    hit tokens, tokens prefetched, bad pages among those prefetched."""
    import torch

    cc = stack.controller
    ops = []
    for j, tokens in enumerate(token_lists):
        stack._rid += 1
        ops.append(cc.prefetch(f"edge{stack._rid}-{j}", tokens))
    deadline = time.monotonic() + DEADLINE_S
    seen: set[int] = set()
    while len(seen) < len(ops):
        op = cc.prefetch_hit_queue.get(timeout=max(0.01, deadline - time.monotonic()))
        seen.add(id(op))
    out: list[dict[str, Any]] = []
    live = []
    for op in ops:
        hit = int(op.storage_hit_count)
        res = {"rid": op.request_id, "hit": hit, "done": 0, "bad": 0, "idx": None}
        out.append(res)
        if hit == 0:
            continue
        idx = stack.alloc(hit)
        for i in range(hit // PAGE):  # scribble: every byte checked comes from kvtierd
            page = torch.randint(
                -32768, 32768, (stack.host.get_dummy_flat_data_page().numel(),), dtype=torch.int16
            )
            stack.host.set_from_flat_data_page(int(idx[i * PAGE]), page.view(stack.host.dtype))
        op.hash_value = op.hash_value[: hit // PAGE]
        op.host_indices = idx
        res["idx"], res["op"] = idx, op
        live.append(res)
    for res in live:
        cc.prefetch_buffer.put(res["op"])
    pending = {res["rid"]: res for res in live}
    while pending:
        try:
            ack = cc.ack_prefetch_queue.get(timeout=max(0.01, deadline - time.monotonic()))
        except Empty:
            raise TimeoutError(f"prefetches {sorted(pending)} did not complete") from None
        res = pending.get(ack.rid)
        if res is None:
            continue
        if ack.completed_tokens is not None:
            res["done"] = max(res["done"], int(ack.completed_tokens))
        if ack.completed_req:
            del pending[ack.rid]
    for res in live:
        keys = res["op"].hash_value[: res["done"] // PAGE]
        idx = res["idx"]
        res["bad"] = sum(
            not torch.equal(
                stack.host.get_data_page(int(idx[i * PAGE]), flat=True).view(torch.int16),
                _expected(stack, key),
            )
            for i, key in enumerate(keys)
        )
        stack.host.free(idx)
        res.pop("op")
        res.pop("idx")
    return out


def _daemon(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> DaemonProcess:
    return DaemonProcess(tmp / name, [*DAEMON_ARGS, *args], env=env).start()


def _slow_l3_flags(tmp: Path, delay_s: float) -> list[str]:
    """An L3 whose every read takes ``delay_s`` (the file backend, slowed down)."""
    extra = {
        "backend_name": "slow-file",
        "module_path": "tests.integration.test_l3_tier",
        "class_name": "SlowFileBackend",
        "path": str(tmp / "slow-l3"),
        "delay_s": delay_s,
    }
    return [
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
        "--prefetch-concurrency",
        "1",
        "--prefetch-threshold",
        "0",
    ]


@pytest.fixture
def tmp(module_tmp: Path, request: pytest.FixtureRequest) -> Path:
    d = module_tmp / request.node.name[:20]
    d.mkdir()
    return d


def test_two_requests_sharing_an_l3_prefix_both_get_their_hit(tmp: Path) -> None:
    """Two requests with the same prefix, in L3 only, arrive together (a shared system
    prompt; or SGLang retrying a request's prefetch). The second PREFETCH has the same name
    as the first (the adapter names none: the daemon uses the run's last key) and replaces
    it, but the reads it shares go on: both requests get the whole run they were told of."""
    d = _daemon(tmp, "d", *_slow_l3_flags(tmp, 0.4), env={"PYTHONPATH": REPO})
    stack = None
    try:
        stack = _stack("page_first", extra_config(d.runtime_dir, model_id="edge-dup"))
        assert _store(stack, seq=1, pages=32) == 32 * PAGE
        assert flush_l2(d) >= 32
        tokens = _tokens(1, 32)
        got = _prefetch_many(stack, [tokens, tokens])
        assert [g["hit"] for g in got] == [32 * PAGE] * 2
        c = admin_stats(d)["counters"]
        prefetch = {k: v for k, v in c.items() if k.startswith("l3_prefetch")}
        assert [(g["done"], g["bad"]) for g in got] == [(32 * PAGE, 0)] * 2, (got, prefetch)
    finally:
        if stack is not None:
            stack.close()
        d.stop()
        d.remove_pool()


def test_an_l3_run_larger_than_what_l2_can_take_is_not_reported_whole(tmp: Path) -> None:
    """L3 holds a run of 100 pages; kvtierd's L2 has room for ~64. The PREFETCH reads only
    what fits and says so (``coming``); ``batch_exists`` reports that much, so SGLang's
    prefetch thread never waits for pages that will not come."""
    d = _daemon(
        tmp,
        "d",
        "--hicache-size",
        "2MiB",
        "--extent-size",
        "1MiB",
        "--hicache-storage-backend",
        "file",
        "--prefetch-threshold",
        "16",
    )
    stack = None
    try:
        stack = _stack("page_first", extra_config(d.runtime_dir, model_id="edge-big"))

        def sync() -> None:
            flush_l2(d)

        assert _store(stack, seq=2, pages=100, chunk=25, sync=sync) == 100 * PAGE
        flush_l2(d)
        (res,) = _prefetch_many(stack, [_tokens(2, 100)])
        assert res["bad"] == 0
        # what SGLang was promised is what it gets
        assert res["done"] == res["hit"], (res, admin_stats(d)["counters"])
    finally:
        if stack is not None:
            stack.close()
        d.stop()
        d.remove_pool()
