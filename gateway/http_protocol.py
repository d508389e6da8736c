"""uvicorn's httptools protocol with the two things the gateway needs that it lacks.

1. A deadline for request headers. uvicorn closes a keep-alive connection idle between
   requests (``timeout_keep_alive``), but it waits forever for a client that connects and
   sends nothing, or that sends its headers a byte at a time (slow loris): each such
   connection holds a socket and a parser. Here the head of every request, timed from the
   connection (first request) or from the request's first byte (later ones), must be
   complete within ``header_timeout`` seconds, or the connection is closed and counted.
   The body has its own deadline in the app (``body_timeout``).
2. What the app needs to treat a slow reader: ``scope["extensions"]["tokenmill.write_paused"]``
   says whether the client's socket is backed up (the next write waits for it to drain), so
   the stream can coalesce the text that arrives meanwhile; and
   ``scope["extensions"]["tokenmill.drop_connection"]`` aborts the connection of a client
   that stopped reading altogether, whose pending writes would otherwise hold it open.

3. A request body's pieces as httptools hands them (``scope["extensions"]["tokenmill.body"]``,
   a ``request_body.RequestBody``), which the gateway never joins. uvicorn appends each piece to
   a bytearray and copies that into bytes for every ``receive()``: more copies of a 7 MB image
   body on the loop. Reading pauses past uvicorn's high-water mark of unread bytes, as uvicorn's does.

4. Optionally a fixed send buffer per connection (``send_buffer_bytes``), in the kernel and
   as uvloop's write high-water mark (64 KiB otherwise). Linux grows a socket's send buffer up
   to ``net.ipv4.tcp_wmem``'s maximum (4 MiB by default), so a client that stops reading can
   pin megabytes of kernel memory before the gateway notices; a fixed buffer makes that bound,
   and the point where coalescing starts, small and known.

HTTP parsing stays uvicorn's and httptools'; only connection bookkeeping is added.
"""

from __future__ import annotations

import socket
from typing import Callable

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenmill.gateway.request_body import RequestBody


def protocol_class(header_timeout: float, on_header_timeout: Callable[[], None], send_buffer_bytes: int = 0) -> type:
    class GatewayHttpProtocol(HttpToolsProtocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if send_buffer_bytes > 0:
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                transport.set_write_buffer_limits(high=send_buffer_bytes)  # uvloop's own buffer: the same bound
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # already armed for a connection's first request: its deadline runs from the connect

        def on_headers_complete(self) -> None:
            self._disarm()
            flow = self.flow
            self.scope["extensions"] = {
                "tokenmill.drop_connection": self.transport.abort,
                "tokenmill.write_paused": lambda: flow.write_paused,
                "tokenmill.body": RequestBody(),
            }
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return
            pieces = cycle.scope["extensions"]["tokenmill.body"]
            pieces.append(body)
            if pieces.unread > HIGH_WATER_LIMIT:
                self.flow.pause_reading()  # receive() resumes it, as for uvicorn's own body buffer
            cycle.message_event.set()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is None and header_timeout > 0:
                self._head_timer = self.loop.call_later(header_timeout, self._head_overdue)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_overdue(self) -> None:
            self._head_timer = None
            on_header_timeout()
            self.transport.close()

    return GatewayHttpProtocol
