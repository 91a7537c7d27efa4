"""One SGLang "instance" in a process of its own: SGLang 0.5.23's real HiCache classes, no server.

The host pool and ``HiCacheController`` come from :func:`kvtier.bench.sglang_stack.build_stack`
(SGLang's runtime context published from ``ServerArgs`` with the extra config that
README.md ("Using kvtier with SGLang") gives; SGLang's own allocator choice and dynamic backend loader). Then it
serves commands, one JSON object per line on stdin, one reply per line on stdout (``@@``):

- ``{"op": "store", "seq": S, "pages": N}``: fill N host pages of token sequence S with
  bytes derived from each page's SGLang key, back them up through the controller's backup
  thread (``write_storage``), reply ``{"tokens": backed-up tokens}``;
- ``{"op": "prefetch", "seq": S, "pages": N}``: prefetch the sequence through the
  controller's prefetch threads (hit query → host allocation → ``prefetch_buffer`` → acks;
  the host pages are scribbled over first, so every byte checked comes from kvtierd), reply
  ``{"hit": tokens the hit query found, "done": tokens prefetched, "bad": pages among
  those whose bytes differ from what was stored}``; with ``"pause": true`` it replies
  ``{"paused": hit}`` after the hit query and waits for a line;
- ``{"op": "stage", "seq": S, "pages": N}``: what SGLang's ``buffer_only`` pipeline does
  with a write: the pages are staged in host slots, backed up, and the slots are given
  back at the storage ack, after being overwritten (a later write may reuse them at
  once); reply ``{"tokens": backed-up tokens, "slots": host pages used}``;
- ``{"op": "mode"}``: the controller's host memory mode, host pages, prefetch budget;
- ``{"op": "keys_of", "seq": S, "pages": N}``: SGLang's page keys of the sequence;
- ``{"op": "event_hashes", "seq": S, "pages": N}``: the block hashes SGLang's own KV events
  give the sequence's pages (its radix cache, with events on, inserting the tokens);
- ``{"op": "stats"}``: the backend's counters; ``{"op": "quit"}``.

Page bytes are a function of the page's key (random int16 seeded by it), so any instance
can check pages another one stored; bf16 is compared as int16 (random bits include NaNs).

Run as ``python sglang_instance.py '<json config>'`` (see :func:`main`); a config with
``"attempts": [overrides, ...]`` first tries to start with each (replying ``{"refused":
message}`` or ``{"started": true}``), and with ``"only_attempts": true`` stops there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kvtier.bench.sglang_stack import build_stack


class Instance:
    """SGLang's host pool and HiCache controller with the kvtier backend (see module doc)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.stack = build_stack(
            cfg["layout"],
            cfg.get("backend", "dynamic"),
            cfg["extra"],
            mla=bool(cfg.get("mla")),
            tp_rank=int(cfg.get("tp_rank", 0)),
            tp_size=int(cfg.get("tp_size", 1)),
            host_memory_mode=cfg.get("host_memory_mode", "cache"),
            host_tokens=int(cfg.get("host_tokens", 2048)),
            **{k: int(cfg[k]) for k in ("layers", "heads", "head_dim") if k in cfg},
        )
        import torch

        self.torch = torch
        self.host = self.stack.host
        self.page = self.stack.page

    def tokens(self, seq: int, pages: int) -> list[int]:
        """Token ids of sequence ``seq`` (distinct per sequence), ``pages`` full pages."""
        return [(seq * 7919 + i) % 50000 + 1 for i in range(pages * self.page)]

    def expected(self, key: str) -> Any:
        """The int16 view of the page stored under ``key``."""
        torch = self.torch
        numel = self.host.get_dummy_flat_data_page().numel()
        gen = torch.Generator().manual_seed(int(key[:15], 16))
        return torch.randint(-32768, 32768, (numel,), dtype=torch.int16, generator=gen)

    def _filled(self, seq: int, pages: int) -> tuple[list[int], list[str], Any]:
        """Host pages holding the expected bytes of sequence ``seq``: (tokens, keys, indexes)."""
        tokens = self.tokens(seq, pages)
        keys = self.stack.keys(tokens)
        idx = self.stack.alloc(len(tokens))
        for i, key in enumerate(keys):
            self.host.set_from_flat_data_page(
                int(idx[i * self.page]), self.expected(key).view(self.host.dtype)
            )
        return tokens, keys, idx

    def store(self, seq: int, pages: int) -> dict[str, Any]:
        tokens, keys, idx = self._filled(seq, pages)
        done = self.stack.backup(idx, tokens, keys)
        self.host.free(idx)
        return {"tokens": done}

    def stage(self, seq: int, pages: int) -> dict[str, Any]:
        tokens, keys, idx = self._filled(seq, pages)
        garbage = self.torch.full_like(self.expected(keys[0]), 0x5A5A).view(self.host.dtype)
        done = self.stack.backup(idx, tokens, keys)
        for i in reversed(range(len(keys))):  # at the ack the slots are free for reuse
            self.host.set_from_flat_data_page(int(idx[i * self.page]), garbage)
        self.host.free(idx)
        return {"tokens": done, "slots": sorted({int(i) // self.page for i in idx.tolist()})}

    def mode(self) -> dict[str, Any]:
        cc = self.stack.controller
        return {
            "host_memory_mode": cc.host_memory_mode,
            "host_pages": self.host.size // self.page,
            "prefetch_limit_tokens": cc.prefetch_capacity_limit,
        }

    def _scribble(self, idx: Any, pause: bool) -> None:
        torch = self.torch
        for i in range(len(idx) // self.page):  # garbage where the pages will land
            page = torch.randint(
                -32768, 32768, (self.host.get_dummy_flat_data_page().numel(),), dtype=torch.int16
            )
            self.host.set_from_flat_data_page(int(idx[i * self.page]), page.view(self.host.dtype))
        if pause:  # the test acts (kills kvtierd) between the hit query and the page reads
            print("@@" + json.dumps({"paused": len(idx)}), flush=True)
            sys.stdin.readline()

    def prefetch(self, seq: int, pages: int, pause: bool = False) -> dict[str, Any]:
        idx, hit, done, keys = self.stack.prefetch(
            self.tokens(seq, pages), lambda i: self._scribble(i, pause)
        )
        bad = sum(
            not self.torch.equal(
                self.host.get_data_page(int(idx[i * self.page]), flat=True).view(self.torch.int16),
                self.expected(key),
            )
            for i, key in enumerate(keys)
        )
        if idx is not None:
            self.host.free(idx)
        return {"hit": hit, "done": done, "bad": bad}

    def keys_of(self, seq: int, pages: int) -> dict[str, Any]:
        """SGLang's page keys of sequence ``seq``."""
        return {"keys": self.stack.keys(self.tokens(seq, pages))}

    def event_hashes(self, seq: int, pages: int) -> dict[str, Any]:
        """The block hashes of SGLang's own ``BlockStored`` events for sequence ``seq``."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        cache = RadixCache.create_simulated(page_size=self.page, enable_kv_cache_events=True)
        tokens = self.tokens(seq, pages)
        cache.insert(InsertParams(key=RadixKey(tokens), value=self.torch.arange(len(tokens))))
        events = cache.take_events()
        return {"hashes": [h for e in events for h in getattr(e, "block_hashes", [])]}

    def stats(self) -> dict[str, Any]:
        outer = self.stack.backend
        backend = getattr(outer, "_backend", outer)  # under SGLang's fault injector
        return {
            "counters": dict(getattr(backend, "counters", {})),
            "registrations": getattr(backend, "registrations", 0),
            "backend": type(backend).__name__,
            "wrapped": backend is not outer,
        }


def main() -> None:
    """Build the instance from ``argv[1]`` (JSON), then serve commands from stdin."""
    cfg = json.loads(sys.argv[1])
    for attempt in cfg.pop("attempts", []):  # configurations expected to fail at start
        try:
            Instance({**cfg, **attempt})
            rep = {"started": True}
        except Exception as err:
            rep = {"refused": f"{type(err).__name__}: {err}"}
        print("@@" + json.dumps(rep), flush=True)
    if cfg.pop("only_attempts", False):
        return
    inst = Instance(cfg)
    print("@@" + json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        t0 = time.monotonic()
        try:
            rep = getattr(inst, op)(**cmd)
        except Exception as err:
            rep = {"error": f"{type(err).__name__}: {err}"}
        rep["seconds"] = time.monotonic() - t0
        print("@@" + json.dumps(rep), flush=True)
    inst.stack.close()


if __name__ == "__main__":
    main()
