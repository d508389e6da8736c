"""Running a case through tokenmill's parsers: the helpers both parser test modules use."""

from __future__ import annotations

import json

from tests.parser_cases import Case
from tokenmill.tokenizer_workers.output_parsers import (
    CALL,
    CONTENT,
    REASONING,
    OutputParser,
    join_pieces,
    reasoning_parser_class,
    tool_parser_class,
)


def make_parser(case: Case) -> OutputParser:
    reasoning = reasoning_parser_class(case.reasoning_parser)(case.prompt) if case.reasoning_parser else None
    tools = tool_parser_class(case.tool_parser)(case.tools) if case.tool_parser else None
    return OutputParser(reasoning, tools)


def parse_chunks(case: Case, chunks: list[str]) -> list:
    parser = make_parser(case)
    pieces = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    pieces += parser.finish()
    return [(k, (v.name, json.loads(v.arguments)) if k == CALL else v) for k, v in join_pieces(pieces)]


def summary(pieces: list) -> dict:
    """The non-streamed message: reasoning and content joined, calls in order."""
    reasoning = "".join(v for k, v in pieces if k == REASONING)
    content = "".join(v for k, v in pieces if k == CONTENT)
    calls = [{"name": v[0], "arguments": v[1]} for k, v in pieces if k == CALL]
    return {"reasoning": reasoning or None, "content": content or None, "tool_calls": calls}


def markers(case: Case) -> list[str]:
    if case.vllm_markers is not None:
        return list(case.vllm_markers)
    out = []
    if case.tool_parser:
        out += tool_parser_class(case.tool_parser).markers
    if case.reasoning_parser:
        out += reasoning_parser_class(case.reasoning_parser).markers
    return out
