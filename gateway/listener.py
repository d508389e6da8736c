"""The gateway's listening sockets, and an accept loop that keeps up with a busy event loop.

libuv (under uvloop) accepts one connection per event-loop iteration (libuv PR #3696): fair to
the other handles when the loop is idle, but while a gateway streams to a thousand clients an
iteration takes tens of milliseconds, so it accepts a few dozen connections a second and new
ones (a health check from a load balancer, Prometheus' scrape, a new client) wait in the kernel's
accept queue for seconds. Measured here (``tokenmill bench streams`` at 2048 streams, one gateway):
the accept queue held ~1,100 connections and drained at ~35 a second, so ``/health`` on a new
connection took over 20 s while the loop's own lag stayed under 200 ms.

So the gateway accepts itself: a reader on each listening socket accepts up to ``batch``
connections each time the socket is readable and hands each to uvloop as an accepted socket,
with uvicorn's protocol. uvicorn still parses HTTP, tracks the connections and shuts them down;
it is given no sockets of its own to listen on.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Callable

log = logging.getLogger("tokenmill.gateway")

_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENOBUFS, errno.ENOMEM}
_OUT_OF_FILES = {errno.EMFILE, errno.ENFILE}


def listen_sockets(host: str, port: int, reuseport: bool, backlog: int = 2048) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for host:port, one per address it resolves to (as
    asyncio's create_server binds them). ``reuseport``: other gateway processes bind the same port."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuseport:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "::" and 0.0.0.0 bind side by side
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Acceptor:
    """Accepts up to ``batch`` connections per readiness of each listening socket."""

    def __init__(
        self, sockets: list[socket.socket], protocol_factory: Callable[[], asyncio.Protocol], batch: int = 128
    ):
        self.sockets = sockets
        self.factory = protocol_factory
        self.batch = batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused: set[int] = set()
        self._connecting: set[asyncio.Task] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self.accept, sock)

    def accept(self, sock: socket.socket) -> int:
        """Accept what is waiting (up to the batch); returns how many."""
        loop = self._loop
        done = 0
        while done < self.batch:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in _OUT_OF_FILES:  # wait for connections to close rather than spin on the error
                    log.error("accept: %s; not accepting for 1 s (raise LimitNOFILE=)", exc.strerror)
                    self._pause(sock, 1.0)
                elif exc.errno not in _TRANSIENT:
                    log.error("accept: %s", exc)
                break
            done += 1
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass  # the peer is gone already; the transport will see it
            task = loop.create_task(self._connect(conn))
            self._connecting.add(task)  # held until done: the loop keeps only weak references to tasks
            task.add_done_callback(self._connecting.discard)
        return done

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self.factory, sock=conn)
        except OSError:
            conn.close()  # reset before the transport was made

    def _pause(self, sock: socket.socket, seconds: float) -> None:
        fd = sock.fileno()
        if fd in self._paused:
            return
        self._paused.add(fd)
        self._loop.remove_reader(fd)

        def resume() -> None:
            self._paused.discard(fd)
            if sock.fileno() != -1:
                self._loop.add_reader(fd, self.accept, sock)

        self._loop.call_later(seconds, resume)

    def close(self) -> None:
        """Stop accepting: new connections are refused by the kernel once the sockets close."""
        for sock in self.sockets:
            if sock.fileno() != -1:
                if self._loop is not None:
                    self._loop.remove_reader(sock.fileno())
                sock.close()
