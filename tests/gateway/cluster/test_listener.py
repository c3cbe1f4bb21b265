"""The gateway's own HTTP listener (gateway/cluster/listener.py) on a real socket, with a real HTTP
client: it serves and streams from the running event loop, listeners share a port, a port
something else holds is refused with its address, and a stopped listener says so."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from gateway.cluster.listener import Listener, open_socket
from tests.redis_server import free_port


def app(name: str) -> FastAPI:
    api = FastAPI()

    @api.get("/who")
    async def who() -> dict:
        return {"name": name}

    @api.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


async def _served(port: int, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        for _ in range(100):  # uvicorn starts serving on the loop's next turns
            try:
                return await client.get(path)
            except httpx.ConnectError:
                await asyncio.sleep(0.02)
    raise AssertionError("the listener never answered")


def test_a_listener_serves_and_streams_then_stops() -> None:
    async def run() -> None:
        port = free_port()
        listener = Listener(app("a"), "127.0.0.1", port)
        assert (await _served(port, "/who")).json() == {"name": "a"}
        assert (await _served(port, "/stream")).text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert listener.failure() is None
        await listener.stop()
        assert listener.failure() == "stopped"
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(timeout=2) as client:
                await client.get(f"http://127.0.0.1:{port}/who")

    asyncio.run(run())


def test_two_gateway_replicas_share_the_port() -> None:
    async def run() -> None:
        port = free_port()
        first, second = Listener(app("first"), "127.0.0.1", port), Listener(app("second"), "127.0.0.1", port)
        seen = set()
        for _ in range(60):  # the kernel spreads new connections over both
            seen.add((await _served(port, "/who")).json()["name"])
            if len(seen) == 2:
                break
        assert seen == {"first", "second"}
        await first.stop()
        assert (await _served(port, "/who")).json() == {"name": "second"}  # the other keeps serving
        await second.stop()

    asyncio.run(run())


def test_a_port_held_by_another_program_is_refused_with_its_address() -> None:
    with socket.socket() as other:  # no SO_REUSEPORT: not ours to share
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            open_socket("127.0.0.1", port)
