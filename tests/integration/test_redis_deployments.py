"""The ``redis`` L3 backend configured as users deploy it: managed or shared Redis servers
(passwords, ACL users, unix sockets, database numbers, foreign keys in the same database).

Every test runs a real ``kvtierd`` and, where it needs one, a real ``redis-server`` bound to
127.0.0.1 or a unix socket under /tmp. A misconfiguration must be refused at start naming
the key (exit 2) or reported by HEALTH as degraded with the reason; a secret must never
reach the log, stderr or HEALTH; keys of other applications must never be touched.
"""

from __future__ import annotations

import shutil
import tempfile
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.integration.test_admin_cli import kvtier, one_line, stored
from tests.integration.test_l3_tier import l3_flags, wait_for
from tests.servers import free_port, run_kvtierd

SECRET = "Zq7SecretPw"
"""A password whose every appearance in a log line, stderr or HEALTH is a leak."""

BASE = ["--hicache-size", "64MiB", "--extent-size", "4MiB"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvtierd(rdir: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvtierd`` with this module's :data:`BASE` flags to its end (it is expected to
    refuse to start)."""
    return run_kvtierd(rdir, *BASE, *args, timeout=timeout)


def health(d) -> str:
    return one_line(kvtier("health", "--runtime-dir", str(d.runtime_dir)).stdout)


class Server:
    """A redis-server on 127.0.0.1 (and a unix socket under /tmp) requiring ``SECRET``."""

    def __init__(self, *extra: str, port: int | None = None, password: str = SECRET) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvt-redis-", dir="/tmp"))
        self.port = port or free_port()
        self.password = password
        self.unix = self.dir / "redis.sock"
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                "--unixsocket",
                str(self.unix),
                "--unixsocketperm",
                "700",
                "--requirepass",
                password,
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                with self.client() as c:
                    c.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server() -> Iterator[Server]:
    server = Server()
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------------ secrets


@pytest.mark.timeout(60)
def test_password_in_url_query_string_is_never_shown(daemon_factory):
    """redis-py (and so kvtier) accepts the password as ``?password=`` in the URL, as many
    managed-Redis dashboards print it. When the server cannot be reached, HEALTH and the log
    must say why without the password (the docs promise secrets never reach a log line)."""
    url = f"redis://127.0.0.1:{closed_port()}/0?password={SECRET}"
    d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
    line = wait_for(lambda: (h := health(d)).startswith("degraded") and h, what="degraded")
    log = d.log_path.read_text(errors="replace")
    assert "L3 backend redis" in line
    assert SECRET not in line, line
    assert SECRET not in log, [x for x in log.splitlines() if SECRET in x]


@pytest.mark.timeout(60)
def test_unencoded_slash_in_password_is_refused_without_showing_it(short_tmp):
    """A password holding '/' that the user did not percent-encode makes the URL unparsable.
    kvtierd must refuse to start (exit 2) naming the key, without printing any part of the
    password."""
    url = f"redis://:{SECRET}/tail@127.0.0.1:6379/0"
    r = kvtierd(
        short_tmp / "rt",
        "--hicache-storage-backend",
        "redis",
        "--hicache-storage-backend-extra-config",
        f'{{"url": "{url}"}}',
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-800:]
    assert "url" in out
    assert SECRET not in out, out[-800:]


# ------------------------------------------------------------------------ AUTH


@pytest.mark.timeout(60)
@pytest.mark.parametrize("password", ["WrongPw42"])
def test_missing_or_wrong_password_is_reported_as_an_auth_failure(
    daemon_factory, redis_server: Server, password
):
    """A server that requires AUTH, given no password or a wrong one: HEALTH says degraded,
    naming the authentication failure (so the operator knows to fix the URL's password), and
    never shows the right or the wrong password; L2 keeps serving."""
    cred = "" if password is None else f":{password}@"
    url = f"redis://{cred}127.0.0.1:{redis_server.port}/0"
    d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
    line = wait_for(lambda: (h := health(d)).startswith("degraded") and h, what="degraded")
    log = d.log_path.read_text(errors="replace")
    assert "auth" in line.lower() or "password" in line.lower(), line
    assert "L2 keeps serving" in line
    for secret in (SECRET, password):
        if secret:
            assert secret not in line and secret not in log


# ------------------------------------------------------------------------ foreign keys


@pytest.mark.timeout(90)
def test_flush_l3_leaves_other_applications_keys_alone(daemon_factory, redis_server):
    """Another application sharing the database keeps keys whose names merely look like
    kvtier's (``kvtier:<hex>:<hex>``: a hash, a list, a short string). They are not pages
    kvtier wrote (not the namespace fingerprint's length, not a page object) and a FLUSH of
    L3 must leave them, and only them, untouched."""
    url = f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0"
    other = redis_server.client()
    try:
        other.hset("kvtier:00:11", mapping={"user": "alice"})
        other.rpush("kvtier:abcd:ef01", "job1")
        other.set("kvtier:cafe:beef", "session-token-of-another-app")
        other.set("kvtier:" + "ab" * 32 + ":" + "cd" * 16, "not a page object")
        other.set("unrelated", "x")
        before = sorted(other.keys("*"))
        d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 1.0}))
        wait_for(lambda: health(d).startswith("ok"), what="healthy L3")
        r = kvtier("flush", "--tier", "l3", "--runtime-dir", str(d.runtime_dir))
        assert r.returncode == 0, r.stdout + r.stderr
        assert sorted(other.keys("*")) == before, r.stdout
        assert other.hgetall("kvtier:00:11") == {b"user": b"alice"}
    finally:
        other.close()


# ------------------------------------------------------------------------ addresses


@pytest.mark.timeout(90)
def test_unix_socket_url_with_password_and_database(daemon_factory, redis_server: Server):
    """``unix://:<password>@/path?db=3`` (documented: ``unix://`` URLs may carry the password
    and the database): SYNC writes the pages into database 3 only, other databases keep
    their keys, and FLUSH of L3 deletes exactly those pages."""
    url = f"unix://:{SECRET}@{redis_server.unix}?db=3"
    c0 = redis_server.client()
    c3 = redis.Redis(unix_socket_path=str(redis_server.unix), password=SECRET, db=3)
    try:
        c0.set("app:key", "v")
        d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 1.0}))
        wait_for(lambda: health(d).startswith("ok"), what="healthy L3")
        pool, conn, _keys = stored(d.runtime_dir, n=4)
        try:
            r = kvtier("sync", "--runtime-dir", str(d.runtime_dir))
            assert r.returncode == 0, r.stdout + r.stderr
            assert len(c3.keys("kvtier:*")) == 4, r.stdout
            assert c0.keys("*") == [b"app:key"]
            r = kvtier("flush", "--tier", "l3", "--runtime-dir", str(d.runtime_dir))
            assert r.returncode == 0, r.stdout + r.stderr
            assert c3.keys("*") == [] and c0.keys("*") == [b"app:key"]
        finally:
            conn.close()
            pool.close()
        assert SECRET not in d.log_path.read_text(errors="replace")
    finally:
        c0.close()
        c3.close()


@pytest.mark.timeout(60)
def test_rediss_against_a_plain_server_does_not_connect_in_clear(daemon_factory, redis_server):
    """``rediss://`` asks for TLS; a server that speaks plain RESP must not be used in clear
    text: the daemon starts, HEALTH says degraded naming L3, and the password never shows."""
    url = f"rediss://:{SECRET}@127.0.0.1:{redis_server.port}/0"
    d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
    line = wait_for(lambda: (h := health(d)).startswith("degraded") and h, what="degraded")
    assert "L3 backend redis" in line
    assert SECRET not in line and SECRET not in d.log_path.read_text(errors="replace")


# ------------------------------------------------------------------------ server changes


@pytest.mark.timeout(90)
def test_server_restarted_with_another_password_is_reported_as_auth_failure(daemon_factory):
    """The server is restarted with a rotated password: L3 cannot authenticate any more.
    HEALTH must say degraded with the reason (authentication / password), not a generic
    'health check failed', so the operator knows what to fix; the secrets never show."""
    rotated = "Rotated9Pw"
    server = Server()
    try:
        url = f"redis://:{SECRET}@127.0.0.1:{server.port}/0"
        d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
        wait_for(lambda: health(d).startswith("ok"), what="healthy L3")
        port = server.port
        server.stop()
        server = Server(port=port, password=rotated)
        line = wait_for(
            lambda: (h := health(d)).startswith("degraded") and h, timeout=40, what="degraded"
        )
        log = d.log_path.read_text(errors="replace")
        assert "auth" in line.lower() or "password" in line.lower(), line
        assert SECRET not in line + log and rotated not in line + log
    finally:
        server.stop()


@pytest.mark.timeout(90)
def test_server_out_of_memory_without_eviction_is_reported_with_the_reason(daemon_factory):
    """A shared server with ``maxmemory`` and ``maxmemory-policy noeviction`` refuses every
    write (OOM). SYNC cannot write the pages; HEALTH must say degraded with the reason (the
    server is out of memory) rather than ``ok`` while nothing reaches L3, and L2 keeps
    serving the pages."""
    server = Server("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    c = server.client()
    try:
        c.set("filler", "x" * (2 << 20))  # allowed below the limit, puts it over
    except redis.RedisError:
        pass
    try:
        url = f"redis://:{SECRET}@127.0.0.1:{server.port}/0"
        d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 1.0}))
        wait_for(lambda: health(d).startswith("ok"), what="healthy L3")
        pool, conn, keys = stored(d.runtime_dir, n=4)
        try:
            r = kvtier("sync", "--runtime-dir", str(d.runtime_dir))
            out = r.stdout + r.stderr
            assert c.keys("kvtier:*") == [], out
            line = health(d)
            assert conn.lookup(keys).l2 == 4
        finally:
            conn.close()
            pool.close()
        assert line.startswith("degraded") and "memory" in line.lower(), (out, line)
    finally:
        c.close()
        server.stop()
