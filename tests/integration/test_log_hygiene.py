"""The daemon's log (stderr -> journald) under hostile and faulty input.

An operator reads kvtierd's log: a local client must not be able to forge lines in it
(control characters in the strings it sends), flood it (a line per bad request), nor make
it show a secret from the configuration.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import handover_path
from kvtier.launch.daemon_process import DaemonStartError

from tests.engines import SMALL, engine
from tests.servers import RawDealer

PASSWORD = "s3cretPW-91f4"


def log_text(d) -> str:
    return d.log_path.read_text(errors="replace")


def wait_for_log(d, needle: str, start: int = 0, timeout: float = 10.0) -> str:
    """The log text after ``start`` once it holds ``needle`` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_text(d)[start:]
        if needle in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not logged within {timeout}s:\n{d.log_tail()}")


def settle(d, quiet_s: float = 0.5, timeout: float = 15.0) -> str:
    """The whole log once it stopped growing for ``quiet_s`` (bounded wait)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        size = d.log_path.stat().st_size
        if size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.05)
    return log_text(d)


# ---------------------------------------------------------------- log injection


FORGED = "2030-01-01 00:00:00,000 ERROR kvtier.daemon: FORGED by a client"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "model_id",
    [
        f"m\n{FORGED}",
        f"m\r{FORGED}",
        "m\x1b[2K\x1b[1A\x1b[31mFORGED-ANSI\x1b[0m",
    ],
    ids=["newline", "carriage-return", "ansi"],
)
def test_model_id_cannot_forge_a_log_line(daemon, model_id):
    """A REGISTER's model id is the client's string: the daemon logs it in the line
    "session N registered: ... model <id>". Control characters in it (newline,
    carriage return, ESC) are escaped (e.g. with ``%r``), so the log keeps one line per
    event and a client cannot write a line that looks like the daemon's own (or rewrite
    the terminal with ANSI escapes)."""
    start = len(log_text(daemon))
    pool, conn = engine(daemon.runtime_dir, model=model_id)
    try:
        new = wait_for_log(daemon, "registered", start)
    finally:
        conn.close()
        pool.close()
    line = next(x for x in new.splitlines() if "registered" in x)
    assert "\x1b" not in new, f"raw ESC from a client in the log: {line!r}"
    assert "\r" not in new, f"raw CR from a client in the log: {new!r}"
    forged = [x for x in new.splitlines() if x.startswith(FORGED[:10])]
    assert not forged, f"a client forged a log line: {forged!r}"


# ---------------------------------------------------------------- flooding


@pytest.mark.timeout(90)
def test_garbage_handover_connections_do_not_flood_the_log(daemon):
    """Any local user may connect to the handover socket. A stream of bad
    handover requests (here 300 of 8 garbage bytes) is summarised or rate-limited in the
    log (a few lines, or one per interval), not one INFO line per connection: a client
    must not be able to fill journald (and push out the lines an operator needs)."""
    path = str(handover_path(daemon.runtime_dir))
    base = settle(daemon).count("\n")
    n = 300
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5.0)
        try:
            s.connect(path)
            s.send(b"garbage!")
            s.recv(256)  # the refusal
        finally:
            s.close()
    text = settle(daemon)
    added = text.splitlines()[base:]
    refused = [x for x in added if "handover" in x]
    assert len(added) <= n // 10, (
        f"{n} bad handover connections added {len(added)} log lines "
        f"({len(refused)} about handovers), e.g. {added[:2]!r}"
    )


TOKEN = "tok-a-5f1e9c"


@pytest.mark.timeout(90)
def test_wrong_token_registrations_do_not_flood_the_log(daemon_factory):
    """With tenants configured, a REGISTER with a wrong token is refused and logged
    (README: "a missing or wrong token is refused and logged without the token").
    A client retrying with wrong tokens (here 300 REGISTERs) does not add a
    WARNING line per attempt: repeats are rate-limited or summarised (e.g. "... and 299
    more"), so one misbehaving client cannot flood journald."""
    d = daemon_factory("--tenants", json.dumps({"a": {"token": TOKEN}}))
    pool = SharedKVPool(SMALL, 4)
    raw = RawDealer(d.endpoint)
    try:
        base = settle(d).count("\n")
        n = 300
        for i in range(n):
            msg = P.Register(
                req_id=i + 1,
                protocol_version=P.PROTOCOL_VERSION,
                namespace=P.NamespaceSpec("m"),
                geometry=pool.geometry,
                memory=pool.export(),
                pid=os.getpid(),
                handover=b"",
                tenant="a",
                token=f"wrong-{i}",
            )
            rep = raw.ask(P.encode(msg))
            assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNAUTHORIZED, rep
        text = settle(d)
    finally:
        raw.close()
        pool.close()
    added = text.splitlines()[base:]
    assert "wrong-" not in "\n".join(added), "a presented token reached the log"
    assert len(added) <= n // 10, (
        f"{n} wrong-token REGISTERs added {len(added)} log lines, e.g. {added[:2]!r}"
    )


# ---------------------------------------------------------------- secrets


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra",
    [
        # a port beside a url: refused by a check across fields
        {"url": f"redis://kv:{PASSWORD}@127.0.0.1:6390/0", "port": 6380},
        # a typo in the scheme
        {"url": f"redsi://kv:{PASSWORD}@127.0.0.1:6390/0"},
        # a password= query parameter, with a bad value elsewhere
        {"url": f"redis://127.0.0.1:6390/0?password={PASSWORD}", "db": 1},
        # a trailing comma: not JSON
        f'{{"url": "redis://kv:{PASSWORD}@127.0.0.1:6390/0",}}',
    ],
    ids=["url-and-port", "bad-scheme", "query-password", "invalid-json"],
)
def test_redis_password_never_logged_for_a_refused_extra_config(daemon_factory, extra):
    """docs/configuration.md (redis): "A password goes in the URL ... and is never logged."
    When the redis extra config is refused, the error line names the problem
    with the URL redacted (``redis://kv:***@...``, as the PING failure already does)."""
    d = daemon_factory(
        "--hicache-storage-backend",
        "redis",
        "--hicache-storage-backend-extra-config",
        extra if isinstance(extra, str) else json.dumps(extra),
        start=False,
    )
    with pytest.raises(DaemonStartError):
        d.start(timeout=30)
    text = log_text(d)
    assert "extra_config" in text or "extra config" in text, text  # the refusal is logged
    assert PASSWORD not in text, [x for x in text.splitlines() if PASSWORD in x]


@pytest.mark.timeout(60)
def test_redis_password_redacted_when_the_server_is_away(daemon_factory):
    """A valid redis URL with a password, its server away, is logged
    redacted in the "could not open" line (user and query password both)."""
    extra = {
        "url": f"redis://kv:{PASSWORD}@127.0.0.1:1/0?password={PASSWORD}",
        "timeout_s": 0.5,
    }
    d = daemon_factory(
        "--hicache-storage-backend",
        "redis",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
    )
    text = wait_for_log(d, "could not open")
    assert PASSWORD not in text
    assert re.search(r"kv:\*\*\*@127\.0\.0\.1:1", text), text


@pytest.mark.timeout(60)
def test_mooncake_metadata_server_credentials_not_logged(daemon_factory):
    """A Mooncake ``metadata_server`` URL may carry credentials (``http://user:pw@host``,
    ``etcd://user:pw@...``), as a redis URL may. The line saying the metadata
    server is unreachable names it with the password redacted, as the redis backend does
    (``http://kv:***@...``)."""
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")
    master = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # reachable "master"
    master.bind(("127.0.0.1", 0))
    master.listen(8)
    try:
        extra = {
            "master_server_address": f"127.0.0.1:{master.getsockname()[1]}",
            "metadata_server": f"http://kv:{PASSWORD}@127.0.0.1:1/metadata",
            "timeout_s": 1.0,
        }
        d = daemon_factory(
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-storage-backend-extra-config",
            json.dumps(extra),
        )
        text = wait_for_log(d, "metadata_server", timeout=20)
    finally:
        master.close()
    assert PASSWORD not in text, [x for x in text.splitlines() if PASSWORD in x]


@pytest.mark.timeout(90)
def test_wrong_admin_token_requests_do_not_flood_the_log(daemon_factory):
    """STATS needs no session: any local user can send it. A client hammering
    it with a wrong admin token (here 300 times) adds a bounded number of lines (the
    refusal rate-limited or summarised)."""
    d = daemon_factory("--admin-token", "adm-4c2d1e")
    raw = RawDealer(d.endpoint)
    try:
        base = settle(d).count("\n")
        n = 300
        for i in range(n):
            rep = raw.ask(P.encode(P.Stats(req_id=i + 1, admin_token="nope")))
            assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNAUTHORIZED, rep
        text = settle(d)
    finally:
        raw.close()
    added = text.splitlines()[base:]
    assert len(added) <= n // 10, (
        f"{n} STATS with a wrong admin token added {len(added)} log lines, e.g. {added[:2]!r}"
    )


@pytest.mark.timeout(60)
def test_under_systemd_error_lines_carry_a_journald_priority(daemon_factory):
    """When stderr is the journal's stream (``$JOURNAL_STREAM`` names its device and inode,
    as systemd sets it) kvtierd drops the timestamp because journald adds one, and each
    line carries its level as a syslog priority prefix (``<3>`` for ERROR, ``<4>`` WARNING,
    sd-daemon(3)), so ``journalctl -u kvtier -p warning`` shows the daemon's warnings and
    errors. A unit whose stderr goes to a file (``INVOCATION_ID`` set, no journal stream)
    keeps plain, timestamped lines."""
    extra = {"url": "redis://127.0.0.1:1/0", "timeout_s": 0.5}
    flags = (
        "--hicache-storage-backend",
        "redis",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
    )
    unit = {"INVOCATION_ID": "0123456789abcdef0123456789abcdef"}
    journal = daemon_factory(*flags, env=dict(unit), start=False)
    journal.log_path.parent.mkdir(parents=True, exist_ok=True)
    journal.log_path.touch()
    st = journal.log_path.stat()
    journal.env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    journal.start()
    text = wait_for_log(journal, "could not open")
    line = next(x for x in text.splitlines() if "could not open" in x)
    assert line.startswith("<3>ERROR "), (
        f"an ERROR line reaches journald without a priority: {line!r}"
    )
    journal.stop()

    to_file = daemon_factory(*flags, name="d1", env=dict(unit))
    text = wait_for_log(to_file, "could not open")
    line = next(x for x in text.splitlines() if "could not open" in x)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ERROR ", line), (
        f"a line written to a file has no timestamp or a journald prefix: {line!r}"
    )
