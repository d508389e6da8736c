"""Anthropic Messages wire format: the message body, its SSE events, and Anthropic's error shape.

The worker has already split the output into text, reasoning and tool calls (with JSON
arguments); this only frames them as blocks. A framer serves one request and keeps the stream's
block state: the open block, the next block index (contiguous from 0), whether a tool was used.
Thinking blocks carry a signature as Anthropic's do: here a digest of the thinking text, stable
for the same text (vLLM sends a random one).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib

import msgspec

from tokenmill.gateway.request_body import HEAD_BYTES, RequestBody
from tokenmill.tokenizer_workers.messages import ApiError

_json = msgspec.json.Encoder()

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

PING = b'event: ping\ndata: {"type":"ping"}\n\n'


def error_object(error: ApiError) -> dict:
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(error: ApiError) -> bytes:
    return _json.encode(error_object(error))


def event(name: str, obj: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(obj) + b"\n\n"


def signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def usage(usage_obj: dict) -> dict:
    """Anthropic's usage from the chat usage: input_tokens excludes the engine's cached tokens."""
    cached = (usage_obj.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage_obj["prompt_tokens"] - cached,
        "cache_read_input_tokens": cached,
        "output_tokens": usage_obj["completion_tokens"],
    }


def stop_reason(finish: str | None, stop: str | int | None, tool_used: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence), as Anthropic reports them: max_tokens wins, then a finished tool call."""
    if finish == "length":
        return "max_tokens", None
    if tool_used or finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class MessagesFramer:
    """Frames one /v1/messages answer (one choice: the Messages API has no n)."""

    chat = True  # App._stream sends role_chunk (here message_start) first
    include_usage = True

    def __init__(self, request_id: str, model: str, prompt_tokens: int):
        self.id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.index = 0  # the next block's index
        self.open: str | None = None  # the open block's type
        self.thinking = hashlib.sha256()  # the open thinking block's text, for its signature
        self.tool_used = False
        self.finish: str | None = None
        self.stop: str | int | None = None

    def _message(self, content: list, stop: str | None, sequence: str | None, usage_obj: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": sequence,
            "usage": usage_obj,
        }

    # ---- stream ---------------------------------------------------------------------

    def role_chunk(self, index: int) -> bytes:
        start = self._message([], None, None, {"input_tokens": self.prompt_tokens, "output_tokens": 0})
        return event("message_start", {"type": "message_start", "message": start}) + PING

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":
            sig = base64.b64encode(self.thinking.digest()).decode()
            delta = {"type": "signature_delta", "signature": sig}
            out = event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
            self.thinking = hashlib.sha256()
        self.open = None
        out += event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.index += 1
        return out

    def _start(self, block: dict) -> bytes:
        self.open = block["type"]
        return event(
            "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    def delta_chunk(self, kind: str, index: int, text: str, tokens: int = 0) -> bytes:
        block = "thinking" if kind == "reasoning" else "text"
        out = b""
        if self.open != block:
            out = self._close() + self._start(
                {"type": "thinking", "thinking": "", "signature": ""}
                if block == "thinking"
                else {"type": "text", "text": ""}
            )
        if block == "thinking":
            self.thinking.update(text.encode())
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        return out + event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def call_chunks(self, index: int, call, tokens: int = 0) -> bytes:
        self.tool_used = True
        out = self._close() + self._start({"type": "tool_use", "id": call.call_id, "name": call.name, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": call.text}
        out += event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
        return out + self._close()

    def logprobs_chunk(self, index: int, text: str, fragments, tokens: int = 0) -> bytes:
        return self.delta_chunk("text", index, text, tokens)  # the Messages API has no logprobs

    def ids_chunk(self, index: int, kind, text: str, ids: bytes, fragments, tokens: int = 0) -> bytes:
        return self.delta_chunk(kind, index, text, tokens) if kind and text else b""

    def finish_chunk(self, index: int, reason: str, tokens: int = 0, stop_reason: str | int | None = None) -> bytes:
        self.finish, self.stop = reason, stop_reason
        return self._close()

    def done_chunk(self, usage_obj: dict, failed: bool) -> bytes:
        if failed:
            return b""
        out = b""
        if self.index == 0:  # Anthropic's empty answer is one empty text block
            out = self._start({"type": "text", "text": ""}) + self._close()
        reason, sequence = stop_reason(self.finish, self.stop, self.tool_used)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = usage(usage_obj)
        return out + event("message_delta", delta) + event("message_stop", {"type": "message_stop"})

    def error_chunk(self, error: ApiError) -> bytes:
        return event("error", error_object(error))

    # ---- whole ----------------------------------------------------------------------

    def full(
        self, texts, reasons, usage_obj, reasoning=None, calls=None, logprobs=None, stop_reasons=None, **_
    ) -> bytes:
        content: list = []
        thinking = reasoning[0] if reasoning else ""
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": signature(thinking)})
        if texts[0]:
            content.append({"type": "text", "text": texts[0]})
        for call in calls[0] if calls else ():
            content.append({"type": "tool_use", "id": call.call_id, "name": call.name, "input": msgspec.Raw(call.text)})
        if not content:
            content.append({"type": "text", "text": ""})
        reason, sequence = stop_reason(reasons[0], (stop_reasons or [None])[0], bool(calls and calls[0]))
        return _json.encode(self._message(content, reason, sequence, usage(usage_obj)))


def wants_stream(body: RequestBody) -> bool:
    """Whether a Messages body asks for a stream, read from its bytes (no JSON parsing on the loop), at
    its ends: a top-level key sits before or after the messages, and the middle of a 7 MB body is its
    images (missed, a stream only goes without keep-alive pings while it converts). A ``"stream": true``
    pair cannot occur inside a JSON string (its quotes would be escaped), so only a nested object with
    a "stream" key of true (a tool input) could mislead it."""
    for text in (body.head(), body.tail(1 << 16)) if len(body) > HEAD_BYTES else (body.head(),):
        if b'"stream":true' in text or b'"stream": true' in text:
            return True
    return False


class Pinger:
    """Keeps a streamed /v1/messages request alive while its prompt converts: after ``interval``
    seconds it starts the SSE response and sends a ``ping`` event every ``interval``. ``send`` is
    the ASGI send to use meanwhile and after: once the stream has started, a later response start
    is dropped and an error response goes out as an ``error`` event (its body is Anthropic's error
    object already)."""

    def __init__(self, send, interval: float, headers: list):
        self._send = send
        self.interval = interval
        self.headers = headers
        self.started = False
        self._error_status: int | None = None
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run()) if interval > 0 else None

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return
            except TimeoutError:
                pass
            if not self.started:
                self.started = True
                await self._send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await self._send({"type": "http.response.body", "body": PING, "more_body": True})

    async def stop(self) -> None:
        """No more pings (the conversion ended); waits for a ping being written."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def send(self, message: dict) -> None:
        if not self.started:
            await self._send(message)
        elif message["type"] == "http.response.start":
            if message["status"] != 200:
                self._error_status = message["status"]
        elif self._error_status is not None:  # an error answer, once the stream has begun: an error event
            await self._send(
                {"type": "http.response.body", "body": b"event: error\ndata: " + message["body"] + b"\n\n"}
            )
        else:
            await self._send(message)
