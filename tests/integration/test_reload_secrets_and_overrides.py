"""A live reload (SIGHUP, ``systemctl reload kvtier``) refused for a misspelt secret key or a
wrongly written extra config, and one of a prefetch setting the extra config overrides,
against real kvtierd processes started with ``--config FILE``.

docs/configuration.md: a source that no longer loads is refused with a log line and the
configuration in force stays; "Passwords and tokens of settings never reach the log"; a
reload whose changes are all live applies them all and logs ``reload: applied <fields>``.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

from tests.engines import SMALL, engine, fill_page, tokens

BASE = (
    'hicache_size = "64MiB"\n'
    'extent_size = "4MiB"\n'
    'hicache_storage_backend = "none"\n'
    "lease_s = 5.0\n"
    'log_level = "info"\n'
)


def log_text(d: DaemonProcess) -> str:
    return d.log_path.read_text(errors="replace")


def wait_log(d: DaemonProcess, text: str, start: int = 0, timeout: float = 30.0) -> str:
    """Wait until the daemon's log holds ``text`` after offset ``start``; return the log
    from ``start`` on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        since = log_text(d)[start:]
        if text in since:
            return since
        if d.proc is not None and d.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged after offset {start}; tail:\n{d.log_tail(40)}")


def reload_with(d: DaemonProcess, cfg: Path, text: str, expect: str) -> str:
    """Rewrite the config file with ``text``, SIGHUP, wait for ``expect``; return the log
    written since the SIGHUP."""
    mark = len(log_text(d))
    cfg.write_text(text)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    return wait_log(d, expect, start=mark)


def health(d: DaemonProcess) -> str:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return admin.health().status


def flush(d: DaemonProcess, tier: str) -> P.FlushReply:
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        rep = admin.call(P.Flush(req_id=0, tier=tier))
    assert isinstance(rep, P.FlushReply), rep
    return rep


def counters(d: DaemonProcess) -> dict:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return admin.stats()["counters"]


@pytest.fixture
def started(short_tmp: Path) -> Iterator:
    """``started(text, name="d")`` -> (daemon, config path): kvtierd run with --config only
    (the file is what a reload re-reads); stopped and its pool removed at teardown."""
    made: list[DaemonProcess] = []

    def make(text: str = BASE, name: str = "d"):
        cfg = short_tmp / f"{name}.toml"
        cfg.write_text(text)
        d = DaemonProcess(short_tmp / name, ["--config", str(cfg)])
        made.append(d)
        d.start()
        return d, cfg

    yield make
    for d in made:
        if d.proc is not None:
            d.stop()
        d.remove_pool()


# ------------------------------------------------------------------ secrets in refusals
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "typo",
    [
        '[tenant.team-a]\ntoken = "S3CRET-TENANT-TOKEN"\n',  # [tenant.X] for [tenants.X]
        'admin-token = "S3CRET-ADMIN-TOKEN"\n',  # a dash for the underscore
    ],
    ids=["tenant_table", "admin_token_dash"],
)
def test_a_refused_reload_of_a_misspelled_secret_key_never_logs_the_secret(started, typo):
    """An operator rotating a token edits the file, mistypes the key (``[tenant.team-a]``
    for ``[tenants.team-a]``, ``admin-token``) and runs ``systemctl reload kvtier``. The
    reload is refused (unknown key) and kvtierd keeps serving; the refusal goes to the
    journal, which many can read, so it must name the key without quoting the token the
    key holds ("tokens of settings never reach the log")."""
    d, cfg = started()
    since = reload_with(d, cfg, BASE + typo, "reload rejected")
    assert health(d) == "ok"
    assert "S3CRET" not in since, f"the refused reload logged the token:\n{since}"


@pytest.mark.timeout(60)
def test_a_refused_reload_of_an_extra_config_table_never_logs_its_password(started):
    """``hicache_storage_backend_extra_config`` is JSON text or ``@path``; an operator who
    writes it as a TOML table (with a Redis URL holding a password) gets the reload
    refused, as they should, but the journal line must quote the URL without its password,
    as every other message about this setting does ("URLs are quoted without their
    password")."""
    d, cfg = started()
    text = (
        BASE.replace('"none"', '"redis"')
        + 'hicache_storage_backend_extra_config = { url = "redis://kv:S3CRETPW@10.0.0.9:6379/0" }\n'
    )
    since = reload_with(d, cfg, text, "reload rejected")
    assert health(d) == "ok"
    assert "S3CRETPW" not in since, f"the refused reload logged the password:\n{since}"


# ------------------------------------------------------------------ "applied" means in force
@pytest.mark.timeout(90)
def test_a_reload_of_a_prefetch_setting_the_extra_config_overrides_is_refused(started, short_tmp):
    """``prefetch_threshold`` is live, but the L3 extra config may carry it too (as SGLang's
    storage extra config does), and that one wins. A reload that changes the field while
    the extra config overrides it would change nothing: it is refused, naming both, and the
    threshold in force stays the extra config's."""
    extra = json.dumps({"path": str(short_tmp / "l3"), "prefetch_threshold": 1_000_000})
    base = (
        BASE.replace('"none"', '"file"')
        + f"hicache_storage_backend_extra_config = {json.dumps(extra)}\n"
    )
    d, cfg = started(base + "prefetch_threshold = 1000000\n")
    pool, conn = engine(d.runtime_dir, num_pages=16)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=11))
        for p in range(8):
            fill_page(pool, p, 700 + p)
        assert conn.store(keys, list(range(8))).wait(20)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            c = counters(d)
            if c["l3_write_written_pages"] + c["l3_write_skipped_pages"] >= 8:
                break
            time.sleep(0.05)
        assert flush(d, "l2").l2_pages == 8
        assert conn.lookup(keys).l3 == 8
        assert conn.prefetch(keys) == 0  # 128 tokens < 1,000,000: no prefetch

        since = reload_with(d, cfg, base + "prefetch_threshold = 0\n", "nothing was changed")
        line = next(x for x in since.splitlines() if "nothing was changed" in x)
        assert "prefetch_threshold = 1e+06 set in hicache_storage_backend_extra_config" in line
        assert "reload: applied" not in since
        assert conn.prefetch(keys) == 0
        assert health(d) == "ok"
    finally:
        conn.close()
        pool.close()
