"""Per-user bounds on a shared node: what one user's engines leave behind in the host pool
must not keep other users' engines out (real kvtierd, real distinct uids; needs root).

kvtierd runs as root with its runtime directory group-owned by GROUP (mode 0750), as in
test_multiuser.py and test_user_limits.py; the attacker and the honest engine are
processes of other users in that group, dropping to their uid after their imports.

The pool's persistent id tables are shared by every user: namespaces (4,096 entries, one
per model / geometry / TP position / tenant) and page classes (256 page sizes taken from
engines). When one is full, an id held only by cached pages (no open session, nothing
pinned or being written) gives them up to a newcomer, so one user filling the table one
short-lived session at a time keeps nobody out.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.integration.test_shared_node_bounds import (
    group_rdir,  # noqa: F401  (fixture)
)
from tests.integration.test_shared_node_bounds import run_child as shared_run_child

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root: runs the daemon and engines as distinct uids"
    ),
    pytest.mark.timeout(300),
]

ATTACKER = 4831
HONEST = 4832
WAIT_S = 200.0

CHILD = r"""
import json, os, sys, time
from pathlib import Path
from kvtier.client.connection.connection import Connection, DaemonError, DaemonUnavailable
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P
from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens

role, uid, rdir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
args = json.loads(sys.argv[4])
os.setgroups([GROUP])
os.setgid(GROUP)
os.setuid(uid)
out = {"uid": os.getuid()}

def emit(**kw):
    out.update(kw)
    print(json.dumps(out), flush=True)

def tiny(width):
    # one 1-token page of one layer, MLA: `width` bytes a page
    return P.Geometry(num_layers=1, page_size=1, kv_heads=1, head_dim=width, dtype="uint8",
                      attention="mla")

if role == "models":  # one short-lived engine per new model id, each storing one tiny page
    pool = SharedKVPool(tiny(8), 2)
    opened, refusal, deadline = 0, None, time.monotonic() + args["max_s"]
    for i in range(args["n"]):
        if time.monotonic() > deadline:
            refusal = "out of time"
            break
        try:
            conn = Connection(pool, model_id=f"junk-{i}", config=client_config(rdir))
        except (DaemonError, DaemonUnavailable) as err:
            refusal = f"{type(err).__name__}: {err}"
            break
        try:
            if not conn.store(conn.page_keys(tokens(1, salt=i)), [0]).wait(10):
                refusal = f"store {i} failed"
                break
        finally:
            conn.close()
        opened += 1
    pool.close()
    emit(opened=opened, refusal=refusal)

elif role == "sizes":  # one short-lived engine per new page size, each storing one page
    opened, refusal = 0, None
    for i in range(args["n"]):
        pool = SharedKVPool(tiny(8 * (i + 1)), 2)
        try:
            try:
                conn = Connection(pool, model_id="sizes", config=client_config(rdir))
            except (DaemonError, DaemonUnavailable) as err:
                refusal = f"{type(err).__name__}: {err}"
                break
            try:
                if not conn.store(conn.page_keys(tokens(1, salt=i)), [0]).wait(10):
                    refusal = f"store {i} failed"
                    break
            finally:
                conn.close()
        finally:
            pool.close()
        opened += 1
    emit(opened=opened, refusal=refusal)

elif role == "engine":  # an engine of a model nobody registered before: store and load
    try:
        pool, conn = engine(rdir, model=args["model"], request_timeout_s=5.0)
    except (DaemonError, DaemonUnavailable) as err:
        emit(error=f"{type(err).__name__}: {err}")
        sys.exit(0)
    try:
        keys = conn.page_keys(tokens(2 * SMALL.page_size, salt=uid))
        fill_page(pool, 0, 11)
        fill_page(pool, 1, 12)
        stored = conn.store(keys, [0, 1]).wait(30)
        h = conn.load(keys, [2, 3])
        loaded = h.count == 2 and h.wait(30)
        exact = [page_bytes(pool, 2), page_bytes(pool, 3)] == [page_bytes(pool, 0), page_bytes(pool, 1)]
        emit(error=None, stored=bool(stored), loaded=bool(loaded), exact=exact)
    finally:
        conn.close()
        pool.close()
"""


def run_child(role: str, uid: int, rdir: Path, **args: object) -> dict:
    """:func:`~tests.integration.test_shared_node_bounds.run_child` of this module's CHILD."""
    return shared_run_child(role, uid, rdir, child=CHILD, wait_s=WAIT_S, **args)


def honest_ok(got: dict) -> bool:
    return got == {"uid": HONEST, "error": None, "stored": True, "loaded": True, "exact": True}


def test_one_users_one_page_models_do_not_keep_other_users_models_out(
    group_rdir,  # noqa: F811  (the fixture)
    daemon_factory,
):
    """A user that runs thousands of short-lived engines, each of a new model and each
    storing one tiny page (16 MiB of a 64 MiB pool in all, no session held for long), must
    not keep another user's engine of a new model out: that engine registers, stores and
    loads, because the daemon gives it the namespace id whose pages are only cached and
    were used the longest ago (those pages dropped)."""
    d = daemon_factory()
    churn = run_child("models", ATTACKER, d.runtime_dir, n=4200, max_s=150.0)
    assert churn["uid"] == ATTACKER and churn["opened"] > 0, churn
    honest = run_child("engine", HONEST, d.runtime_dir, model="honest-model")
    assert d.proc.poll() is None, d.log_tail()
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        pool = admin.stats()["pool"]
    assert honest_ok(honest), (honest, churn, {k: v for k, v in pool.items() if k != "classes"})


def test_one_users_page_sizes_do_not_keep_other_users_page_size_out(
    group_rdir,  # noqa: F811  (the fixture)
    daemon_factory,
):
    """A user that runs short-lived engines of 256 page sizes, each storing one page (a
    pool of 1,024 extents, as a 32 GiB pool of the default 32 MiB extents has), must not
    keep another user's engine of a page size not seen before out: it registers, stores
    and loads, because the class held only by cached pages used the longest ago is given
    up (its pages dropped)."""
    d = daemon_factory("--extent-size", "64KiB")
    churn = run_child("sizes", ATTACKER, d.runtime_dir, n=260)
    assert churn["uid"] == ATTACKER and churn["opened"] >= 256, churn
    honest = run_child("engine", HONEST, d.runtime_dir, model="honest-model")
    assert d.proc.poll() is None, d.log_tail()
    assert honest_ok(honest), (honest, churn)
