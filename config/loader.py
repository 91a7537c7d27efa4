"""Load a config model from its three sources into one frozen object.

Precedence, lowest first: the model's defaults, a TOML file, ``KVTIER_<FIELD>`` environment
variables, CLI flags (``--field-name``). This module is the only place that reads the
environment for configuration. Every error is a :class:`ConfigError` naming the key, the
source and the bad value.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from kvtier.config.errors import ConfigError
from kvtier.config.models import ClientConfig, DaemonConfig, shown
from kvtier.config.sizes import format_size, parse_size
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
ENV_PREFIX = "KVTIER_"
# Variables that are read elsewhere on purpose and are not config fields of either model.
_OTHER_ENV = {"KVTIER_CONFIG"}


def runtime_dir(configured: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Return the runtime directory (socket, completion blocks).

    Args:
        configured: a directory set in the config; wins when given.
        env: the environment (default ``os.environ``).

    Returns:
        ``configured``, else ``$KVTIER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/kvtier``,
        else ``/tmp/kvtier-<uid>``.
    """
    env = os.environ if env is None else env
    if configured is not None:
        return Path(configured)
    if env.get("KVTIER_RUNTIME_DIR"):
        return Path(env["KVTIER_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvtier"
    return Path(f"/tmp/kvtier-{os.getuid()}")


def state_dir(configured: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Return the state directory: what must outlive the daemon and a reboot (the ``file``
    L3 store lives in ``<state_dir>/l3``).

    Not derived from the runtime directory: that is usually a tmpfs (``/run/user/<uid>``,
    ``/tmp``), which a reboot empties and whose files take memory.

    Args:
        configured: a directory set in the config (``state_dir`` from the TOML file,
            ``$KVTIER_STATE_DIR`` or ``--state-dir``); wins when given.
        env: the environment (default ``os.environ``).

    Returns:
        ``configured``, else ``$KVTIER_STATE_DIR``, else the first path of
        ``$STATE_DIRECTORY`` (set by systemd's ``StateDirectory=``; colon-separated when the
        unit names several), else ``$XDG_STATE_HOME/kvtier``, else ``~/.local/state/kvtier``.
        An empty variable counts as unset, and so does a relative ``$XDG_STATE_HOME`` (the
        XDG base directory spec says to ignore it).

    Raises:
        ConfigError: none of these is set and the user has no home directory.
    """
    env = os.environ if env is None else env
    if configured is not None:
        return Path(configured)
    if env.get("KVTIER_STATE_DIR"):
        return Path(env["KVTIER_STATE_DIR"])
    first = env.get("STATE_DIRECTORY", "").split(":")[0]
    if first:
        return Path(first)
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "kvtier"
    home = env.get("HOME")
    if not home:
        import pwd

        try:
            home = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            home = ""
    if not home:
        raise ConfigError(
            f"no state directory: uid {os.getuid()} has no home directory and "
            "none of state_dir, $STATE_DIRECTORY, $XDG_STATE_HOME is set"
        )
    return Path(home) / ".local" / "state" / "kvtier"


def socket_path(rdir: Path) -> Path:
    """Return the daemon's control socket path inside runtime directory ``rdir``."""
    return rdir / "kvtierd.sock"


def pool_path(pool_dir: Path, rdir: Path) -> Path:
    """Return the host pool's shared-memory file: one per runtime directory, stable across
    restarts of the daemon (so a restarted daemon finds its pool)."""
    import hashlib

    tag = hashlib.sha256(str(Path(rdir).resolve()).encode()).hexdigest()[:16]
    return Path(pool_dir) / f"kvtier-pool-{tag}"


def _is_structured(model: type[BaseModel], name: str) -> bool:
    ann = model.model_fields[name].annotation
    origin = get_origin(ann)
    if origin in (dict, list):
        return True
    return any(get_origin(a) in (dict, list) for a in get_args(ann))


def _read_toml(path: Path) -> dict[str, Any]:
    import tomllib  # here: a daemon started without a config file never imports it (an import of milliseconds)

    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as err:
        raise ConfigError(f"config file {str(path)!r} does not exist") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {err}") from err
    except OSError as err:  # a directory, no permission, an I/O error
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from err


def _from_env(model: type[BaseModel], env: Mapping[str, str]) -> dict[str, Any]:
    known = set(DaemonConfig.model_fields) | set(ClientConfig.model_fields)
    out: dict[str, Any] = {}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var in _OTHER_ENV:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name not in known:
            raise ConfigError(  # its value unquoted: a misspelt key may hold a secret
                f"unknown environment variable {var} (no such config key {name!r})"
            )
        if name not in model.model_fields:
            continue
        out[name] = _parse_structured(model, name, raw, f"environment variable {var}")
    return out


def _parse_structured(model: type[BaseModel], name: str, raw: Any, source: str) -> Any:
    if isinstance(raw, str) and _is_structured(model, name):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            # where, not what: the text may hold tokens or passwords anywhere
            raise ConfigError(f"{name} from {source}: not valid JSON ({err})") from err
    return raw


def load_config(
    model: type[M],
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
    cli_source: str | None = None,
) -> M:
    """Build a frozen config from defaults, a TOML file, the environment and CLI values.

    Args:
        model: :class:`DaemonConfig` or :class:`ClientConfig`.
        file: a TOML file with top-level keys named like the fields (tables for dict fields).
        env: the environment to read ``KVTIER_*`` from (default ``os.environ``).
        cli: values from CLI flags, keyed by field name; ``None`` values are ignored.
        cli_source: where ``cli`` came from, for the messages (default: flags, named
            ``--field-name``); e.g. an engine's own settings.

    Returns:
        The validated, frozen model.

    Raises:
        ConfigError: an unknown key or a bad value; the message names the key, its source
            and the value.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if file is not None:
        for key, val in _read_toml(Path(file)).items():
            if key not in model.model_fields:
                raise ConfigError(  # its value unquoted: a misspelt key may hold a secret
                    f"unknown key {key!r} in config file {str(file)!r}"
                )
            values[key], sources[key] = val, f"config file {str(file)!r}"
    for key, val in _from_env(model, env).items():
        values[key], sources[key] = val, f"environment variable {ENV_PREFIX}{key.upper()}"
    for key, val in (cli or {}).items():
        if val is None:
            continue
        if key not in model.model_fields:
            if cli_source is not None:
                raise ConfigError(f"unknown key {key!r} in {cli_source}")
            raise ConfigError(f"unknown option --{key.replace('_', '-')}")
        values[key] = _parse_structured(model, key, val, cli_source or "the command line")
        sources[key] = cli_source or f"flag --{key.replace('_', '-')}"
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ConfigError(_describe(err, values, sources)) from err


def client_config(
    given: Mapping[str, Any] | None = None, source: str = "arguments"
) -> ClientConfig:
    """An engine's :class:`ClientConfig`: defaults, then the ``KVTIER_*`` environment, then
    ``given`` (an engine's or adapter's own settings, named ``source`` in messages).

    Raises:
        ConfigError: an unknown key or a bad value, named with its source.
    """
    return load_config(ClientConfig, cli=given, cli_source=source)


def _describe(err: ValidationError, values: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    lines = []
    for e in err.errors():
        if not e["loc"]:  # a check across fields: its message names them and their values
            msg = e["msg"].removeprefix("Value error, ")
            named = [k for k in values if k in msg]
            src = ", ".join(f"{k} from {sources.get(k, 'defaults')}" for k in named)
            lines.append(f"{msg} ({src})" if src else msg)
            continue
        loc = ".".join(str(p) for p in e["loc"])
        top = str(e["loc"][0])
        value = e.get("input", values.get(top))
        if isinstance(value, dict) and top in values and len(e["loc"]) == 1:
            value = values[top]
        src = sources.get(top, "defaults")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc} = {shown(e['loc'], value, e['type'])!r} (from {src}): {msg}")
    return "invalid configuration: " + "; ".join(lines)


# Help for fields whose description (in models.py) does not say how to write the value or
# what it is for; shown by ``kvtierd --help`` in place of / after the description.
_HELP_REPLACED = {
    "admin_token": "Credential the admin requests must carry: kvtier stats, sessions, "
    "namespaces, flush and sync (health needs none). Unset: anyone who can reach the socket "
    "may use them, unless tenants are configured: then a tenant's token gives that "
    "tenant's view and sync is refused. The admin commands send it from --admin-token or "
    "$KVTIER_ADMIN_TOKEN.",
}
_HELP_NOTES = {
    "tenants": 'Format: a JSON object {"NAME": {"token": "SECRET", "quota_pages": N}, ...} '
    "(quota_pages optional: no quota; max_sessions and max_mapped_bytes optional: the "
    "per-user bounds); in TOML, one [tenants.NAME] table each. "
    "Engines register with ClientConfig tenant and token.",
    "hicache_storage_backend_extra_config": 'E.g. \'{"path": "/data/kvtier", "capacity": '
    '"64GiB"}\' for file; the keys of each backend are '
    "in docs/configuration.md.",
}


def _is_size(field: Any) -> bool:
    """Whether a field takes a byte size (``ByteSize``, or ``ByteSize | None``)."""
    metadata = [*field.metadata]
    for arg in get_args(field.annotation):
        metadata.extend(getattr(arg, "__metadata__", ()))
    return any(getattr(m, "func", None) is parse_size for m in metadata)


def _default_text(field: Any) -> str:
    """How ``--help`` shows a field's default: sizes as ``1.0 GiB``, booleans as true/false."""
    if field.default_factory is not None:
        value = field.default_factory()
        return "none" if not value else repr(value)
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if _is_size(field):
        return format_size(int(value))
    return str(value)


def _bounds_text(field: Any) -> str:
    """The field's numeric bounds as ``>= 1, <= 64`` (empty when it has none)."""
    parts = []
    for m in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sign} {getattr(m, attr)}")
    return ", ".join(parts)


def _metavar(model: type[BaseModel], name: str, field: Any) -> str:
    """The placeholder ``--help`` shows for a field's value: its choices, SIZE, JSON, ..."""
    if get_origin(field.annotation) is Literal:
        return "{" + ",".join(str(a) for a in get_args(field.annotation)) + "}"
    if field.annotation is bool:
        return "BOOL"
    if _is_size(field):
        return "SIZE"
    if _is_structured(model, name):
        return "JSON"
    return "VALUE"


def flag_help(name: str, field: Any) -> str:
    """The ``--help`` text of one config field: what it is, its choices, bounds and default.

    Args:
        name: the field's name.
        field: its pydantic ``FieldInfo``.

    Returns:
        One paragraph (argparse wraps it); ``%`` is escaped for argparse.
    """
    parts = [_HELP_REPLACED.get(name, field.description or "")]
    if name in _HELP_NOTES:
        parts.append(_HELP_NOTES[name])
    choices = [a for a in get_args(field.annotation) if isinstance(a, str)]
    if get_origin(field.annotation) is Literal and choices:
        parts.append(f"Choices: {', '.join(choices)}.")
    if field.annotation is bool:
        parts.append("true or false; the bare flag means true.")
    bounds = _bounds_text(field)
    if bounds:
        parts.append(f"Range: {bounds}.")
    if _is_size(field):
        parts.append("Bytes, or a size such as 512MiB, 4GiB.")
    if "Default:" not in parts[0]:  # else the description says how the default is derived
        parts.append(f"Default: {_default_text(field)}.")
    return " ".join(p for p in parts if p).replace("%", "%%")


def add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Add one ``--field-name VALUE`` flag per field of ``model`` (all strings, default None).

    Values are validated by the model, so ``--hicache-size 4GiB`` works like the TOML key.
    A boolean flag given without a value means true (``--cold-start``). Each flag's help
    names the field's choices, bounds and default (:func:`flag_help`).
    """
    group = parser.add_argument_group(
        "configuration (each flag is also a TOML key and a KVTIER_<KEY> variable; flags win "
        "over variables, variables over the file)"
    )
    for name, field in model.model_fields.items():
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if field.annotation is bool else {}
        group.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"cfg_{name}",
            default=None,
            metavar=_metavar(model, name, field),
            help=flag_help(name, field),
            **extra,
        )


def package_version() -> str:
    """kvtier's version, from the installed package's metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:
        return "unknown (kvtier is not installed: pip install -e .)"


def add_version_flag(parser: argparse.ArgumentParser, prog: str) -> None:
    """Add ``--version``: print ``<prog> <version>`` (from package metadata) and exit 0."""
    parser.add_argument("--version", action="version", version=f"{prog} {package_version()}")


def flags_to_dict(ns: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """Collect the values of the flags :func:`add_config_flags` added, keyed by field name."""
    return {name: getattr(ns, f"cfg_{name}", None) for name in model.model_fields}
