"""What the Redis drop watcher asks of a server's ``notify-keyspace-events`` (the watcher
itself runs against a real redis-server in tests/integration/test_kv_events.py)."""

from __future__ import annotations

import pytest
from kvtier.daemon.storage.redis.drops import merged_flags
from kvtier.daemon.storage.redis.options import RedisOptions


@pytest.mark.parametrize(
    ("current", "wanted"),
    [
        ("", "Eex"),
        ("Ex", "Exe"),
        ("KEA", "KEA"),  # A covers every event type
        ("Kg$", "Kg$Eex"),  # what others set is kept
        ("Eex", "Eex"),
    ],
)
def test_merged_flags_add_only_what_is_missing(current: str, wanted: str) -> None:
    assert merged_flags(current) == wanted


def test_watch_drops_is_off_unless_asked_and_must_be_a_bool() -> None:
    assert RedisOptions().watch_drops is False
    assert RedisOptions(watch_drops=True).watch_drops is True
    with pytest.raises(ValueError, match="watch_drops"):
        RedisOptions(watch_drops="maybe")
