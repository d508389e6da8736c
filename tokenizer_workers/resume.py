"""A stream's decoder spec as bytes the gateway keeps, so another worker can take the stream over.

When a worker dies mid-stream, the gateway sends its streams to a live worker with this spec, the
token frames the dead worker had answered (and how they were batched) and the frames it had not
answered yet (messages.Resume). The new worker makes the same DetokSpec again (the output parser
from its recipe), replays the answered frames batch by batch with their output thrown away (that
text was sent already), and so holds the state the dead worker held: the incremental decoder, the
held-back stop-string prefix, the parser's state, the logprobs text offset. The rest continues
from there. The gateway never reads these bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.tokenizer_workers.conversion.plan import DetokSpec

VERSION = 1  # a worker refuses a spec of another version: that stream fails with a clear error


class ResumeSpec(msgspec.Struct, array_like=True):
    version: int
    request_id: str
    stop: list[str]
    include_stop: bool
    skip_special_tokens: bool
    include_reasoning: bool
    tool_parser_name: str
    logprobs: int | None
    tokens_as_ids: bool
    prefix: str
    chat: bool
    token_ids: bool
    spaces_between: bool
    stop_reason_ids: list[int]
    prompt_logprobs: int | None
    prompt_ids: list[int] | None
    echo_logprobs: int | None
    # ParserChoice.make's arguments: tools, prompt tail, forced, max_calls (None: no parser)
    parser_recipe: tuple[list[dict[str, Any]] | None, str, str | None, int] | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ResumeSpec)


class UnknownSpec(ValueError):
    """A spec this worker cannot rebuild a stream from."""


def encode_spec(spec: DetokSpec) -> bytes:
    ids = spec.prompt_ids
    return _encoder.encode(
        ResumeSpec(
            VERSION,
            spec.request_id,
            list(spec.stop),
            spec.include_stop,
            spec.skip_special_tokens,
            spec.include_reasoning,
            spec.tool_parser_name,
            spec.logprobs,
            spec.tokens_as_ids,
            spec.prefix,
            spec.chat,
            spec.token_ids,
            spec.spaces_between,
            sorted(spec.stop_reason_ids),
            spec.prompt_logprobs,
            None if ids is None else [int(i) for i in ids],
            spec.echo_logprobs,
            spec.parser_recipe,
        )
    )


def decode_spec(data: bytes, parsers) -> DetokSpec:
    """The DetokSpec again, its parser made by ``parsers`` (the worker's ParserChoice)."""
    try:
        r = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise UnknownSpec(f"undecodable stream state ({exc})") from None
    if r.version != VERSION:
        raise UnknownSpec(f"stream state of version {r.version}; this worker knows version {VERSION}")
    parser = None
    if r.parser_recipe is not None:
        parser = parsers.make(*r.parser_recipe)
        if parser is None:
            raise UnknownSpec("the stream used an output parser this worker does not have")
    return DetokSpec(
        r.request_id,
        r.stop,
        include_stop=r.include_stop,
        skip_special_tokens=r.skip_special_tokens,
        parser=parser,
        include_reasoning=r.include_reasoning,
        tool_parser_name=r.tool_parser_name,
        logprobs=r.logprobs,
        tokens_as_ids=r.tokens_as_ids,
        prefix=r.prefix,
        chat=r.chat,
        token_ids=r.token_ids,
        spaces_between=r.spaces_between,
        stop_reason_ids=frozenset(r.stop_reason_ids),
        prompt_logprobs=r.prompt_logprobs,
        prompt_ids=r.prompt_ids,
        echo_logprobs=r.echo_logprobs,
        parser_recipe=r.parser_recipe,
    )
