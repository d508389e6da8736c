"""The gateway's async client for a GPU scheduler.

One DEALER socket, connected (and reconnected by ZeroMQ) to the scheduler's ROUTER.
A socket monitor tells the moment a connection is made or lost; ZMTP heartbeats turn
a silent peer into a lost connection. After each connect the client says Hello and is
``connected`` only once Welcome arrives. Whenever the connection drops, every request in
flight is reported lost at once: a restarted scheduler knows none of them.

Outputs are handed to a callback as decoded ``RequestOutput`` lists; their token IDs stay
raw bytes. Generate headers arrive already encoded (built by a tokenizer worker), so
sending is a plain multipart write.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from tokenmill.scheduler_client import protocol
from tokenmill.transport.loop_socket import LoopSocket

log = logging.getLogger("tokenmill.scheduler")


class SchedulerUnavailable(Exception):
    pass


class SchedulerClient:
    def __init__(
        self,
        endpoint: str,
        on_outputs: Callable[[list[protocol.RequestOutput]], None],
        on_lost: Callable[[str], None],
        on_error: Callable[[protocol.Error], None] | None = None,
        on_welcome: Callable[[protocol.Welcome], None] | None = None,
        ctx: zmq.Context | None = None,
        curve: dict | None = None,
        heartbeat_ms: int = 1000,
    ):
        self.endpoint = endpoint
        self.on_outputs = on_outputs
        self.on_lost = on_lost
        self.on_error = on_error or (lambda err: log.warning("scheduler error: %s", err.message))
        self.on_welcome = on_welcome
        self.ctx = ctx or zmq.Context.instance()
        self.curve = curve
        self.heartbeat_ms = heartbeat_ms
        self.connected = False
        self.welcome: protocol.Welcome | None = None
        self.stats: protocol.Stats | None = None
        self._connected_event = asyncio.Event()
        self.sock: LoopSocket | None = None
        self._monitor: LoopSocket | None = None

    async def start(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)  # plain, served by LoopSocket
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue a Generate for a scheduler not yet there
        # a scheduler that starts (or restarts) is found within 100 ms: with ZeroMQ's doubling up to a second,
        # one that came up 0.8 s after the gateway waited until 1.5 s; 10 tries a second cost nothing
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 100)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_ms * 3)
        if self.curve:
            sock.curve_secretkey = self.curve["secret"]
            sock.curve_publickey = self.curve["public"]
            sock.curve_serverkey = self.curve["server"]
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
        )
        sock.connect(self.endpoint)
        self.sock = LoopSocket(sock, self._on_message)
        self.sock.start()
        self._monitor = LoopSocket(monitor, self._on_monitor_event)
        self._monitor.start()

    async def wait_connected(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._connected_event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def generate(self, header: bytes, prompt_frame: bytes, *image_frames) -> None:
        """Send a ready-made Generate header, its prompt frame and its images' pixel frames (1.2)."""
        if not self.connected:
            raise SchedulerUnavailable("the scheduler is not connected")
        try:
            self.sock.send([header, prompt_frame, *image_frames])
        except zmq.ZMQError as exc:  # no connection after all (IMMEDIATE): the request must not vanish
            raise SchedulerUnavailable(f"the scheduler cannot take messages: {exc}") from None

    def abort(self, request_ids: list[str]) -> None:
        if self.connected and request_ids:
            try:
                self.sock.send([protocol.encode(protocol.Abort(request_ids))])
            except zmq.ZMQError:
                pass  # the connection is gone: the scheduler frees the session's requests itself

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
        if self.sock is not None:
            self.sock.close()  # (disable_monitor() would block: the monitor socket is closed already)
        self.connected = False

    # ---- internals --------------------------------------------------------------------

    def _on_monitor_event(self, frames) -> None:
        event = parse_monitor_message([f.bytes for f in frames])["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            try:
                self.sock.send([protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION))])
            except zmq.ZMQError as exc:
                log.warning("could not greet the scheduler at %s: %s", self.endpoint, exc)
        elif event == zmq.EVENT_DISCONNECTED:
            self._lose("the connection to the scheduler was lost")

    def _lose(self, why: str) -> None:
        was = self.connected
        self.connected = False
        self._connected_event.clear()
        if was:
            log.warning("scheduler at %s: %s", self.endpoint, why)
            self.on_lost(why)

    def _on_message(self, frames) -> None:
        try:
            msg = protocol.decode_from_scheduler(frames[0].buffer)
        except Exception as exc:
            log.error("undecodable message from the scheduler: %s", exc)
            return
        if isinstance(msg, protocol.Outputs):
            self.on_outputs(msg.outputs)
        elif isinstance(msg, protocol.Stats):
            self.stats = msg
        elif isinstance(msg, protocol.Welcome):
            self.welcome = msg
            self.connected = True
            self._connected_event.set()
            log.info("scheduler %s connected at %s", msg.scheduler_name, self.endpoint)
            if self.on_welcome is not None:
                self.on_welcome(msg)
        elif isinstance(msg, protocol.Error):
            if msg.request_id is None and msg.code == "version_mismatch":
                log.error("scheduler refused protocol version %d: %s", protocol.PROTOCOL_VERSION, msg.message)
            self.on_error(msg)
