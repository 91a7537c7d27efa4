"""Reaching a Mooncake cluster: reachability checks, and setup with a TCP bind address.

Mooncake's own setup retries for about 90 s against an address that refuses, so the
backend first checks that the master and the metadata server accept a TCP connection.

Mooncake's transfer engine (0.3.13) takes its TCP bind address from nowhere but the
environment variable ``MC_TCP_BIND_ADDRESS``, read once while ``setup`` initialises the
engine; without it a TCP segment is advertised on whatever interface the engine picks.
:func:`setup_with_bind_address` makes the address visible for that call only and puts the
environment back as it was, so opening a backend leaves ``os.environ`` unchanged.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import threading
import urllib.parse
from collections.abc import Callable

__all__ = ["BIND_ADDRESS_ENV", "is_ip", "setup_with_bind_address", "unreachable"]

BIND_ADDRESS_ENV = "MC_TCP_BIND_ADDRESS"
"""The variable Mooncake's transfer engine reads its TCP bind address from."""

_ENV_LOCK = threading.Lock()
"""Serializes setups that set :data:`BIND_ADDRESS_ENV` (the environment is per process)."""


def setup_with_bind_address(setup: Callable[[], int], local_hostname: str) -> int:
    """Run Mooncake's ``setup`` with its TCP bind address set to ``local_hostname``.

    When ``local_hostname`` is an IP literal and :data:`BIND_ADDRESS_ENV` is not set (an
    operator's setting wins), the variable is set for the duration of ``setup`` and removed
    afterwards, even when ``setup`` raises. Blocking: run it in a worker thread.

    Args:
        setup: the call that initialises Mooncake's client and transfer engine.
        local_hostname: the address this daemon's segment is advertised at.

    Returns:
        What ``setup`` returns.
    """
    if not is_ip(local_hostname):
        return setup()
    with _ENV_LOCK:
        if BIND_ADDRESS_ENV in os.environ:
            return setup()
        os.environ[BIND_ADDRESS_ENV] = local_hostname
        try:
            return setup()
        finally:
            del os.environ[BIND_ADDRESS_ENV]


async def unreachable(address: str, timeout_s: float) -> str | None:
    """Why a TCP connection to ``address`` (``host:port`` or an http URL) fails; ``None`` if it
    connects or the address has another form (etcd lists, ``P2PHANDSHAKE``: setup decides)."""
    if address.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(address)
        host = parts.hostname
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as err:
            return str(err)
    else:
        host_text, _, port_text = address.rpartition(":")
        if not host_text or not port_text.isdigit() or "://" in address:
            return None
        host, port = host_text.strip("[]"), int(port_text)
    if not host:
        return None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as err:
        return f"{type(err).__name__}: {err}" if str(err) else f"no connection within {timeout_s} s"
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:  # the peer reset first: it answered, which is all this checks
        pass
    return None


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 literal."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
