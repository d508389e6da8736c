"""The link between a gateway and a tokenizer worker it spawned: one Unix socket pair.

A short request crosses this link four times (the job, its conversion, a detokenization
batch, its text). Over ZeroMQ each crossing woke libzmq's I/O thread on both sides, and on
a busy node every wake-up is a context switch: a round trip cost ~70 µs of CPU where a
plain socket pair costs ~15 µs (docs/design/components.md). Here a message is one
``writev`` on the gateway's loop and one ``sendmsg`` from the worker's IO thread, and the
pair needs no endpoint in the filesystem and admits nobody else: only the child holds the
other end. Workers on other hosts and the node's other gateways keep ZeroMQ (CURVE,
reconnection, several peers).

A message is a list of frames, as with ZeroMQ. On the wire: the frame count and each
frame's length (little-endian uint32), then the frames back to back.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import mmap
import socket
import struct
import sys
from typing import Callable

_U32 = struct.Struct("<I")
_HEADS = {n: struct.Struct(f"<{n + 1}I") for n in range(9)}  # count + lengths, for the usual sizes
_READ = 256 * 1024
_BIG = 64 * 1024  # messages from this size on are read in place (FrameReader)
_MAX_IN_PLACE = 256 << 20  # a larger claimed size is gathered as it arrives, not allocated up front
_MAPPED = 1 << 20  # messages from this size on are received into an anonymous mapping (_in_place)
_WRITE_SLICE = 256 * 1024  # the most the gateway's loop hands the kernel in one write (PipeLink)


def _head(count: int) -> struct.Struct:
    """The layout of a prefix: the frame count, then each frame's length."""
    return _HEADS.get(count) or struct.Struct(f"<{count + 1}I")


def pack_header(frames) -> bytes:
    """The prefix of one message: its frame count and each frame's length (a list: one frame in pieces)."""
    return _head(len(frames)).pack(len(frames), *(sum(map(len, f)) if type(f) is list else len(f) for f in frames))


class FrameReader:
    """Cuts a byte stream into messages. Frames are memoryviews into the bytes read, not copies.

    Reads go where ``buffer()`` says: a scratch chunk, copied out once per read (a few small
    messages), or, once a large message's prefix has arrived, straight into a buffer of its own
    size, so a long prompt's body or token IDs land in their final place from the socket (two
    copies and a dozen allocations fewer per megabyte than gathering chunks)."""

    __slots__ = ("_pending", "_need", "_scratch", "_big", "_filled", "_big_at")

    def __init__(self, chunk: int = _READ, big_at: int = _BIG) -> None:
        self._pending = bytearray()  # the start of a message that has not fully arrived
        self._need = 0  # bytes that message needs in all, once its prefix is known
        self._scratch = memoryview(bytearray(chunk))
        self._big: memoryview | None = None  # a large message being received in place
        self._filled = 0  # bytes of it so far
        self._big_at = big_at  # messages from this size on are received in place

    def buffer(self) -> memoryview:
        """Where the next read should go (never past the end of a large message)."""
        if self._big is not None:
            return self._big[self._filled :]
        return self._scratch

    def filled(self, nbytes: int) -> list[list[memoryview]]:
        """``nbytes`` were read into ``buffer()``: the messages now whole."""
        big = self._big
        if big is None:
            return self.feed(bytes(self._scratch[:nbytes]))
        self._filled += nbytes
        if self._filled < len(big):
            return []
        self._big = None
        return [_frames(big, 0)[0]]

    def feed(self, data: bytes) -> list[list[memoryview]]:
        """Bytes read (they must not change afterwards: the frames point into them). Once a
        large message has begun, its rest must come through buffer() and filled()."""
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
            if pos + 4 + 4 * count > size:
                break
            frames, end = _frames(view, pos, count)
            if end > size:
                need = end - pos
                if self._big_at <= need <= _MAX_IN_PLACE:  # the rest goes straight into a buffer of its own
                    self._big = _in_place(need)
                    self._big[: size - pos] = view[pos:]
                    self._filled, pos = size - pos, size
                else:
                    self._need = need
                break
            messages.append(frames)
            pos = end
        if pos < size:
            self._pending = bytearray(view[pos:])
        return messages


class _Mappings:
    """Buffers for large messages (``_in_place``), kept for reuse once nothing points into them.

    ``bytearray(size)`` zero-fills a buffer at once: for a conversion carrying images' pixel frames
    (~23 MB as float32) that memset and its page faults ran on the loop in one go, stalling /health by
    0.1-1 s (``tokenmill bench vllm --images``). An anonymous mapping's pages are faulted in by the reads
    that fill them, a socket buffer at a time, but each such fault has the kernel zero a fresh page: a
    quarter of the gateway's CPU while pixels stream through it (perf: clear_page under
    unix_stream_read). A mapping whose frames have all been let go (sent on, answered) is taken again,
    its pages already there. Kept up to ``keep`` bytes per process; the loop's thread (or a worker's IO
    thread) is the only user."""

    def __init__(self, keep: int = 128 << 20) -> None:
        self.keep = keep
        self.kept: list[mmap.mmap] = []

    def take(self, size: int) -> memoryview:
        if size < _MAPPED:
            return memoryview(bytearray(size))
        getrefcount = sys.getrefcount
        for mapping in self.kept:
            # idle: referenced by the list, this loop and getrefcount's argument only (a frame's memoryview
            # holds the mapping through its managed buffer, however many slices share it)
            if size <= len(mapping) <= 2 * size and getrefcount(mapping) == 3:
                return memoryview(mapping)[:size]
        mapping = mmap.mmap(-1, -(-size // _MAPPED) * _MAPPED, flags=mmap.MAP_PRIVATE)
        if sum(map(len, self.kept)) + len(mapping) <= self.keep:
            self.kept.append(mapping)
        return memoryview(mapping)[:size]


_mappings = _Mappings()


def _in_place(size: int) -> memoryview:
    """A buffer for one large message (the frames, memoryviews into it, keep it alive)."""
    return _mappings.take(size)


def _frames(view: memoryview, pos: int, count: int | None = None) -> tuple[list[memoryview], int]:
    """The message whose prefix starts at ``pos``: its frames (possibly past the end of ``view``
    when it has not all arrived, then to be ignored), and where it ends."""
    if count is None:
        count = _U32.unpack_from(view, pos)[0]
    lengths = _head(count).unpack_from(view, pos)[1:]
    start, frames = pos + 4 + 4 * count, []
    for length in lengths:
        frames.append(view[start : start + length])
        start += length
    return frames, start


class LinkDown(ConnectionError):
    """The worker's end is closed, or it has stopped reading."""


class PipeLink(asyncio.BufferedProtocol):
    """The gateway's end, served by the event loop. What arrives (read into the FrameReader's
    buffers) is handed to ``on_message`` as soon as it is whole. A send goes out at most
    ``_WRITE_SLICE`` per loop turn: a 5 MB body written at once was one ``writev`` that lasted as
    long as the worker took to read it (1-14 ms measured here with images arriving, the loop
    stalled all that time, /health p99 13-17 ms); in slices, the loop's other callbacks run between
    them. The same bound holds for reads (``get_buffer``)."""

    MAX_BACKLOG = 256 << 20  # bytes queued for a worker that stopped reading: past this, sends fail

    def __init__(self, on_message: Callable[["PipeLink", list], None]):
        self.on_message = on_message
        self.transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._outbox: collections.deque[memoryview] = collections.deque()  # not yet handed to the transport
        self._outbox_bytes = 0
        self._blocked = False  # the transport holds bytes the kernel has not taken: wait for resume_writing
        self._pumping = False  # a _pump is scheduled

    @classmethod
    async def open(cls, sock: socket.socket, on_message: Callable[["PipeLink", list], None]) -> "PipeLink":
        link = cls(on_message)
        await asyncio.get_running_loop().create_unix_connection(lambda: link, sock=sock)
        return link

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=0, low=0)  # pause_writing as soon as the kernel is full

    def connection_lost(self, exc) -> None:
        self.transport = None  # the worker's process watcher, not this, decides what its death means
        self._outbox.clear()
        self._outbox_bytes = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.buffer()[:_READ]

    def buffer_updated(self, nbytes: int) -> None:
        for frames in self._reader.filled(nbytes):
            if self.transport is None:
                return
            self.on_message(self, frames)

    def pause_writing(self) -> None:
        self._blocked = True

    def resume_writing(self) -> None:
        self._blocked = False
        self._schedule_pump()

    def send(self, frames: list) -> None:
        """Queue one message; raises LinkDown when the worker cannot take it."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise LinkDown("the worker's link is closed")
        if self._outbox_bytes + transport.get_write_buffer_size() > self.MAX_BACKLOG:
            raise LinkDown("the worker has stopped reading its link")
        parts = [pack_header(frames)]
        for frame in frames:  # a list is one frame in pieces (a request body as it arrived): never joined here
            if type(frame) is list:
                parts.extend(frame)
            else:
                parts.append(frame)
        size = sum(map(len, parts))
        if not self._outbox and not self._blocked and size <= _WRITE_SLICE:
            transport.writelines(parts)  # the usual message: written now, in one call
            return
        self._outbox.extend(memoryview(part).cast("B") for part in parts)
        self._outbox_bytes += size
        if not self._blocked and not self._pumping:
            self._pump()

    def _schedule_pump(self) -> None:
        if self._outbox and not self._pumping and not self._blocked:
            self._pumping = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """Hand the transport the next slice of the outbox; the rest on a later loop turn."""
        self._pumping = False
        transport = self.transport
        if transport is None or self._blocked:
            return
        outbox, parts, room = self._outbox, [], _WRITE_SLICE
        while outbox and room:
            part = outbox[0]
            if len(part) <= room:
                parts.append(outbox.popleft())
                room -= len(part)
            else:
                parts.append(part[:room])
                outbox[0] = part[room:]
                room = 0
        self._outbox_bytes -= _WRITE_SLICE - room
        transport.writelines(parts)  # may call pause_writing (the kernel took less than all of it)
        self._schedule_pump()

    def close(self) -> None:
        self._outbox.clear()
        self._outbox_bytes = 0
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
        parts = [memoryview(pack_header(frames)), *map(memoryview, frames)]
        sendmsg = self.sock.sendmsg
        while parts:  # a large message (a long prompt's tokens, pixel frames) goes in several calls
            sent = sendmsg(parts)
            while parts and sent >= parts[0].nbytes:  # the parts now sent whole; the rest, not copied
                sent -= parts.pop(0).nbytes
            if parts:
                parts[0] = parts[0].cast("B")[sent:]

    def receive(self) -> list[list[memoryview]]:
        """Every whole message waiting now; raises EOFError when the gateway has gone."""
        messages, reader, recv_into = [], self._reader, self.sock.recv_into
        while True:
            # at most _READ per call: megabytes copied in one call are milliseconds inside the
            # kernel, where a kernel without preemption keeps the gateway's loop from this core
            buffer = reader.buffer()[:_READ]
            try:
                nbytes = recv_into(buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return messages
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise EOFError(str(exc)) from exc
            if not nbytes:
                raise EOFError("the gateway closed the link")
            messages += reader.filled(nbytes)
            if nbytes < len(buffer):
                return messages
