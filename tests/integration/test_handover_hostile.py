"""What a hostile local client's handovers and memory cost a real kvtierd, in descriptors.

The daemon's bounds on what one user makes it hold are counted in descriptors
(``max_handover_descriptors_per_user``, half of ``RLIMIT_NOFILE`` in all) and in mappings
(``max_mapped_segments_per_user``, and half of ``RLIMIT_NOFILE`` for all sessions: each
mapping holds a descriptor while mapped). Each test counts the descriptors in
``/proc/<daemon pid>/fd`` against those statements.
"""

from __future__ import annotations

import fcntl
import os
import resource
import secrets
import time
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import fdpass
from kvtier.ipc import protocol as P

from tests.engines import handover
from tests.servers import RawDealer

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def daemon_fds(pid: int) -> list[tuple[str, int, int]]:
    """(target, st_dev, st_ino) of each descriptor process ``pid`` holds now."""
    out = []
    for f in Path(f"/proc/{pid}/fd").iterdir():
        try:
            st = os.stat(f)
            out.append((os.readlink(f), st.st_dev, st.st_ino))
        except OSError:  # closed while we looked
            continue
    return out


def healthy(d) -> None:
    assert d.proc.poll() is None, d.log_tail()
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        assert admin.health().status == "ok"


# A geometry of 50 layers (100 K/V buffers of 1 KiB pages); each buffer lies 4 MiB from the
# next in one sparse, sealed memfd, so the daemon maps 100 windows of it (runs more than
# 2 MiB apart never share a mapping).
WIDE = P.Geometry(num_layers=50, page_size=16, kv_heads=1, head_dim=16, dtype="float32")
PAGES = 4
SPACING = 4 << 20


def sparse_sealed_memfd(size: int) -> int:
    fd = os.memfd_create("hostile-wide", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def register_wide(raw: RawDealer, d, fd: int, size: int, req_id: int) -> P.Reply:
    """REGISTER memory of 100 windows of the sparse memfd ``fd`` (handed over first)."""
    n_buf = WIDE.num_layers * WIDE.components
    memory = P.KVMemory(
        kind="fd",
        num_pages=PAGES,
        segments=[P.MemorySegment(name="wide", size=size)],
        buffer_segments=[0] * n_buf,
        buffer_offsets=[i * SPACING for i in range(n_buf)],
    )
    token = handover(d.runtime_dir, fds=[fd])
    return raw.ask(
        P.encode(
            P.Register(
                req_id=req_id,
                protocol_version=P.PROTOCOL_VERSION,
                namespace=P.NamespaceSpec(f"wide-{req_id}"),
                geometry=WIDE,
                memory=memory,
                pid=os.getpid(),
                handover=token,
            )
        )
    )


def test_the_sessions_mappings_hold_at_most_half_the_descriptor_limit(daemon):
    """Each mapping of engine memory keeps a descriptor of its own while mapped (Python's
    mmap), so the mappings of all sessions together are bounded by half the daemon's
    ``RLIMIT_NOFILE``: with the limit at 256, a REGISTER needing 100 mappings is served,
    holding one descriptor per mapping and no more, and a second one needing 100 more is
    refused BUSY naming the bound; once the first session is gone, the second is served."""
    n_buf = WIDE.num_layers * WIDE.components
    size = n_buf * SPACING
    fd = sparse_sealed_memfd(size)
    st = os.fstat(fd)
    hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (256, hard))
    raw = RawDealer(daemon.endpoint, wait_s=WAIT_S)
    try:
        rep = register_wide(raw, daemon, fd, size, 1)
        assert isinstance(rep, P.Registered), rep
        maps = Path(f"/proc/{daemon.pid}/maps").read_text().count("memfd:hostile-wide")
        held = [t for t, dev, ino in daemon_fds(daemon.pid) if (dev, ino) == (st.st_dev, st.st_ino)]
        assert maps == n_buf and len(held) <= maps, (maps, len(held))
        refused = register_wide(raw, daemon, fd, size, 2)
        assert isinstance(refused, P.ErrorReply), refused
        assert refused.code == P.ErrorCode.BUSY and "RLIMIT_NOFILE" in refused.message
        raw.ask(P.encode(P.Unregister(req_id=3, session_id=rep.session_id)))
        deadline = time.monotonic() + WAIT_S
        while True:  # the closed session's memory is unmapped on the unmap thread
            again = register_wide(raw, daemon, fd, size, 4)
            if isinstance(again, P.Registered) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert isinstance(again, P.Registered), again
    finally:
        raw.close()
        os.close(fd)
    healthy(daemon)


def test_one_users_waiting_handovers_hold_at_most_the_descriptor_bound(daemon_factory):
    """``max_handover_descriptors_per_user`` bounds the descriptors one user's waiting
    handovers make the daemon hold, the completion block's included: with the bound at 64,
    a user's handovers of no descriptor are accepted until the daemon holds 64 descriptors
    for them, and never more."""
    bound = 64
    d = daemon_factory("--max-handover-descriptors-per-user", str(bound))
    time.sleep(0.2)
    before = {(dev, ino) for _, dev, ino in daemon_fds(d.pid)}
    accepted = 0
    path = fdpass.handover_path(d.runtime_dir)
    for _ in range(2 * bound):  # bounded: the bound refuses one long before
        try:
            os.close(fdpass.hand_over(path, secrets.token_bytes(16), [], 0.2))
        except fdpass.HandoverBusy as err:
            assert "max_handover_descriptors_per_user = 64" in str(err), err
            break
        accepted += 1
    else:
        pytest.fail(f"{2 * bound} handovers accepted; the bound never refused one")
    # all accepted handovers wait (10 s) for their REGISTER: count what they hold now
    extra = [
        t
        for t, dev, ino in daemon_fds(d.pid)
        if (dev, ino) not in before and not t.startswith("socket:")  # a connection closing
    ]
    assert len(extra) <= bound, (
        f"{accepted} waiting handovers of one user hold {len(extra)} of the daemon's "
        f"descriptors; max_handover_descriptors_per_user = {bound} "
        f"({sorted(set(extra))})"
    )
    healthy(d)
