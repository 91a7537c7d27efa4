"""The ``kvtier`` command line as an operator uses it: the installed console script run as a
subprocess against no daemon, a daemon of another uid, a hung daemon, and bad arguments.

What an operator is promised (README "Admin commands", docs/metrics.md "kvtier stats and
friends", cli/admin.py): never a Python traceback, one line naming the problem and what to
do, exit 0 on success, 1 when the daemon refused / is unhealthy / did not answer, 2 for bad
usage (nothing sent), and no wait past ``--timeout``.
"""

from __future__ import annotations

import os
import signal
import site
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import find_binary

KVTIER = find_binary("kvtier")
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


# ---------------------------------------------------------------------------- helpers
def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    base.update(extra or {})
    base["COLUMNS"] = "200"
    return base


def kvtier(
    *args: str | bytes, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``kvtier`` console script (bytes arguments pass as they are)."""
    if KVTIER is None:
        pytest.fail(f"the kvtier console script is not installed next to {sys.executable}")
    return subprocess.run(
        [KVTIER, *args],
        env=_env(env),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        check=False,
        cwd="/tmp",
    )


def kvtier_as_nobody(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the same ``kvtier`` entry point as uid ``nobody`` (a real distinct uid).

    The venv's interpreter lives under /root (mode 0700 here), which ``nobody`` cannot
    execute, so this runs ``kvtier.cli.main.main`` with the system's python of the same
    version on the venv's site-packages: the same code the console script runs.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to run a command as another uid")
    probe = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0 or probe.stdout.strip() != str(tuple(sys.version_info[:2])):
        pytest.skip(f"no {SYSTEM_PYTHON} of python {sys.version_info[:2]} to run as nobody")
    sites = [p for p in site.getsitepackages() if p.startswith(sys.prefix)]
    code = (
        "import site, sys\n"
        f"for p in {sites!r}: site.addsitedir(p)\n"
        "from kvtier.cli.main import main\n"
        "sys.argv[0] = 'kvtier'\n"
        "sys.exit(main())\n"
    )
    return subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", code, *args],
        env=_env({"HOME": "/tmp"}),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        check=False,
        cwd="/tmp",
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
    )


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    out = r.stdout + r.stderr
    assert "Traceback" not in out, f"a Python traceback reached the terminal:\n{out[-2000:]}"


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines!r}"
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def open_dirs_to_others(daemon, runtime_mode: int) -> None:
    """Let other users walk down to the daemon's runtime directory (mkdtemp made 0700)."""
    os.chmod(daemon.runtime_dir.parent, 0o755)
    os.chmod(daemon.runtime_dir, runtime_mode)


# ---------------------------------------------------------------------------- another uid
@pytest.mark.timeout(90)
def test_socket_of_another_user_is_reported_as_permission_denied(daemon):
    """A daemon of root in a runtime directory others may enter (mode 0755, allowed by the
    README) has its socket mode 0660 root:root. ``nobody`` running ``kvtier stats`` /
    ``health`` must be told that permission is denied on the socket and what to do (run as
    the daemon's user or in its group, as the message for an unenterable directory says),
    with exit 1, at once: not a timeout that reads like a hung daemon."""
    open_dirs_to_others(daemon, 0o755)
    st = os.stat(daemon.socket)
    assert st.st_uid == 0 and st.st_mode & 0o007 == 0  # others may not connect
    for cmd in ("stats", "sessions"):
        r = kvtier_as_nobody(cmd, "--runtime-dir", str(daemon.runtime_dir), "--timeout", "1")
        no_traceback(r)
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
        line = one_line(r.stderr)
        assert "permission" in line.lower(), line
        assert "group" in line or "user" in line, line


@pytest.mark.timeout(90)
def test_health_of_unreachable_daemon_prints_unhealthy_line_on_stdout(daemon):
    """docs/metrics.md: "`unhealthy: ...` and exit 1 also when the daemon is unreachable";
    probes read that one line on stdout. When the runtime directory cannot be entered
    (daemon of root, mode 0750, CLI run as ``nobody``), ``kvtier health`` must print
    ``unhealthy: <why>`` on stdout and exit 1, the why naming the permission denied."""
    open_dirs_to_others(daemon, 0o750)
    r = kvtier_as_nobody("health", "--runtime-dir", str(daemon.runtime_dir), "--timeout", "1")
    no_traceback(r)
    assert r.returncode == 1
    assert one_line(r.stdout).startswith("unhealthy: "), (r.stdout, r.stderr)
    assert "permission denied" in r.stdout


# ---------------------------------------------------------------------------- admin bad arguments
@pytest.mark.timeout(60)
@pytest.mark.parametrize("via", ["flag", "env"])
def test_non_utf8_admin_token_is_a_usage_error(daemon, via):
    """An admin token that is not UTF-8 (``--admin-token $'\\xff'`` or the same in
    ``$KVTIER_ADMIN_TOKEN``) is a bad value: one line ``kvtier stats: ...`` on stderr,
    exit 2, nothing sent."""
    bad = os.fsdecode(b"\xff")
    if via == "flag":
        r = kvtier("stats", "--runtime-dir", str(daemon.runtime_dir), "--admin-token", bad)
    else:
        r = kvtier(
            "stats", "--runtime-dir", str(daemon.runtime_dir), env={"KVTIER_ADMIN_TOKEN": bad}
        )
    no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert one_line(r.stderr).startswith("kvtier stats: ")


@pytest.mark.timeout(60)
def test_non_utf8_tcp_endpoint_is_a_one_line_error():
    """``kvtier stats --endpoint tcp://127.0.0.1:<byte 0xff>`` must fail with one line
    naming the endpoint (exit 1 or 2), no traceback."""
    r = kvtier("stats", "--endpoint", os.fsdecode(b"tcp://127.0.0.1:\xff"), "--timeout", "1")
    no_traceback(r)
    assert r.returncode in (1, 2)
    assert one_line(r.stderr).startswith("kvtier stats: ")


# ---------------------------------------------------------------------------- events
@pytest.mark.timeout(60)
@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1", "foo", ""])
def test_events_malformed_endpoint_is_a_one_line_error(endpoint):
    """``kvtier events --endpoint <malformed>`` must print one line naming the endpoint and
    exit non-zero (2: bad usage), no traceback."""
    r = kvtier("events", "--endpoint", endpoint, "--timeout", "1", timeout=30)
    no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stderr[-300:])
    assert one_line(r.stderr).startswith("kvtier events: ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start", ["-1", str(2**70)])
def test_events_from_out_of_range_is_a_usage_error(start):
    """``--from SEQ`` is a sequence number (>= 0, 64 bits). ``--from -1`` or a huge one
    must be refused as bad usage (one line, exit 2), before any replay request is made."""
    r = kvtier(
        "events",
        "--endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--replay",
        f"tcp://127.0.0.1:{free_port()}",
        "--from",
        start,
        "--timeout",
        "1",
        timeout=30,
    )
    no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stderr[-300:])


@pytest.mark.timeout(60)
def test_events_non_utf8_topic_is_a_one_line_error():
    """``kvtier events --topic $'\\xff'`` (not UTF-8) must be refused in one line (exit 2),
    no traceback."""
    r = kvtier(
        "events",
        "--endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--topic",
        os.fsdecode(b"\xff"),
        "--timeout",
        "1",
        timeout=30,
    )
    no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stderr[-300:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["nan", "-1"])
def test_events_timeout_must_be_a_sane_number(value):
    """``kvtier events --timeout`` is "stop after this many quiet seconds (0: never)".
    NaN or a negative number are not seconds: refused as bad usage (exit 2) at
    once, as the admin commands refuse them (the command is killed here after 15 s)."""
    try:
        r = kvtier(
            "events",
            "--endpoint",
            f"tcp://127.0.0.1:{free_port()}",
            "--timeout",
            value,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier events --timeout {value} was accepted and never stopped")
    no_traceback(r)
    assert r.returncode == 2


@pytest.mark.timeout(90)
def test_events_replay_waits_no_longer_than_timeout():
    """``kvtier events --replay EP --from 0 --timeout 1`` against endpoints where nothing
    answers must give up after about the quiet time asked for, as the same command without
    ``--replay`` does: the replay answer is awaited no longer than ``--timeout``, so the
    command takes well under 2.5 times as long as the one without replay."""
    live = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    plain = kvtier("events", "--endpoint", live, "--timeout", "1", timeout=30)
    t_plain = time.monotonic() - t0
    t0 = time.monotonic()
    rep = kvtier(
        "events",
        "--endpoint",
        live,
        "--replay",
        f"tcp://127.0.0.1:{free_port()}",
        "--from",
        "0",
        "--timeout",
        "1",
        timeout=30,
    )
    t_replay = time.monotonic() - t0
    no_traceback(plain)
    no_traceback(rep)
    assert t_replay < 2.5 * t_plain, (
        f"with --replay it took {t_replay:.1f}s, without {t_plain:.1f}s, for --timeout 1"
    )


# ---------------------------------------------------------------------------- demo and bench
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [["--turns", "-1"], ["--conversations", "0"]])
def test_demo_refuses_meaningless_sizes(args):
    """``kvtier demo --turns -1`` / ``--conversations 0`` describe no workload: one line
    naming the flag on stderr, exit 2 ("the demo could not run"), before anything runs (no
    traceback, no "0 of 0 turns" reported as a success)."""
    r = kvtier("demo", *args, "--no-plot", timeout=100)
    no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stdout[-300:], r.stderr[-300:])
    assert args[0] in r.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        ["e2e", "--runs", "0"],
        ["l3", "--path", "/nonexistent-kvtier-operator-test"],
        ["l2", "--mib", "-1"],
    ],
)
def test_bench_bad_arguments_are_usage_errors(args):
    """Bad ``kvtier bench`` arguments (``--runs 0``; ``--path`` a directory that does not
    exist; ``--mib -1`` where the help says ">= 256") are refused before anything runs: one
    line on stderr, exit 2, no traceback."""
    r = kvtier("bench", *args, timeout=100)
    no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stderr[-300:])


@pytest.mark.timeout(30)
def test_unknown_command_is_named_on_stderr():
    """``kvtier stat`` (a typo) must say on stderr that ``stat`` is not a command (exit 2),
    as every other usage error does: ``kvtier: 'stat' is not a command (see kvtier
    --help)``."""
    r = kvtier("stat", timeout=20)
    assert r.returncode == 2
    assert "stat" in r.stderr, (r.stdout, r.stderr)


# ---------------------------------------------------------------------------- guards (pass)
@pytest.mark.timeout(120)
def test_hung_daemon_every_admin_command_gives_up_within_timeout(daemon):
    """A SIGSTOPped kvtierd: each admin command with ``--timeout 1`` exits 1 with one line
    (``health``: ``unhealthy: ...`` on stdout), no traceback, and does not hang."""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        rdir = str(daemon.runtime_dir)
        for cmd in (
            ["health"],
            ["stats", "--json"],
            ["sessions"],
            ["flush"],
            ["sync", "--wait", "1"],
        ):
            r = kvtier(*cmd, "--runtime-dir", rdir, "--timeout", "1", timeout=20)
            no_traceback(r)
            assert r.returncode == 1, (cmd, r.stdout, r.stderr)
            if cmd[0] == "health":
                assert one_line(r.stdout).startswith("unhealthy: ")
            else:
                assert r.stdout == ""  # --json: nothing half-written on stdout
                assert one_line(r.stderr).startswith(f"kvtier {cmd[0]}: ")
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_no_daemon_and_bad_numbers_exit_codes(short_tmp: Path):
    """No daemon: exit 1 and a one-line hint to start one; bad numbers: exit 2, nothing sent."""
    missing = str(short_tmp / "nothing-here")
    r = kvtier("stats", "--json", "--runtime-dir", missing, "--timeout", "1")
    assert r.returncode == 1 and r.stdout == ""
    assert "kvtier serve" in one_line(r.stderr)
    for bad in (
        ["--timeout", "nan"],
        ["--timeout", "-1"],
        ["--timeout", "0"],
        ["--timeout", "inf"],
    ):
        r = kvtier("stats", "--runtime-dir", missing, *bad)
        assert r.returncode == 2, (bad, r.stderr)
        one_line(r.stderr)
