"""A light HTTP/1.1 load client for the benchmarks: keep-alive connections, one uvloop, no threads.

On the 2-core development machine, ``http.client`` in one thread per connection cost the load
190–260 µs of CPU per small request, as much as half of what the gateway spent on it, and its
threads queued for their own GIL: the small-request benchmark measured its client as much as
the server. Here each connection is an asyncio Protocol whose responses httptools (llhttp,
the parser uvicorn serves with) parses; the next request goes out from the callback that
completed the last one. It costs 31–47 µs of CPU per request there and drives a few thousand
small requests per second from one process.
"""

from __future__ import annotations

import asyncio
import time

import httptools


class _Connection(asyncio.Protocol):
    """One keep-alive connection sending the same request again as soon as each answer is complete."""

    def __init__(self, load: "_Load") -> None:
        self.load = load
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0
        self.waiting = False  # a request is out and its answer not complete
        self.body: list[bytes] = []
        self.closed = load.loop.create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.send()

    def send(self) -> None:
        if not self.load.take():
            self.transport.close()
            return
        self.body.clear()
        self.waiting = True
        self.sent_at = time.perf_counter()
        self.transport.write(self.load.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.load.fail(f"unparseable answer: {exc}")
            self.transport.close()

    def on_body(self, chunk: bytes) -> None:
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        self.waiting = False
        self.load.answered(self.parser.get_status_code(), self.sent_at, self.body)
        if self.parser.should_keep_alive():
            self.send()
            return
        if self.load.left > 0:  # the other connections take the rest, at a lower concurrency than asked
            self.load.fail("the server closed a keep-alive connection")
        self.transport.close()

    def connection_lost(self, exc) -> None:
        if self.waiting:
            self.waiting = False
            self.load.fail(f"the connection closed before the answer was complete ({exc or 'by the server'})")
        if not self.closed.done():
            self.closed.set_result(None)


class _Load:
    def __init__(self, loop, request: bytes, count: int) -> None:
        self.loop = loop
        self.request = request
        self.left = count
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def take(self) -> bool:
        if self.left <= 0 or len(self.errors) > 100:
            return False
        self.left -= 1
        return True

    def answered(self, status: int, sent_at: float, body: list[bytes]) -> None:
        if status == 200:
            self.latencies.append((time.perf_counter() - sent_at) * 1000)
        else:
            self.errors.append(f"{status}: {b''.join(body)[:200].decode(errors='replace')}")

    def fail(self, why: str) -> None:
        self.errors.append(why)


def post_many(port: int, path: str, body: bytes, count: int, concurrency: int, timeout: float = 600.0) -> dict:
    """POST ``body`` to ``path`` on 127.0.0.1 ``count`` times over ``concurrency`` keep-alive connections,
    each sending its next request when its last is answered. Returns the wall time, the latency in ms
    of every 200 answer, the other answers as "status: body" (at most ~100, then it stops), and the
    CPU this process spent."""
    import uvloop

    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        load = _Load(loop, request, count)
        t0, cpu0 = time.perf_counter(), time.process_time()
        conns = []
        for _ in range(min(concurrency, count)):
            _, conn = await loop.create_connection(lambda: _Connection(load), "127.0.0.1", port)
            conns.append(conn)
        done, pending = await asyncio.wait([c.closed for c in conns], timeout=timeout)
        for conn in conns:
            conn.transport.close()
        if pending:
            load.fail(f"{len(pending)} connection(s) still waiting for an answer after {timeout:.0f} s")
        return {
            "elapsed": time.perf_counter() - t0,
            "latencies": load.latencies,
            "errors": load.errors,
            "cpu_s": time.process_time() - cpu0,
        }

    return uvloop.run(main())
