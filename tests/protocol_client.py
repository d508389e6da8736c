"""A fake front end for the tests: the client side of the scheduler protocol on a ZeroMQ DEALER.

The tests of the simulated scheduler, the engine bridges and the transformers and vLLM engines
talk to a scheduler as the gateway does. :class:`ProtocolClient` is that front end, synchronous,
with bounded waits (a failure shows the scheduler's log); :class:`AsyncProtocolClient` the same
on an asyncio loop, for a scheduler served in the test's own process. Test modules add only what
is theirs (a scheduler fixture's endpoint and log, their ways of collecting results).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import zmq
import zmq.asyncio

from tokenmill.scheduler_client.protocol import (
    PROTOCOL_VERSION,
    Generate,
    Hello,
    Outputs,
    Stats,
    Welcome,
    decode_from_scheduler,
    encode,
    ids_to_frame,
)

WAIT = 10.0  # any single expected message


def generate_frames(request_id: str, prompt: Sequence[int], **fields) -> list[bytes]:
    """A Generate for ``prompt`` (``fields``: the other Generate fields) and its token frame."""
    message = Generate(request_id=request_id, prompt_token_count=len(prompt), **fields)
    return [encode(message), ids_to_frame(list(prompt))]


def decode(frames: list[bytes]):
    """The scheduler message in a multipart message (which must be one frame)."""
    assert len(frames) == 1, f"scheduler messages are one frame, got {len(frames)}"
    return decode_from_scheduler(frames[0])


class ProtocolClient:
    """A front end's DEALER connected to ``endpoint``, synchronous, with bounded waits.

    ``ctx``: a ZeroMQ context to make the socket in (the owner terms it), else one of its own.
    ``log``: the scheduler's log so far, shown when an expected message does not come.
    """

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None, log: Callable[[], str] = lambda: "") -> None:
        self._own_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.log = log

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    # ---- sending

    def send(self, message: msgspec.Struct, *extra: bytes) -> None:
        self.sock.send_multipart([encode(message), *extra])

    def hello(self, client_name: str = "tokenmill", protocol_version: int = PROTOCOL_VERSION) -> None:
        self.send(Hello(protocol_version=protocol_version, client_name=client_name))

    def send_generate(self, request_id: str, prompt: Sequence[int], **fields) -> None:
        self.sock.send_multipart(generate_frames(request_id, prompt, **fields))

    # ---- receiving

    def poll(self, timeout: float):
        """The next message within ``timeout`` seconds, or None (every receive goes through here)."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def recv(self, timeout: float = WAIT):
        """The next message; an AssertionError (with the scheduler's log) if none comes in time."""
        message = self.poll(timeout)
        if message is None:
            raise AssertionError(f"nothing from the scheduler in {timeout}s:\n{self.log()}")
        return message

    def recv_not_stats(self, timeout: float = WAIT):
        deadline = time.monotonic() + timeout
        while True:
            message = self.recv(max(0.01, deadline - time.monotonic()))
            if not isinstance(message, Stats):
                return message

    def handshake(self, client_name: str = "test") -> Welcome:
        self.hello(client_name)
        welcome = self.recv_not_stats()
        assert isinstance(welcome, Welcome), welcome
        return welcome

    def messages(self, seconds: float) -> Iterator:
        """Every message, decoded, until ``seconds`` are up."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            message = self.poll(0.2)
            if message is not None:
                yield message

    def collect(self, request_ids, timeout: float = WAIT, on_message=None) -> dict[str, list]:
        """RequestOutputs per request until all of request_ids finished."""
        pending = set(request_ids)
        outputs: dict[str, list] = {rid: [] for rid in pending}
        while pending:
            message = self.recv(timeout)
            if on_message is not None:
                on_message(message)
            if isinstance(message, Stats):
                continue
            assert isinstance(message, Outputs), message
            for out in message.outputs:
                assert out.request_id in outputs, f"output for an unexpected request: {out}"
                assert out.request_id in pending, f"output after the final one: {out}"
                outputs[out.request_id].append(out)
                if out.finish_reason is not None:
                    pending.discard(out.request_id)
        return outputs

    def quiet(self, seconds: float) -> list:
        """Everything but Stats that arrives within ``seconds``."""
        got = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            message = self.poll(left + 0.001)
            if message is not None and not isinstance(message, Stats):
                got.append(message)
        return got


class AsyncProtocolClient:
    """A front end's DEALER connected to ``endpoint``, on the running asyncio loop."""

    def __init__(self, endpoint: str, wait: float = WAIT) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.wait = wait

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    async def send(self, message: msgspec.Struct, *extra: bytes) -> None:
        await self.sock.send_multipart([encode(message), *extra])

    async def send_generate(self, request_id: str, prompt: Sequence[int], **fields) -> None:
        await self.sock.send_multipart(generate_frames(request_id, prompt, **fields))

    async def hello(self) -> Welcome:
        await self.send(Hello(protocol_version=PROTOCOL_VERSION))
        return await self.recv(Welcome)

    async def next(self):
        """The next message, whatever it is."""
        return decode_from_scheduler(await asyncio.wait_for(self.sock.recv(), self.wait))

    async def recv(self, kind=None):
        """The next message of type ``kind``; without one, the next that is not Stats."""
        while True:
            message = await self.next()
            if kind is None and not isinstance(message, Stats) or kind is not None and isinstance(message, kind):
                return message
