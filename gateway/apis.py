"""The four generating APIs, each as one small handler: what differs between them and nothing else.

Chat Completions, Completions, Anthropic's Messages and OpenAI's Responses share the whole path through the
gateway (convert in a worker, generate, stream the worker's text back); they differ in the worker's request
kind, the form of the response id, the key that keeps a conversation on one worker and one scheduler rank,
the framer that writes their wire format, and (Messages) pings while a long prompt converts.
"""

from __future__ import annotations

import time
import zlib

from tokenmill.gateway import anthropic_format as anthropic
from tokenmill.gateway import openai_format as fmt
from tokenmill.gateway.request_body import RequestBody
from tokenmill.gateway.responses_format import ResponsesFramer


def conversation_key(body: bytes, system_field: bool = False, field: bytes = b'"messages"') -> int | None:
    """A hash of the conversation's beginning, from the raw body's head (RequestBody.head): the start
    of "messages" and of its first user message, which repeat across the turns of one conversation
    (conversations that open with one long system prompt differ in the second). Cheap (no JSON parsing, 4 KB hashed,
    a scan of at most 64 KB for the user message: past it, the start of "messages" alone) and
    only a hint. ``field``: where the conversation's items start ("input" for a Responses body).
    ``system_field``: Anthropic's Messages body, whose system prompt is its own field ("system"),
    hashed too (its first 2 KB) wherever it stands."""
    start = body.find(field, 0, 65536)
    if start < 0:
        return None
    if system_field:
        system = body.find(b'"system"', 0, 65536)
        seed = zlib.crc32(body[system : system + 2048]) if system >= 0 else 0
        key = conversation_key(body, field=field)
        return None if key is None else zlib.crc32(key.to_bytes(4, "little"), seed)
    user = body.find(b'"user"', start + len(field), start + 65536)  # ~1 us per KB scanned, on the loop
    if user < 0:
        return zlib.crc32(body[start : start + 2048])
    key = zlib.crc32(body[start : min(user, start + 2048)])
    # up to its first "}" (the message's end, or a brace in its text, the same on every turn): past
    # the message, a later turn's body differs
    end = body.find(b"}", user + 6, user + 2048)
    return zlib.crc32(body[user : end if end >= 0 else user + 2048], key)


def responses_key(head: bytes, tail: bytes) -> int | None:
    """conversation_key for a Responses body (``head``: its first bytes, ``tail``: its last 4 KB; a
    short body's whole in both): the client's prompt_cache_key when it names one (Codex sends it last,
    so the body's ends are searched), else the start of "instructions" and of "input"'s first user
    message, which repeat on every turn."""
    for text, start in ((head, head.find(b'"prompt_cache_key"', 0, 4096)), (tail, tail.find(b'"prompt_cache_key"'))):
        if start >= 0:
            value = text.find(b'"', text.find(b":", start + 18, start + 40) + 1, start + 64)
            if value >= 0:
                end = text.find(b'"', value + 1, value + 512)
                if end > value + 1:
                    return zlib.crc32(text[value + 1 : end])
    key = conversation_key(head, field=b'"input"')
    instructions = head.find(b'"instructions"', 0, 65536)
    if instructions >= 0:
        return zlib.crc32(head[instructions : instructions + 2048], key or 0)
    return key


def id_tail(scope, done, own: str) -> str:
    """What follows the prefix of a response's id, as vLLM makes it: the X-Request-Id header, else the
    body's request_id, else the server's own (``own``)."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value.decode("latin-1")
    if done.client_request_id is not None:
        return done.client_request_id
    return own


class Api:
    """Chat Completions: the base every API handler overrides where it differs."""

    kind = "chat"  # the workers' request kind (ConvertJob.kind)
    prefix = "chatcmpl"  # of the response id, and of the scheduler's request ids
    separator = "-"  # between the prefix and the rest: OpenAI's chatcmpl-/cmpl-, Anthropic's msg_, resp_

    def affinity(self, body: RequestBody) -> int | None:
        """The conversation's key for the workers' dispatch (None: no conversation to keep together)."""
        return conversation_key(body.head())

    def public_id(self, scope, done, own: str) -> str:
        """The response's id as the API's clients expect it (``own``: the server's id without its prefix)."""
        return f"{self.prefix}{self.separator}{id_tail(scope, done, own)}"

    def pinger(self, body: RequestBody, send, interval: float, headers) -> anthropic.Pinger | None:
        """Something that keeps the client's stream alive while the prompt converts (None: nothing)."""
        return None

    def framer(self, model: str, done, choices, response_id: str):
        """The writer of this API's response objects and stream events for one request."""
        return fmt.Framer(
            self.kind,
            done.completion,
            response_id=response_id,
            created=int(time.time()),
            model=model,
            prompt_tokens=[c.prompt_tokens for c in choices],
        )


class Completions(Api):
    kind = "completion"
    prefix = "cmpl"

    def affinity(self, body: RequestBody) -> int | None:
        return None  # a prompt, not a conversation


class Messages(Api):
    """Anthropic's Messages API: msg_ ids, the system prompt in the conversation's key, pings."""

    kind = "messages"
    prefix = "msg"
    separator = "_"

    def affinity(self, body: RequestBody) -> int | None:
        return conversation_key(body.head(), system_field=True)

    def pinger(self, body: RequestBody, send, interval: float, headers) -> anthropic.Pinger | None:
        return anthropic.Pinger(send, interval, headers) if anthropic.wants_stream(body) else None

    def framer(self, model: str, done, choices, response_id: str):
        return anthropic.MessagesFramer(response_id, model, choices[0].prompt_tokens)


class Responses(Api):
    """OpenAI's Responses API: resp_ ids, a conversation keyed by prompt_cache_key or its opening items."""

    kind = "responses"
    prefix = "resp"
    separator = "_"

    def affinity(self, body: RequestBody) -> int | None:
        return responses_key(body.head(), body.tail(4096))

    def framer(self, model: str, done, choices, response_id: str):
        return ResponsesFramer(response_id, int(time.time()), model, done.responses)


CHAT, COMPLETIONS, MESSAGES, RESPONSES = Api(), Completions(), Messages(), Responses()
