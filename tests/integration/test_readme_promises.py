"""What README.md promises a new user who follows it literally, checked against the real thing:
the Quick start's ``kvtier demo`` ("everything is removed at the end", ``--json PATH`` /
``--plot PATH``), the engine-mode (CUDA) variant of "Using it from an engine" in the parts a
CPU can run, and what ``systemd/install.sh`` does with the README's own install command."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INSTALL = ROOT / "systemd" / "install.sh"
KVTIER = str(Path(sys.executable).parent / "kvtier")
ENGINE_MARKER = "<!-- readme-snippet: engine -->"


def _env() -> dict[str, str]:
    """The caller's environment without KVTIER_* (a user who set nothing)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie whose parent has not reaped it is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------------- the demo
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_demo_stopped_by_a_signal_removes_its_private_daemon_pool_and_runtime_dir(
    sig: signal.Signals, tmp_path: Path
) -> None:
    """README (Quick start): ``make demo`` "starts a private kvtierd of its own in a temporary
    runtime directory (a 256 MiB host pool ...), and everything is removed at the end"; the
    demo itself prints "all of it is removed when the demo ends".

    A demo ended by SIGTERM (``timeout``, ``kill``, a CI job cancelled) or SIGHUP (its
    terminal closed) still stops its private kvtierd and removes the runtime directory and
    the 256 MiB pool file in /dev/shm, as it does on Ctrl-C and on errors: never a kvtierd
    left running, orphaned, holding /dev/shm and /tmp/kvtier-demo-*."""
    proc = subprocess.Popen(
        [KVTIER, "demo", "--model", "tiny", "--no-plot", "--turns", "60"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a signal sent here reaches the demo only, as `kill PID` does
    )
    pid = 0
    rdir = pool = None
    head: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded: the demo ends by itself after 60 turns
            head.append(line)
            if m := re.search(r"a private kvtierd \(pid (\d+)\)", line):
                pid = int(m.group(1))
            if m := re.match(r"\s+runtime dir\s+(\S+)", line):
                rdir = Path(m.group(1))
            if m := re.match(r"\s+host pool\s+.* in (\S+)", line):
                pool = Path(m.group(1))
            if re.match(r"\s+0\s+1\s", line):  # a table row: the run is under way
                break
        assert pid and rdir and pool, "".join(head)
        assert _alive(pid) and rdir.is_dir() and pool.exists()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (_alive(pid) or rdir.exists() or pool.exists()):
            time.sleep(0.2)
        left = [
            what
            for what, there in (
                (f"kvtierd pid {pid} still running", _alive(pid)),
                (f"runtime dir {rdir}", rdir.exists()),
                (f"pool file {pool}", pool.exists()),
            )
            if there
        ]
        assert not left, f"after {sig.name} the demo (exit {proc.returncode}) left: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
            for _ in range(100):
                if not _alive(pid):
                    break
                time.sleep(0.1)
        if pool is not None:
            pool.unlink(missing_ok=True)
        if rdir is not None and rdir.name.startswith("kvtier-demo-"):
            subprocess.run(["rm", "-rf", "--", str(rdir)], check=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_demo_output_path_that_cannot_be_written_is_a_one_line_error(
    option: str, tmp_path: Path
) -> None:
    """README (Quick start): ``--plot PATH`` says where the plot goes, ``--json PATH`` keeps
    the numbers; the CLI promises one-line errors for every command, demo included, and
    ``kvtier demo`` exits 1 only when its targets are not met, 2 when it could not run.

    A PATH that cannot be written (here: its directory is a regular file) is refused with
    one line ``kvtier demo: ...`` naming it and exit code 2, before the demo runs (its
    numbers would be lost), never a traceback or exit 1 ("targets not met")."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    out = blocker / ("x.json" if option == "--json" else "x.png")
    extra = [option, str(out)] + (["--no-plot"] if option == "--json" else [])
    r = subprocess.run(
        [KVTIER, "demo", "--model", "tiny", "--conversations", "1", "--turns", "2", *extra],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert "Traceback" not in r.stderr, r.stderr[-1500:]
    assert r.returncode == 2, (r.returncode, r.stderr[-800:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier demo: ") and str(blocker) in lines[0]


# ------------------------------------------------------- "Using it from an engine", CUDA
def _python_blocks_after_marker() -> tuple[str, str]:
    """The engine snippet (the block after the marker) and the next python block of README.md,
    the engine copy mode's ``StagedConnection`` variant."""
    after = README.read_text().split(ENGINE_MARKER, 1)[1]
    blocks = re.findall(r"```python\n(.*?)\n```", after, re.DOTALL)
    assert len(blocks) >= 2, "README: the engine snippet and its GPU variant"
    assert "StagedConnection" in blocks[1], blocks[1]
    return blocks[0], blocks[1]


def _staged_variant_on_cpu() -> str:
    """The README's engine-mode block made runnable on a CPU: its own lines (the import, the
    engine's KV tensors with ``device="cpu"`` for ``"cuda"``, the ``with`` line) around the
    first snippet's setup and body, which the block says are "the same calls as above"."""
    first, staged = _python_blocks_after_marker()
    head, body = first.split("\nwith (", 1)
    body_lines = body.split("\n")
    start = next(i for i, ln in enumerate(body_lines) if ln.startswith("):")) + 1
    calls = "\n".join(body_lines[start:])
    s_lines = staged.split("\n")
    imports = [ln for ln in s_lines if ln.startswith("from ")]
    kv = [ln for ln in s_lines if ln.startswith("kv = ")]
    with_line = [ln for ln in s_lines if ln.startswith("with StagedConnection.over(")]
    assert len(imports) == 1 and len(kv) == 1 and len(with_line) == 1, staged
    assert 'device="cuda"' in kv[0]
    return "\n".join(
        [
            "import torch",
            imports[0],
            head,
            kv[0].replace('device="cuda"', 'device="cpu"'),
            with_line[0],
            calls,
        ]
    )


@pytest.mark.timeout(120)
def test_readme_engine_copy_mode_variant_runs_on_cpu_tensors_and_names_real_apis(
    daemon_factory,
) -> None:
    """README ("On a GPU"): ``StagedConnection.over(kv, geometry, model_id, staging_pages=8)``
    takes "the same calls as above", ``CudaKVPool(geometry, num_pages, device="cuda:0")``
    lives in ``kvtier.client.kv_pool.cuda``, ``CudaRegionMemory`` in
    ``kvtier.client.kv_pool.cuda_regions``, and ``ReferenceEngine(device=..., copy_mode=...)``.

    The block with CPU tensors runs against a real daemon and
    prints ``0 of 6 ...`` then ``6 of 6 ...``, and every name and keyword it shows exists."""
    from kvtier.client.cache.staged import StagedConnection
    from kvtier.client.kv_pool.cuda import CudaKVPool
    from kvtier.client.kv_pool.cuda_regions import CudaRegionMemory
    from kvtier.engine.engine import ReferenceEngine

    assert "staging_pages" in inspect.signature(StagedConnection.over).parameters
    assert "device" in inspect.signature(CudaKVPool).parameters
    assert CudaRegionMemory.__name__ == "CudaRegionMemory"
    params = inspect.signature(ReferenceEngine).parameters
    assert "device" in params and "copy_mode" in params

    daemon = daemon_factory("--lease-s", "30")
    script = _staged_variant_on_cpu()
    env = {**_env(), "KVTIER_RUNTIME_DIR": str(daemon.runtime_dir)}
    outs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.strip())
    assert outs == ["0 of 6 pages from L2; stored: True", "6 of 6 pages from L2; stored: True"]


# ------------------------------------------------------------------ Install as a service
@pytest.mark.timeout(60)
def test_install_sh_unhides_home_when_the_venvs_python_lives_there(tmp_path: Path) -> None:
    """README (Install as a service): ``sudo systemd/install.sh --kvtierd
    "$(pwd)/.venv/bin/kvtierd"`` "points ExecStart at your kvtierd"; the unit says "A venv
    under /home or /root also needs ProtectHome=read-only", and install.sh writes that into
    its drop-in when the kvtierd path starts with /home or /root.

    A venv made by ``python -m venv`` with a pyenv or uv Python (as this repository's own
    .venv is: .venv/bin/python -> /root/.pyenv/...) runs an interpreter under a home
    directory even when the venv is elsewhere (/opt, /srv, /work): install.sh follows
    kvtierd's ``#!`` interpreter and, when it resolves under /home or /root, writes
    ``ProtectHome=read-only`` (and warns that user kvtier must reach it), as for a kvtierd
    under /home (the unit's ProtectHome=yes would hide the interpreter: status 203/EXEC)."""
    root = tmp_path / "root"
    venv_bin = root / "opt" / "kvtier" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    # what `python -m venv` makes with a pyenv interpreter of user alice
    (venv_bin / "python3").symlink_to("/home/alice/.pyenv/versions/3.12.3/bin/python3")
    (venv_bin / "python").symlink_to("python3")
    kvtierd = venv_bin / "kvtierd"
    kvtierd.write_text(
        "#!/opt/kvtier/.venv/bin/python\n"
        "import sys\nfrom kvtier.daemon.__main__ import main\nsys.exit(main())\n"
    )
    kvtierd.chmod(0o755)
    r = subprocess.run(
        ["bash", str(INSTALL), "--root", str(root), "--kvtierd", "/opt/kvtier/.venv/bin/kvtierd"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    dropin = root / "etc/systemd/system/kvtier.service.d/10-kvtierd-path.conf"
    text = dropin.read_text()
    assert "ExecStart=/opt/kvtier/.venv/bin/kvtierd --config /etc/kvtier/kvtierd.toml" in text
    assert "ProtectHome=read-only" in text, (
        "kvtierd's interpreter resolves to /home/alice/.pyenv/..., hidden by the unit's "
        f"ProtectHome=yes; drop-in:\n{text}\nstderr:\n{r.stderr}"
    )


@pytest.mark.timeout(60)
def test_install_sh_unhides_tmp_when_kvtierd_lives_there(tmp_path: Path) -> None:
    """A checkout under /tmp (``install.sh --kvtierd /tmp/kvtier/.venv/bin/kvtierd``): the
    unit's PrivateTmp=yes gives kvtierd a /tmp of its own, where its ExecStart is not found.
    install.sh writes PrivateTmp=no into its drop-in for it, and warns that a temporary
    directory is no place to install to."""
    root = tmp_path / "root"
    venv_bin = root / "tmp" / "kvtier" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    kvtierd = venv_bin / "kvtierd"
    kvtierd.write_text("#!/usr/bin/python3\nraise SystemExit(0)\n")
    kvtierd.chmod(0o755)
    r = subprocess.run(
        ["bash", str(INSTALL), "--root", str(root), "--kvtierd", "/tmp/kvtier/.venv/bin/kvtierd"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    text = (root / "etc/systemd/system/kvtier.service.d/10-kvtierd-path.conf").read_text()
    assert "PrivateTmp=no" in text and "ProtectHome" not in text, text
    assert "temporary directory" in r.stderr
