"""What the operator's commands print from data others control: an engine's model id in
``kvtier events``, a publisher's frames, pool files another user planted in the pool
directory. A terminal shows what the commands print: a control character or escape
sequence from someone else must never reach it raw (it could forge lines or drive the
terminal), ``--json`` is always valid JSON, and a bad frame is an error line or skipped,
never a traceback."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import zmq
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, tokens
from tests.integration.test_admin_cli import kvtier
from tests.integration.test_kv_events import event_flags
from tests.integration.test_pools_cli import pools

pytestmark = pytest.mark.timeout(120)

FORGED = "FORGED-LINE"
HOSTILE_MODEL = f"m\x1b[2K\x1b]0;owned\x07\r\n{FORGED} 0 kvtier/x/ BlockStored CPU"


def _controls(text: str) -> list[str]:
    """Control characters in ``text`` other than the newline that ends each line."""
    return sorted({c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0})


# ---------------------------------------------------------------------------- kvtier events
def test_kvtier_events_prints_a_hostile_model_ids_topic_as_one_inert_line(
    daemon_factory, short_tmp
):
    """An engine chooses its model id, and ``kvtier events`` prints the topic that carries
    it: each event stays one line of the operator's terminal, with no escape sequence or
    carriage return of the engine's making in it (--json shows the topic as it is)."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, model=HOSTILE_MODEL)
    try:
        keys = conn.page_keys(tokens(2 * SMALL.page_size))
        assert conn.store(keys, [0, 1], engine=P.EngineBlocks(hashes=[1, 2])).wait()
        ep = ["--endpoint", f"ipc://{short_tmp}/ev.sock", "--replay", f"ipc://{short_tmp}/evr.sock"]
        rows = kvtier("events", *ep, "--from", "0", "--json", "--timeout", "1")
        assert rows.returncode == 0, rows.stderr
        [row] = [json.loads(line) for line in rows.stdout.splitlines()]
        assert row["topic"] == E.namespace_topic(HOSTILE_MODEL, conn.ns_fingerprint)
        text = kvtier("events", *ep, "--from", "0", "--timeout", "1")
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert len(lines) == 1, f"one event, one line; got {lines!r}"
        assert not lines[0].lstrip().startswith(FORGED)
        assert _controls(text.stdout) == [], f"raw control characters: {text.stdout!r}"
    finally:
        conn.close()
        pool.close()


class _Publisher:
    """A PUB socket on an ipc:// path that keeps sending ``frames`` (a list of multipart
    messages) until stopped: what a bad or hostile publisher on an endpoint sends."""

    def __init__(self, path: Path, frames: list[list[bytes]]) -> None:
        self.endpoint = f"ipc://{path}"
        self._frames = frames
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for frame in self._frames:
                self._sock.send_multipart(frame)
            self._stop.wait(0.05)

    def __enter__(self) -> _Publisher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


GOOD = E.encode_batch(E.KVEventBatch(ts=1.0, events=[E.AllBlocksCleared()]))

MALFORMED = {
    "two_frames": [b"kvtier/m/", (0).to_bytes(8, "big")],
    "four_frames": [b"kvtier/m/", (0).to_bytes(8, "big"), GOOD, b"extra"],
    "not_msgpack": [b"kvtier/m/", (0).to_bytes(8, "big"), b"\xc1\xc1garbage"],
    "wrong_shape": [b"kvtier/m/", (0).to_bytes(8, "big"), b"\x93\x01\x02\x03"],
    "topic_not_utf8": [b"kvtier/\xff\xfe/", (0).to_bytes(8, "big"), GOOD],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("frame", sorted(MALFORMED))
def test_kvtier_events_meets_a_malformed_frame_with_an_error_line_not_a_traceback(short_tmp, frame):
    """A publisher that sends a frame that is not a KV event batch (wrong number of
    parts, bytes that do not decode, a topic that is not UTF-8): ``kvtier events`` skips
    it or stops with a one-line ``kvtier events: ...`` error, never a Python traceback."""
    with _Publisher(short_tmp / "bad.sock", [MALFORMED[frame]]) as pub:
        r = kvtier(
            "events",
            "--endpoint",
            pub.endpoint,
            "--timeout",
            "2",
            "--count",
            "1",
            timeout=30,
        )
    assert "Traceback" not in r.stderr, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) <= 1 and all(line.startswith("kvtier events:") for line in err), err


@pytest.mark.timeout(60)
def test_kvtier_events_meets_a_malformed_replay_answer_with_an_error_line(short_tmp):
    """A replay socket that answers ``--from`` with frames that are not replay answers
    (two parts instead of four): ``kvtier events`` skips them or stops with a one-line
    error, never a Python traceback."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{short_tmp}/replay.sock")
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident, *_ = router.recv_multipart()
                router.send_multipart([ident, b"", b"garbage"])

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with _Publisher(short_tmp / "live.sock", []) as pub:
            r = kvtier(
                "events",
                "--endpoint",
                pub.endpoint,
                "--replay",
                f"ipc://{short_tmp}/replay.sock",
                "--from",
                "0",
                "--timeout",
                "2",
                timeout=30,
            )
    finally:
        stop.set()
        t.join(5)
        router.close(0)
        ctx.term()
    assert "Traceback" not in r.stderr, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) <= 1 and all(line.startswith("kvtier events:") for line in err), err


@pytest.mark.timeout(60)
def test_kvtier_events_json_is_valid_json_for_any_batch_timestamp(short_tmp):
    """``--json`` prints one valid JSON object a line, whatever the publisher's batch
    says (a timestamp that is not a finite number included): a router reading the lines
    with a strict JSON parser never fails on one."""
    bad_ts = E.encode_batch(E.KVEventBatch(ts=float("nan"), events=[E.AllBlocksCleared()]))
    frame = [b"kvtier/m/", (0).to_bytes(8, "big"), bad_ts]
    with _Publisher(short_tmp / "nan.sock", [frame]) as pub:
        r = kvtier("events", "--endpoint", pub.endpoint, "--json", "--timeout", "2", "--count", "1")
    assert "Traceback" not in r.stderr, r.stderr

    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant} in {r.stdout!r}")

    for line in r.stdout.splitlines():
        json.loads(line, parse_constant=refuse)


# ---------------------------------------------------------------------------- sessions / stats
SESSION_TENANTS = ("ops[/]", "ml[bold]prod")


@pytest.mark.timeout(90)
def test_kvtier_sessions_and_stats_show_tenant_names_verbatim(daemon_factory):
    """Tenant names are free text (the operator's, and the engines present them): ``kvtier
    sessions`` lists each session's tenant exactly as named, and ``kvtier stats`` of a
    tenant shows its name, never a traceback, whatever brackets the names hold."""
    cfg = {name: {"token": f"tok-{i}"} for i, name in enumerate(SESSION_TENANTS)}
    d = daemon_factory("--tenants", json.dumps(cfg), "--admin-token", "adm")
    opened = []
    try:
        for i, name in enumerate(SESSION_TENANTS):
            opened.append(engine(d.runtime_dir, tenant=name, token=f"tok-{i}"))
        env = {"KVTIER_ADMIN_TOKEN": "adm"}
        rows = kvtier("sessions", "--runtime-dir", str(d.runtime_dir), "--json", env=env)
        assert rows.returncode == 0, rows.stderr
        assert sorted(s["tenant"] for s in json.loads(rows.stdout)) == sorted(SESSION_TENANTS)
        table = kvtier("sessions", "--runtime-dir", str(d.runtime_dir), env=env)
        assert "Traceback" not in table.stderr, table.stderr
        assert table.returncode == 0, table.stderr
        for name in SESSION_TENANTS:
            assert name in table.stdout, f"{name!r} not shown in:\n{table.stdout}"
        scoped = kvtier(
            "stats", "--runtime-dir", str(d.runtime_dir), env={"KVTIER_ADMIN_TOKEN": "tok-0"}
        )
        assert "Traceback" not in scoped.stderr, scoped.stderr
        assert scoped.returncode == 0 and SESSION_TENANTS[0] in scoped.stdout, scoped.stdout
    finally:
        for pool, conn in opened:
            conn.close()
            pool.close()


# ---------------------------------------------------------------------------- kvtier pools
def _pool_head(runtime_dir: bytes) -> bytes:
    """The first bytes of a pool file whose owner tag names ``runtime_dir``."""
    from kvtier.daemon.pool.poolfile import OWNER_TAG_MAGIC, OWNER_TAG_OFFSET

    head = bytearray(8192)
    at = OWNER_TAG_OFFSET
    head[at : at + len(OWNER_TAG_MAGIC)] = OWNER_TAG_MAGIC
    at += len(OWNER_TAG_MAGIC)
    head[at : at + 2] = len(runtime_dir).to_bytes(2, "little")
    head[at + 2 : at + 2 + len(runtime_dir)] = runtime_dir
    return bytes(head)


def test_kvtier_pools_shows_a_planted_files_name_and_tag_as_inert_text(short_tmp):
    """Anyone may create files in a shared pool directory (``/dev/shm``): a file whose
    name, or the runtime directory its header names, holds control characters (an escape
    sequence, a newline that would forge a row saying a pool is held) is listed on one
    row of inert text, and ``--stale`` reports it on one line too."""
    shm = short_tmp / "shm"
    shm.mkdir()
    forged_row = f"\n{shm}/kvtier-pool-forged  64.0 MiB  1s  0 yes (pid 1)  /run/x"
    name = "kvtier-pool-a\x1b]0;owned\x07\x1b[2K" + forged_row.replace("/", "_")
    (shm / name).write_bytes(b"\0" * 8192)
    tagged = shm / "kvtier-pool-b"
    tagged.write_bytes(_pool_head(f"/tmp/x\x1b[31m\r{FORGED}\n".encode()))
    os.chmod(tagged, 0o644)
    table = pools("--pool-dir", str(shm))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert len(lines) == 3, f"a header and two rows, got {lines!r}"
    assert _controls(table.stdout) == [], f"raw control characters: {table.stdout!r}"
    stale = pools("--pool-dir", str(shm), "--stale")
    assert len(stale.stdout.splitlines()) + len(stale.stderr.splitlines()) == 2, stale
    assert _controls(stale.stdout + stale.stderr) == [], f"raw: {stale!r}"


def test_removing_a_planted_pool_creates_nothing_in_the_directory_its_tag_names(short_tmp):
    """A pool file of one user whose header names a directory of another user (anyone may
    plant such a file in ``/dev/shm``): ``kvtier pools --remove``, run as root, removes the
    file and creates no lock file in that directory (a daemon's runtime directory is its
    own user's)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the planted file belongs to another uid")
    shm = short_tmp / "shm"
    shm.mkdir()
    victim = short_tmp / "victim"
    victim.mkdir()  # root's
    planted = shm / "kvtier-pool-planted"
    planted.write_bytes(_pool_head(str(victim).encode()))
    os.chown(planted, 4343, 4343)
    r = pools("--pool-dir", str(shm), "--remove", str(planted))
    assert r.returncode == 0, r.stderr
    assert not planted.exists()
    assert list(victim.iterdir()) == [], f"created in {victim}: {list(victim.iterdir())}"


# ---------------------------------------------------------------------------- daemon log
@pytest.mark.timeout(60)
def test_a_refused_registration_is_logged_with_the_senders_real_pid(daemon_factory):
    """A REGISTER with a wrong tenant token is logged as a warning naming the process
    that sent it: the pid the daemon knows from the socket, not a pid the request
    claims (an engine must not make the operator blame another process, e.g. pid 1)."""
    from kvtier.client.kv_pool.shared import SharedKVPool

    from tests.integration.test_log_hygiene import wait_for_log
    from tests.servers import RawDealer

    d = daemon_factory("--tenants", json.dumps({"a": {"token": "tok-a"}}))
    pool = SharedKVPool(SMALL, 4)
    raw = RawDealer(d.endpoint)
    try:
        start = len(d.log_path.read_text(errors="replace"))
        msg = P.Register(
            req_id=1,
            protocol_version=P.PROTOCOL_VERSION,
            namespace=P.NamespaceSpec("m"),
            geometry=pool.geometry,
            memory=pool.export(),
            pid=1,
            handover=b"",
            tenant="a",
            token="wrong",
        )
        rep = raw.ask(P.encode(msg))
        assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNAUTHORIZED, rep
        text = wait_for_log(d, "registration refused", start)
    finally:
        raw.close()
        pool.close()
    [line] = [ln for ln in text.splitlines() if "registration refused" in ln]
    assert "pid 1 " not in line, f"the claimed pid is logged as the sender: {line!r}"
    assert f"pid {os.getpid()}" in line, line


@pytest.mark.timeout(90)
def test_a_symlink_planted_where_a_pool_goes_is_removable_and_not_held(daemon_factory, short_tmp):
    """Another user plants a symlink at the name a daemon's pool file will have, pointing
    at a live daemon's pool. A symlink is never a pool: ``kvtier pools`` does not list it
    as held by the daemon its target belongs to, and ``kvtier pools --remove`` (what the
    refused daemon tells the operator to run) removes the symlink itself, leaving the
    live pool it points at alone."""
    from kvtier.config.loader import pool_path

    shm = short_tmp / "shm"
    shm.mkdir()
    live = daemon_factory("--pool-dir", str(shm), name="live")
    live_pool = pool_path(shm, live.runtime_dir)
    planted = pool_path(shm, short_tmp / "next")
    os.symlink(live_pool, planted)
    if os.geteuid() == 0:
        os.lchown(planted, 4343, 4343)
    listed = pools("--pool-dir", str(shm), "--json")
    assert listed.returncode == 0, listed.stderr
    row = {r["path"]: r for r in json.loads(listed.stdout)}[str(planted)]
    assert row["kind"] == "symlink"
    assert row["held"] != "yes", f"a symlink listed as held by pid {row['holder_pid']}: {row}"
    done = pools("--pool-dir", str(shm), "--remove", str(planted))
    assert done.returncode == 0, done.stderr
    assert not os.path.lexists(planted)
    assert live_pool.exists() and live.proc is not None and live.proc.poll() is None
