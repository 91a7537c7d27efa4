"""One fresh vLLM engine of ``kvtier bench vllm`` (run as a subprocess by bench/vllm.py).

    python -m kvtier.bench.vllm_engine CONFIG_PATH

CONFIG_PATH: a JSON file ``{"model": dir, "connector": "kvtier" | "example" | "none",
"runtime_dir": ..., "example_dir": ..., "kv_bytes": n, "max_tokens": n, "pause_s": s,
"prefix_caching": bool}``; ``make_model``
instead writes the benchmark's random Llama to ``model`` and exits. The engine prints
``{"ready": true}``, then answers each line ``{"prompt": [ids]}`` on stdin with one JSON
line: the time to first token (a ``max_tokens=1`` request), its token and logprob, the
tokens vLLM reports cached, the connector's load times for that request, then the greedy
tokens and logprobs of a second request of the same prompt, ``pause_s`` later (and its
cached tokens: with kvtier, or vLLM's own ``prefix_caching``, a cold prompt's second request
reuses what its first one stored). The driver can so keep
several engines alive and alternate requests between them.

Both connectors are timed by the same wrapper (:class:`_LoadTimer`), around vLLM's own
calls into the connector, so their load times mean the same: the time the request waited
on its load,

- for a load vLLM waits for inside the step (synchronous: ExampleConnector's, kvtier's
  layer-wise loads of L2 hits): the time that step spent in the connector's
  ``start_load_kv``, ``wait_for_layer_load`` and ``get_finished`` calls;
- for an asynchronous load (kvtier's loads of L3 hits): from the ``start_load_kv`` that
  started it to the ``get_finished`` that reported it done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from kvtier.client.adapters.vllm.connector import KvtierConnector
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

BENCH_MODEL = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
"""A random Llama whose 4K-token prefill takes about a second on a small CPU machine."""


class _LoadTimer:
    """Times a connector's loads (see the module docstring); mixed into a connector class."""

    if TYPE_CHECKING:  # the connector's, which this is mixed into

        def _get_connector_metadata(self) -> Any: ...
        def has_connector_metadata(self) -> bool: ...

    def _loads_of(self, meta: Any) -> dict[str, bool]:
        """The step's loads: request id → loaded synchronously (within the step)."""
        raise NotImplementedError

    def _timer(self) -> dict[str, Any]:
        if not hasattr(self, "_timing"):
            self._timing = {"times": [], "step": {}, "spent": 0.0, "async": {}}
        return self._timing

    @property
    def load_times(self) -> list[float]:
        """Seconds each load kept its request waiting, in the order they ended."""
        return self._timer()["times"]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """The connector's start_load_kv, timed when the step has loads."""
        tm = self._timer()
        loads = (
            self._loads_of(self._get_connector_metadata()) if self.has_connector_metadata() else {}
        )
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        if loads:
            tm["step"] = {r for r, sync in loads.items() if sync}
            tm["async"].update({r: t0 for r, sync in loads.items() if not sync})
            tm["spent"] = time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The connector's wait_for_layer_load, timed in a step with loads."""
        tm = self._timer()
        t0 = time.perf_counter()
        super().wait_for_layer_load(layer_name)  # type: ignore[misc]
        if tm["step"]:
            tm["spent"] += time.perf_counter() - t0

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        """The connector's get_finished; ends the step's timings."""
        tm = self._timer()
        t0 = time.perf_counter()
        out = super().get_finished(finished_req_ids)  # type: ignore[misc]
        now = time.perf_counter()
        if tm["step"]:
            tm["times"].extend([tm["spent"] + now - t0] * len(tm["step"]))
            tm["step"] = set()
        for r in (out[1] or ()) if out else ():
            started = tm["async"].pop(r, None)
            if started is not None:
                tm["times"].append(now - started)
        return out


class TimedKvtierConnector(_LoadTimer, KvtierConnector):
    """kvtier's connector, its loads timed by :class:`_LoadTimer`."""

    def _loads_of(self, meta: Any) -> dict[str, bool]:
        return {s.req_id: bool(getattr(s, "layerwise", False)) for s in getattr(meta, "loads", ())}


class TimedExampleConnector(_LoadTimer, ExampleConnector):
    """vLLM's ExampleConnector (synchronous loads), timed by :class:`_LoadTimer`."""

    def _loads_of(self, meta: Any) -> dict[str, bool]:
        # its per-request metadata has no request id: any distinct name does
        return {
            f"load{i}": True for i, r in enumerate(getattr(meta, "requests", ())) if not r.is_store
        }


def _make_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(initializer_range=0.3, max_position_embeddings=8192, **BENCH_MODEL)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def _serve(cfg: dict[str, Any], out: Any) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.inputs import TokensPrompt

    kv = None
    if cfg["connector"] == "kvtier":
        kv = KVTransferConfig(
            kv_connector="TimedKvtierConnector",
            kv_connector_module_path="kvtier.bench.vllm_engine",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"runtime_dir": cfg["runtime_dir"], **cfg.get("extra", {})},
        )
    elif cfg["connector"] == "example":
        kv = KVTransferConfig(
            kv_connector="TimedExampleConnector",
            kv_connector_module_path="kvtier.bench.vllm_engine",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": cfg["example_dir"]},
        )
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=8192,
        block_size=32,
        kv_cache_memory_bytes=cfg.get("kv_bytes", 256 << 20),
        enable_prefix_caching=bool(cfg.get("prefix_caching", False)),
        kv_transfer_config=kv,
        seed=0,
    )
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, ignore_eos=True)
    full = SamplingParams(
        temperature=0.0, max_tokens=cfg.get("max_tokens", 8), logprobs=1, ignore_eos=True
    )
    timer = get_kv_transfer_group() if has_kv_transfer_group() else None
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        ids = json.loads(line)["prompt"]
        before = len(timer.load_times) if timer is not None else 0
        t0 = time.perf_counter()
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)], first, use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        loads = list(timer.load_times[before:]) if timer is not None else []
        time.sleep(cfg.get("pause_s", 0.0))  # the first request's stores end meanwhile
        rc = llm.generate([TokensPrompt(prompt_token_ids=ids)], full, use_tqdm=False)[0]
        c = rc.outputs[0]
        t1 = r.outputs[0].token_ids[0]
        out.write(
            json.dumps(
                {
                    "ttft_s": ttft,
                    "cached": r.num_cached_tokens or 0,
                    "load_s": loads,
                    "first": [t1, round(float(r.outputs[0].logprobs[0][t1].logprob), 4)],
                    "tokens": list(c.token_ids),
                    "tokens_cached": rc.num_cached_tokens or 0,
                    "logprobs": [
                        round(float(d[t].logprob), 4)
                        for d, t in zip(c.logprobs, c.token_ids, strict=True)
                    ],
                }
            )
            + "\n"
        )
        out.flush()


def main() -> None:
    """Run the engine described by the file ``sys.argv[1]`` (see the module docstring)."""
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    out = os.fdopen(os.dup(1), "w")  # the answers only: vLLM logs go to stderr
    os.dup2(2, 1)
    if cfg.get("make_model"):
        _make_model(cfg["model"])
        out.write("{}\n")
        out.flush()
    else:
        _serve(cfg, out)


if __name__ == "__main__":
    main()
