"""The handover socket's per-user bounds against a real kvtierd (one user: this process).

A user at ``max_handovers_waiting_per_user`` or ``max_handover_descriptors_per_user`` is
answered busy, naming the setting; the client tries again until its deadline, so a
handover that finds room meanwhile (a waiting one claimed by its REGISTER) goes through.
The bounds and each user's use show in STATS and the refusals are counted.
"""

from __future__ import annotations

import os
import secrets
import threading

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection, DaemonError
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import fdpass
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config
from tests.servers import RawDealer

pytestmark = pytest.mark.timeout(90)


def hand(rdir, fds: list[int], timeout: float) -> bytes:
    token = secrets.token_bytes(16)
    os.close(fdpass.hand_over(fdpass.handover_path(rdir), token, fds, timeout))
    return token


def limits(d) -> dict:
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.stats()["limits"]


def test_waiting_handovers_are_bounded_per_user_and_a_retry_gets_in_once_one_is_claimed(
    daemon_factory,
):
    d = daemon_factory("--max-handovers-waiting-per-user", "2")
    uid = str(os.getuid())
    with SharedKVPool(SMALL, 4) as pool:
        fds = pool.memory_fds()
        first, _ = hand(d.runtime_dir, fds, 5.0), hand(d.runtime_dir, fds, 5.0)
        with pytest.raises(
            fdpass.HandoverBusy, match="max_handovers_waiting_per_user = 2 reached: uid"
        ):
            hand(d.runtime_dir, fds, 0.5)
        seen = limits(d)
        assert seen["users"][uid]["handovers_waiting"] == 2, seen
        assert seen["refusals"]["max_handovers_waiting_per_user"] >= 1, seen
        assert seen["bounds"]["max_handovers_waiting_per_user"] == 2

        got: list[bytes] = []
        late = threading.Thread(target=lambda: got.append(hand(d.runtime_dir, fds, 20.0)))
        late.start()  # busy now: it tries again until the REGISTER below makes room
        raw = RawDealer(d.endpoint, wait_s=10.0)
        try:
            rep = raw.ask(
                P.encode(
                    P.Register(
                        req_id=1,
                        protocol_version=P.PROTOCOL_VERSION,
                        namespace=P.NamespaceSpec("h"),
                        geometry=SMALL,
                        memory=pool.export(),
                        pid=os.getpid(),
                        handover=first,
                    )
                )
            )
            assert isinstance(rep, P.Registered), rep
            late.join(30)
            assert len(got) == 1
            raw.ask(P.encode(P.Unregister(req_id=2, session_id=rep.session_id)))
        finally:
            raw.close()


def test_descriptors_held_by_waiting_handovers_are_bounded_per_user(daemon_factory):
    d = daemon_factory("--max-handover-descriptors-per-user", "64")
    with SharedKVPool(SMALL, 4) as pool:
        # 20 descriptors a handover, + its completion block's 2 (its memfd, mmap's duplicate)
        fds = pool.memory_fds() * 20
        for _ in range(2):
            hand(d.runtime_dir, fds, 5.0)
        with pytest.raises(fdpass.HandoverBusy, match="max_handover_descriptors_per_user = 64"):
            hand(d.runtime_dir, fds, 0.5)
        hand(d.runtime_dir, pool.memory_fds() * 18, 5.0)  # 20 more: the 64th still fits
    seen = limits(d)
    assert seen["refusals"]["max_handover_descriptors_per_user"] >= 1, seen


def test_a_refused_register_names_the_session_bound(daemon_factory):
    d = daemon_factory("--max-sessions-per-user", "1")
    with SharedKVPool(SMALL, 4) as a, SharedKVPool(SMALL, 4) as b:
        first = Connection(a, model_id="m", config=client_config(d.runtime_dir))
        try:
            with pytest.raises(DaemonError) as err:
                Connection(b, model_id="m", config=client_config(d.runtime_dir))
            assert err.value.code == P.ErrorCode.BUSY
            assert "max_sessions_per_user = 1 reached" in str(err.value)
        finally:
            first.close()
        Connection(b, model_id="m", config=client_config(d.runtime_dir)).close()  # room again
