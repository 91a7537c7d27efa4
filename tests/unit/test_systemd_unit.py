"""Checks of the systemd integration files under ``systemd/``.

``systemd-analyze verify`` (Debian package ``systemd``) checks the unit the way
systemd will load it; the tests that need it are skipped where it is missing. The
structural tests pin down the settings the daemon relies on (notify + watchdog,
a runtime directory that survives restarts, shared memory and CUDA left working),
so a later "hardening" edit cannot silently break them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SYSTEMD_DIR = REPO / "systemd"
UNIT = SYSTEMD_DIR / "kvtier.service"
TMPFILES = SYSTEMD_DIR / "kvtier.tmpfiles.conf"
SYSUSERS = SYSTEMD_DIR / "kvtier.sysusers.conf"
INSTALL = SYSTEMD_DIR / "install.sh"
EXAMPLE_CONFIG = SYSTEMD_DIR / "kvtierd.toml.example"

EXEC_START = "ExecStart=/usr/local/bin/kvtierd --config /etc/kvtier/kvtierd.toml"

Unit = dict[str, list[tuple[str, str]]]


def parse_unit(text: str) -> Unit:
    """Parse a unit file into ``{section: [(key, value), ...]}``, keeping repeats.

    Raises:
        ValueError: a line that is neither a comment, a section header nor
            ``key=value``, or a setting before the first section.
    """
    unit: Unit = {}
    section: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            unit.setdefault(section, [])
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()):
            raise ValueError(f"line {number}: not key=value: {raw!r}")
        if section is None:
            raise ValueError(f"line {number}: setting outside a section: {raw!r}")
        unit[section].append((key.strip(), value.strip()))
    return unit


def values(unit: Unit, section: str, key: str) -> list[str]:
    """Every value ``key`` takes in ``section``, in file order."""
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit: Unit, section: str, key: str) -> str | None:
    """The effective (last) value of ``key`` in ``section``, or None if unset."""
    found = values(unit, section, key)
    return found[-1] if found else None


@pytest.fixture(scope="module")
def unit() -> Unit:
    """The shipped unit, parsed."""
    return parse_unit(UNIT.read_text())


# ---- what the daemon relies on ------------------------------------------------


def test_unit_runs_kvtierd_as_a_notify_service_with_a_watchdog(unit: Unit) -> None:
    assert set(unit) == {"Unit", "Service", "Install"}
    assert value(unit, "Service", "Type") == "notify"
    assert value(unit, "Service", "NotifyAccess") == "main"
    assert value(unit, "Service", "WatchdogSec") == "30s"
    assert value(unit, "Service", "Restart") == "on-failure"
    assert values(unit, "Service", "ExecStart") == [EXEC_START.partition("=")[2]]
    assert value(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert value(unit, "Service", "KillMode") == "mixed"
    assert value(unit, "Service", "TimeoutStopSec") is not None
    assert value(unit, "Service", "User") == "kvtier"
    assert value(unit, "Service", "Group") == "kvtier"
    assert value(unit, "Service", "UMask") == "0007"
    assert value(unit, "Service", "LimitMEMLOCK") == "infinity"
    assert "KVTIER_RUNTIME_DIR=/run/kvtier" in values(unit, "Service", "Environment")
    assert value(unit, "Install", "WantedBy") == "multi-user.target"


def test_runtime_directory_survives_restarts(unit: Unit) -> None:
    assert value(unit, "Service", "RuntimeDirectory") == "kvtier"
    assert value(unit, "Service", "RuntimeDirectoryMode") == "0750"
    assert value(unit, "Service", "RuntimeDirectoryPreserve") == "yes"
    assert value(unit, "Service", "StateDirectory") == "kvtier"


def test_state_directory_holds_the_default_l3_store_for_kvtierd_alone(unit: Unit) -> None:
    # systemd passes /var/lib/kvtier as $STATE_DIRECTORY: the file store's default home.
    assert value(unit, "Service", "StateDirectory") == "kvtier"
    # Every tenant's pages are in it; engine users (group kvtier) must not read them.
    assert value(unit, "Service", "StateDirectoryMode") == "0700"
    # Writable under ProtectSystem=strict (systemd mounts StateDirectory= read-write) as
    # long as nothing hides it again or pins the state dir elsewhere.
    svc = dict(unit["Service"])
    for key in ("ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem"):
        assert "/var/lib" not in " ".join(values(unit, "Service", key)), key
    env = " ".join(values(unit, "Service", "Environment"))
    assert "KVTIER_STATE_DIR" not in env and "STATE_DIRECTORY" not in env
    assert svc.get("ProtectSystem") == "strict"


def test_sandbox_keeps_shared_memory_and_cuda_working(unit: Unit) -> None:
    svc = dict(unit["Service"])  # last value wins, as in systemd
    # The host pool outlives the daemon and is shared with other users.
    assert svc.get("RemoveIPC") == "no"
    assert "DynamicUser" not in svc  # implies RemoveIPC=yes
    assert svc.get("PrivateUsers", "no") == "no"
    assert svc.get("PrivateIPC", "no") == "no"
    # CUDA needs /dev/nvidia* and W+X memory.
    assert svc.get("PrivateDevices") == "no"
    assert svc.get("MemoryDenyWriteExecute") == "no"
    assert svc.get("DevicePolicy", "auto") == "auto"
    assert "DeviceAllow" not in svc
    assert "ProtectClock" not in svc  # implies DeviceAllow=char-rtc, an allow list
    assert svc.get("ProcSubset", "all") == "all"
    assert svc.get("ProtectProc", "default") == "default"
    # /dev/shm stays writable under ProtectSystem=strict.
    assert svc.get("ProtectSystem") == "strict"
    assert "/dev/shm" in " ".join(values(unit, "Service", "ReadWritePaths")).split()
    families = svc["RestrictAddressFamilies"].split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)
    assert svc.get("NoNewPrivileges") == "yes"


def test_every_hardening_option_is_explained() -> None:
    """In the sandboxing part, every paragraph that sets options carries a comment."""
    text = UNIT.read_text()
    sandbox = text[text.index("# ---- Sandboxing") : text.index("[Install]")]
    paragraphs = [p.splitlines() for p in re.split(r"\n\s*\n", sandbox) if p.strip()]
    for lines in paragraphs:
        settings = [line for line in lines if line and not line.startswith("#")]
        if settings:
            assert any(line.startswith("#") for line in lines), f"unexplained: {settings}"


# ---- systemd-analyze verify ---------------------------------------------------


def _kvtierd_for_verify() -> str:
    """An executable to put in ExecStart: the venv's kvtierd, else this Python."""
    candidate = Path(sys.executable).parent / "kvtierd"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("kvtierd") or sys.executable


def _verify(unit_text: str, directory: Path) -> tuple[int, list[str], str]:
    """Run ``systemd-analyze verify`` on ``unit_text`` saved as kvtier.service.

    ``verify`` refuses an ExecStart binary that does not exist, and kvtierd is not
    at /usr/local/bin on a test machine, so ExecStart is pointed at the venv's
    kvtierd first. Everything else is verified as shipped.

    Returns:
        The exit status, the output lines that concern this unit (systemd reports
        most mistakes as warnings with exit status 0), and the whole output.
    """
    assert EXEC_START in unit_text.splitlines()
    path = directory / "kvtier.service"
    path.write_text(
        unit_text.replace(
            EXEC_START, f"ExecStart={_kvtierd_for_verify()} --config /etc/kvtier/kvtierd.toml"
        )
    )
    help_text = subprocess.run(
        ["systemd-analyze", "verify", "--help"], capture_output=True, text=True, check=False
    ).stdout
    cmd = ["systemd-analyze", "verify", "--man=no"]
    if "--recursive-errors" in help_text:
        cmd.append("--recursive-errors=no")  # judge this unit, not the host's other units
    proc = subprocess.run(
        [*cmd, str(path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
        timeout=45,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and "Failed to initialize manager" in output:
        pytest.skip(f"systemd-analyze cannot start a manager here: {output.strip()}")
    mine = [
        line for line in output.splitlines() if str(directory) in line or "kvtier.service" in line
    ]
    return proc.returncode, mine, output


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not found (Debian package: systemd)",
)


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    rc, mine, output = _verify(UNIT.read_text(), tmp_path)
    assert rc == 0 and mine == [], f"systemd-analyze verify (rc={rc}):\n{output}"


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("Type=notify", "Type=notfiy"),
        ("WatchdogSec=30s", "WatchdogSecs=30s"),
        ("RestrictAddressFamilies=AF_UNIX", "RestrictAddressFamilies=AF_UNX"),
        ("SystemCallFilter=@system-service", "SystemCallFilter=@system-servce"),
        ("[Service]", "[Servce]"),
    ],
    ids=["bad-value", "unknown-key", "bad-family", "bad-syscall-group", "bad-section"],
)
def test_verify_check_catches_a_broken_unit(tmp_path: Path, good: str, bad: str) -> None:
    """The check above fails on real mistakes (systemd calls many of them warnings)."""
    text = UNIT.read_text()
    assert good in text
    rc, mine, output = _verify(text.replace(good, bad, 1), tmp_path)
    assert rc != 0 or mine, f"a broken unit passed verify:\n{output}"


# ---- tmpfiles.d / sysusers.d ----------------------------------------------------

_TMPFILES_TYPES = set("fFwdDevqQpLcbCxXrRzZtThHaA")


def _entries(path: Path) -> list[list[str]]:
    """The non-comment lines of a tmpfiles.d / sysusers.d file, split into fields."""
    rows = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            rows.append(_split_fields(line))
    return rows


def _split_fields(line: str) -> list[str]:
    """Split on whitespace, keeping a double-quoted field (a GECOS) whole."""
    return [
        m.group(1) if m.group(1) is not None else m.group(2)
        for m in re.finditer(r'"([^"]*)"|(\S+)', line)
    ]


def test_tmpfiles_entries_are_well_formed_and_match_the_unit(unit: Unit) -> None:
    rows = _entries(TMPFILES)
    assert rows
    by_path = {}
    for row in rows:
        assert 2 <= len(row) <= 7, row
        kind, path = row[0], row[1]
        assert kind.rstrip("!-=~^+") in _TMPFILES_TYPES, row
        assert path.startswith("/"), row
        mode, user, group, age = (row + ["-"] * 7)[2:6]
        assert mode == "-" or re.fullmatch(r"[~:]?[0-7]{3,4}", mode), row
        assert re.fullmatch(r"[a-z_][a-z0-9_-]*|-", user), row
        assert re.fullmatch(r"[a-z_][a-z0-9_-]*|-", group), row
        assert age == "-", f"{path} must never be aged out: {row}"
        by_path[path] = row
    assert set(by_path) == {"/run/kvtier", "/var/lib/kvtier"}
    run_row = by_path["/run/kvtier"]
    assert run_row[0] == "d"
    assert run_row[2] == value(unit, "Service", "RuntimeDirectoryMode")
    assert run_row[3:5] == ["kvtier", "kvtier"]
    state_row = by_path["/var/lib/kvtier"]
    assert state_row[0] == "d"
    assert state_row[2] == value(unit, "Service", "StateDirectoryMode")
    assert state_row[3:5] == ["kvtier", "kvtier"]


def test_sysusers_entries_are_well_formed() -> None:
    rows = _entries(SYSUSERS)
    for row in rows:
        assert row[0] in {"u", "g", "m", "r"}, row
        assert re.fullmatch(r"[a-z_][a-z0-9_-]*", row[1]), row
    groups = [row for row in rows if row[0] == "g"]
    users = [row for row in rows if row[0] == "u"]
    assert [g[1] for g in groups] == ["kvtier"]
    assert [u[1] for u in users] == ["kvtier"]
    user = users[0]
    assert len(user) == 6, user
    assert user[2] in {"-", "-:kvtier"}, user
    assert user[4] == "/var/lib/kvtier"
    assert user[5].endswith("nologin")


needs_root_and_tools = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("systemd-sysusers") is None
    or shutil.which("systemd-tmpfiles") is None,
    reason="needs root, systemd-sysusers and systemd-tmpfiles (Debian package: systemd)",
)


@needs_root_and_tools
def test_sysusers_and_tmpfiles_apply_to_an_empty_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    for _ in range(2):  # the second run must change nothing and succeed
        subprocess.run(
            ["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)],
            check=True,
            capture_output=True,
            timeout=30,
        )
        subprocess.run(
            ["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(TMPFILES)],
            check=True,
            capture_output=True,
            timeout=30,
        )
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    uid, gid = int(passwd["kvtier"][2]), int(passwd["kvtier"][3])
    assert gid == int(groups["kvtier"][2])
    for rel, mode in (("run/kvtier", 0o750), ("var/lib/kvtier", 0o700)):
        st = (tmp_path / rel).stat()
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, uid, gid), rel


@needs_root_and_tools
def test_tmpfiles_tightens_a_state_directory_an_older_install_left(tmp_path: Path) -> None:
    """An upgrade from the 0750 /var/lib/kvtier of earlier versions ends at 0700."""
    (tmp_path / "etc").mkdir()
    old = tmp_path / "var/lib/kvtier"
    old.mkdir(parents=True)
    old.chmod(0o750)
    subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    subprocess.run(
        ["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(TMPFILES)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    assert old.stat().st_mode & 0o7777 == 0o700


# ---- install.sh -----------------------------------------------------------------


def test_install_script_parses() -> None:
    subprocess.run(["bash", "-n", str(INSTALL)], check=True, timeout=30)
    assert os.access(INSTALL, os.X_OK), "install.sh must be executable"


def test_install_script_help_and_bad_arguments() -> None:
    shown = subprocess.run(
        ["bash", str(INSTALL), "--help"], check=False, capture_output=True, text=True, timeout=30
    )
    assert shown.returncode == 0
    assert "--enable-now" in shown.stdout
    bad = subprocess.run(
        ["bash", str(INSTALL), "--no-such-flag"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode != 0
    assert "--no-such-flag" in bad.stderr


def test_example_config_exists() -> None:
    assert EXAMPLE_CONFIG.read_text().startswith("# Example /etc/kvtier/kvtierd.toml")


@needs_root_and_tools
def test_install_script_is_safe_to_rerun(tmp_path: Path) -> None:
    def install(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(INSTALL), "--root", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    first = install()
    assert first.returncode == 0, first.stderr
    unit_dest = tmp_path / "etc/systemd/system/kvtier.service"
    config = tmp_path / "etc/kvtier/kvtierd.toml"
    assert unit_dest.read_text() == UNIT.read_text()
    assert (tmp_path / "etc/tmpfiles.d/kvtier.conf").read_text() == TMPFILES.read_text()
    assert (tmp_path / "etc/sysusers.d/kvtier.conf").read_text() == SYSUSERS.read_text()
    assert config.read_text() == EXAMPLE_CONFIG.read_text()
    assert config.stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "run/kvtier").is_dir()
    assert (tmp_path / "var/lib/kvtier").is_dir()

    # An operator's configuration survives a re-run; the unit is refreshed.
    config.write_text("# edited by the operator\n")
    unit_dest.write_text("stale\n")
    venv_bin = tmp_path / "opt/kvtier/bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "kvtierd").write_text("#!/bin/sh\n")
    (venv_bin / "kvtierd").chmod(0o755)
    second = install("--kvtierd", "/opt/kvtier/bin/kvtierd")
    assert second.returncode == 0, second.stderr
    assert config.read_text() == "# edited by the operator\n"
    assert unit_dest.read_text() == UNIT.read_text()
    dropin = tmp_path / "etc/systemd/system/kvtier.service.d/10-kvtierd-path.conf"
    assert values(parse_unit(dropin.read_text()), "Service", "ExecStart") == [
        "",
        "/opt/kvtier/bin/kvtierd --config /etc/kvtier/kvtierd.toml",
    ]

    third = install()
    assert third.returncode == 0, third.stderr
    assert "created" not in third.stdout and "updated" not in third.stdout, third.stdout
    assert dropin.is_file()

    refused = install("--enable-now")
    assert refused.returncode != 0
    assert not (tmp_path / "etc/systemd/system/multi-user.target.wants").exists()
