"""Parse and validate the extra config of an L3 backend.

The daemon's ``hicache_storage_backend_extra_config`` carries a backend's settings, as in
SGLang HiCache. It arrives as JSON text, as ``@path`` to a ``.json`` or ``.toml`` file, or
as an already parsed mapping (:func:`parse_extra_config`). Every backend validates its own
keys with a frozen pydantic model through :func:`validate_options`, so an unknown or bad key
fails at start with a :class:`~kvtier.config.errors.ConfigError` that names the key and the
value.

This module imports no backend: backends import it, and the registry imports backends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvtier.config.errors import ConfigError
from kvtier.config.redact import redact_text, redact_url, redact_value
from pydantic import BaseModel, ValidationError

__all__ = [
    "EXTRA_CONFIG_FIELD",
    "parse_extra_config",
    "redact_text",
    "redact_url",
    "redact_value",
    "validate_options",
]

EXTRA_CONFIG_FIELD = "hicache_storage_backend_extra_config"
"""The configuration field every extra-config error names."""

_Options = TypeVar("_Options", bound=BaseModel)


def parse_extra_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Parse a backend's extra config.

    Args:
        value: ``None`` or ``""`` (no settings); a mapping (copied); JSON text holding an
            object; or ``@path`` to a ``.json`` or ``.toml`` file (``~`` expanded).

    Returns:
        A new dict of settings.

    Raises:
        ConfigError: the JSON or TOML does not parse, does not hold an object / table,
            the file is missing or unreadable, or its extension is neither .json nor .toml.
            The message names ``hicache_storage_backend_extra_config`` and quotes the value.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return _string_keys(dict(value), "the mapping")
    if not isinstance(value, str):
        raise ConfigError(
            f"{EXTRA_CONFIG_FIELD}: expected JSON text, '@file' or a mapping, got "
            f"{type(value).__name__}"
        )
    text = value.strip()
    if not text:
        return {}
    if text.startswith("@"):
        return _load_file(text[1:].strip(), value)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{EXTRA_CONFIG_FIELD}: invalid JSON ({err.msg} at line {err.lineno} column "
            f"{err.colno}) in {redact_text(value)!r}"
        ) from err
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"{EXTRA_CONFIG_FIELD}: expected a JSON object, got {type(parsed).__name__}"
        )
    return _string_keys(parsed, "the JSON object")


def _load_file(path_text: str, value: str) -> dict[str, Any]:
    """Read ``@path``: JSON or TOML by extension."""
    if not path_text:
        raise ConfigError(
            f"{EXTRA_CONFIG_FIELD}: '@' must be followed by a file path, got {value!r}"
        )
    path = Path(path_text).expanduser()
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ConfigError(f"{EXTRA_CONFIG_FIELD}: {value!r}: the file must end in .json or .toml")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"{EXTRA_CONFIG_FIELD}: cannot read {value!r}: {err.strerror or err}"
        ) from err
    if suffix == ".toml":
        # imported here: a daemon whose options are not in a TOML file never needs it (an import of milliseconds)
        import tomllib

        try:
            parsed: Any = tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{EXTRA_CONFIG_FIELD}: invalid TOML in {value!r}: {err}") from err
    else:
        try:
            parsed = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{EXTRA_CONFIG_FIELD}: invalid JSON in {value!r}: {err}") from err
        if not isinstance(parsed, dict):
            raise ConfigError(f"{EXTRA_CONFIG_FIELD}: {value!r} must hold a JSON object")
    return _string_keys(parsed, repr(value))


def _string_keys(parsed: dict[Any, Any], where: str) -> dict[str, Any]:
    for key in parsed:
        if not isinstance(key, str):
            raise ConfigError(
                f"{EXTRA_CONFIG_FIELD}: key {redact_value(key)!r} in {where} is not a string"
            )
    return parsed


def validate_options(
    model: type[_Options], extra_config: Mapping[str, Any], backend: str
) -> _Options:
    """Validate a backend's extra config against its options model.

    Args:
        model: a frozen pydantic model with ``extra="forbid"``; one field per accepted key.
        extra_config: the parsed extra config.
        backend: the backend's name, for messages.

    Returns:
        The validated options.

    Raises:
        ConfigError: one line per bad key, each naming the key and the value it was given;
            unknown keys also list the accepted ones.
    """
    try:
        return model.model_validate(dict(extra_config))
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            key = ".".join(str(part) for part in problem["loc"]) or "(config)"
            if problem["type"] == "extra_forbidden":
                accepted = ", ".join(model.model_fields)
                given = redact_value(problem["input"], key)
                lines.append(f"unknown key {key!r} = {given!r} (accepted: {accepted})")
            else:
                given = redact_value(problem["input"], key)
                lines.append(f"{key!r} = {given!r}: {problem['msg']}")
        raise ConfigError(f"{EXTRA_CONFIG_FIELD} for {backend!r}: " + "; ".join(lines)) from err
