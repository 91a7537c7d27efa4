"""Configuration: one frozen model fed by a TOML file, KVTIER_* variables and flags."""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import pydantic
import pytest
from kvtier.config import (
    ClientConfig,
    ConfigError,
    DaemonConfig,
    format_size,
    load_config,
    parse_size,
    runtime_dir,
)
from kvtier.config.loader import add_config_flags, flags_to_dict, state_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text,value",
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("10G", 10 * 1000**3),
        ("4096", 4096),
        (4096, 4096),
        (" 2 KiB ", 2048),
        ("1b", 1),
    ],
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["abc", "4GB/s", "-1", -1, True, "1.5.2G", ""])
def test_bad_sizes_name_the_value(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        parse_size(bad)


def test_format_size():
    assert format_size(1 << 30) == "1.0 GiB"
    assert format_size(512) == "512 B"


def test_precedence_file_then_env_then_flags(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('hicache_size = "2GiB"\nlease_s = 7\ncopy_threads = 3\n')
    cfg = load_config(
        DaemonConfig,
        file=f,
        env={"KVTIER_LEASE_S": "9", "KVTIER_COPY_THREADS": "4"},
        cli={"copy_threads": "5"},
    )
    assert (cfg.hicache_size, cfg.lease_s, cfg.copy_threads) == (2 << 30, 9.0, 5)


def test_defaults_and_frozen():
    cfg = load_config(DaemonConfig, env={})
    assert cfg.hicache_size == 1 << 30 and cfg.hicache_storage_prefetch_policy == "timeout"
    with pytest.raises(pydantic.ValidationError):
        cfg.hicache_size = 1  # type: ignore[misc]


def test_unknown_key_in_file_names_the_key_and_not_its_value(tmp_path):
    """An unknown key may be a misspelt secret one (``admin-token``): named, its value not."""
    f = tmp_path / "k.toml"
    f.write_text('hicache_sise = "2GiB"\nadmin-token = "S3CRET"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'hicache_sise' in config file") as err:
        load_config(DaemonConfig, file=f, env={})
    assert "2GiB" not in str(err.value)
    f.write_text('admin-token = "S3CRET"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'admin-token'") as err:
        load_config(DaemonConfig, file=f, env={})
    assert "S3CRET" not in str(err.value)


def test_unknown_env_variable_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown environment variable KVTIER_HICACHE_SISE "):
        load_config(DaemonConfig, env={"KVTIER_HICACHE_SISE": "1"})


@pytest.mark.parametrize(
    "cli",
    [
        {"tenants": '{"x": "S3CRET"}'},  # a tenant written as its bare token
        {"tenants": '{"x": {"tokne": "S3CRET"}}'},  # a misspelt token key
        {"tenants": "{'x': {'token': 'S3CRET'}}"},  # not JSON (Python's quotes)
        {"tenants": '{"x": {"token": "S3CRET"tail"}}'},  # not JSON past the secret
    ],
)
def test_a_tenants_table_written_wrong_shows_no_token(cli):
    with pytest.raises(ConfigError, match="tenants") as err:
        load_config(DaemonConfig, env={}, cli=cli)
    assert "S3CRET" not in str(err.value) and "tail" not in str(err.value)


@pytest.mark.parametrize(
    "env",
    [
        {"KVTIER_TENANTS": '{"a": {"token": "S3CRET-TOK"'},  # broken JSON
        {"KVTIER_ADMIN_TOKENS": "S3CRET-TOK"},  # no such key
        {"KVTIER_EXTRA_CONFIG": "redis://kv:S3CRET-TOK@h:6379"},  # no such key
    ],
)
def test_an_environment_variable_refused_shows_no_secret(env):
    with pytest.raises(ConfigError) as err:
        load_config(DaemonConfig, env=env)
    assert next(iter(env)) in str(err.value) and "S3CRET" not in str(err.value)


def test_client_variables_are_not_daemon_errors():
    cfg = load_config(DaemonConfig, env={"KVTIER_REQUEST_TIMEOUT_S": "3"})
    assert cfg.lease_s == 30.0
    assert load_config(ClientConfig, env={"KVTIER_REQUEST_TIMEOUT_S": "3"}).request_timeout_s == 3.0


@pytest.mark.parametrize(
    "source,expect",
    [
        (
            {"env": {"KVTIER_HICACHE_SIZE": "lots"}},
            r"hicache_size = 'lots' \(from environment variable KVTIER_HICACHE_SIZE\)",
        ),
        ({"cli": {"copy_threads": "0"}}, r"copy_threads = '0' \(from flag --copy-threads\)"),
        (
            {"cli": {"hicache_storage_prefetch_policy": "sometimes"}},
            r"hicache_storage_prefetch_policy = 'sometimes'",
        ),
        (
            {"cli": {"tenants": '{"a": {"token": "x", "quota_pages": 0}}'}},
            r"tenants.a.quota_pages = 0",
        ),
        (
            {"cli": {"tenants": "{not json"}},
            r"tenants from the command line: not valid JSON \(Expecting",
        ),
        (
            {"cli": {"extent_size": "2GiB", "hicache_size": "1GiB"}},
            r"extent_size .* must not exceed",
        ),
    ],
)
def test_bad_values_name_key_source_and_value(source, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(DaemonConfig, **{"env": {}, **source})


def test_tokens_are_redacted_in_errors():
    with pytest.raises(ConfigError) as err:
        load_config(DaemonConfig, env={}, cli={"tenants": '{"a": {"token": 91357, "bogus": 1}}'})
    msg = str(err.value)
    assert "tenants.a.bogus" in msg and "tenants.a.token = '<redacted>'" in msg
    assert "91357" not in msg


SECRET = "s3cretXYZ"


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ClientConfig(token=SECRET * 1000), "token"),
        (lambda: ClientConfig(token=[SECRET]), "token"),
        (lambda: ClientConfig.model_validate({"token": SECRET * 1000}), "token"),
        (lambda: DaemonConfig(admin_token=[SECRET]), "admin_token"),
        (
            lambda: DaemonConfig(tenants={"a": {"token": [SECRET], "quota_pages": 1}}),
            "tenants.a.token",
        ),
        (
            lambda: DaemonConfig(tenants={"a": {"token": SECRET}, "b": {"token": SECRET}}),
            "tenants.b.token and tenants.a.token are the same",
        ),
        (
            lambda: DaemonConfig(admin_token=SECRET, tenants={"a": {"token": SECRET}}),
            "tenants.a.token is the admin_token",
        ),
    ],
)
def test_a_model_built_in_code_shows_no_token_in_its_errors(build, field):
    """A configuration built directly (not through the loader) names the field in its error
    and hides the token, in the message, in ``errors()`` and in the printed traceback (no
    chained error carries it)."""
    with pytest.raises(pydantic.ValidationError) as err:
        build()
    shown = (
        str(err.value) + repr(err.value.errors()) + "".join(traceback.format_exception(err.value))
    )
    assert field in str(err.value)
    assert SECRET not in shown and "'<redacted>'" in shown


def test_a_model_built_in_code_still_shows_other_values():
    """Only tokens are hidden: a bad value elsewhere is shown, beside a valid token."""
    with pytest.raises(pydantic.ValidationError) as err:
        ClientConfig(token=SECRET, endpoint=12345)
    assert "endpoint" in str(err.value) and "input_value=12345" in str(err.value)
    assert SECRET not in str(err.value)


@pytest.mark.parametrize(
    ("tenants", "admin", "expect"),
    [
        (
            {"a": {"token": "s3cret"}, "b": {"token": "s3cret"}},
            None,
            r"tenants\.b\.token and tenants\.a\.token are the same",
        ),
        ({"a": {"token": ""}}, None, r"tenants\.a\.token is empty"),
        ({"a": {"token": "s3cret"}}, "s3cret", r"tenants\.a\.token is the admin_token"),
    ],
)
def test_each_tenant_has_a_token_of_its_own(tenants, admin, expect):
    """A token names one tenant: two tenants with one token, an empty token or the admin
    token is refused, naming the tenants and never the token."""
    cli = {"tenants": json.dumps(tenants), **({"admin_token": admin} if admin else {})}
    with pytest.raises(ConfigError, match=expect) as err:
        load_config(DaemonConfig, env={}, cli=cli)
    assert "s3cret" not in str(err.value)


def test_unknown_flag_is_an_error():
    with pytest.raises(ConfigError, match=r"--no-such"):
        load_config(DaemonConfig, env={}, cli={"no_such": "1"})


def test_flags_cover_every_field():
    p = argparse.ArgumentParser()
    add_config_flags(p, DaemonConfig)
    ns = p.parse_args(["--hicache-size", "3GiB", "--log-level", "debug"])
    cfg = load_config(DaemonConfig, env={}, cli=flags_to_dict(ns, DaemonConfig))
    assert cfg.hicache_size == 3 << 30 and cfg.log_level == "debug"


def test_example_config_parses():
    cfg = load_config(DaemonConfig, file=REPO / "systemd" / "kvtierd.toml.example", env={})
    assert cfg.hicache_size == 8 << 30 and cfg.runtime_dir == Path("/run/kvtier")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(DaemonConfig, file=tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("hicache_size = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(DaemonConfig, file=bad, env={})


def test_runtime_dir_resolution():
    assert runtime_dir(None, {"KVTIER_RUNTIME_DIR": "/x"}) == Path("/x")
    assert runtime_dir(None, {"XDG_RUNTIME_DIR": "/run/user/5"}) == Path("/run/user/5/kvtier")
    assert str(runtime_dir(None, {})).startswith("/tmp/kvtier-")
    assert runtime_dir(Path("/cfg"), {"KVTIER_RUNTIME_DIR": "/x"}) == Path("/cfg")


@pytest.mark.parametrize(
    "env,expect",
    [
        (
            {
                "KVTIER_STATE_DIR": "/k",
                "STATE_DIRECTORY": "/s",
                "XDG_STATE_HOME": "/x",
                "HOME": "/h",
            },
            "/k",
        ),
        (
            {"STATE_DIRECTORY": "/var/lib/kvtier", "XDG_STATE_HOME": "/x", "HOME": "/h"},
            "/var/lib/kvtier",
        ),
        (
            {"STATE_DIRECTORY": "/var/lib/kvtier:/var/lib/other"},
            "/var/lib/kvtier",
        ),  # several: first
        ({"XDG_STATE_HOME": "/x", "HOME": "/h"}, "/x/kvtier"),
        ({"HOME": "/h"}, "/h/.local/state/kvtier"),
        # empty means unset; a relative XDG_STATE_HOME is ignored, as the XDG spec says
        (
            {"KVTIER_STATE_DIR": "", "STATE_DIRECTORY": "", "XDG_STATE_HOME": "", "HOME": "/h"},
            "/h/.local/state/kvtier",
        ),
        ({"XDG_STATE_HOME": "rel/state", "HOME": "/h"}, "/h/.local/state/kvtier"),
    ],
    ids=["kvtier-var", "systemd", "systemd-several", "xdg", "home", "empty-vars", "xdg-relative"],
)
def test_state_dir_resolution(env, expect):
    assert state_dir(None, env) == Path(expect)


def test_state_dir_configured_wins_and_never_follows_the_runtime_dir():
    env = {"KVTIER_STATE_DIR": "/k", "STATE_DIRECTORY": "/s", "XDG_RUNTIME_DIR": "/run/user/5"}
    assert state_dir(Path("/cfg"), env) == Path("/cfg")
    assert state_dir(
        None, {"XDG_RUNTIME_DIR": "/run/user/5", "KVTIER_RUNTIME_DIR": "/r", "HOME": "/h"}
    ) == Path("/h/.local/state/kvtier")


def test_state_dir_without_a_home_uses_the_password_database():
    import pwd

    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        pytest.skip(f"uid {os.getuid()} has no password database entry")
    assert state_dir(None, {}) == Path(home) / ".local/state/kvtier"


def test_the_default_l3_backend_is_the_file_store_in_the_state_dir(monkeypatch, tmp_path):
    from kvtier.daemon.tier.guard import storage_settings

    cfg = load_config(DaemonConfig, env={})
    assert cfg.hicache_storage_backend == "file" and cfg.state_dir is None
    for var in ("KVTIER_STATE_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "st"))
    extra, _ = storage_settings(cfg, tmp_path / "run")
    assert extra == {"path": str(tmp_path / "st" / "l3")}
    cfg = load_config(DaemonConfig, env={"KVTIER_STATE_DIR": str(tmp_path / "k")})
    assert storage_settings(cfg, tmp_path / "run")[0] == {"path": str(tmp_path / "k" / "l3")}
    # a path in the extra config, or another backend, takes nothing from the state dir
    cfg = load_config(
        DaemonConfig, env={}, cli={"hicache_storage_backend_extra_config": '{"path": "/elsewhere"}'}
    )
    assert storage_settings(cfg, tmp_path / "run")[0] == {"path": "/elsewhere"}
    cfg = load_config(DaemonConfig, env={}, cli={"hicache_storage_backend": "none"})
    assert storage_settings(cfg, tmp_path / "run")[0] == {}


def test_an_empty_state_or_runtime_dir_means_unset():
    cfg = load_config(DaemonConfig, env={"KVTIER_STATE_DIR": "", "KVTIER_RUNTIME_DIR": " "})
    assert cfg.state_dir is None and cfg.runtime_dir is None
    assert load_config(DaemonConfig, env={}, cli={"state_dir": "/s"}).state_dir == Path("/s")


def test_a_later_flag_wins():
    """Test fixtures put their defaults first (``--hicache-storage-backend none``) and let a
    test's own flags override them."""
    p = argparse.ArgumentParser()
    add_config_flags(p, DaemonConfig)
    ns = p.parse_args(
        [
            "--hicache-storage-backend",
            "none",
            "--state-dir",
            "/a",
            "--hicache-storage-backend",
            "file",
            "--state-dir",
            "/b",
        ]
    )
    cfg = load_config(DaemonConfig, env={}, cli=flags_to_dict(ns, DaemonConfig))
    assert (cfg.hicache_storage_backend, cfg.state_dir) == ("file", Path("/b"))


def test_boolean_flag_without_value_means_true():
    p = argparse.ArgumentParser()
    add_config_flags(p, DaemonConfig)
    cfg = load_config(
        DaemonConfig, env={}, cli=flags_to_dict(p.parse_args(["--cold-start"]), DaemonConfig)
    )
    assert cfg.cold_start is True
    cfg = load_config(
        DaemonConfig, env={}, cli=flags_to_dict(p.parse_args(["--prefault", "false"]), DaemonConfig)
    )
    assert cfg.prefault is False


def test_a_heartbeat_interval_past_a_day_is_refused_naming_it():
    """The heartbeat thread sleeps ``heartbeat_interval_s``: a value past what a thread
    can wait would end it (and the session with its lease), so it is refused at load."""
    assert load_config(ClientConfig, env={"KVTIER_HEARTBEAT_INTERVAL_S": "86400"})
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        load_config(ClientConfig, env={"KVTIER_HEARTBEAT_INTERVAL_S": "1e10"})


def test_client_string_settings_are_bounded_as_register_bounds_them() -> None:
    """A ClientConfig string past REGISTER's bound is a configuration error naming the
    setting at load, not a registration the daemon refuses naming a wire field."""
    from kvtier.config import ClientConfig
    from kvtier.ipc import limits as L

    bound = {
        name: next(m.max_length for m in f.metadata if hasattr(m, "max_length"))
        for name, f in ClientConfig.model_fields.items()
        if name in ("tp_group", "tenant", "token", "cache_salt")
    }
    assert bound == {
        "tp_group": L.MAX_NAME,
        "tenant": L.MAX_NAME,
        "token": L.MAX_TEXT,
        "cache_salt": L.MAX_TEXT,
    }
    from kvtier.config import ConfigError, client_config

    for name, most in bound.items():
        assert client_config({name: "x" * most}, source="test") is not None
        with pytest.raises(ConfigError, match=name):
            client_config({name: "x" * (most + 1)}, source="test")
