"""A ZeroMQ socket served by the event loop's reader callback, without pyzmq's Futures.

pyzmq's asyncio sockets wrap every send and receive in a Future and a chain of callbacks.
On the gateway's hot path (six messages per short request) that wrapping cost more CPU
than ZeroMQ itself. Here a plain socket's file descriptor is watched with
``loop.add_reader``; waiting messages are handed to a callback in batches, and a send is
one non-blocking call that raises at once (a ROUTER send to a peer that is gone fails
here, not in a Future nobody awaits).

ZeroMQ's descriptor is edge-triggered: it signals that the socket's state may have
changed, and any send or receive can consume that signal. So every send schedules one
more look at the socket on the next loop iteration, and a drain that stops early to let
other callbacks run schedules its own continuation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq

_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)  # plain ints: pyzmq's flag enums cost a call each time
log = logging.getLogger("tokenmill.zmq")


class LoopSocket:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[list], None], budget_s: float = 0.002):
        self.sock = sock
        self.on_message = on_message  # gets the frames (zmq.Frame, copy=False) of one message
        # time one callback may spend on messages before other callbacks (HTTP, /health) get the loop:
        # one scheduler message can carry a step for a thousand streams
        self.budget_s = budget_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = False
        self._fd: int | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = self.sock.get(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._check()  # messages may have arrived before we watched

    def send(self, frames: list, copy: bool = False) -> None:
        """Send one multipart message now; raises zmq.ZMQError (zmq.Again rather than block)."""
        send = self.sock.send
        for frame in frames[:-1]:
            send(frame, _MORE, copy=copy)
        send(frames[-1], _NOBLOCK, copy=copy)
        self._check()

    def _check(self) -> None:
        if not self._pending and self._loop is not None:
            self._pending = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._pending = False
        sock = self.sock
        if sock.closed:
            return
        on_message, recv, get = self.on_message, sock.recv, sock.get
        deadline = time.perf_counter() + self.budget_s
        while time.perf_counter() < deadline:
            if not get(_EVENTS) & _POLLIN:
                return
            frame = recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
            try:
                on_message(frames)
            except Exception:  # one bad message must not stop the socket being served
                log.exception("error handling a ZeroMQ message")
            if sock.closed:  # the callback closed it
                return
        self._check()  # more may wait: continue after the loop's other callbacks

    def close(self, linger: int = 0) -> None:
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        self._pending = False
        if not self.sock.closed:
            self.sock.close(linger)
