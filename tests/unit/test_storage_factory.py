"""Unit tests of the backend factory: extra-config parsing, backend construction, plug-ins."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from kvtier.config.errors import ConfigError, StorageError
from kvtier.daemon.storage.base import HostArena, StorageBackend
from kvtier.daemon.storage.registry import create_backend, parse_extra_config

pytestmark = pytest.mark.timeout(30)

MODULE = __name__


class PluginBackend(StorageBackend):
    """A complete, do-nothing backend that a ``dynamic`` config can name."""

    name = "plugin"

    def __init__(self, extra_config: dict[str, Any]) -> None:
        super().__init__(extra_config)
        if "explode" in extra_config:
            raise RuntimeError("plug-in refuses its config")
        if "bad" in extra_config:
            raise ConfigError(f"plugin: 'bad' = {extra_config['bad']!r} is not allowed")

    async def open(self, arena: HostArena) -> None:
        pass

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        return 0

    async def get_into(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        return [False] * len(keys)

    async def put_from(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        return [False] * len(keys)

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> int:
        return 0

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        pass


class HalfBackend(StorageBackend):
    """Misses every abstract method but one."""

    async def open(self, arena: HostArena) -> None:
        pass


class NotABackend:
    """Has the right shape of name but no base class."""

    def __init__(self, extra_config: dict[str, Any]) -> None:
        self.extra_config = extra_config


# -- parse_extra_config ------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "   "])
def test_empty_values_give_an_empty_config(value: str | None) -> None:
    assert parse_extra_config(value) == {}


def test_json_text_and_mappings_parse_into_new_dicts() -> None:
    assert parse_extra_config('{"url": "redis://h:1/0", "ttl_s": 60}') == {
        "url": "redis://h:1/0",
        "ttl_s": 60,
    }
    original = {"a": 1}
    parsed = parse_extra_config(original)
    assert parsed == original and parsed is not original


def test_bad_json_names_the_field_and_the_value() -> None:
    with pytest.raises(ConfigError) as err:
        parse_extra_config('{"url": ')
    message = str(err.value)
    assert "hicache_storage_backend_extra_config" in message
    assert "invalid JSON" in message and '{"url": ' in message


@pytest.mark.parametrize("value", ["[1, 2]", '"text"', "7"])
def test_json_that_is_not_an_object_is_rejected(value: str) -> None:
    with pytest.raises(ConfigError, match="expected a JSON object"):
        parse_extra_config(value)


def test_missing_file_is_a_config_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    with pytest.raises(ConfigError) as err:
        parse_extra_config(f"@{missing}")
    assert str(missing) in str(err.value) and "cannot read" in str(err.value)


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "l3.toml"
    path.write_text('url = "redis://10.0.0.7:6379/0"\nttl_s = 86400\nmax_connections = 8\n')
    assert parse_extra_config(f"@{path}") == {
        "url": "redis://10.0.0.7:6379/0",
        "ttl_s": 86400,
        "max_connections": 8,
    }


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "l3.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.7:50051"}))
    assert parse_extra_config(f"@{path}") == {"master_server_address": "10.0.0.7:50051"}


def test_bad_toml_and_bad_json_files(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("url = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse_extra_config(f"@{toml}")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nope}")
    with pytest.raises(ConfigError, match="invalid JSON"):
        parse_extra_config(f"@{bad_json}")
    array = tmp_path / "array.json"
    array.write_text("[]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        parse_extra_config(f"@{array}")


def test_other_file_extensions_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "l3.yaml"
    path.write_text("url: x\n")
    with pytest.raises(ConfigError, match=r"\.json or \.toml"):
        parse_extra_config(f"@{path}")
    with pytest.raises(ConfigError, match="file path"):
        parse_extra_config("@")


# -- create_backend ----------------------------------------------------------------------


def test_unknown_backend_names_the_value_and_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        create_backend("s3", {})
    message = str(err.value)
    assert "hicache_storage_backend" in message and "'s3'" in message
    assert "redis" in message and "mooncake" in message and "dynamic" in message


def test_redis_backend_is_built_with_validated_options() -> None:
    from kvtier.daemon.storage.redis import RedisBackend

    backend = create_backend(
        "redis", {"host": "10.0.0.7", "port": 6380, "ttl_s": 60, "prefix": "prod"}
    )
    assert isinstance(backend, RedisBackend) and backend.name == "redis"
    assert backend.options.address == "redis://10.0.0.7:6380/0"
    assert backend.key_name(b"\x01" * 32, b"\x02" * 32) == b"prod:" + b"01" * 32 + b":" + b"02" * 32


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"ttl": 5}, "unknown key 'ttl' = 5"),
        ({"timeout_s": -1}, "'timeout_s' = -1"),
        ({"max_connections": "many"}, "'max_connections' = 'many'"),
        ({"url": "http://x"}, "redis://"),
        ({"url": "redis://a:1/0", "host": "b"}, "not both"),
        ({"port": 7000}, "need 'host'"),
        ({"prefix": "has space"}, "'prefix' = 'has space'"),
    ],
)
def test_redis_config_errors_name_the_key_and_the_value(
    extra: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        create_backend("redis", extra)
    assert fragment in str(err.value)
    assert "hicache_storage_backend_extra_config" in str(err.value)


def test_mooncake_backend_is_built_without_touching_the_network() -> None:
    from kvtier.daemon.storage.mooncake import MooncakeBackend

    backend = create_backend(
        "mooncake",
        {
            "master_server_address": "10.0.0.7:50051",
            "global_segment_size": "4GiB",
            "protocol": "tcp",
        },
    )
    assert isinstance(backend, MooncakeBackend) and backend.name == "mooncake"
    assert backend.options.global_segment_size == 4 << 30
    assert backend.store is None


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"protocol": "udp"}, "'protocol' = 'udp'"),
        ({"global_segment_size": "lots"}, "'global_segment_size' = 'lots'"),
        ({"master": "x:1"}, "unknown key 'master'"),
        ({"sub_batch_keys": 0}, "'sub_batch_keys' = 0"),
    ],
)
def test_mooncake_config_errors_name_the_key_and_the_value(
    extra: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        create_backend("mooncake", extra)
    assert fragment in str(err.value)


def test_file_backend_is_imported_lazily_and_built() -> None:
    file_module = pytest.importorskip("kvtier.daemon.storage.file")
    with pytest.raises(ConfigError):
        create_backend("file", {"no_such_key": 1})
    backend = create_backend("file", {"path": "/tmp/kvtier-factory-test-unused"})
    assert isinstance(backend, file_module.FileBackend) and backend.name == "file"


def test_dynamic_backend_gets_the_remaining_keys() -> None:
    backend = create_backend(
        "dynamic",
        {
            "backend_name": "my_store",
            "module_path": MODULE,
            "class_name": "PluginBackend",
            "interface_v1": 1,
            "endpoint": "x:1",
            "depth": 3,
        },
    )
    assert isinstance(backend, PluginBackend)
    assert backend.name == "my_store"
    assert backend.extra_config == {"endpoint": "x:1", "depth": 3}


def test_dynamic_backend_keeps_its_class_name_without_backend_name() -> None:
    backend = create_backend("dynamic", {"module_path": MODULE, "class_name": "PluginBackend"})
    assert backend.name == "plugin" and backend.extra_config == {}


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"class_name": "PluginBackend"}, "'module_path' must be a non-empty string"),
        ({"module_path": MODULE}, "'class_name' must be a non-empty string"),
        (
            {"module_path": "kvtier_no_such_module", "class_name": "X"},
            "'module_path' = 'kvtier_no_such_module' cannot be imported",
        ),
        (
            {"module_path": MODULE, "class_name": "Missing"},
            "'class_name' = 'Missing' is not defined",
        ),
        ({"module_path": MODULE, "class_name": "NotABackend"}, "not a StorageBackend subclass"),
        ({"module_path": MODULE, "class_name": "MODULE"}, "not a StorageBackend subclass"),
        ({"module_path": MODULE, "class_name": "HalfBackend"}, "does not implement"),
        (
            {"module_path": MODULE, "class_name": "PluginBackend", "backend_name": ""},
            "'backend_name'",
        ),
        ({"module_path": MODULE, "class_name": "PluginBackend", "bad": 1}, "'bad' = 1"),
    ],
)
def test_dynamic_errors_are_config_errors(extra: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        create_backend("dynamic", extra)
    assert fragment in str(err.value)


def test_a_plugin_that_fails_for_its_own_reason_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="refuses its config") as err:
        create_backend(
            "dynamic", {"module_path": MODULE, "class_name": "PluginBackend", "explode": 1}
        )
    assert isinstance(err.value.__cause__, RuntimeError)


def test_parse_then_create_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "plugin.toml"
    path.write_text(f'module_path = "{MODULE}"\nclass_name = "PluginBackend"\nlimit = 4\n')
    backend = create_backend("dynamic", parse_extra_config(f"@{path}"))
    assert isinstance(backend, PluginBackend) and backend.extra_config == {"limit": 4}
