"""Values that reach kvtier's C extensions: each entry point's argument checks, and the
client-controlled request fields that end up there.

Every call into C that could crash runs in a child process (``sys.executable -c ...``):
a segfault fails the test instead of ending pytest. The daemon-level checks send crafted
requests over a raw ZeroMQ DEALER and then require the daemon to be alive and to answer
HEALTH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P

from tests.engines import SMALL, handover
from tests.servers import RawDealer

CHILD_TIMEOUT_S = 60


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a crash there is a failed test, not ours)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )


def ok_child(code: str) -> str:
    """Run ``code`` in a child; it must exit 0 (no crash, no failed assert). Its stdout."""
    r = run_child(code)
    assert r.returncode == 0, (
        f"child exited {r.returncode} (negative: killed by a signal)\n"
        f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"
    )
    return r.stdout


# -- C entry points ---------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_check_pages_refuses_a_negative_page_count():
    """``kvtier.ipc._packkeys.check_pages(packed_pages, num_pages)`` checks every page
    against ``num_pages``. A negative ``num_pages`` is no page count: it is refused
    (ValueError / OverflowError), never read as 2**64 - 1, which would make every page
    (page 5 here) "inside" an engine of -1 pages."""
    out = ok_child(
        """
        from kvtier.ipc._packkeys import check_pages
        try:
            r = check_pages(b"\\x05\\x00\\x00\\x00", -1)
        except (ValueError, OverflowError) as e:
            print("refused", type(e).__name__, e)
        else:
            print("accepted", r)
        """
    )
    assert out.startswith("refused"), f"check_pages(page 5, num_pages=-1) -> {out.strip()}"


@pytest.mark.timeout(90)
def test_copy_regions_does_not_misread_index_arrays_that_are_not_int64():
    """``kvtier.kernels.guarded_copy.copy_regions`` takes the pages' ``offsets`` and
    ``page_ids`` (its sibling ``copy_strided`` converts whatever it gets with
    ``np.ascontiguousarray(..., dtype=np.int64)``). Given int32 arrays of two pages
    (page 2 -> slot offset 16, page 0 -> offset 0) it must either copy both pages or refuse
    the arrays naming their dtype, never read the 8 bytes of two int32 page ids as one
    int64 id (copying page 2 only and answering 1, which a caller reads as "page 1
    faulted")."""
    out = ok_child(
        """
        import numpy as np
        from kvtier.kernels import guarded_copy as gc
        if not gc.strided():
            print("skip"); raise SystemExit(0)
        host = np.zeros(64, np.uint8)
        eng = np.arange(64, dtype=np.uint8)
        table = np.array([[0, eng.ctypes.data, 4, 16, 16]], np.int64)
        try:
            done = gc.copy_regions(
                host.ctypes.data, host.nbytes,
                np.array([16, 0], np.int32), np.array([2, 0], np.int32), table, True,
            )
        except (TypeError, ValueError) as e:
            print("refused", e)
        else:
            ok = host[16:32].tolist() == list(range(32, 48)) and host[:16].tolist() == list(range(16))
            print("copied", done, ok)
        """
    )
    if out.strip() == "skip":
        pytest.skip("region copies are not in use")
    assert out.startswith("refused") or out.strip() == "copied 2 True", (
        f"copy_regions with int32 arrays of 2 pages -> {out.strip()}"
    )


@pytest.mark.timeout(90)
def test_page_keys_refuses_a_page_size_past_its_bound_naming_it():
    """``kvtier.client.page_keys.page_keys`` keys pages of at most ``MAX_PAGE_TOKENS``
    tokens: a larger ``page_size`` (2**28 + 1, or 2**62, whose byte size does not fit a C
    size) is refused with a ValueError naming ``page_size``, never an OverflowError or a
    message about ``page_bytes`` the caller never passed."""
    out = ok_child(
        """
        from kvtier.client.page_keys import page_keys
        for ps in (2**28 + 1, 2**62):
            try:
                print(ps, repr(page_keys(b"s" * 32, list(range(10)), ps)))
            except Exception as e:
                print(ps, type(e).__name__, "page_size" in str(e))
        """
    )
    lines = out.strip().splitlines()
    assert lines == [f"{2**28 + 1} ValueError True", f"{2**62} ValueError True"], out


# -- the same values through a real kvtierd --------------------------------------------


class Raw(RawDealer):
    def register(self, pool: SharedKVPool) -> P.Reply:
        return self.ask(
            P.encode(
                P.Register(
                    req_id=7,
                    protocol_version=P.PROTOCOL_VERSION,
                    namespace=P.NamespaceSpec("native-inputs"),
                    geometry=pool.geometry,
                    memory=pool.export(),
                    pid=os.getpid(),
                    handover=handover(self.rdir, pool),
                )
            )
        )


def alive(daemon) -> None:
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
    with AdminClient(daemon.endpoint, timeout_s=10.0) as admin:
        assert admin.health().status == "ok"


def refused(rep: P.Reply, code: P.ErrorCode, *words: str) -> None:
    assert isinstance(rep, P.ErrorReply), rep
    assert rep.code == code, rep
    for w in words:
        assert w in rep.message, rep.message


@pytest.mark.timeout(120)
def test_packed_pages_and_keys_that_reach_c_are_refused_naming_them(daemon):
    """Guard: a packed page outside the engine (up to 0xFFFFFFFF), a partial page, a page twice,
    a partial packed key, and keys/pages lengths that disagree are each refused with an
    error naming the field before C sees them; the daemon is alive and answers HEALTH."""
    raw = Raw(daemon.endpoint, wait_s=10.0)
    try:
        with SharedKVPool(SMALL, 4) as pool:
            reg = raw.register(pool)
            assert isinstance(reg, P.Registered), reg
            sid, k = reg.session_id, b"\x11" * 32

            def store(**kw):
                return raw.ask(P.encode(P.Store(req_id=2, session_id=sid, slot=0, seq=1, **kw)))

            refused(
                store(packed_keys=k, packed_pages=b"\xff\xff\xff\xff"),
                P.ErrorCode.OUT_OF_RANGE,
                "packed_pages[0] = 4294967295",
            )
            refused(store(packed_keys=k, packed_pages=b"\x00\x00\x00"), P.ErrorCode.BAD_MESSAGE)
            refused(
                store(packed_keys=k * 2, packed_pages=b"\x01\x00\x00\x00" * 2),
                P.ErrorCode.BAD_MESSAGE,
                "twice",
            )
            refused(
                store(packed_keys=k + b"x", packed_pages=b"\x00\x00\x00\x00"),
                P.ErrorCode.BAD_MESSAGE,
                "packed_keys",
            )
            rep = raw.ask(
                P.encode(
                    P.Load(
                        req_id=3,
                        session_id=sid,
                        packed_keys=k,
                        packed_pages=b"\x04\x00\x00\x00",
                        slot=0,
                        seq=1,
                    )
                )
            )
            refused(rep, P.ErrorCode.OUT_OF_RANGE, "packed_pages[0] = 4")
            rep = raw.ask(P.encode(P.Lookup(req_id=4, session_id=sid, packed_keys=k + b"y")))
            refused(rep, P.ErrorCode.BAD_MESSAGE, "packed_keys")
            rep = raw.ask(P.encode(P.Lookup(req_id=5, session_id=sid, packed_keys=k)))
            assert isinstance(rep, P.LookupResult) and rep.l2 == 0, rep
            raw.ask(P.encode(P.Unregister(req_id=6, session_id=sid)))
    finally:
        raw.close()
    alive(daemon)
