"""kimi_k2: Kimi K2's tool calls, each named by an id ``functions.NAME:INDEX``, and its reasoning.

    text<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id (``functions.get_weather:0``) becomes the call's id, as in vLLM; the name is what stands
between ``functions.`` and ``:INDEX`` (a header without the index is still read as a name).

Reasoning: thinking is on unless the prompt closed it (``<think></think>``), so the output starts
in reasoning; ``</think>`` ends it, and so does a tool-call section, which the model may open
without closing its thinking. A ``<think>`` inside the reasoning is dropped, and so is the
whitespace that ends the reasoning (vLLM trims it).
"""

from __future__ import annotations

import re

from tokenmill.tokenizer_workers.output_parsers.base import CONTENT, REASONING, Piece
from tokenmill.tokenizer_workers.output_parsers.delimited import DelimitedCallsParser
from tokenmill.tokenizer_workers.output_parsers.think import ThinkParser

SECTION_START = "<|tool_calls_section_begin|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
_HEADER = re.compile(r"(?:functions\.)?(?P<name>[^:]+?)(?::\d+)?")


class KimiK2Parser(DelimitedCallsParser):
    name = "kimi_k2"
    section_start = SECTION_START
    section_end = "<|tool_calls_section_end|>"
    call_start = "<|tool_call_begin|>"
    call_end = "<|tool_call_end|>"
    markers = (section_start, section_end, call_start, call_end, ARGUMENTS)
    template_signature = (SECTION_START, "<|tool_call_begin|>", ARGUMENTS)

    def parse_call(self, body: str, index: int) -> Piece:
        raw = self.call_start + body + self.call_end
        header, sep, arguments = body.partition(ARGUMENTS)
        header = header.strip()
        match = _HEADER.fullmatch(header) if sep else None
        if match is None:
            return self.call_or_content(None, None, raw)
        call_id = header if match.end("name") < len(header) else None  # only a header with its :INDEX is an id
        return self.call_or_content(match.group("name"), arguments, raw, call_id)


class KimiK2ReasoningParser(ThinkParser):
    name = "kimi_k2"
    reasoning_first = True
    markers = ("<think>", "</think>", SECTION_START)
    template_signature = ("<|im_assistant|>", "<think>", "</think>")

    def __init__(self, prompt: str = "") -> None:
        super().__init__(prompt)
        self._trailing: list[str] = []  # whitespace at the end of the reasoning so far, held

    def reasoning_ends(self) -> tuple[str, ...]:
        return (self.end, SECTION_START, self.start)

    def on_marker(self, marker: str, out: list[Piece]) -> bool:
        if marker == self.start:  # a <think> inside the reasoning is dropped
            return False
        self._trailing = []
        if marker == SECTION_START:  # the tool parser reads the section
            out.append((CONTENT, marker))
        return True

    def reasoning(self, text: str, out: list[Piece]) -> None:
        kept = text.rstrip()
        if kept:
            out.append((REASONING, "".join(self._trailing) + kept))
            self._trailing = []
        if len(kept) < len(text):
            self._trailing.append(text[len(kept) :])

    def finish(self) -> list[Piece]:
        out = super().finish()
        self._trailing = []  # whitespace ending the reasoning is dropped
        return out
