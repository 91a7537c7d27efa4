"""Pages the Redis server drops on its own: its keyspace notifications of evicted and
expired keys, for :meth:`~kvtier.daemon.storage.base.StorageBackend.dropped`.

A server under ``maxmemory`` evicts keys, and a page stored with ``ttl_s`` expires; neither
passes through kvtier. With the extra-config key ``watch_drops``, the backend subscribes to
the server's ``__keyevent@<db>__:evicted`` and ``__keyevent@<db>__:expired`` channels on a
connection of its own and keeps the names under its prefix that come by (at most
:data:`MAX_DROPS` between two batches; more are counted and lost), so KV events can say
that L3 no longer holds them.

The server publishes these only with the ``E`` class and the ``e`` / ``x`` event types in
its ``notify-keyspace-events`` setting. The watcher adds what is missing with ``CONFIG SET``
(keeping the classes already set, which other clients may rely on); a server that refuses
``CONFIG`` (an ACL, a managed service) must have them set by its operator, and the watcher
says so in the log once. Notifications are fire-and-forget: those sent while the
subscription is down (the server restarted) are lost, never replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import redis.asyncio as redis_asyncio
from kvtier.daemon.storage.keys import ObjectNames
from redis.exceptions import RedisError

__all__ = ["MAX_DROPS", "NOTIFY_FLAGS", "DropWatch", "merged_flags"]

_log = logging.getLogger("kvtier.daemon.storage.redis")

MAX_DROPS = 65536
"""Dropped pages kept between two takes; the oldest go beyond it."""

NOTIFY_FLAGS = "Eex"
"""What ``notify-keyspace-events`` needs: keyevent channels (``E``), evicted (``e``) and
expired (``x``) keys."""

_RETRY_S = 1.0  # between two subscription attempts after a lost connection


def merged_flags(current: str) -> str:
    """``current`` ``notify-keyspace-events`` classes plus :data:`NOTIFY_FLAGS` (``A``, the
    alias of every event type, already covers ``e`` and ``x``)."""
    missing = [f for f in NOTIFY_FLAGS if f not in current and not (f in "ex" and "A" in current)]
    return current + "".join(missing)


class DropWatch:
    """Collects the pages a Redis server evicts or expires (see the module docstring).

    Args:
        client: the backend's open client (the watcher takes one connection of its pool
            for its subscription).
        names: the backend's object names (only names under its prefix count).
        db: the database the pages live in.
        on_drop: called (from the event loop) when a page of ours was dropped.

    Attributes:
        lost: dropped pages not kept (more than :data:`MAX_DROPS` between two takes).
        watching: whether the subscription is up.
    """

    def __init__(
        self,
        client: redis_asyncio.Redis,
        names: ObjectNames,
        db: int,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._on_drop = on_drop
        self._names = names
        self._channels = [f"__keyevent@{db}__:evicted", f"__keyevent@{db}__:expired"]
        self._dropped: deque[tuple[bytes, bytes]] = deque(maxlen=MAX_DROPS)
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self.lost = 0
        self.watching = False
        self._timeout_s = 5.0

    async def start(self, timeout_s: float) -> None:
        """Make sure the server notifies, then subscribe (waits up to ``timeout_s`` for the
        subscription; a failure is logged, never raised: the backend works without it)."""
        self._timeout_s = timeout_s
        await self.ensure_notify()
        self._task = asyncio.create_task(self._run(), name="kvtier-redis-drops")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), timeout_s)

    async def ensure_notify(self) -> None:
        """Make sure the server publishes evictions and expiries (``notify-keyspace-events``
        has :data:`NOTIFY_FLAGS`): at start, and again for a server that restarted (its
        configuration is its own); a failure is logged, never raised."""
        timeout_s = self._timeout_s
        try:
            current = await asyncio.wait_for(
                self._client.config_get("notify-keyspace-events"), timeout_s
            )
            flags = str(current.get("notify-keyspace-events", ""))
            if merged_flags(flags) != flags:
                await asyncio.wait_for(
                    self._client.config_set("notify-keyspace-events", merged_flags(flags)),
                    timeout_s,
                )
        except (RedisError, OSError, TimeoutError) as err:
            _log.warning(
                "redis backend: cannot check or set notify-keyspace-events (%s); pages the "
                "server evicts or expires are announced only if it is set to include %r",
                err,
                NOTIFY_FLAGS,
            )

    def take(self) -> list[tuple[bytes, bytes]]:
        """The pages dropped since the last take, oldest first."""
        out = list(self._dropped)
        self._dropped.clear()
        return out

    async def close(self) -> None:
        """Stop the subscription; idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.watching = False

    async def _run(self) -> None:
        first = True
        while True:
            if not first:  # subscribing again: the server may have restarted, unset
                await self.ensure_notify()
            first = False
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*self._channels)
                self.watching = True
                self._subscribed.set()
                while True:
                    msg = await pubsub.get_message(timeout=None)
                    if msg is not None:
                        self._note(msg)
            except (RedisError, OSError) as err:
                if self.watching:
                    _log.warning("redis backend: drop notifications lost: %s", err)
                self.watching = False
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(_RETRY_S)

    def _note(self, msg: dict[str, Any]) -> None:
        ident = self._names.parse(msg.get("data", b""))
        if ident is None:  # another prefix's key, or not a page
            return
        if len(self._dropped) == MAX_DROPS:
            self.lost += 1
        self._dropped.append(ident)
        if self._on_drop is not None:
            self._on_drop()
