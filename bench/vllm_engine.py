"""One fresh vLLM engine of ``kvtier bench vllm`` (run as a subprocess by bench/vllm.py).

    python -m kvtier.bench.vllm_engine CONFIG_PATH

CONFIG_PATH: a JSON file ``{"model": dir, "connector": "kvtier" | "example" | "none", "runtime_dir": ...,
"example_dir": ..., "warmup": [ids], "prompts": {label: [ids]}, "max_tokens": n}``. It
prints one JSON line: per label the time to first token (a ``max_tokens=1`` request),
then the greedy tokens and logprobs of a second request, the tokens vLLM reports cached,
and the connector's load times (seconds per loaded request). Also ``make_model``: write
the benchmark's random Llama to ``model``.

:class:`TimedExampleConnector` is vLLM's ``ExampleConnector`` with its (synchronous) loads
timed, so both connectors' load times are measured the same way: from the step that starts
a load to the moment its KV is in vLLM's blocks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

BENCH_MODEL = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
               "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4}
"""A random Llama whose 4K-token prefill takes about a second on a 2-core machine."""


class TimedExampleConnector(ExampleConnector):
    """vLLM's ExampleConnector, recording how long each step's loads take."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_times: list[float] = []

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load as ExampleConnector does; time it when there was something to load."""
        meta = self._get_connector_metadata()
        loads = any(not r.is_store for r in getattr(meta, "requests", ()))
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        if loads:
            self.load_times.append(time.perf_counter() - t0)


def _make_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(initializer_range=0.3, max_position_embeddings=8192, **BENCH_MODEL)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def _run(cfg: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.inputs import TokensPrompt

    kv = None
    if cfg["connector"] == "kvtier":
        kv = KVTransferConfig(kv_connector="KvtierConnector",
                              kv_connector_module_path="kvtier.client.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"runtime_dir": cfg["runtime_dir"]})
    elif cfg["connector"] == "example":
        kv = KVTransferConfig(kv_connector="TimedExampleConnector",
                              kv_connector_module_path="kvtier.bench.vllm_engine",
                              kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": cfg["example_dir"]})
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=8192, block_size=32, kv_cache_memory_bytes=cfg.get("kv_bytes", 256 << 20),
              enable_prefix_caching=False, kv_transfer_config=kv, seed=0)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=cfg.get("max_tokens", 8), logprobs=1,
                          ignore_eos=True)
    if cfg.get("warmup"):
        llm.generate([TokensPrompt(prompt_token_ids=cfg["warmup"])], full, use_tqdm=False)
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    results: dict[str, Any] = {}
    for label, ids in cfg["prompts"].items():
        before = len(_load_times(worker))
        t0 = time.perf_counter()
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)], first, use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        loads = _load_times(worker)[before:]
        c = llm.generate([TokensPrompt(prompt_token_ids=ids)], full, use_tqdm=False)[0].outputs[0]
        results[label] = {"ttft_s": ttft, "cached": r.num_cached_tokens or 0, "load_s": loads,
                          "tokens": list(c.token_ids),
                          "logprobs": [round(float(d[t].logprob), 4)
                                       for d, t in zip(c.logprobs, c.token_ids, strict=True)]}
    return results


def _load_times(connector: Any) -> list[float]:
    if connector is None:
        return []
    worker = getattr(connector, "_worker", None)  # KvtierConnector's worker side
    return list(getattr(worker, "load_times", None) or getattr(connector, "load_times", []))


def main() -> None:
    """Run the engine described by the file ``sys.argv[1]`` and print its measurements."""
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    out = os.fdopen(os.dup(1), "w")  # the answer only: vLLM logs go to stderr
    os.dup2(2, 1)
    if cfg.get("make_model"):
        _make_model(cfg["model"])
        out.write("{}\n")
    else:
        out.write(json.dumps(_run(cfg)) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
