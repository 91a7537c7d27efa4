"""A minimal ZeroMQ ROUTER echo server on uvloop: the baseline for control-plane latency.

``python -m kvtier.bench.echo_server ipc:///path/echo.sock`` echoes every message back to
its sender until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop
import zmq
import zmq.asyncio


async def serve(endpoint: str) -> None:
    """Echo [identity, body] back until cancelled."""
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
            await sock.send_multipart(frames)

    task = asyncio.create_task(loop())
    await stop.wait()
    task.cancel()
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1]))
