"""An engine's client settings come from the ``KVTIER_*`` environment as the daemon's do:
an engine started with ``KVTIER_ENDPOINT`` reaches the daemon there, and an engine's own
settings win over the environment."""

from __future__ import annotations

import pytest
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ConfigError, client_config

from tests.engines import SMALL


def test_an_engine_without_settings_reaches_the_daemon_its_environment_names(
    daemon_factory, short_tmp, monkeypatch
):
    """``KVTIER_ENDPOINT`` (no runtime directory anywhere near the daemon's) is where a
    :class:`Connection` built without a config registers."""
    d = daemon_factory()
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(short_tmp / "elsewhere"))
    monkeypatch.setenv("KVTIER_ENDPOINT", d.endpoint)
    monkeypatch.setenv("KVTIER_REQUEST_TIMEOUT_S", "3.5")
    pool = SharedKVPool(SMALL, 8)
    try:
        conn = Connection(pool, model_id="env")
        try:
            assert conn.session_id != 0
            assert conn.endpoint == d.endpoint and conn.config.request_timeout_s == 3.5
        finally:
            conn.close()
    finally:
        pool.close()


def test_an_engines_own_settings_win_and_bad_values_are_named(monkeypatch):
    """Given values win over the environment; a bad environment value or an unknown given
    key is refused naming it and where it came from."""
    monkeypatch.setenv("KVTIER_REQUEST_TIMEOUT_S", "0.7")
    assert client_config().request_timeout_s == 0.7
    assert client_config({"request_timeout_s": 0.5}).request_timeout_s == 0.5
    with pytest.raises(ConfigError, match=r"runtim_dir.*the engine's settings"):
        client_config({"runtim_dir": "/x"}, "the engine's settings")
    monkeypatch.setenv("KVTIER_LOAD_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError, match="KVTIER_LOAD_TIMEOUT_S"):
        client_config()
