"""A minimal ZeroMQ ROUTER "echo" server on uvloop: the baseline for control-plane latency.

``python -m kvtier.bench.echo_server ipc:///path/echo.sock`` answers every message until
SIGTERM: it reads the request whole and sends back a reply of :data:`ANSWER_BYTES` (as large
as a LOOKUP's answer, whatever the request's size), so the baseline moves the bytes a
LOOKUP moves and does none of its work.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop
import zmq
import zmq.asyncio
from kvtier.ipc import protocol as P


ANSWER = P.encode(P.LookupResult(req_id=1 << 40, epoch=1 << 40, l2=8192, l3=8192))
"""What the server answers: a LOOKUP's answer with large numbers (its largest usual size)."""
ANSWER_BYTES = len(ANSWER)


async def serve(endpoint: str) -> None:
    """Answer [identity, body] with [identity, ANSWER] until cancelled."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)

    async def loop() -> None:
        while True:
            frames = await sock.recv_multipart()
            await sock.send_multipart([*frames[:-1], ANSWER])

    task = asyncio.create_task(loop())
    await stop.wait()
    task.cancel()
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1]))
