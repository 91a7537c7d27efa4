"""Replies of the wrong type, from a daemon-like ROUTER: checked as data, never fatal.

A :class:`WrongReplyProxy` stands between the client and a real kvtierd. It forwards every
request and its reply, except a request of the type a test names, which it answers itself
with a reply of another type (with the request's id, so the client takes it as the answer).
The handover socket is the real daemon's (the proxy's endpoint lies beside it), so REGISTER
and every other call run as they do against kvtierd alone.

Each engine call then does what it does when the daemon refuses: a lookup or claim reports a
miss, a store or load is dropped, a release is forgotten; REGISTER and STATS raise
:class:`~kvtier.client.connection.replies.UnexpectedReply` naming the expected and the received type;
the admin client raises an :class:`~kvtier.client.connection.admin.AdminError`. The connection keeps
working afterwards. None of this depends on ``assert`` (the suite runs under ``python -O``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from kvtier.client.connection.admin import AdminClient, AdminError, UnexpectedAdminReply
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.replies import UnexpectedReply
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, tokens

Answer = Callable[[P.Request], P.Reply]


class WrongReplyProxy:
    """A ROUTER that forwards to kvtierd, answering the request types in :attr:`answers`
    itself (module docstring).

    Args:
        daemon_endpoint: the real daemon's control endpoint.
        endpoint: where the proxy binds (beside the daemon's socket).
    """

    def __init__(self, daemon_endpoint: str, endpoint: str) -> None:
        self.endpoint = endpoint
        self.answers: dict[type, Answer] = {}
        self.answered: list[str] = []  # the request types the proxy answered itself
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(endpoint)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(daemon_endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wrong-reply-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            identity, body = self._router.recv_multipart()
            req = P.decode_request(body)
            answer = self.answers.get(type(req))
            if answer is not None:
                self.answered.append(type(req).__name__)
                self._router.send_multipart([identity, P.encode(answer(req))])
                continue
            self._dealer.send(body)
            if self._dealer.poll(10_000):  # no answer: the client's own timeout reports it
                self._router.send_multipart([identity, self._dealer.recv()])

    def close(self) -> None:
        """Stop the thread, then close the sockets."""
        self._stop.set()
        self._thread.join(10)
        self._router.close(0)
        self._dealer.close(0)
        self._ctx.term()


@pytest.fixture
def proxy(module_daemon) -> Iterator[WrongReplyProxy]:
    """A proxy in front of the module's daemon, its socket beside the daemon's."""
    path = Path(module_daemon.socket).parent / "proxy.sock"
    p = WrongReplyProxy(module_daemon.endpoint, f"ipc://{path}")
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def conn(proxy: WrongReplyProxy, module_daemon, request) -> Iterator[Connection]:
    """A connection registered through the proxy (a model id of its own per test)."""
    pool = SharedKVPool(SMALL, 16)
    c = Connection(
        pool,
        model_id=request.node.name,
        config=client_config(module_daemon.runtime_dir, endpoint=proxy.endpoint),
    )
    try:
        yield c
    finally:
        c.close()
        pool.close()


def reply(kind: type, **fields: object) -> Answer:
    """An answer: a ``kind`` reply carrying the request's id."""
    return lambda req: kind(req_id=req.req_id, epoch=1, **fields)


def test_register_answered_with_another_reply_raises_naming_both(proxy, module_daemon):
    proxy.answers[P.Register] = reply(P.Ack)
    pool = SharedKVPool(SMALL, 16)
    try:
        with pytest.raises(UnexpectedReply) as caught:
            Connection(
                pool,
                model_id="register-wrong",
                config=client_config(module_daemon.runtime_dir, endpoint=proxy.endpoint),
            )
    finally:
        pool.close()
    err = caught.value
    assert (err.request, err.expected, err.received) == ("Register", P.Registered, P.Ack)
    assert str(err) == "Register: kvtierd answered Ack, expected Registered"
    assert proxy.answered == ["Register"]


def test_lookup_answered_with_a_claim_reply_is_a_miss(proxy, conn):
    keys = conn.page_keys(tokens(4 * SMALL.page_size))
    assert conn.store(keys, [0, 1, 2, 3]).wait()
    proxy.answers[P.Lookup] = reply(P.ClaimReply, l2=4)  # has l2, not l3
    r = conn.lookup(keys)
    assert (r.l2, r.l3) == (0, 0)
    del proxy.answers[P.Lookup]
    assert conn.lookup(keys).l2 == 4  # the connection is as it was
    assert proxy.answered == ["Lookup"]


def test_claim_answered_with_a_lookup_result_is_a_miss(proxy, conn):
    keys = conn.page_keys(tokens(2 * SMALL.page_size))
    assert conn.store(keys, [0, 1]).wait()
    proxy.answers[P.Claim] = reply(P.LookupResult, l2=2, l3=0)  # an l2 of the wrong reply
    assert conn.claim(keys) == 0
    del proxy.answers[P.Claim]
    assert conn.claim(keys) == 2
    assert proxy.answered == ["Claim"]


def test_prefetch_answered_with_an_ack_starts_nothing(proxy, conn):
    proxy.answers[P.Prefetch] = reply(P.Ack)
    assert conn.prefetch(conn.page_keys(tokens(2 * SMALL.page_size))) == 0
    assert proxy.answered == ["Prefetch"]


def test_store_answered_as_a_load_is_dropped_and_its_slot_kept(proxy, conn):
    keys = conn.page_keys(tokens(3 * SMALL.page_size))
    proxy.answers[P.Store] = reply(P.LoadAccepted, count=3)
    h = conn.store(keys, [0, 1, 2])
    assert (h.count, h.writing) == (0, 0)
    del proxy.answers[P.Store]
    h = conn.store(keys, [0, 1, 2])
    assert (h.count, h.writing) == (3, 3) and h.wait()
    assert conn.lookup(keys).l2 == 3
    assert proxy.answered == ["Store"]


def test_load_answered_as_a_store_is_a_miss(proxy, conn):
    keys = conn.page_keys(tokens(2 * SMALL.page_size))
    assert conn.store(keys, [0, 1]).wait()
    proxy.answers[P.Load] = reply(P.StoreAccepted, count=2, writing=2)
    assert conn.load(keys, [4, 5]).count == 0
    del proxy.answers[P.Load]
    h = conn.load(keys, [4, 5])
    assert h.count == 2 and h.wait()
    assert proxy.answered == ["Load"]


def test_release_answered_with_another_reply_is_forgotten(proxy, conn):
    keys = conn.page_keys(tokens(2 * SMALL.page_size))
    h = conn.store(keys, [0, 1])
    assert not h.done  # not waited for yet: release() asks the daemon to cancel it
    proxy.answers[P.Release] = reply(P.PrefetchReply, started=1)
    conn.release([h])  # does not raise
    assert proxy.answered == ["Release"]
    h.wait()  # done or cancelled: either way its slot comes back
    del proxy.answers[P.Release]
    assert conn.store(keys, [0, 1]).wait()


def test_stats_answered_with_a_health_reply_raises_naming_both(proxy, conn):
    proxy.answers[P.Stats] = reply(P.HealthReply, status="ok", sessions=0)
    with pytest.raises(
        UnexpectedReply, match="Stats: kvtierd answered HealthReply, expected StatsReply"
    ):
        conn.stats()
    del proxy.answers[P.Stats]
    assert "pool" in conn.stats()


@pytest.mark.parametrize(
    "call,request_type,wrong",
    [
        (lambda a: a.health(), P.Health, reply(P.StatsReply, stats={})),
        (lambda a: a.stats(), P.Stats, reply(P.HealthReply, status="ok", sessions=0)),
        (lambda a: a.sync(timeout_s=1.0), P.Sync, reply(P.Ack)),
    ],
    ids=["health", "stats", "sync"],
)
def test_admin_calls_answered_with_another_reply_raise_an_admin_error(
    proxy, call, request_type, wrong
):
    proxy.answers[request_type] = wrong
    with (
        AdminClient(proxy.endpoint, timeout_s=5.0) as admin,
        pytest.raises(UnexpectedAdminReply) as caught,
    ):
        call(admin)
    err = caught.value
    assert isinstance(err, AdminError) and isinstance(err, UnexpectedReply)
    assert err.request == request_type.__name__
    assert err.received is not err.expected
    assert proxy.answered == [request_type.__name__]
