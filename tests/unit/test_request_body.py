"""tokenmill.gateway.request_body.RequestBody: a body's pieces as they arrived, read at its ends, searched across
the seams, and sent to a worker as one frame without being joined (tokenmill.transport.pipe_link)."""

from __future__ import annotations

import asyncio
import json
import random
import socket

from tokenmill.gateway.apis import conversation_key, responses_key
from tokenmill.gateway.request_body import HEAD_BYTES, RequestBody
from tokenmill.transport.pipe_link import PipeLink, pack_header


def _cut(data: bytes, seed: int, largest: int = 5000) -> RequestBody:
    """``data`` in random pieces, some of a byte or none, as a socket might hand them over."""
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(data):
        size = rng.choice((0, 1, 2, 3, rng.randrange(1, largest)))
        pieces.append(data[at : at + size])
        at += size
    return RequestBody(pieces)


def test_ends_and_search_are_those_of_the_joined_body_however_it_was_cut():
    rng = random.Random(1)
    data = bytes(97 + b % 3 for b in rng.randbytes(60_000))  # a, b, c: a small alphabet, many near misses
    for seed in range(30):
        body = _cut(data, seed)
        assert len(body) == len(data) and body.joined() == data
        for limit in (1, 7, 4096, 59_999, 60_000, 70_000):
            assert body.first(limit) == data[:limit] and body.tail(limit) == data[-limit:], limit
        for start in (0, 1, 4999, 30_000, 59_990):
            needle = data[start : start + 10]
            assert needle in body, (seed, start)
        assert b"abcabcabcd" not in body and b"d" not in body
    assert RequestBody().head() == b"" and RequestBody().tail(10) == b"" and b"x" not in RequestBody()


def test_the_first_piece_itself_is_the_start_when_it_holds_it():
    first = b"x" * 100
    body = RequestBody([first, b"y" * 10])
    assert body.first(100) is first and body.first(50) == first[:50]
    assert RequestBody([first]).head() is first and RequestBody([first]).joined() is first


def test_keys_from_the_ends_equal_keys_from_the_whole_body():
    """What app.py reads for dispatch (conversation key, Responses' prompt_cache_key, Anthropic's stream
    flag) comes out the same from the pieces as from the body in one piece; a 7 MB body's middle is
    never looked at."""
    image = "data:image/png;base64," + "A" * 7_000_000
    chat = json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [image]}]}
    ).encode()
    body = _cut(chat, 3, largest=300_000)
    assert conversation_key(body.head(), False) == conversation_key(chat) is not None
    for cache_key_first in (True, False):
        fields = {"model": "m", "input": [{"role": "user", "content": image}]}
        named = (
            {"prompt_cache_key": "session-42", **fields}
            if cache_key_first
            else {**fields, "prompt_cache_key": "session-42"}
        )
        raw = json.dumps(named).encode()
        pieces = _cut(raw, 4, largest=300_000)
        assert responses_key(pieces.head(), pieces.tail(4096)) == responses_key(raw, raw) is not None
    from tokenmill.gateway.anthropic_format import wants_stream

    for stream_first in (True, False):
        fields = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": image}]}
        message = {"stream": True, **fields} if stream_first else {**fields, "stream": True}
        assert wants_stream(_cut(json.dumps(message).encode(), 5, largest=300_000))
    assert not wants_stream(RequestBody([json.dumps({"model": "m", "stream": False}).encode()]))
    assert len(chat) > 3 * HEAD_BYTES


def test_a_body_in_pieces_crosses_a_pipe_link_as_one_frame():
    """PipeLink.send takes a list as one frame in pieces: the other end reads the frame whole."""
    data = random.Random(2).randbytes(3_000_000)
    body = _cut(data, 6, largest=300_000)
    assert pack_header([b"header", body.pieces, b""]) == pack_header([b"header", data, b""])

    async def run():
        ours, theirs = socket.socketpair()
        got = asyncio.get_running_loop().create_future()
        sender = await PipeLink.open(ours, lambda link, frames: None)
        receiver = await PipeLink.open(theirs, lambda link, frames: got.set_result([bytes(f) for f in frames]))
        sender.send([b"header", body.pieces, b""])
        try:
            return await asyncio.wait_for(got, 30)
        finally:
            sender.close()
            receiver.close()

    assert asyncio.run(run()) == [b"header", data, b""]
