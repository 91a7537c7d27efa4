"""A real vLLM engine in its own process, driven by JSON lines (run by vllm_harness.py).

    python vllm_engine_proc.py MODEL_DIR CONFIG_JSON

CONFIG_JSON: ``{"kvtier": {extra config} | null, "block_size": 32, "kv_bytes": ...,
"max_model_len": ..., "tp": n, "record_loads": bool, "prefix_caching": false, "kv_events":
{KVEventsConfig fields} | null}`` (``tp`` > 1: that many worker processes, tensor parallel;
``kv_events``: vLLM publishes its KV events, as ``--kv-events-config`` makes it). The process
prints ``{"ready": true}`` once the engine is up, then answers each request line
``{"prompts": [[ids]], "max_tokens": n, "salt": s}`` with ``{"outputs": [{"tokens": [...],
"logprobs": [...], "cached": n}], "ok": true}``. Greedy sampling, prompts as token ids, vLLM's
own prefix caching off unless ``prefix_caching``.

With ``record_loads`` (the worker in this process: no tensor parallelism, vLLM's engine
core in-process), the connector's worker side is watched: for every load it ran, what vLLM
is told when the load ends (the request reported in ``finished_recving``, or the step of a
layer-wise load ending) is recorded with the SHA-256 of each of the load's blocks at that
moment, all layers in layer order (the bytes vLLM then computes with). A request line
``{"loads": true}`` is answered with ``{"ok": true, "loads": [...]}`` (and the record is
cleared): per load ``req_id``, ``tokens``, ``start``, ``block_ids``, ``layerwise``,
``errors`` (the blocks reported as not loaded) and ``digests`` (one per block).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from typing import Any


def record_loads() -> list[dict[str, Any]]:
    """Watch every WorkerSide made in this process from now on (see the module docstring);
    return the list the finished loads are appended to."""
    import torch
    from kvtier.client.adapters.vllm.staged_worker import StagedWorkerSide
    from kvtier.client.adapters.vllm.worker import WorkerSide

    done: list[dict[str, Any]] = []
    lock = threading.Lock()
    start, finished = WorkerSide.start_loads, WorkerSide.get_finished

    def watched(register):  # type: ignore[no-untyped-def]
        # each copy mode's worker side registers vLLM's KV tensors in its own way
        def register_kv_caches(self, kv_caches, layer_index):  # type: ignore[no-untyped-def]
            seen: dict[int, torch.Tensor] = {}
            for name in sorted(kv_caches, key=layer_index.__getitem__):
                seen.setdefault(kv_caches[name].data_ptr(), kv_caches[name])
            self._recorded_layers = list(seen.values())
            self._recorded_specs = {}
            return register(self, kv_caches, layer_index)

        return register_kv_caches

    def start_loads(self, meta, idle=False):  # type: ignore[no-untyped-def]
        for spec in meta.loads:
            self._recorded_specs.setdefault(spec.req_id, spec)
        return start(self, meta, idle)

    def digest(self, block: int) -> str:  # type: ignore[no-untyped-def]
        h = hashlib.sha256()
        for t in self._recorded_layers:
            h.update(t[block].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
        sending, recving = finished(self, finished_req_ids)
        with self._cv:
            errors = set(self._step_errors)  # reported by load_errors() next
        ended = [
            spec for r, spec in list(self._recorded_specs.items()) if r in recving or spec.layerwise
        ]
        for spec in ended:
            del self._recorded_specs[spec.req_id]
            with lock:
                done.append(
                    {
                        "req_id": spec.req_id,
                        "tokens": list(spec.tokens),
                        "start": spec.start,
                        "block_ids": list(spec.block_ids),
                        "layerwise": spec.layerwise,
                        "errors": sorted(errors & set(spec.block_ids)),
                        "digests": [digest(self, b) for b in spec.block_ids],
                    }
                )
        return sending, recving

    for side in (WorkerSide, StagedWorkerSide):
        side.register_kv_caches = watched(side.register_kv_caches)  # type: ignore[method-assign]
    WorkerSide.start_loads = start_loads  # type: ignore[method-assign]
    WorkerSide.get_finished = get_finished  # type: ignore[method-assign]
    return done


def main() -> None:
    """Start the engine and serve request lines until stdin closes."""
    model_dir, config = sys.argv[1], json.loads(sys.argv[2])
    out = os.fdopen(os.dup(1), "w")  # answers only: vLLM's own logs go to stderr
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    loads = record_loads() if config.get("record_loads") else None
    kv = None
    if config.get("kvtier") is not None:
        # the README's --kv-transfer-config, with the test's extra config
        kv = KVTransferConfig(
            **{**config["kv_transfer"], "kv_connector_extra_config": config["kvtier"]}
        )
    elif config.get("example_dir"):
        kv = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": config["example_dir"]},
        )
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=config.get("max_model_len", 1024),
        block_size=config.get("block_size", 32),
        kv_cache_memory_bytes=config.get("kv_bytes", 64 << 20),
        enable_prefix_caching=config.get("prefix_caching", False),
        kv_events_config=KVEventsConfig(**config["kv_events"]) if config.get("kv_events") else None,
        kv_transfer_config=kv,
        seed=0,
        tensor_parallel_size=config.get("tp", 1),
        distributed_executor_backend="mp" if config.get("tp", 1) > 1 else None,
    )
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("loads"):
            assert loads is not None, "the engine was started without record_loads"
            out.write(json.dumps({"ok": True, "loads": loads[:]}) + "\n")
            out.flush()
            del loads[: len(loads)]
            continue
        params = SamplingParams(
            temperature=0.0, max_tokens=req.get("max_tokens", 8), logprobs=1, ignore_eos=True
        )
        prompts = [
            TokensPrompt(prompt_token_ids=p, cache_salt=req["salt"])
            if req.get("salt")
            else TokensPrompt(prompt_token_ids=p)
            for p in req["prompts"]
        ]
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs = []
        for r in results:
            c = r.outputs[0]
            lps = [round(float(d[t].logprob), 4) for d, t in zip(c.logprobs, c.token_ids)]
            outputs.append(
                {
                    "tokens": list(c.token_ids),
                    "logprobs": lps,
                    "cached": r.num_cached_tokens or 0,
                    "finish": c.finish_reason,
                }
            )
        out.write(json.dumps({"ok": True, "outputs": outputs}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
