"""Configuration: one frozen model fed by a TOML file, KVTIER_* variables and flags."""

from __future__ import annotations

import argparse
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
from kvtier.config.loader import add_config_flags, flags_to_dict

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,value", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("10G", 10 * 1000**3),
    ("4096", 4096), (4096, 4096), (" 2 KiB ", 2048), ("1b", 1),
])
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
    cfg = load_config(DaemonConfig, file=f, env={"KVTIER_LEASE_S": "9", "KVTIER_COPY_THREADS": "4"},
                      cli={"copy_threads": "5"})
    assert (cfg.hicache_size, cfg.lease_s, cfg.copy_threads) == (2 << 30, 9.0, 5)


def test_defaults_and_frozen():
    cfg = load_config(DaemonConfig, env={})
    assert cfg.hicache_size == 1 << 30 and cfg.hicache_storage_prefetch_policy == "timeout"
    with pytest.raises(pydantic.ValidationError):
        cfg.hicache_size = 1  # type: ignore[misc]


def test_unknown_key_in_file_names_key_and_value(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('hicache_sise = "2GiB"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'hicache_sise' \(value '2GiB'\)"):
        load_config(DaemonConfig, file=f, env={})


def test_unknown_env_variable_is_an_error():
    with pytest.raises(ConfigError, match=r"KVTIER_HICACHE_SISE='1'"):
        load_config(DaemonConfig, env={"KVTIER_HICACHE_SISE": "1"})


def test_client_variables_are_not_daemon_errors():
    cfg = load_config(DaemonConfig, env={"KVTIER_REQUEST_TIMEOUT_S": "3"})
    assert cfg.lease_s == 30.0
    assert load_config(ClientConfig, env={"KVTIER_REQUEST_TIMEOUT_S": "3"}).request_timeout_s == 3.0


@pytest.mark.parametrize("source,expect", [
    (dict(env={"KVTIER_HICACHE_SIZE": "lots"}),
     r"hicache_size = 'lots' \(from environment variable KVTIER_HICACHE_SIZE\)"),
    (dict(cli={"copy_threads": "0"}), r"copy_threads = '0' \(from flag --copy-threads\)"),
    (dict(cli={"hicache_storage_prefetch_policy": "sometimes"}),
     r"hicache_storage_prefetch_policy = 'sometimes'"),
    (dict(cli={"tenants": '{"a": {"token": "x", "quota_pages": 0}}'}), r"tenants.a.quota_pages = 0"),
    (dict(cli={"tenants": "{not json"}), r"tenants = '\{not json' from the command line: not valid JSON"),
    (dict(cli={"extent_size": "2GiB", "hicache_size": "1GiB"}), r"extent_size .* must not exceed"),
])
def test_bad_values_name_key_source_and_value(source, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(DaemonConfig, **{"env": {}, **source})


def test_tokens_are_redacted_in_errors():
    with pytest.raises(ConfigError) as err:
        load_config(DaemonConfig, env={}, cli={"tenants": '{"a": {"token": 91357, "bogus": 1}}'})
    msg = str(err.value)
    assert "tenants.a.bogus" in msg and "tenants.a.token = '<redacted>'" in msg
    assert "91357" not in msg


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


def test_boolean_flag_without_value_means_true():
    p = argparse.ArgumentParser()
    add_config_flags(p, DaemonConfig)
    cfg = load_config(DaemonConfig, env={}, cli=flags_to_dict(p.parse_args(["--cold-start"]), DaemonConfig))
    assert cfg.cold_start is True
    cfg = load_config(DaemonConfig, env={},
                      cli=flags_to_dict(p.parse_args(["--prefault", "false"]), DaemonConfig))
    assert cfg.prefault is False
