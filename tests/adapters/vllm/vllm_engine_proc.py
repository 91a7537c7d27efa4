"""A real vLLM engine in its own process, driven by JSON lines (run by vllm_harness.py).

    python vllm_engine_proc.py MODEL_DIR CONFIG_JSON

CONFIG_JSON: ``{"kvtier": {extra config} | null, "block_size": 32, "kv_bytes": ...,
"max_model_len": ..., "tp": n, "prefix_caching": false, "kv_events": {KVEventsConfig
fields} | null}`` (``tp`` > 1: that many worker processes, tensor parallel; ``kv_events``:
vLLM publishes its KV events, as ``--kv-events-config`` makes it). The process prints ``{"ready": true}`` once the engine is up, then
answers each request line ``{"prompts": [[ids]], "max_tokens": n, "salt": s}`` with
``{"outputs": [{"tokens": [...], "logprobs": [...], "cached": n}], "ok": true}``. Greedy sampling, prompts as token ids, vLLM's own prefix caching off unless ``prefix_caching``.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    """Start the engine and serve request lines until stdin closes."""
    model_dir, config = sys.argv[1], json.loads(sys.argv[2])
    out = os.fdopen(os.dup(1), "w")  # answers only: vLLM's own logs go to stderr
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if config.get("kvtier") is not None:
        # the README's --kv-transfer-config, with the test's extra config
        kv = KVTransferConfig(**{**config["kv_transfer"],
                                 "kv_connector_extra_config": config["kvtier"]})
    elif config.get("example_dir"):
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path":
                                                         config["example_dir"]})
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=config.get("max_model_len", 1024),
              block_size=config.get("block_size", 32),
              kv_cache_memory_bytes=config.get("kv_bytes", 64 << 20),
              enable_prefix_caching=config.get("prefix_caching", False),
              kv_events_config=KVEventsConfig(**config["kv_events"])
              if config.get("kv_events") else None,
              kv_transfer_config=kv, seed=0,
              tensor_parallel_size=config.get("tp", 1),
              distributed_executor_backend="mp" if config.get("tp", 1) > 1 else None)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8),
                                logprobs=1, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p, cache_salt=req["salt"]) if req.get("salt")
                   else TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs = []
        for r in results:
            c = r.outputs[0]
            lps = [round(float(d[t].logprob), 4) for d, t in zip(c.logprobs, c.token_ids)]
            outputs.append({"tokens": list(c.token_ids), "logprobs": lps,
                            "cached": r.num_cached_tokens or 0,
                            "finish": c.finish_reason})
        out.write(json.dumps({"ok": True, "outputs": outputs}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
