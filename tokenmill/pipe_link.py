"""The link between a gateway and a tokenizer worker it spawned: one Unix socket pair.

A short request crosses this link four times (the job, its conversion, a detokenization
batch, its text). Over ZeroMQ each crossing woke libzmq's I/O thread on both sides, and on
a busy node every wake-up is a context switch: a round trip cost ~70 µs of CPU where a
plain socket pair costs ~15 µs (docs/front-end-cost.md). Here a message is one
``writev`` on the gateway's loop and one ``sendmsg`` from the worker's IO thread, and the
pair needs no endpoint in the filesystem and admits nobody else: only the child holds the
other end. Workers on other hosts and the node's other gateways keep ZeroMQ (CURVE,
reconnection, several peers).

A message is a list of frames, as with ZeroMQ. On the wire: the frame count and each
frame's length (little-endian uint32), then the frames back to back.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
from typing import Callable

_U32 = struct.Struct("<I")
_HEADS = {n: struct.Struct(f"<{n + 1}I") for n in range(9)}  # count + lengths, for the usual sizes
_READ = 256 * 1024


def _head(count: int) -> struct.Struct:
    """The layout of a prefix: the frame count, then each frame's length."""
    return _HEADS.get(count) or struct.Struct(f"<{count + 1}I")


def pack_header(frames) -> bytes:
    """The prefix of one message: its frame count and each frame's length."""
    return _head(len(frames)).pack(len(frames), *map(len, frames))


class FrameReader:
    """Cuts a byte stream into messages. Frames are memoryviews into the bytes read, not copies."""

    __slots__ = ("_pending", "_need")

    def __init__(self) -> None:
        self._pending = bytearray()  # the start of a message that has not fully arrived
        self._need = 0  # bytes that message needs in all, once its prefix is known

    def feed(self, data: bytes) -> list[list[memoryview]]:
        if self._pending:
            self._pending += data
            if len(self._pending) < self._need:
                return []
            data, self._pending, self._need = bytes(self._pending), bytearray(), 0
        view = memoryview(data)
        size, pos, messages = len(data), 0, []
        unpack_from = _U32.unpack_from
        while size - pos >= 4:
            count = unpack_from(data, pos)[0]
            start = pos + 4 + 4 * count
            if start > size:
                break
            lengths = _head(count).unpack_from(data, pos)[1:]
            end = start + sum(lengths)
            if end > size:
                self._need = end - pos
                break
            frames = []
            for length in lengths:
                frames.append(view[start : start + length])
                start += length
            messages.append(frames)
            pos = end
        if pos < size:
            self._pending = bytearray(view[pos:])
        return messages


class LinkDown(ConnectionError):
    """The worker's end is closed, or it has stopped reading."""


class PipeLink(asyncio.Protocol):
    """The gateway's end, served by the event loop: a send is one non-blocking write, and
    what arrives is handed to ``on_message`` as soon as it is whole."""

    MAX_BACKLOG = 256 << 20  # bytes queued for a worker that stopped reading: past this, sends fail

    def __init__(self, on_message: Callable[["PipeLink", list], None]):
        self.on_message = on_message
        self.transport: asyncio.Transport | None = None
        self._reader = FrameReader()

    @classmethod
    async def open(cls, sock: socket.socket, on_message: Callable[["PipeLink", list], None]) -> "PipeLink":
        link = cls(on_message)
        await asyncio.get_running_loop().create_unix_connection(lambda: link, sock=sock)
        return link

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None  # the worker's process watcher, not this, decides what its death means

    def data_received(self, data: bytes) -> None:
        for frames in self._reader.feed(data):
            if self.transport is None:
                return
            self.on_message(self, frames)

    def send(self, frames: list) -> None:
        """Queue one message; raises LinkDown when the worker cannot take it."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise LinkDown("the worker's link is closed")
        if transport.get_write_buffer_size() > self.MAX_BACKLOG:
            raise LinkDown("the worker has stopped reading its link")
        transport.writelines([pack_header(frames), *frames])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # unsent bytes are for a worker that is gone
            self.transport = None


class PipePeer:
    """The worker's end, used by its IO thread: blocking sends, and reads when poll says so."""

    def __init__(self, fd: int):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd)
        self._reader = FrameReader()

    def fileno(self) -> int:  # so that zmq.Poller can watch it beside ZeroMQ sockets
        return self.sock.fileno()

    def send(self, data, flags: int = 0) -> None:
        """As a ZeroMQ socket's send (flags such as NOBLOCK are accepted: the gateway's loop always reads)."""
        self.send_multipart([data])

    def send_multipart(self, frames: list, copy: bool = False) -> None:
        parts = [pack_header(frames), *frames]
        sent = self.sock.sendmsg(parts)
        total = sum(map(len, parts))
        if sent < total:  # a large message (a long prompt's tokens) or an interrupted call: send the rest
            rest = memoryview(b"".join(parts))[sent:]
            self.sock.sendall(rest)

    def receive(self) -> list[list[memoryview]]:
        """Every whole message waiting now; raises EOFError when the gateway has gone."""
        messages = []
        while True:
            try:
                data = self.sock.recv(_READ, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return messages
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise EOFError(str(exc)) from exc
            if not data:
                raise EOFError("the gateway closed the link")
            messages += self._reader.feed(data)
            if len(data) < _READ:
                return messages
