"""A TCP forwarder on loopback: `python tests/tcp_forwarder.py LISTEN_PORT TARGET_PORT` accepts on
127.0.0.1:LISTEN_PORT and relays each connection, both ways, to 127.0.0.1:TARGET_PORT.

The tests put one in front of a server to make a replica of it that can die on its own: kill -9 of the
forwarder closes its connections (the kernel does, mid-stream) and refuses later connects, which is what a
client sees when that server's process dies, while the server behind it goes on serving the others.
`Forwarder` starts one as a subprocess and returns once it accepts connections.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from tokenmill.bench.servers import ProcessHandle

HOST = "127.0.0.1"


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until the reading side ends, then pass the end on (a half-close: the other way goes on)."""
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _relay(target_port: int, client_reader, client_writer) -> None:
    try:
        server_reader, server_writer = await asyncio.open_connection(HOST, target_port)
    except OSError:
        client_writer.transport.abort()  # the target is not there: the client sees its connection reset
        return
    pipes = [
        asyncio.ensure_future(_pipe(client_reader, server_writer)),
        asyncio.ensure_future(_pipe(server_reader, client_writer)),
    ]
    try:
        await asyncio.gather(*pipes)
    except OSError:  # one side reset: reset the other
        client_writer.transport.abort()
        server_writer.transport.abort()
    finally:
        for pipe in pipes:
            pipe.cancel()
        client_writer.close()
        server_writer.close()


async def _orphaned() -> None:
    """Return when the process that started this one has gone (a test run killed): the forwarder ends too."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)


async def serve(listen_port: int, target_port: int) -> None:
    server = await asyncio.start_server(lambda r, w: _relay(target_port, r, w), HOST, listen_port, reuse_address=True)
    print(f"forwarding {HOST}:{listen_port} to {HOST}:{target_port}", flush=True)
    async with server:
        await _orphaned()


class Forwarder(ProcessHandle):
    """`tests/tcp_forwarder.py` in its own process (kill -9 of ``pid`` is a replica's death), accepting
    connections on ``port`` when constructed; ``url`` is its HTTP address."""

    def __init__(self, port: int, target_port: int) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        super().__init__("tcp forwarder", [sys.executable, __file__, str(port), str(target_port)], new_session=True)
        self.wait_until(self.accepts, 10, interval=0.02)

    def accepts(self) -> bool:
        with socket.create_connection((HOST, self.port), timeout=1):
            return True


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/tcp_forwarder.py LISTEN_PORT TARGET_PORT")
    try:
        asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2])))
    except KeyboardInterrupt:
        pass
