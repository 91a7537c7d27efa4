"""The HTTP server behind kvtierd's ``/metrics``: a thread per connection, within bounds.

prometheus_client's own server (``start_http_server``) gives every connection a thread
and waits on it without a deadline or a limit, which lets any local user (the endpoint has
no authentication) pin a daemon thread, and its stack, per idle connection it opens. This
server serves the same WSGI app (:func:`prometheus_client.make_wsgi_app`: the
registry, OpenMetrics when the ``Accept`` header asks for it, gzip when allowed) with a
bounded cost per client::

    connect ──▶ listen backlog (BACKLOG) ──▶ accept thread ──▶ MAX_CONNECTIONS busy?
                                                    │ yes: close at once   │ no
                                                    ▼                      ▼
                                                (refused)        handler thread: one request,
                                                                 CONNECTION_TIMEOUT_S per
                                                                 read or write, then close

- a connection silent for :data:`CONNECTION_TIMEOUT_S` (sending its request or taking
  the reply) is closed, as the handover socket closes one that sends no request in time;
- a request must arrive whole (its line and headers) within :data:`REQUEST_TIMEOUT_S` of
  the connection, and in at most :data:`MAX_REQUEST_BYTES` (a scrape sends a few hundred);
  a longer one is answered 431 and closed, a slower one closed: a client that sends a byte
  now and then holds its connection for no longer than that, and one that sends megabytes
  of headers costs the daemon no more than that;
- at most :data:`MAX_CONNECTIONS` connections have a handler thread at once; one that
  arrives beyond them is closed at once, so the accept thread never waits and
  ``shutdown()`` is prompt;
- the listen backlog is :data:`BACKLOG`, so a burst of scrapes arriving together waits in
  the kernel's queue instead of having its SYNs dropped and retransmitted a second later.

Typical use (what :meth:`~kvtier.daemon.service.metrics.DaemonMetrics.start` does)::

    server, thread = serve_metrics("127.0.0.1", 9464, registry)
    ...
    server.shutdown()       # from another thread: serve_forever() returns
    server.server_close()   # frees the port
"""

from __future__ import annotations

import io
import logging
import socket
import socketserver
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = [
    "BACKLOG",
    "CONNECTION_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_REQUEST_BYTES",
    "REQUEST_TIMEOUT_S",
    "MetricsHTTPServer",
    "serve_metrics",
]

log = logging.getLogger("kvtier.daemon.service.metrics_http")

CONNECTION_TIMEOUT_S = 3.0
"""How long a metrics connection may stay silent (its request, or taking the reply) before
it is closed."""
REQUEST_TIMEOUT_S = 5.0
"""How long a metrics connection may take to send its whole request (line and headers)."""
MAX_REQUEST_BYTES = 16384
"""The longest request (line and headers) a metrics connection may send; past it, 431."""
MAX_CONNECTIONS = 64
"""Connections served at once, each by its own thread; further ones are closed at once."""
BACKLOG = 128
"""The listen backlog (the kernel caps it at ``net.core.somaxconn``)."""
REFUSAL_LOG_INTERVAL_S = 60.0
"""Least time between two warnings that connections were refused for want of a thread."""


class _MetricsRequestHandler(WSGIRequestHandler):
    """One HTTP request per connection, each socket read and write bounded by the
    timeout, and no access log (a scrape every few seconds is not news)."""

    timeout = CONNECTION_TIMEOUT_S

    def handle(self) -> None:
        """Serve the request; a client that goes silent or away only loses its reply."""
        try:
            head = self._read_request()
            if head is None:
                return
            self.rfile = io.BytesIO(head)  # what the WSGI handler parses, whole and bounded
            super().handle()
        except TimeoutError:
            log.debug("metrics: %s too slow, closed", self.client_address)
        except ConnectionError as err:
            log.debug("metrics: %s went away: %s", self.client_address, err)

    def _read_request(self) -> bytes | None:
        """The request's line and headers, read within :data:`REQUEST_TIMEOUT_S` (else
        TimeoutError); None when it is longer than :data:`MAX_REQUEST_BYTES` (answered 431)."""
        sock: socket.socket = self.connection
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        buf = bytearray()
        while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
            if len(buf) >= MAX_REQUEST_BYTES:
                sock.sendall(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                    b"Content-Length: 0\r\nConnection: close\r\n\r\n"
                )
                log.debug("metrics: %s sent a request over %d bytes", self.client_address, len(buf))
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(min(left, self.timeout))
            chunk = sock.recv(min(4096, MAX_REQUEST_BYTES - len(buf)))
            if not chunk:  # the client closed: what came is all there is
                break
            buf += chunk
        sock.settimeout(self.timeout)
        return bytes(buf)

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: requests are not logged, errors go through ``handle_error``."""


class MetricsHTTPServer(socketserver.ThreadingMixIn, WSGIServer):
    """A WSGI server with a thread per connection, at most ``MAX_CONNECTIONS`` of them.

    The slot of a connection is taken on the accept thread before its handler thread
    starts, and given back when that thread ends, whatever ended it. A connection that
    finds no free slot is closed without being read.

    Args:
        server_address: ``(host, port)`` to bind; port 0 picks a free one.
        family: the address family of ``host`` (``AF_INET`` or ``AF_INET6``).
        max_connections: connections served at once.

    Raises:
        OSError: the address cannot be bound.
    """

    daemon_threads = True  # handler threads never hold up the daemon's exit
    request_queue_size = BACKLOG

    def __init__(
        self,
        server_address: tuple[str, int],
        *,
        family: socket.AddressFamily = socket.AF_INET,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        self.address_family = family
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refused = 0  # since the last warning; only the accept thread touches these
        self._next_warning = 0.0
        super().__init__(server_address, _MetricsRequestHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the connection to a new thread if a slot is free, else close it now."""
        if not self._slots.acquire(blocking=False):
            self._refuse(client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve the connection on its own thread, then give its slot back."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Send a failed request's traceback to the daemon's log, not to bare stderr."""
        log.warning("metrics: serving %s failed", client_address, exc_info=True)

    def _refuse(self, client_address: Any) -> None:
        """Count a refused connection; warn at most once per ``REFUSAL_LOG_INTERVAL_S``."""
        self._refused += 1
        now = time.monotonic()
        if now < self._next_warning:
            log.debug(
                "metrics: all %d connections busy, closed %s", self.max_connections, client_address
            )
            return
        log.warning(
            "metrics: all %d connections busy; closed %d new one(s) (idle ones are closed "
            "after %gs)",
            self.max_connections,
            self._refused,
            CONNECTION_TIMEOUT_S,
        )
        self._refused = 0
        self._next_warning = now + REFUSAL_LOG_INTERVAL_S


def serve_metrics(
    host: str, port: int, registry: CollectorRegistry
) -> tuple[MetricsHTTPServer, threading.Thread]:
    """Serve ``registry`` over HTTP on ``host:port`` from a new daemon thread.

    Args:
        host: bind address, IPv4 or IPv6 (a name resolves to its first address).
        port: TCP port; 0 picks a free one.
        registry: what every scrape renders.

    Returns:
        The server (``shutdown()`` then ``server_close()`` to stop it) and the thread
        running its accept loop.

    Raises:
        OSError: ``host`` does not resolve, or the address cannot be bound.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    server = MetricsHTTPServer((str(sockaddr[0]), port), family=family)
    try:
        server.set_app(make_wsgi_app(registry))
        thread = threading.Thread(target=server.serve_forever, name="kvtier-metrics", daemon=True)
        thread.start()
    except BaseException:
        server.server_close()
        raise
    return server, thread
