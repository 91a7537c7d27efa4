"""``--help`` and ``--version`` of ``kvtierd`` and ``kvtier``: defaults, choices, structured
options, the version from package metadata; the stats table's adoption row."""

from __future__ import annotations

import importlib.metadata
import io
import re

import pytest
from kvtier.cli import admin
from kvtier.cli import main as kvtier_main
from kvtier.cli.demo import DEFAULT_PLOT
from kvtier.cli.demo import build_parser as demo_parser
from kvtier.cli.stats_view import render_namespaces, render_stats
from kvtier.daemon import __main__ as kvtierd

VERSION = importlib.metadata.version("kvtier")


def flat(text: str) -> str:
    """Help text with argparse's line wrapping undone."""
    return re.sub(r"\s+", " ", text)


def test_kvtierd_help_shows_defaults_choices_and_how_to_write_structured_values():
    text = flat(kvtierd.build_parser().format_help())
    for expected in (
        "--hicache-size SIZE",
        "Default: 1.0 GiB.",  # a size, as people write it
        "--log-level {debug,info,warning,error}",
        "Choices: none, file, mooncake, redis, dynamic. Default: file.",
        "--cold-start [BOOL]",
        "Default: false.",
        "Range: >= 1, <= 64. Default: 2.",  # copy_threads
        '{"NAME": {"token": "SECRET", "quota_pages": N}',  # the tenants format
        "kvtier stats, sessions, namespaces, flush and sync",  # the admin token's scope
        "--max-mapped-bytes-per-user SIZE",  # an optional size is still a size
        "max_sessions and max_mapped_bytes optional",  # the tenants' own bounds
        "keys of each backend are in docs/configuration.md",
        "--version",
    ):
        assert expected in text, f"{expected!r} missing from kvtierd --help"
    assert "(flush); None" not in text  # the old, wrong scope of the admin token


def test_kvtierd_version_comes_from_package_metadata(capsys):
    with pytest.raises(SystemExit) as stop:
        kvtierd.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtierd {VERSION}"


def test_kvtier_version_and_admin_command_version(capsys):
    assert kvtier_main.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvtier {VERSION}"
    assert admin.main(["stats", "--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvtier {VERSION}"
    with pytest.raises(SystemExit) as stop:
        kvtier_main.main(["events", "--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtier {VERSION}"


def test_flush_help_names_its_default_tier_and_token_sources(capsys):
    assert admin.main(["flush", "--help"]) == 0
    text = flat(capsys.readouterr().out)
    assert "default: l2" in text and "{l2,l3,all}" in text
    assert "$KVTIER_ADMIN_TOKEN" in text and "admin_token" in text


def test_admin_help_never_shows_the_token_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("KVTIER_ADMIN_TOKEN", "s3cret-in-env")
    for command in ("stats", "sessions", "flush", "sync"):
        assert admin.main([command, "--help"]) == 0
        assert "s3cret-in-env" not in capsys.readouterr().out


def test_demo_help_names_the_default_plot_path_and_the_private_daemon():
    text = flat(demo_parser().format_help())
    assert f"default: {DEFAULT_PLOT} in the current directory" in text
    assert "always starts a private kvtierd" in text
    assert demo_parser().parse_args([]).plot == DEFAULT_PLOT  # a plot unless --no-plot


def _text(renderable: object) -> str:
    from rich.console import Console

    console = Console(width=120, file=io.StringIO())
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("adopt", "shown"),
    [
        (
            {
                "adopted": True,
                "reason": "metadata matches",
                "pages_adopted": 4096,
                "pages_dropped": 2,
                "bytes_adopted": 1 << 30,
                "seconds": 0.032,
                "generation": 3,
            },
            "4,096 pages (1.0 GiB) in 32 ms, 2 dropped, generation 3",
        ),
        (
            {
                "adopted": False,
                "reason": "no pool file (first start)",
                "pages_adopted": 0,
                "pages_dropped": 0,
                "bytes_adopted": 0,
                "seconds": 0.0,
                "generation": 1,
            },
            "none, started empty (no pool file (first start))",
        ),
    ],
)
def test_stats_table_shows_what_the_start_adopted(adopt, shown):
    text = _text(render_stats({"adopt": adopt, "pool": {}, "counters": {}}))
    row = next(line for line in text.splitlines() if "adopted at start" in line)
    assert shown in row


def test_stats_table_shows_each_users_use_against_its_bounds():
    limits = {
        "bounds": {"max_sessions_per_user": 128, "max_mapped_bytes_per_user": 64 << 20},
        "users": {"4343": {"sessions": 3, "mapped_bytes": 32 << 20}},
        "refusals": {"max_mapped_bytes_per_user": 2},
    }
    text = _text(render_stats({"pool": {}, "counters": {}, "limits": limits}))
    row = next(line for line in text.splitlines() if "4343" in line)
    assert "3 / 128" in row and "32.0 MiB / 64.0 MiB" in row, row
    assert "refused: max_mapped_bytes_per_user 2" in text


def test_namespaces_table_says_when_the_daemon_listed_only_some():
    row = {"namespace": "ab" * 32, "pages": 7, "sessions": 0, "tenant": "", "models": ["m"]}
    text = _text(render_namespaces([row], total=5000))
    assert text.startswith("1 of 5000 namespaces") and "ab" * 32 in text
    assert _text(render_namespaces([row])).startswith("1 namespace ")
