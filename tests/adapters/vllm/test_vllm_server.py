"""README.md's vLLM server command, run as a user copies it: two OpenAI-compatible servers
one after the other, the second serving the first one's prefix from kvtierd.

The command is read from the README's vLLM section (the ``sh`` block that starts the
server), with only what a user fills in replaced: ``MODEL`` by the test's model,
``/run/kvtier`` by the test daemon's runtime directory, and ``--host 127.0.0.1 --port N``
added (a test binds nothing else). The model is the tests' tiny random Llama with a
word-level tokenizer saved beside it (the server needs one; prompts are token ids all the
same). The hit is read from the server's own Prometheus metric
``vllm:external_prefix_cache_hits_total`` (tokens a KV connector supplied), and the second
server's greedy tokens and logprobs must equal the first one's, which computed them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import README, make_tiny_llama, prompt, wait_for_pages

pytestmark = pytest.mark.timeout(900)

START_S = 420.0
"""How long a server may take to answer /health (it compiles the model on the CPU)."""

_TOKENIZER = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {f"w{i}": i for i in range(1024)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                        eos_token="w2").save_pretrained(sys.argv[1])
"""


def readme_server_command() -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv) of the README's server command."""
    text = README.read_text()
    section = text[text.index("## Using kvtier with vLLM") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    command = next(b for b in blocks if "vllm.entrypoints.openai.api_server" in b)
    words = shlex.split(command.replace("\\\n", " "))
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The README's server on ``model``, run as written: its connector finds kvtierd where
    engines look by default, here ``$KVTIER_RUNTIME_DIR`` set to ``runtime_dir``."""

    def __init__(self, model: Path, runtime_dir: Path, log: Path) -> None:
        env_add, argv = readme_server_command()
        assert argv[0] == "python", f"the README's command starts with {argv[0]!r}"
        argv = [sys.executable, *argv[1:]]
        argv[argv.index("MODEL")] = str(model)
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert "runtime_dir" not in kv["kv_connector_extra_config"]  # the default's
        env_add["KVTIER_RUNTIME_DIR"] = str(runtime_dir)
        self.port = free_port()
        self.model = str(model)
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(self.port)],
            env={**os.environ, **env_add},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return r.read().decode()

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + START_S
        while True:
            assert self.proc.poll() is None, f"the server exited:\n{self.log_tail()}"
            try:
                self._get("/health")
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, f"no /health in {START_S}s:\n{self.log_tail()}"
                time.sleep(0.5)

    def complete(self, ids: list[int]) -> dict[str, Any]:
        """A greedy completion of the token ids ``ids``: its tokens and their logprobs."""
        body = json.dumps(
            {"model": self.model, "prompt": ids, "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        return {
            "tokens": choice["logprobs"]["tokens"],
            "logprobs": [round(x, 4) for x in choice["logprobs"]["token_logprobs"]],
        }

    def external_hits(self) -> float:
        """Tokens the KV connector supplied so far (vLLM's own counter)."""
        total = 0.0
        for line in self._get("/metrics").splitlines():
            if line.startswith("vllm:external_prefix_cache_hits_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        """Ctrl-C, as a user stops it (SIGKILL past 60 s); its exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def served_model(vllm_tmp: Path) -> Path:
    """The tiny random Llama with a tokenizer, as a server loads it."""
    path = make_tiny_llama(vllm_tmp / "served-llama")
    subprocess.run(
        [sys.executable, "-c", _TOKENIZER, str(path)], check=True, capture_output=True, timeout=300
    )
    return path


def test_the_readme_server_command_serves_a_restarted_server_from_kvtierd(
    daemon_factory, served_model, short_tmp
):
    d = daemon_factory()
    ids = prompt(41, 10 * 32 + 5)  # ten full blocks and a partial one
    servers: list[Server] = []
    try:
        first = Server(served_model, d.runtime_dir, short_tmp / "server1.log")
        servers.append(first)
        first.wait_healthy()
        computed = first.complete(ids)
        assert first.external_hits() == 0
        wait_for_pages(d.runtime_dir, served_model, ids, 10)
        assert first.stop() is not None

        second = Server(served_model, d.runtime_dir, short_tmp / "server2.log")
        servers.append(second)
        second.wait_healthy()
        assert second.complete(ids) == computed
        assert second.external_hits() == 10 * 32, second.log_tail()
    finally:
        for s in servers:
            s.stop()
