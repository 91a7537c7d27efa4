"""The vLLM connector's worker holds the blocks of a transfer whose wait failed while a
stalled kvtierd may still copy them (a real kvtierd, stopped with SIGSTOP mid-copy).

vLLM reuses the blocks of a failed store and recomputes a failed load into the same blocks;
a daemon that resumes its copy afterwards would store another request's KV under the old
keys, or overwrite the recomputed KV. The worker's I/O thread (and, for a layer-wise load,
the engine thread) therefore returns only once the daemon ended the transfer or is gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import pytest

from kvtier.ipc import protocol as P

from tests.engines import engine, fill_page, tokens

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations), not ours
    warnings.simplefilter("ignore")
    from kvtier.client.adapters.vllm import worker as W


WIDE = P.Geometry(num_layers=8, page_size=32, kv_heads=8, head_dim=64, dtype="float32")
"""Pages of 512 KiB: a STORE of 128 takes long enough to be stopped in the middle."""


@pytest.mark.timeout(120)
def test_a_failed_store_is_held_until_the_stalled_daemon_ends_it(daemon_factory):
    d = daemon_factory("--hicache-size", "256MiB", "--extent-size", "32MiB")
    n = 128
    for attempt in range(4):
        pool, conn = engine(
            d.runtime_dir, WIDE, num_pages=n, request_timeout_s=0.5, load_timeout_s=0.3
        )
        stopped = False
        try:
            for p in range(n):
                fill_page(pool, p, 100 + p)
            keys = conn.page_keys(tokens(n * WIDE.page_size, salt=attempt))
            h = conn.store(keys, list(range(n)))
            os.kill(d.pid, signal.SIGSTOP)
            stopped = True
            if h.writing == 0 or h.wait():  # ended before the stop: nothing to hold
                continue
            if not h.copying():
                continue  # the daemon had ended it: nothing late can come
            returned = threading.Event()

            def hold(h=h, returned=returned) -> None:
                W._until_ended(h, "r")
                returned.set()

            t = threading.Thread(target=hold)
            t.start()
            time.sleep(0.3)  # any bounded look: it must still be waiting
            assert not returned.is_set(), "the blocks were handed back while the copy ran"
            os.kill(d.pid, signal.SIGCONT)
            stopped = False
            assert returned.wait(20), "the transfer's end was never seen"
            t.join(5)
            return
        finally:
            if stopped:
                os.kill(d.pid, signal.SIGCONT)
            conn.close()
            pool.close()
    pytest.skip("the STORE ended before the daemon stopped, 4 times: nothing to hold")
