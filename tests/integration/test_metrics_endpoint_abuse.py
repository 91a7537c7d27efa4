"""The metrics HTTP endpoint against clients that abuse it (slow requests, huge headers):
what each may cost a real kvtierd."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


from tests.servers import free_port

pytestmark = pytest.mark.timeout(120)


def scrape(port: int, timeout: float = 10.0) -> str:
    """GET /metrics and return the exposition text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as rep:
        assert rep.status == 200
        return rep.read().decode("utf-8")


@contextmanager
def trickling_clients(port: int, n: int, every_s: float = 1.0, max_s: float = 90.0) -> Iterator:
    """``n`` connections to the metrics port, each sending a request line and then one
    byte of a header every ``every_s`` seconds (never silent for the server's 3 s read
    timeout, never finishing the request): a slowloris client. Stopped on exit, or after
    ``max_s`` at the latest."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        socks.append(s)
    stop = threading.Event()

    def trickle() -> None:
        deadline = time.monotonic() + max_s
        while not stop.is_set() and time.monotonic() < deadline:
            for s in socks:
                try:
                    s.sendall(b"a")
                except OSError:
                    pass
            stop.wait(every_s)

    t = threading.Thread(target=trickle, name="slowloris", daemon=True)
    t.start()
    try:
        yield socks
    finally:
        stop.set()
        t.join(timeout=10)
        for s in socks:
            s.close()


def test_slow_clients_cannot_lock_prometheus_out_of_the_metrics_endpoint(daemon_factory):
    """The endpoint bounds what each client may cost (idle connections closed after 3 s,
    at most 64 served at once). A local user who opens 64 connections and keeps each
    request going with a byte a second must not lock Prometheus out: a scrape made while
    they trickle is still answered (within 10 s)."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    scrape(port)
    with trickling_clients(port, 64):
        time.sleep(5.0)  # past the 3 s read timeout: any "silent" connection would be gone
        errors = []
        for _ in range(3):
            try:
                scrape(port, timeout=10)
                break
            except (urllib.error.URLError, ConnectionError, OSError) as err:
                errors.append(repr(err))
                time.sleep(1.0)
        else:
            pytest.fail(f"every scrape refused while 64 slow clients trickle: {errors}")
    assert d.proc is not None and d.proc.poll() is None


def peak_rss_mib(pid: int) -> int:
    """The peak resident set of process ``pid`` (VmHWM), MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) // 1024


def test_huge_request_headers_do_not_blow_up_the_daemons_memory(daemon_factory):
    """The metrics endpoint has no authentication, so any local user may send it what they
    like; a scrape needs a request of a few hundred bytes. 64 clients (the endpoint's
    connection bound) each sending one GET with 99 header lines of 64 KB (6.4 MB each, 410
    MB in all), finished together, must not make kvtierd, which shares the node's memory
    with GPU engines, grow by more than 512 MiB: a request's size should be bounded to what
    a scrape needs, or refused (431) as it arrives."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    scrape(port)
    assert d.proc is not None
    before = peak_rss_mib(d.pid)
    head = b"GET /metrics HTTP/1.1\r\n" + (b"X-A: " + b"a" * 65000 + b"\r\n") * 99
    n = 64
    sent = threading.Barrier(n + 1)

    def send_one() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                try:
                    s.sendall(head)
                finally:
                    sent.wait(timeout=60)
                s.sendall(b"\r\n")  # every request ends at once
                while s.recv(65536):  # the answer (or a refusal), until the server closes
                    pass
        except (OSError, threading.BrokenBarrierError):
            pass

    threads = [threading.Thread(target=send_one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    sent.wait(timeout=60)
    for t in threads:
        t.join(timeout=60)
    grown = peak_rss_mib(d.pid) - before
    assert d.proc.poll() is None
    scrape(port)
    assert grown < 512, f"64 requests with large headers grew kvtierd's peak RSS by {grown} MiB"


def test_a_request_head_past_the_bound_is_refused_431(daemon_factory):
    """A request whose line and headers pass ``MAX_REQUEST_BYTES`` is answered 431 however
    its bytes arrive (here: in one send, just past the bound); one within it is served."""
    from kvtier.daemon.service.metrics_http import MAX_REQUEST_BYTES

    port = free_port()
    daemon_factory("--metrics-port", str(port))

    def status(extra: int) -> bytes:
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * extra + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head)
            return s.recv(64).split(b"\r\n", 1)[0]

    assert status(MAX_REQUEST_BYTES - 200).endswith(b"200 OK")
    assert status(MAX_REQUEST_BYTES + 100).endswith(b"431 Request Header Fields Too Large")
