"""Edges of the vLLM connector where a request could get KV that is not its own.

- What a request's KV depends on besides its token ids, which kvtier's page keys must
  therefore tell apart: its prompt embeddings, its LoRA adapter, and the engine's
  ``kv_cache_dtype``. A request must never load pages computed for another embedding,
  another adapter or another KV encoding.
- A layer-wise load that fails: the pages the step computed over the missing KV must not
  be stored.

In each, a request's outputs with the connector must be those it gets alone, without a hit.
Each engine runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a few seconds to
start) from this very file (``python test_vllm_connector_edges.py MODEL CONFIG``, see
:func:`_serve`), which takes the engine settings these tests need (``enable_prompt_embeds``,
``enable_lora``, ``kv_cache_dtype``) and answers JSON lines. Every reference output comes
from the same engine, with a ``cache_salt`` of its own: the same computation, never a hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


# ---------------------------------------------------------------------------------------
# the engine process (this file run as a script)
# ---------------------------------------------------------------------------------------
def _serve(model_dir: str, config: dict[str, Any]) -> None:
    """A real ``vllm.LLM`` answering request lines (see :meth:`_Engine.generate`)."""
    out = os.fdopen(os.dup(1), "w")  # answers only: vLLM's own logs go to stderr
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations), not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import EmbedsPrompt, TokensPrompt
        from vllm.lora.request import LoRARequest

    armed = _arm_l2_flush(config["flush_endpoint"]) if config.get("flush_endpoint") else None
    kv = None
    if config.get("kvtier") is not None:
        kv = KVTransferConfig(
            **{**config["kv_transfer"], "kv_connector_extra_config": config["kvtier"]}
        )
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=1024,
        block_size=32,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,
        kv_transfer_config=kv,
        seed=0,
        **config.get("llm", {}),
    )
    hidden = llm.llm_engine.model_config.get_hidden_size()
    loras = {
        name: LoRARequest(name, i + 1, path)
        for i, (name, path) in enumerate(sorted(config.get("loras", {}).items()))
    }
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("flush_l2_before_next_load"):
            assert armed is not None, "the engine was started without flush_endpoint"
            armed.set()
        params = SamplingParams(
            temperature=0.0, max_tokens=req.get("max_tokens", 8), logprobs=1, ignore_eos=True
        )
        salt = {"cache_salt": req["salt"]} if req.get("salt") else {}
        prompts: list[Any] = []
        for p in req["prompts"]:
            if "embeds" in p:  # a prompt of embeddings, N(0, 0.3²) from its seed
                g = torch.Generator().manual_seed(int(p["embeds"]))
                e = (torch.randn(int(p["n"]), hidden, generator=g) * 0.3).to(torch.bfloat16)
                prompts.append(EmbedsPrompt(prompt_embeds=e, **salt))
            else:
                prompts.append(TokensPrompt(prompt_token_ids=p["tokens"], **salt))
        lora = loras[req["lora"]] if req.get("lora") else None
        try:
            results = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        except Exception as err:  # reported to the test
            out.write(json.dumps({"ok": False, "error": repr(err)}) + "\n")
            out.flush()
            continue
        outputs = []
        for r in results:
            c = r.outputs[0]
            lps = [round(float(d[t].logprob), 4) for d, t in zip(c.logprobs, c.token_ids)]
            outputs.append(
                {"tokens": list(c.token_ids), "logprobs": lps, "cached": r.num_cached_tokens or 0}
            )
        out.write(json.dumps({"ok": True, "outputs": outputs}) + "\n")
        out.flush()


def _arm_l2_flush(endpoint: str) -> Any:
    """Make the worker drop kvtierd's whole L2 (an admin FLUSH) right before the next
    layer-wise load it starts, once armed: what kvtierd evicting the pages, or restarting
    with an empty pool, between the scheduler's LOOKUP and the worker's LOAD does. Returns
    the event that arms it."""
    import threading

    from kvtier.client.adapters.vllm.worker import WorkerSide
    from kvtier.client.connection.admin import AdminClient
    from kvtier.ipc import protocol as P

    armed = threading.Event()
    start = WorkerSide._start_layerwise

    def start_layerwise(self, spec):  # type: ignore[no-untyped-def]
        if armed.is_set():
            armed.clear()
            with AdminClient(endpoint) as admin:
                assert isinstance(admin.call(P.Flush(req_id=0, tier="l2")), P.FlushReply)
        return start(self, spec)

    WorkerSide._start_layerwise = start_layerwise  # type: ignore[method-assign]
    return armed


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------
import pytest  # noqa: E402
from kvtier.client.connection.admin import AdminClient  # noqa: E402
from vllm_harness import (  # noqa: E402
    EngineError,
    BLOCK,
    TINY,
    EngineProcess,
    _vllm_shm,
    prompt,
    readme_kv_transfer_config,
    same_output,
)

pytestmark = pytest.mark.timeout(900)


class _Engine(EngineProcess):
    """One in-process vLLM engine run by :func:`_serve` (the harness's waits and exits)."""

    def __init__(
        self,
        model: Path,
        kvtier: dict[str, Any] | None,
        log: Path,
        llm: dict[str, Any] | None = None,
        loras: dict[str, str] | None = None,
        flush_endpoint: str | None = None,
    ) -> None:
        env = dict(
            os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0"
        )
        cfg = json.dumps(
            {
                "kvtier": kvtier,
                "kv_transfer": readme_kv_transfer_config(),
                "llm": llm or {},
                "loras": loras or {},
                "flush_endpoint": flush_endpoint,
            }
        )
        self.log_path = log
        self._shm_before = _vllm_shm()
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(model), cfg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )
        self._buf = b""

    def ask(
        self,
        prompts: list[dict[str, Any]],
        salt: str = "",
        lora: str | None = None,
        max_tokens: int = 8,
        flush_l2_before_load: bool = False,
    ) -> list[dict[str, Any]]:
        """Greedy generation; per prompt ``tokens``, ``logprobs`` and ``cached`` tokens
        (``flush_l2_before_load``: kvtierd's L2 is dropped right before the worker starts
        this request's layer-wise load, see :func:`_arm_l2_flush`)."""
        assert self.proc.stdin is not None
        line = {
            "prompts": prompts,
            "salt": salt,
            "lora": lora,
            "max_tokens": max_tokens,
            "flush_l2_before_next_load": flush_l2_before_load,
        }
        self.proc.stdin.write(json.dumps(line).encode() + b"\n")
        self.proc.stdin.flush()
        return self.receive(timeout=180.0)


@pytest.fixture
def start_engine(short_tmp: Path):
    """``start_engine(model, kvtier_extra, llm={...}, loras={...})``; all closed at teardown."""
    started: list[_Engine] = []

    def make(model: Path, kvtier: dict[str, Any] | None, **kw: Any) -> _Engine:
        e = _Engine(model, kvtier, short_tmp / f"edge-engine{len(started)}.log", **kw)
        started.append(e)
        return e.wait_ready(timeout=300.0)

    yield make
    for e in started:
        if e.proc.poll() is None:
            e.close(timeout=60.0)


def _stored_pages(daemon) -> int:
    """Pages kvtierd has copied from engines into L2 so far (whatever their keys)."""
    with AdminClient(daemon.endpoint) as admin:
        return int(dict(admin.stats())["counters"]["store_pages"])


def _wait_stored(daemon, before: int, pages: int) -> None:
    """Wait until kvtierd has copied ``pages`` more pages than ``before`` from engines."""
    deadline = time.monotonic() + 30
    while _stored_pages(daemon) < before + pages:
        assert time.monotonic() < deadline, f"kvtierd did not store {pages} pages in 30 s"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------
def test_prompts_of_different_embeddings_never_share_pages(daemon, start_engine, tiny_model):
    """vLLM gives a prompt of embeddings (``EmbedsPrompt``) placeholder token ids (all 0):
    two different embedding prompts of one length have the same token ids but not the same
    KV. kvtier keys pages by token ids, so it neither stores nor loads such a prompt: the
    second is computed, not loaded from the first's pages."""
    n = 200
    pages = (n - 1) // BLOCK
    e = start_engine(
        tiny_model, {"runtime_dir": str(daemon.runtime_dir)}, llm={"enable_prompt_embeds": True}
    )
    first, second = {"embeds": 1, "n": n}, {"embeds": 2, "n": n}
    want_second = e.ask([second], salt="alone")  # computed on its own (a salt of its own)
    assert want_second[0]["cached"] == 0
    before = _stored_pages(daemon)
    out = e.ask([first])
    assert out[0]["cached"] == 0
    assert not same_output(out, want_second), "the two embedding prompts must differ"
    out = e.ask([{"embeds": 3, "n": n}, {"embeds": 4, "n": n}])  # stores would have ended
    assert _stored_pages(daemon) == before, "pages of prompts of embeddings were stored"
    out = e.ask([second])
    assert same_output(out, want_second), (
        f"{out[0]['cached']} tokens of a prompt of embeddings were loaded from the pages "
        f"of another prompt of embeddings ({pages} pages stored under placeholder token ids)"
    )
    assert out[0]["cached"] == 0


_MAKE_LORA = """
import json, os, sys, torch
from safetensors.torch import save_file
out, base, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
os.makedirs(out, exist_ok=True)
torch.manual_seed(int(sys.argv[4]))
r, h = 8, cfg["hidden_size"]
kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
t = {}
for i in range(cfg["num_hidden_layers"]):
    for m in ("k_proj", "v_proj"):
        p = f"base_model.model.model.layers.{i}.self_attn.{m}"
        t[p + ".lora_A.weight"] = (torch.randn(r, h) * 0.3).contiguous()
        t[p + ".lora_B.weight"] = (torch.randn(kv, r) * 0.3).contiguous()
save_file(t, os.path.join(out, "adapter_model.safetensors"))
with open(os.path.join(out, "adapter_config.json"), "w") as f:
    json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 16,
               "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
               "target_modules": ["k_proj", "v_proj"], "base_model_name_or_path": base,
               "modules_to_save": None, "use_rslora": False, "use_dora": False}, f)
"""


def _make_lora(path: Path, base: Path, seed: int) -> Path:
    """A rank-8 LoRA of the tiny Llama's K and V projections (it changes the KV)."""
    subprocess.run(
        [sys.executable, "-c", _MAKE_LORA, str(path), str(base), json.dumps(TINY), str(seed)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return path


def test_a_lora_request_and_a_base_request_never_share_pages(
    daemon, start_engine, tiny_model, short_tmp
):
    """A LoRA of the K and V projections changes a prompt's KV: pages computed under one
    adapter must not be loaded by a request without it (vLLM's own prefix cache keys
    blocks by the LoRA too)."""
    lora = _make_lora(short_tmp / "lora-kv", tiny_model, 7)
    e = start_engine(
        tiny_model,
        {"runtime_dir": str(daemon.runtime_dir)},
        llm={"enable_lora": True, "max_lora_rank": 8, "max_loras": 1},
        loras={"kv": str(lora)},
    )
    p = prompt(61, 200)
    pages = (len(p) - 1) // BLOCK
    tokens = [{"tokens": p}]
    want_base = e.ask(tokens, salt="alone")
    want_lora = e.ask(tokens, salt="alone-lora", lora="kv")
    assert not same_output(want_base, want_lora), "the adapter must change the output"
    before = _stored_pages(daemon)
    out = e.ask(tokens, lora="kv")  # stored: pages of the prompt under the adapter
    assert same_output(out, want_lora)
    _wait_stored(daemon, before, pages)
    out = e.ask(tokens)  # the same prompt without the adapter
    assert same_output(out, want_base), (
        f"a request without LoRA loaded {out[0]['cached']} tokens computed under a LoRA"
    )
    assert out[0]["cached"] == 0


def test_engines_of_different_fp8_kv_cache_dtypes_never_share_pages(
    daemon, start_engine, tiny_model
):
    """``kv_cache_dtype="fp8_e4m3"`` and ``"fp8_e5m2"`` encode KV differently (both are
    uint8 tensors in vLLM's CPU cache): an e5m2 engine must not load an e4m3 engine's
    pages."""
    extra = {"runtime_dir": str(daemon.runtime_dir)}
    p = prompt(62, 200)
    pages = (len(p) - 1) // BLOCK
    try:
        e4m3 = start_engine(tiny_model, extra, llm={"kv_cache_dtype": "fp8_e4m3"})
    except EngineError as err:
        if "FP8 KV cache on CPU requires" not in str(err):
            raise
        pytest.skip("vLLM's CPU backend keeps an FP8 KV cache only on x86 with AVX-512 or AMX")
    before = _stored_pages(daemon)
    out = e4m3.ask([{"tokens": p}])
    assert out[0]["cached"] == 0
    _wait_stored(daemon, before, pages)
    e4m3.close()

    e5m2 = start_engine(tiny_model, extra, llm={"kv_cache_dtype": "fp8_e5m2"})
    want = e5m2.ask([{"tokens": p}], salt="alone")
    assert want[0]["cached"] == 0
    out = e5m2.ask([{"tokens": p}])
    assert same_output(out, want), (
        f"an fp8_e5m2 engine loaded {out[0]['cached']} tokens an fp8_e4m3 engine stored"
    )
    assert out[0]["cached"] == 0


def test_pages_computed_over_a_failed_layerwise_load_are_never_stored(
    daemon, start_engine, tiny_model
):
    """A layer-wise load that fails (kvtierd lost the pages between the scheduler's LOOKUP
    and the worker's LOAD) leaves the request's blocks without their KV; vLLM then throws
    that step's output away and recomputes the request. The pages the step computed past
    the hit attended to that missing KV: they must not reach kvtierd, or the next request
    with this prefix loads them and its output is wrong."""
    e = start_engine(
        tiny_model,
        {"runtime_dir": str(daemon.runtime_dir)},
        flush_endpoint=daemon.endpoint,
    )
    head = prompt(63, 200)  # 6 full pages are stored
    longer = head[:192] + prompt(64, 100)  # a 6-page hit, then 3 more full pages computed
    pages = (len(longer) - 1) // BLOCK
    want = e.ask([{"tokens": longer}], salt="alone")
    before = _stored_pages(daemon)
    assert e.ask([{"tokens": head}])[0]["cached"] == 0
    _wait_stored(daemon, before, 6)

    # the hit is planned, then its pages vanish before the worker loads them: vLLM
    # recomputes the request (its output stays right)
    before = _stored_pages(daemon)
    out = e.ask([{"tokens": longer}], flush_l2_before_load=True)
    assert same_output(out, want)
    _wait_stored(daemon, before, pages)  # the recomputed request's pages are stored

    out = e.ask([{"tokens": longer}])  # its prefix is loaded from kvtierd now
    assert out[0]["cached"] > 0
    assert same_output(out, want), (
        f"the {out[0]['cached'] // BLOCK} pages loaded from kvtierd are not this prompt's KV"
    )
