"""A request preempted, resumed by a load from kvtierd and aborted while it loads, against a
real vLLM and a real kvtierd.

Each engine runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) from this very file
(``python test_vllm_preempted_abort.py MODEL CONFIG``, see :func:`_serve`): it drives vLLM's own
``LLMEngine`` (``add_request`` / ``step`` / ``abort_request``), so a test can abort a request
after a given number of steps, and it reports what the connector's two sides still hold per
request. Reference outputs come from an engine of the same settings without the connector.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


# ---------------------------------------------------------------------------------------
# the engine process (this file run as a script)
# ---------------------------------------------------------------------------------------
def _connector_state(llm: Any) -> dict[str, Any]:
    """What the connector's scheduler side and worker side hold per request."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler.connector
    state: dict[str, Any] = {"vllm_requests": sorted(core.scheduler.requests)}
    if sched is not None and sched._scheduler is not None:
        s = sched._scheduler
        state["scheduler"] = {
            "hits": sorted(s._hits),
            "in_l2": sorted(s._in_l2),
            "chains": sorted(s._chains),
            "tracked": sorted(s._tracked),
            "loads": [x.req_id for x in s._loads],
        }
    agent = kv_transfer_state._KV_CONNECTOR_AGENT
    if agent is not None and agent._worker is not None:
        w = agent._worker
        with w._cv:
            state["worker"] = {
                "stored": sorted(w._stored),
                "finished": sorted(w._finished),
                "outstanding": sorted(r for r, n in w._outstanding.items() if n),
                "outstanding_keys": sorted(w._outstanding),
                "loading": sorted(w._loading),
                "loaded": sorted(w._loaded),
                "load_started": sorted(w._load_started),
            }
    return state


def _serve(model_dir: str, config: dict[str, Any]) -> None:
    """A real ``vllm.LLM`` answering request lines (see :meth:`_Engine.run`)."""
    out = os.fdopen(os.dup(1), "w")  # answers only: vLLM's own logs go to stderr
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations), not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

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
        block_size=32,
        kv_transfer_config=kv,
        seed=0,
        **{
            "max_model_len": 1024,
            "kv_cache_memory_bytes": 64 << 20,
            "enable_prefix_caching": False,
            **config.get("llm", {}),
        },
    )
    engine = llm.llm_engine
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    counter = 0
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("state"):
            out.write(json.dumps({"ok": True, "state": _connector_state(llm)}) + "\n")
            out.flush()
            continue
        params = SamplingParams(
            temperature=0.0, max_tokens=req.get("max_tokens", 8), logprobs=1, ignore_eos=True
        )
        salt = {"cache_salt": req["salt"]} if req.get("salt") else {}
        ids = []
        for p in req["prompts"]:
            rid = f"q{counter}"
            counter += 1
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p, **salt), params)
            ids.append(rid)
        abort = {ids[i] for i in req.get("abort", [])}
        abort_at = req.get("abort_after_steps")
        done: dict[str, Any] = {}
        steps = 0
        sched = engine.engine_core.engine_core.scheduler
        events: list[str] = []
        try:
            while engine.has_unfinished_requests():
                if abort and abort_at is not None and steps == abort_at:
                    engine.abort_request(sorted(abort))
                if req.get("abort_resumed"):
                    # a request preempted earlier, now waiting for its KV to load
                    resumed = [
                        r.request_id
                        for r in sched.requests.values()
                        if r.num_preemptions
                        and r.status.name == "WAITING_FOR_REMOTE_KVS"
                        and r.request_id not in sched.finished_recving_kv_req_ids
                    ]
                    if resumed:
                        events.append(f"abort {resumed} at step {steps}")
                        external = [r.rsplit("-", 1)[0] for r in resumed]
                        abort |= set(external)
                        engine.abort_request(external)
                for r in engine.step():
                    if r.finished:
                        done[r.request_id] = r
                steps += 1
                if steps > 20000:
                    raise RuntimeError("the engine did not finish the requests")
        except Exception as err:  # reported to the test
            import traceback

            tb = traceback.format_exc().splitlines()[-6:]
            out.write(json.dumps({"ok": False, "error": repr(err), "where": tb}) + "\n")
            out.flush()
            continue
        outputs = []
        for rid in ids:
            r = done.get(rid)
            if r is None or rid in abort:
                outputs.append(None)
                continue
            c = r.outputs[0]
            lps = [round(float(d[t].logprob), 4) for d, t in zip(c.logprobs, c.token_ids)]
            outputs.append(
                {"tokens": list(c.token_ids), "logprobs": lps, "cached": r.num_cached_tokens or 0}
            )
        out.write(
            json.dumps({"ok": True, "outputs": outputs, "steps": steps, "events": events}) + "\n"
        )
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------
import pytest  # noqa: E402
from vllm_harness import (  # noqa: E402
    EngineProcess,
    _vllm_shm,
    prompt,
    readme_kv_transfer_config,
)

pytestmark = pytest.mark.timeout(240)


class _Engine(EngineProcess):
    """One in-process vLLM engine run by :func:`_serve` (the harness's waits and exits)."""

    def __init__(
        self, model: Path, kvtier: dict[str, Any] | None, log: Path, llm: dict[str, Any]
    ) -> None:
        env = dict(
            os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0"
        )
        cfg = json.dumps({"kvtier": kvtier, "kv_transfer": readme_kv_transfer_config(), "llm": llm})
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

    def _ask(self, line: dict[str, Any], timeout: float = 150.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(line).encode() + b"\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def run(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        salt: str = "",
        abort: list[int] | None = None,
        abort_after_steps: int | None = None,
        abort_resumed: bool = False,
    ) -> list[dict[str, Any] | None]:
        """Greedy generation through vLLM's ``LLMEngine`` steps; the prompts ``abort`` (by
        index) are aborted after ``abort_after_steps`` steps (their output: None)."""
        rep = self._ask(
            {
                "prompts": prompts,
                "max_tokens": max_tokens,
                "salt": salt,
                "abort": abort or [],
                "abort_after_steps": abort_after_steps,
                "abort_resumed": abort_resumed,
            }
        )
        self.events = rep.get("events", [])
        assert rep.get("ok"), f"request failed: {rep}; log tail:\n{self.log_tail()}"
        return rep["outputs"]

    def state(self) -> dict[str, Any]:
        """What the connector holds per request (see :func:`_connector_state`)."""
        rep = self._ask({"state": True}, timeout=30.0)
        assert rep.get("ok"), rep
        return rep["state"]


@pytest.fixture
def start_engine(short_tmp: Path, tiny_model: Path):
    """``start_engine(kvtier_extra_or_None, **llm_settings)``; all closed at teardown."""
    started: list[_Engine] = []

    def make(kvtier: dict[str, Any] | None, **llm: Any) -> _Engine:
        e = _Engine(tiny_model, kvtier, short_tmp / f"more-engine{len(started)}.log", llm)
        started.append(e)
        return e.wait_ready(timeout=200.0)

    yield make
    for e in started:
        if e.proc.poll() is None:
            e.close(timeout=60.0)


SMALL = {
    "kv_cache_memory_bytes": 20 * 64 * 1024,  # 20 blocks: four requests preempt each other
    "max_model_len": 384,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 64,
}
"""A KV cache so small that requests are preempted, and recomputed from kvtierd's pages."""


# ---------------------------------------------------------------------------------------
def test_aborting_a_resumed_request_while_its_kv_loads_keeps_the_engine_serving(
    daemon, start_engine
):
    """With ``layerwise_loads`` off every hit loads asynchronously: a request preempted
    under KV pressure (its pages stored in kvtierd) is resumed by loading them, and waits
    in ``WAITING_FOR_REMOTE_KVS``. A client that aborts it then (a disconnect) does not
    take the engine down: vLLM already keeps the request's blocks until the load is
    reported, so its blocks are freed once, the other requests finish, the engine goes on
    serving, and neither vLLM nor the connector keeps the aborted request."""
    e = start_engine({"runtime_dir": str(daemon.runtime_dir), "layerwise_loads": False}, **SMALL)
    head = prompt(81, 128)
    ps = [head + prompt(90 + i, 20 + 13 * i) for i in range(4)]
    aborted: list[str] = []
    for attempt in range(3):  # fresh pages each time (a salt of its own)
        outs = e.run(ps, max_tokens=150, salt=f"try{attempt}", abort_resumed=True)
        aborted = e.events
        if aborted:
            break
    assert aborted, "no request was preempted and resumed through an asynchronous load"
    assert sum(o is None for o in outs) >= 1
    after = e.run([prompt(5, 100)], max_tokens=4)  # the engine goes on serving
    assert after[0] is not None and len(after[0]["tokens"]) == 4
    e.run([prompt(6, 40)], max_tokens=1)  # one more step: the last request's release
    state = e.state()
    gone = set(re.findall(r"'([^']+)'", " ".join(aborted)))
    held = {
        f"{side}.{name}": set(ids) & gone
        for side in ("scheduler", "worker")
        for name, ids in state[side].items()
    }
    held["vllm.requests"] = set(state["vllm_requests"]) & gone
    assert not any(held.values()), f"the aborted requests are still held: {held}"
