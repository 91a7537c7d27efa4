"""A reply wait of the client's channel gets back the time its own process did not run, up
to the wait's own length (``client/connection/channel.py``, ``_recv_until``).

The socket here is a stand-in whose every look returns late with nothing come (this
process starved for good, so no daemon would be what makes it late): the wait must still
end, having been moved on by no more than its own length. Only counts are asserted.
"""

from __future__ import annotations

import threading
import time

from kvtier.client.connection.channel import PAUSE_SLACK_S, DaemonChannel


class _LateSocket:
    """Each ``poll`` returns :data:`PAUSE_SLACK_S` + 0.05 s late, with nothing to read."""

    def __init__(self) -> None:
        self.looks = 0

    def poll(self, timeout_ms: int, flags: int = 0) -> int:
        self.looks += 1
        time.sleep(timeout_ms / 1000 + PAUSE_SLACK_S + 0.05)
        return 0


def test_a_starved_wait_is_moved_on_by_at_most_its_own_length_and_ends():
    channel = DaemonChannel("ipc:///nonexistent", 0.2, threading.RLock())
    try:
        sock = _LateSocket()
        wait_s = 0.3
        deadline = [time.monotonic() + wait_s, wait_s]
        first = deadline[0]
        assert channel._recv_until(sock, deadline, watch_pid=False) is None  # type: ignore[arg-type]
        assert first < deadline[0] <= first + wait_s + 1e-6
        assert deadline[1] <= 0 and sock.looks >= 2
    finally:
        channel.context.term()
