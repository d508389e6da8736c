"""Where a choice's output starts (reasoning or content) is read from the whole rendered prompt, as vLLM's
parsers read all of the prompt's token IDs: after a long tool result the last ``</think>`` is far from the
generation prompt, and the answer is still content."""

from __future__ import annotations

import json

import pytest

from tokenmill.scheduler_client import protocol
from tokenmill.scheduler_client.protocol import ids_to_frame
from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.converter import Converter
from tokenmill.tokenizer_workers.detokenizer import Detokenizer
from tokenmill.tokenizer_workers.output_parsers.think import ThinkParser
from tokenmill.tokenizer_workers.settings import ConverterSettings

TOOL = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def converter():
    converter = Converter(ConverterSettings(tool_call_parser="auto", reasoning_parser="auto"))
    converter.limit_context(m.Limits(features=list(protocol.FEATURES)))
    return converter


def _pieces(converter, messages: list[dict], output: str, **extra) -> list[tuple[str, str]]:
    body = {"model": "deepseek-v4", "stream": True, "messages": messages, "tools": [TOOL], **extra}
    conversion = converter.convert(m.ConvertJob(1, "chat", "r"), json.dumps(body).encode())
    assert conversion.done.error is None, conversion.done.error
    detok = Detokenizer(converter.tokenizer)
    detok.open(conversion.detok[0])
    ids = converter.tokenizer.encode(output, add_special_tokens=False).ids
    deltas = detok.step([m.DetokItem("r-0", ids_to_frame(ids), True)])
    pieces: list[tuple[str, str]] = []
    for delta in deltas:
        for piece in delta.pieces:
            if pieces and pieces[-1][0] == piece.kind:
                pieces[-1] = (piece.kind, pieces[-1][1] + piece.text)
            else:
                pieces.append((piece.kind, piece.text))
    return pieces


def _after_tool_result(size: int) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    return [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x" * size},
    ]


@pytest.mark.parametrize("size", [10, 300, 20_000])
def test_an_answer_after_a_tool_result_is_content_however_long_the_result(converter, size):
    assert _pieces(converter, _after_tool_result(size), "It worked.") == [("content", "It worked.")]


@pytest.mark.parametrize("size", [10, 20_000])
def test_thinking_switched_on_after_a_tool_result_starts_in_reasoning(converter, size):
    got = _pieces(
        converter,
        _after_tool_result(size),
        "checking</think>It worked.",
        chat_template_kwargs={"enable_thinking": True},
    )
    assert got == [("reasoning", "checking"), ("content", "It worked.")]


def test_the_hint_is_the_prompts_last_marker_only():
    assert ThinkParser.prompt_hint("a<think>b</think>" + "c" * 5000) == "</think>"
    assert ThinkParser.prompt_hint("</think>x<think>" + "c" * 5000) == "<think>"
    assert ThinkParser.prompt_hint("no markers") == ""
