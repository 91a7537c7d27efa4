"""A dependency-free client of systemd's notification protocol (``sd_notify(3)``).

kvtierd runs as a ``Type=notify`` service with a watchdog (``systemd/kvtier.service``).
It tells systemd when it is ready, reloading or stopping, and proves that its event
loop is alive by sending ``WATCHDOG=1`` from the loop itself::

    systemd ──NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID──▶ kvtierd (environment)
    kvtierd ──"READY=1" / "WATCHDOG=1" / ... (AF_UNIX datagrams)──▶ systemd

Outside systemd (tests, a shell, ``make serve``) ``NOTIFY_SOCKET`` is unset and every
call is a no-op, so the daemon uses one code path everywhere.

The environment is read once, when :class:`SystemdNotifier` is built; nothing else
here looks at it. Sending never raises into the daemon: a failed send (systemd gone,
its queue full past the wait below) is logged at warning level once per outage and
reported as ``False``.

Sends are synchronous and short. When systemd's receive queue is full (it holds
``net.unix.max_dgram_qlen`` datagrams, 10 by default, while PID 1 is busy), a state
change (``READY=1``, ``STOPPING=1``, ...) waits up to ``send_timeout`` for room: losing
``READY=1`` would get the daemon killed at its start timeout. A watchdog ping never
waits: the next one follows within half the watchdog period.

Typical use in the daemon::

    notifier = SystemdNotifier()
    ...                                   # resources up
    notifier.ready()
    interval = notifier.watchdog_interval()
    if interval is not None:
        task_group.create_task(watchdog_loop(notifier, interval, health=server.is_healthy))
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Mapping

__all__ = [
    "SLOW_POOL_BYTES_PER_S",
    "START_SLACK_S",
    "STOP_SLACK_S",
    "SystemdNotifier",
    "start_allowance",
    "watchdog_loop",
]

SLOW_POOL_BYTES_PER_S = 256 * 2**20
"""A slow rate at which a start reserves and pre-faults, or adopts, the host pool: the
time a start asks systemd for (``EXTEND_TIMEOUT_USEC``) is computed with it, so that a pool
of hundreds of GiB gets the time it needs while a start that hangs is still stopped."""

START_SLACK_S = 60.0
"""Time a start asks for beyond its pool's (the L3 backend's open, the first requests)."""

STOP_SLACK_S = 15.0
"""Time a stop asks for beyond ``shutdown_timeout_s`` (closing the L3 backend, saving the
engine hashes, unmapping)."""


def start_allowance(pool_bytes: int) -> float:
    """Seconds a start with a pool of ``pool_bytes`` asks systemd for (from its first
    message on): :data:`START_SLACK_S` plus the pool at :data:`SLOW_POOL_BYTES_PER_S`."""
    return START_SLACK_S + max(0, pool_bytes) / SLOW_POOL_BYTES_PER_S


logger = logging.getLogger(__name__)

# sd_notify(3) field names: upper-case letters, digits and underscores.
_FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")


def _parse_positive_int(value: str | None) -> int | None:
    """Parse a positive decimal integer from the environment; anything else is None."""
    if value is None:
        return None
    try:
        number = int(value.strip(), 10)
    except ValueError:
        return None
    return number if number > 0 else None


class SystemdNotifier:
    """Sends state notifications to systemd over its ``NOTIFY_SOCKET``.

    The socket address is taken from ``socket_path`` when given, else from
    ``NOTIFY_SOCKET``. A path starting with ``/`` names a file-system socket; one
    starting with ``@`` names a socket in the abstract namespace (the ``@`` stands for
    the leading NUL byte). Any other value (systemd 254's ``vsock:`` addresses among
    them) is logged once and disables the notifier.

    Each notification is one datagram of ``NAME=value`` lines, sent on a fresh
    ``AF_UNIX``/``SOCK_DGRAM`` socket connected to the address, as ``sd_notify()``
    does: no socket is kept open, so there is nothing to close.

    Args:
        socket_path: where to send notifications; None means ``NOTIFY_SOCKET`` from
            ``environ``. An empty string disables the notifier.
        environ: the environment to read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and
            ``WATCHDOG_PID`` from, once; defaults to :data:`os.environ`.
        send_timeout: the longest a state notification waits for room in systemd's
            receive queue, in seconds (it blocks the caller, the event loop included,
            for that long at most, and only while PID 1 is not reading).

    Raises:
        ValueError: ``send_timeout`` is negative.
    """

    __slots__ = (
        "_address",
        "_failing",
        "_send_timeout",
        "_socket_path",
        "_watchdog_pid",
        "_watchdog_usec",
    )

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        send_timeout: float = 1.0,
    ) -> None:
        if not send_timeout >= 0:
            raise ValueError(f"send_timeout must be >= 0 seconds, got {send_timeout!r}")
        self._send_timeout = send_timeout
        env: Mapping[str, str] = os.environ if environ is None else environ
        if socket_path is None:
            socket_path = env.get("NOTIFY_SOCKET", "")
        self._socket_path = socket_path
        self._address: str | None = None
        if socket_path.startswith("/"):
            self._address = socket_path
        elif socket_path.startswith("@") and len(socket_path) > 1:
            self._address = "\0" + socket_path[1:]
        elif socket_path:
            logger.warning(
                "NOTIFY_SOCKET=%r is not a path or an abstract socket name; "
                "systemd notifications are disabled",
                socket_path,
            )
        self._watchdog_usec = _parse_positive_int(env.get("WATCHDOG_USEC"))
        self._watchdog_pid = _parse_positive_int(env.get("WATCHDOG_PID"))
        self._failing = False

    @property
    def enabled(self) -> bool:
        """Whether a notification socket is configured (False: every call is a no-op)."""
        return self._address is not None

    @property
    def socket_path(self) -> str:
        """The notification socket as configured (``/path``, ``@name``, or ``""``)."""
        return self._socket_path

    def notify(self, **fields: str | int) -> bool:
        """Send one datagram holding ``NAME=value`` for each field, in the given order.

        Waits up to ``send_timeout`` for room in systemd's receive queue.

        Example: ``notify(STATUS="warming up", EXTEND_TIMEOUT_USEC=60_000_000)``.

        Args:
            **fields: the notification fields; names are upper case (``READY``,
                ``STATUS``, ...), values are text or integers without line breaks.

        Returns:
            True if the datagram was sent; False when the notifier is disabled or the
            send failed (the failure is logged, never raised).

        Raises:
            ValueError: no fields, a field name that is not upper case, or a value
                with a line break (these are programming errors, not runtime faults).
        """
        if not fields:
            raise ValueError("notify() needs at least one field")
        lines = []
        for name, value in fields.items():
            if not _FIELD_NAME.match(name):
                raise ValueError(f"notification field name {name!r} is not UPPER_CASE")
            text = str(value)
            if "\n" in text:
                raise ValueError(f"notification field {name} has a line break: {text!r}")
            lines.append(f"{name}={text}")
        return self._send("\n".join(lines).encode(), self._send_timeout)

    def ready(self) -> bool:
        """Tell systemd that start-up (or a reload) is complete: ``READY=1``."""
        return self.notify(READY=1)

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status`` shows: ``STATUS=<text>``.

        Line breaks in ``text`` are replaced by spaces.
        """
        return self.notify(STATUS=" ".join(text.splitlines()))

    def watchdog(self) -> bool:
        """Keep the watchdog from firing: ``WATCHDOG=1``.

        Never waits: when systemd's queue is full the ping is dropped (and logged).
        """
        return self._send(b"WATCHDOG=1", 0.0)

    def stopping(self) -> bool:
        """Tell systemd that shutdown has begun: ``STOPPING=1``."""
        return self.notify(STOPPING=1)

    def reloading(self) -> bool:
        """Tell systemd that a configuration reload has begun.

        Sends ``RELOADING=1`` with ``MONOTONIC_USEC=<CLOCK_MONOTONIC in µs>``, which
        systemd 253 and later require to match the reload to the request. Send
        :meth:`ready` when the reload is done.
        """
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(RELOADING=1, MONOTONIC_USEC=now_usec)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before systemd's start or stop timeout fires.

        Sends ``EXTEND_TIMEOUT_USEC``; useful while pre-faulting a large pool.

        Raises:
            ValueError: ``seconds`` is not positive.
        """
        if seconds <= 0:
            raise ValueError(f"extend_timeout() needs a positive time, got {seconds!r}")
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def watchdog_interval(self) -> float | None:
        """How often to send ``WATCHDOG=1``, in seconds, or None if no watchdog is asked for.

        Returns:
            Half of ``WATCHDOG_USEC`` (as systemd recommends) when it is set and
            ``WATCHDOG_PID`` is unset or equals this process's id; otherwise None
            (no watchdog, or the watchdog belongs to another process, e.g. the
            parent this process was forked from).
        """
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def _send(self, payload: bytes, timeout: float) -> bool:
        """Send one datagram, waiting up to ``timeout`` s for room; never raise.

        The socket is connected first so that waiting works: poll() reports a
        connected datagram socket writable only when the peer's queue has room.
        A timeout of 0 does not wait at all.
        """
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(timeout)
                sock.connect(self._address)
                sock.send(payload)
        except OSError as err:  # socket.timeout is an OSError too
            if not self._failing:
                self._failing = True
                logger.warning(
                    "cannot notify systemd at %s: %s (further failures are logged at debug level)",
                    self._socket_path,
                    err,
                )
            else:
                logger.debug("cannot notify systemd at %s: %s", self._socket_path, err)
            return False
        if self._failing:
            self._failing = False
            logger.info("systemd notifications to %s work again", self._socket_path)
        return True

    def __repr__(self) -> str:
        """Show the configured socket and whether notifications are sent."""
        return f"SystemdNotifier(socket_path={self._socket_path!r}, enabled={self.enabled})"


async def watchdog_loop(
    notifier: SystemdNotifier,
    interval: float,
    health: Callable[[], bool] | None = None,
) -> None:
    """Send ``WATCHDOG=1`` every ``interval`` seconds from the running event loop.

    The pings are sent by a coroutine, not by a thread, on purpose: when the event
    loop is blocked (a synchronous call that hangs, a busy loop), the pings stop and
    systemd's watchdog kills and restarts the daemon.

    The first ping is sent at once. Runs until cancelled; run it in the daemon's
    task group.

    Args:
        notifier: where to send the pings (a disabled notifier makes them no-ops).
        interval: seconds between pings, normally ``notifier.watchdog_interval()``.
        health: called before each ping; when it returns False the ping is skipped,
            so a daemon that is alive but broken is restarted too. An exception it
            raises propagates (it is a bug, not a health verdict).

    Raises:
        ValueError: ``interval`` is not positive.
    """
    if not interval > 0:
        raise ValueError(f"watchdog interval must be positive, got {interval!r}")
    healthy = True
    while True:
        if health is None or health():
            if not healthy:
                logger.info("health check passes again; watchdog pings resume")
                healthy = True
            notifier.watchdog()
        elif healthy:
            healthy = False
            logger.warning("health check failed; withholding watchdog pings")
        await asyncio.sleep(interval)
