"""A daemon out of address space refuses the one REGISTER that needed more and serves on.

The daemon's address space is cut (``RLIMIT_AS`` set on the running process, just above
what it uses) so that mapping a 128 MiB engine fails with ENOMEM, as a daemon whose address
space other sessions had filled would. That REGISTER is refused with BUSY saying so; the
loop keeps answering, a small engine registers and copies byte-exact, and HEALTH says
``degraded`` with the reason. Before, such a failure was a BAD_MEMORY that said nothing of
the daemon, and nothing told the operator.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection, DaemonError
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def vm_size(pid: int) -> int:
    """The process's virtual size in bytes (``VmSize`` of /proc/PID/status)."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmSize:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmSize")


def test_running_out_of_address_space_refuses_one_register_and_says_degraded(daemon):
    with AdminClient(daemon.endpoint, timeout_s=10.0) as admin:
        assert admin.health().status == "ok"
    unlimited = resource.prlimit(daemon.pid, resource.RLIMIT_AS)
    big = SharedKVPool(SMALL, (128 * MiB) // SMALL.page_bytes)
    try:
        resource.prlimit(
            daemon.pid, resource.RLIMIT_AS, (vm_size(daemon.pid) + 64 * MiB, unlimited[1])
        )
        with pytest.raises(DaemonError) as err:
            Connection(big, model_id="m", config=client_config(daemon.runtime_dir))
        assert err.value.code == P.ErrorCode.BUSY
        assert "short of address space or memory" in str(err.value), err.value
        pool, conn = engine(daemon.runtime_dir, num_pages=16)  # 512 KiB: fits
        try:
            keys = conn.page_keys(tokens(2 * SMALL.page_size, salt=9))
            fill_page(pool, 0, 1)
            fill_page(pool, 1, 2)
            assert conn.store(keys, [0, 1]).wait(30)
            h = conn.load(keys, [2, 3])
            assert h.count == 2 and h.wait(30)
            assert [page_bytes(pool, 2), page_bytes(pool, 3)] == [
                page_bytes(pool, 0),
                page_bytes(pool, 1),
            ]
        finally:
            conn.close()
            pool.close()
        with AdminClient(daemon.endpoint, timeout_s=10.0) as admin:
            status = admin.health().status
            shortages = admin.stats()["limits"]["shortages"]
        assert status.startswith("degraded: REGISTER from uid") and "cannot map" in status, status
        assert shortages >= 1
    finally:
        resource.prlimit(daemon.pid, resource.RLIMIT_AS, unlimited)
        big.close()
    assert daemon.proc.poll() is None, daemon.log_tail()
