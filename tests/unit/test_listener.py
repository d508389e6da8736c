"""gateway/listener.py: the gateway accepts every waiting connection per readiness, not one per loop
iteration as libuv does (so a busy loop does not leave health checks in the kernel's accept queue)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from tokenmill.gateway.listener import Acceptor, listen_sockets


class Counting(asyncio.Protocol):
    made: list = []

    def connection_made(self, transport) -> None:
        Counting.made.append(transport)


def connect(port: int, n: int) -> list[socket.socket]:
    clients = []
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", port))  # completes in the kernel's accept queue
        clients.append(c)
    return clients


@pytest.mark.parametrize("batch, first", [(128, 40), (16, 16)])
def test_one_readiness_accepts_the_whole_queue_up_to_the_batch(batch, first):
    (sock,) = listen_sockets("127.0.0.1", 0, reuseport=False)
    port = sock.getsockname()[1]
    clients = connect(port, 40)
    Counting.made = []

    async def main():
        acceptor = Acceptor([sock], Counting, batch=batch)
        acceptor._loop = asyncio.get_running_loop()  # not start(): call accept() by hand, once per "iteration"
        got = [acceptor.accept(sock)]
        while sum(got) < 40:
            got.append(acceptor.accept(sock))
        await asyncio.sleep(0.1)  # the transports are made on the loop
        nodelay = [t.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for t in Counting.made]
        acceptor.close()
        return got, nodelay

    got, nodelay = uvloop.run(main())
    try:
        assert got[0] == first  # everything waiting, not one
        assert sum(got) == 40 and len(Counting.made) == 40
        assert all(nodelay) and len(nodelay) == 40  # small SSE events go out at once
        assert sock.fileno() == -1  # closed: the port takes no more connections
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        for c in clients:
            c.close()


def test_a_port_in_use_is_an_error_at_listen():
    (first,) = listen_sockets("127.0.0.1", 0, reuseport=False)
    try:
        with pytest.raises(OSError):
            listen_sockets("127.0.0.1", first.getsockname()[1], reuseport=False)
    finally:
        first.close()


def test_reuseport_lets_gateways_share_the_port():
    (first,) = listen_sockets("127.0.0.1", 0, reuseport=True)
    try:
        (second,) = listen_sockets("127.0.0.1", first.getsockname()[1], reuseport=True)
        second.close()
    finally:
        first.close()
