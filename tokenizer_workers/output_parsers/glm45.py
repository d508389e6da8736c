"""glm45: GLM-4.5, GLM-4.6 and GLM-4.7 (vLLM's glm45 and glm47 are one parser).

    text
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The name runs to the first ``<arg_key>``; keys are stripped, values kept as written and
typed by the tool's schema, as vLLM does (``schema_value``). Text other than whitespace
between the tags makes the whole call content.
"""

from __future__ import annotations

from typing import Any

from tokenmill.tokenizer_workers.output_parsers.qwen3_coder import XmlCallsParser, schema_value, skip_space

KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"


class Glm45Parser(XmlCallsParser):
    name = "glm45"
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    markers = (call_start, call_end, KEY_START, KEY_END, VALUE_START, VALUE_END)
    template_signature = (call_start, KEY_START, VALUE_START)

    def parse_body(self, body: str) -> list[tuple[str, dict]] | None:
        n = len(body)
        i = body.find(KEY_START)
        i = n if i < 0 else i
        name = body[:i].strip()
        if "<" in name:
            return None
        args: dict[str, Any] = {}
        while (i := skip_space(body, i, n)) < n:
            if not body.startswith(KEY_START, i):
                return None
            key_end = body.find(KEY_END, i)
            if key_end < 0:
                return None
            key = body[i + len(KEY_START) : key_end].strip()
            i = skip_space(body, key_end + len(KEY_END), n)
            if not body.startswith(VALUE_START, i) or KEY_START in key:
                return None
            value_end = body.find(VALUE_END, i)
            if value_end < 0:
                return None
            value = body[i + len(VALUE_START) : value_end]
            schema = self.parameter_schema(name, key)
            args[key] = schema_value(value, schema) if schema else value
            i = value_end + len(VALUE_END)
        return [(name, args)]

    def complete(self, body: str) -> bool:
        return body.rstrip().endswith(VALUE_END)
