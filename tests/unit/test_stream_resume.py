"""Resumable detokenization, in one process: a stream rebuilt on another Detokenizer from its
spec bytes and its answered token frames goes on exactly as the original would have, whatever the
batching; a spec a worker cannot read fails that stream alone, with a reason."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.scheduler_client import protocol
from tokenmill.scheduler_client.protocol import ids_to_frame
from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.converter import Converter
from tokenmill.tokenizer_workers.detokenizer import Detokenizer
from tokenmill.tokenizer_workers.logprobs import TokenTexts
from tokenmill.tokenizer_workers.resume import UnknownSpec, decode_spec, encode_spec
from tokenmill.tokenizer_workers.settings import ConverterSettings
from tokenmill.tokenizer_workers.worker import TokenizerWorker

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
OUTPUT = (
    "Zürich 😀 東京 — think STOP-ish STO then more 🤖 text</think>answer 𝔘𝔫𝔦 STOP! tail "
    + B
    + CB
    + "f"
    + S
    + json.dumps({"a": "ß 😀 東"})
    + CE
    + E
)


@pytest.fixture(scope="module")
def converter():
    converter = Converter(ConverterSettings(tool_call_parser="auto", reasoning_parser="auto"))
    converter.limit_context(m.Limits(features=list(protocol.FEATURES)))  # an engine that takes logprobs
    return converter


def _spec(converter, kind: str, **extra):
    body = {"model": "deepseek-v4", "stream": True, **extra}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    conversion = converter.convert(m.ConvertJob(1, kind, "r"), json.dumps(body).encode())
    assert conversion.done.error is None, conversion.done.error
    return conversion.detok[0]


def _detokenizer(converter) -> Detokenizer:
    """A worker's detokenizer; the token texts for logprobs made once (a second per vocabulary)."""
    detok = Detokenizer(converter.tokenizer)
    if not hasattr(converter, "_test_texts"):
        converter._test_texts = TokenTexts(converter.tokenizer)
    detok._texts = converter._test_texts
    return detok


def _outputs(detok: Detokenizer, rid: str, batches: list[list[int]]) -> list:
    out = []
    for i, batch in enumerate(batches):
        lps = ids_to_frame([0] * len(batch)) if batch else b""  # float32 zeros: logprob 0 for each token
        item = m.DetokItem(rid, ids_to_frame(batch), i == len(batches) - 1, lps)
        out += detok.step([item])
    return out


CASES = [
    ("chat", {}),
    ("chat", {"stop": ["STOP!"]}),
    ("chat", {"stop": ["STOP!"], "include_stop_str_in_output": True}),
    ("chat", {"tools": [TOOL], "chat_template_kwargs": {"enable_thinking": True}}),
    ("chat", {"logprobs": True, "top_logprobs": 0}),
    ("completion", {"logprobs": 0}),  # text_offset goes on from where it was
    ("completion", {"echo": True}),
]


@pytest.mark.parametrize("kind,extra", CASES)
def test_a_rebuilt_stream_goes_on_as_the_original(converter, kind, extra):
    ids = converter.tokenizer.encode(OUTPUT, add_special_tokens=False).ids
    rng = random.Random(7)
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(ids)), 8))
        batches = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        whole = _detokenizer(converter)
        whole.open(_spec(converter, kind, **extra))
        undisturbed = _outputs(whole, "r-0", batches)
        answered = rng.randrange(1, len(batches))  # the old worker answered this many batches
        if any(d.final for d in undisturbed[:answered]):
            continue  # a stop string ended it before: nothing left to resume
        rebuilt = _detokenizer(converter)
        spec = decode_spec(encode_spec(_spec(converter, kind, **extra)), converter.parsers)
        rebuilt.open(spec)
        history = b"".join(ids_to_frame(b) for b in batches[:answered])
        rebuilt.replay("r-0", history, [len(b) for b in batches[:answered]])
        rest = _outputs(rebuilt, "r-0", batches[answered:])
        for got, want in zip(rest, undisturbed[answered:]):
            if got.pieces:  # a call's id is drawn afresh by each parser
                for piece in [*got.pieces, *want.pieces]:
                    piece.call_id = ""
            assert got == want, (kind, extra, answered)


def test_a_stream_that_cannot_be_rebuilt_fails_alone_with_a_reason(converter):
    worker = TokenizerWorker.__new__(TokenizerWorker)
    worker.index, worker.converter = 0, converter
    worker.detokenizer = _detokenizer(converter)
    link = type("Link", (), {"beats": False})()
    with pytest.raises(UnknownSpec):
        decode_spec(b"\x93not a spec", converter.parsers)
    good = encode_spec(_spec(converter, "completion"))
    ids = ids_to_frame(converter.tokenizer.encode("hello there", add_special_tokens=False).ids)
    bad = worker._resume(link, m.ResumeStream("r-9", b"\xc1", b"", b"", [m.DetokItem("r-9", ids, False)]))
    assert [(d.request_id, d.final, bool(d.error)) for d in bad] == [("r-9", True, True)]
    assert "undecodable" in bad[0].error and "r-9" not in worker.detokenizer.states
    ok = worker._resume(link, m.ResumeStream("r-0", good, b"", b"", [m.DetokItem("r-0", ids, True)]))
    assert ok[0].text == "hello there" and not ok[0].error
