"""Tool-call and reasoning parsers for model output, run in the tokenizer workers.

One module per format; each registers under vLLM's parser name below. Adding a format
is a new module and one line here. ``OutputParser`` chains a reasoning parser and a tool
parser for one choice, as vLLM's server does: reasoning first, tool calls in the rest.
"""

from __future__ import annotations

import importlib
import uuid

from tokenmill.tokenizer_workers.output_parsers.base import (
    CALL,
    CONTENT,
    REASONING,
    Piece,
    ReasoningParser,
    ToolCall,
    ToolParser,
    join_pieces,
)

# vLLM's name -> "module:Class" (modules of this package)
TOOL_PARSERS = {
    "hermes": "hermes:HermesParser",
    "qwen3_coder": "qwen3_coder:Qwen3CoderParser",
    "llama3_json": "llama3_json:Llama3JsonParser",
    "mistral": "mistral:MistralParser",
    "deepseek_v3": "deepseek_v3:DeepSeekV3Parser",
    "deepseek_v31": "deepseek_v31:DeepSeekV31Parser",
    "deepseek_v4": "deepseek_v4:DeepSeekV4Parser",
    "kimi_k2": "kimi_k2:KimiK2Parser",
    "glm45": "glm45:Glm45Parser",
    "openai": "harmony:HarmonyToolParser",
}
REASONING_PARSERS = {
    "deepseek_r1": "think:DeepSeekR1Parser",
    "deepseek_v3": "think:DeepSeekV3ReasoningParser",
    "qwen3": "think:Qwen3ReasoningParser",
    "glm45": "think:Glm45ReasoningParser",
    "kimi_k2": "kimi_k2:KimiK2ReasoningParser",
    "openai_gptoss": "harmony:HarmonyReasoningParser",
    "granite": "granite:GraniteReasoningParser",
}

__all__ = [
    "CALL",
    "CONTENT",
    "REASONING",
    "TOOL_PARSERS",
    "REASONING_PARSERS",
    "OutputParser",
    "Piece",
    "ToolCall",
    "join_pieces",
    "reasoning_parser_class",
    "tool_parser_class",
    "detect",
    "ParserChoice",
    "choose_parsers",
]


def _load(table: dict[str, str], name: str, what: str):
    target = table.get(name)
    if target is None:
        raise ValueError(f"unknown {what} parser {name!r}; known: {', '.join(sorted(table))}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def tool_parser_class(name: str) -> type[ToolParser]:
    return _load(TOOL_PARSERS, name, "tool-call")


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    return _load(REASONING_PARSERS, name, "reasoning")


def detect(template: str, table: dict[str, str], loader) -> str | None:
    """The format whose signature the chat template holds (the most specific one), or None."""
    best, best_len = None, 0
    for name in table:
        signature = loader(name).template_signature
        if signature and all(s in template for s in signature) and len(signature) > best_len:
            best, best_len = name, len(signature)
    return best


class ParserChoice:
    """The server's parsers (names resolved), making one OutputParser per chat choice."""

    def __init__(self, tool_cls: type[ToolParser] | None, reasoning_cls: type[ReasoningParser] | None) -> None:
        self.tool_cls = tool_cls
        self.reasoning_cls = reasoning_cls
        self.tool_name = tool_cls.name if tool_cls else ""
        self.reasoning_name = reasoning_cls.name if reasoning_cls else ""

    def prompt_hint(self, prompt: str) -> str:
        """What the reasoning parser reads of the rendered prompt (see ReasoningParser.prompt_hint)."""
        return self.reasoning_cls.prompt_hint(prompt) if self.reasoning_cls else ""

    def make(
        self, tools: list[dict] | None, prompt_hint: str, forced: str | None = None, max_calls: int = 0
    ) -> OutputParser | None:
        """A parser for one choice: tool calls only when ``tools`` are to be parsed. ``forced``: the
        request forced calls (tool_choice "required": "", a named function: its name), so the output
        is constrained JSON rather than the model's markup. ``max_calls`` 1: parallel_tool_calls false."""
        if forced is not None:
            from tokenmill.tokenizer_workers.output_parsers.forced import ForcedCallParser

            tool_parser = ForcedCallParser(tools, forced or None)
        else:
            tool_parser = self.tool_cls(tools) if self.tool_cls and tools else None
        reasoning = self.reasoning_cls(prompt_hint) if self.reasoning_cls else None
        if tool_parser is None and reasoning is None:
            return None
        return OutputParser(reasoning, tool_parser, max_calls)


def choose_parsers(tool_name: str, reasoning_name: str, template: str) -> ParserChoice:
    """Resolve --tool-call-parser / --reasoning-parser: a name, "auto" (from the chat template), or ""."""
    tool_cls = reasoning_cls = None
    if tool_name == "auto":
        tool_name = detect(template, TOOL_PARSERS, tool_parser_class) or ""
    if reasoning_name == "auto":
        reasoning_name = detect(template, REASONING_PARSERS, reasoning_parser_class) or ""
    if tool_name:
        tool_cls = tool_parser_class(tool_name)
    if reasoning_name:
        reasoning_cls = reasoning_parser_class(reasoning_name)
    return ParserChoice(tool_cls, reasoning_cls)


class OutputParser:
    """Reasoning, then tool calls, over one choice's output; calls get their index and id here."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int = 0) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.calls = 0
        self.max_calls = max_calls  # 0: no limit; 1: parallel_tool_calls false keeps the first call, as vLLM does

    @property
    def markers(self) -> tuple[str, ...]:
        """What the worker must keep in the text even where it is a special token."""
        return (self.reasoning.markers if self.reasoning else ()) + (self.tools.markers if self.tools else ())

    @property
    def failures(self) -> int:
        return self.tools.failures if self.tools else 0

    def feed(self, text: str) -> list[Piece]:
        pieces = self.reasoning.feed(text) if self.reasoning else [(CONTENT, text)]
        return self._through_tools(pieces)

    def finish(self) -> list[Piece]:
        pieces = self._through_tools(self.reasoning.finish()) if self.reasoning else []
        if self.tools:
            pieces += self._named(self.tools.finish())
        return join_pieces(pieces)

    def _through_tools(self, pieces: list[Piece]) -> list[Piece]:
        if not self.tools:
            return join_pieces(pieces)
        out: list[Piece] = []
        for kind, value in pieces:
            if kind == CONTENT:
                out += self._named(self.tools.feed(value))
            else:
                out.append((kind, value))
        return join_pieces(out)

    def _named(self, pieces: list[Piece]) -> list[Piece]:
        out = []
        for kind, value in pieces:
            if kind == CALL:
                if self.max_calls and self.calls >= self.max_calls:
                    continue
                call_id = value.id or f"chatcmpl-tool-{uuid.uuid4().hex}"
                value = ToolCall(value.name, value.arguments, call_id, self.calls)
                self.calls += 1
            out.append((kind, value))
        return out
