"""hermes: Hermes 2 Pro/3, Qwen2.5, Qwen3, QwQ.

text<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

from tokenmill.tokenizer_workers.output_parsers.base import Piece, json_value
from tokenmill.tokenizer_workers.output_parsers.delimited import DelimitedCallsParser


class HermesParser(DelimitedCallsParser):
    name = "hermes"
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    markers = (call_start, call_end)
    template_signature = ("<tool_call>", '"name"', '"arguments"')

    def parse_call(self, body: str, index: int) -> Piece:
        return self._piece(body, self.call_start + body + self.call_end)

    def parse_unclosed(self, body: str, index: int) -> Piece | None:
        # vLLM takes a call whose closing tag never came if its JSON is whole
        try:
            json_value(body)
        except ValueError:
            return None
        return self._piece(body, self.call_start + body)

    def _piece(self, body: str, raw: str) -> Piece:
        try:
            obj = json_value(body)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return self.call_or_content(None, None, raw)
        return self.call_or_content(obj.get("name"), obj.get("arguments", {}), raw)
