"""What a generation's table puts on ``Generation.events`` for its HTTP handler, one Struct per kind.

Every event names its choice and carries ``tokens``: the choice's tokens generated up to it, as the worker
counted them when it decoded the event's text (usage in every chunk: vLLM's continuous_usage_stats). The
handler matches on the type; a tagged Struct is as cheap to make as the tuple it replaces.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.tokenizer_workers.messages import ApiError


class Text(msgspec.Struct, gc=False):
    """Answer text of one choice."""

    choice: int
    text: str
    tokens: int


class Reasoning(msgspec.Struct, gc=False):
    """Reasoning text of one choice (a reasoning parser split it from the answer)."""

    choice: int
    text: str
    tokens: int


class Logprobs(msgspec.Struct, gc=False):
    """Text with its tokens' logprobs, as the worker's JSON fragments (tokenizer_workers/logprobs.py)."""

    choice: int
    text: str
    fragments: list[bytes]
    tokens: int


class Call(msgspec.Struct):
    """One whole tool call (the worker's parsed OutPiece)."""

    choice: int
    piece: Any
    tokens: int


class Ids(msgspec.Struct, gc=False):
    """vLLM's return_token_ids: one delta's text with its generated token IDs (comma-joined) and logprob
    fragments (None without), in one chunk. ``kind``: "text", "reasoning", or None when the delta's text
    goes in chunks of its own (a tool call)."""

    choice: int
    kind: str | None
    text: str
    ids: bytes
    fragments: list[bytes] | None
    tokens: int


class Finish(msgspec.Struct, gc=False):
    """The choice ended: its OpenAI finish_reason, and vLLM's stop_reason (None: not written)."""

    choice: int
    reason: str
    tokens: int
    stop_reason: str | int | None = None


class Failed(msgspec.Struct):
    """The whole request failed; nothing follows."""

    error: ApiError


class Disconnected(msgspec.Struct, gc=False):
    """The client hung up; the handler stops writing."""


DISCONNECTED = Disconnected()

Event = Text | Reasoning | Logprobs | Call | Ids | Finish | Failed | Disconnected
