"""Tool calls the request forced (tool_choice "required" or a named function), read from constrained output.

With a forced tool_choice the engine decodes under a JSON schema (built as vLLM builds it, see
tokenizer_workers/generation_params.py), so the output is no model-specific markup but JSON:
a named function's arguments object, or for "required" an array of {"name", "parameters"}.
Nothing is decided before the output ends; then the whole text becomes calls, or comes back as
content (counted as a failure) when it is not what the schema promised, e.g. cut by max_tokens.
"""

from __future__ import annotations

import json

from tokenmill.tokenizer_workers.output_parsers.base import CALL, CONTENT, Piece, ToolCall, ToolParser, json_value


class ForcedCallParser(ToolParser):
    name = "forced"

    def __init__(self, tools: list[dict] | None, function: str | None) -> None:
        super().__init__(tools)
        self.function = function  # the named function; None: "required", an array of calls
        self._parts: list[str] = []

    def feed(self, text: str) -> list[Piece]:
        self._parts.append(text)
        return []

    def finish(self) -> list[Piece]:
        text = "".join(self._parts)
        if self.function is not None:
            return [self.call_or_content(self.function, text, text)]
        try:
            calls = json_value(text)
        except ValueError:
            calls = None
        if (
            not isinstance(calls, list)
            or not calls
            or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
                for c in calls
            )
        ):
            self.failures += 1
            return [(CONTENT, text)] if text else []
        return [(CALL, ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))) for c in calls]
