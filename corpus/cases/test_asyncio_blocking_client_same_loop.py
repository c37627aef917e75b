"""A coroutine calls a blocking HTTP client (urllib) against a server that runs on the same event loop:
the call blocks the loop's only thread, so the server coroutine that would answer never runs."""

import asyncio
import urllib.request


async def handle(reader, writer):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await writer.drain()
    writer.close()


def fetch(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as resp:
        return resp.read()


async def main(offload):
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        if offload:
            return await asyncio.to_thread(fetch, port)
        return fetch(port)  # blocking call on the loop thread


def test_health_check_from_a_coroutine():
    assert asyncio.run(main(offload=False)) == b"ok"


def test_health_check_offloaded_to_a_thread():
    assert asyncio.run(main(offload=True)) == b"ok"
