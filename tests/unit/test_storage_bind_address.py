"""Mooncake's TCP bind address reaches its setup call only, never the process for good."""

from __future__ import annotations

import os

import pytest
from kvtier.daemon.storage.mooncake.connect import BIND_ADDRESS_ENV, setup_with_bind_address

pytestmark = pytest.mark.timeout(10)


def seen_by_setup() -> str | None:
    """A stand-in for Mooncake's setup: what the transfer engine would read (``getenv``)."""
    return os.environ.get(BIND_ADDRESS_ENV)


def test_an_ip_is_visible_during_setup_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_ADDRESS_ENV, raising=False)
    before = dict(os.environ)
    assert setup_with_bind_address(seen_by_setup, "127.0.0.1") == "127.0.0.1"
    assert setup_with_bind_address(seen_by_setup, "::1") == "::1"
    assert dict(os.environ) == before


def test_the_environment_is_restored_when_setup_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_ADDRESS_ENV, raising=False)
    before = dict(os.environ)

    def failing() -> int:
        assert os.environ[BIND_ADDRESS_ENV] == "10.0.0.7"
        raise RuntimeError("setup failed")

    with pytest.raises(RuntimeError, match="setup failed"):
        setup_with_bind_address(failing, "10.0.0.7")
    assert dict(os.environ) == before


def test_an_operators_setting_wins_and_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BIND_ADDRESS_ENV, "192.168.1.5")
    assert setup_with_bind_address(seen_by_setup, "127.0.0.1") == "192.168.1.5"
    assert os.environ[BIND_ADDRESS_ENV] == "192.168.1.5"


def test_a_host_name_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_ADDRESS_ENV, raising=False)
    assert setup_with_bind_address(seen_by_setup, "node7.example") is None
    assert BIND_ADDRESS_ENV not in os.environ
