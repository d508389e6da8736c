"""deepseek_v4: DeepSeek's DSML markup (DeepSeek-V3.2 and V4), one tag per parameter.

    text<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` marks a value given as is; ``string="false"`` (or no attribute) a JSON value,
taken as text where it is not JSON. Values are then fitted to the declared parameter's type
(``"3"`` for an integer parameter is 3), as vLLM does. The section is also accepted under
V3.2's name (``function_calls``) and the misspellings vLLM accepts (``toolcalls``, ``tool``).
A parameter must be closed and nothing but whitespace may stand between the tags; an invoke
that breaks this comes back as content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.tokenizer_workers.output_parsers.base import Piece, finite_number, json_value
from tokenmill.tokenizer_workers.output_parsers.delimited import DelimitedCallsParser

DSML = "｜DSML｜"
SECTIONS = ("tool_calls", "function_calls", "toolcalls", "tool")
PARAM_START = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"
_PARAM_HEAD = re.compile(r'\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>')
_WRAPPERS = ("arguments", "input")  # a model sometimes wraps all its arguments in one of these


class DeepSeekV4Parser(DelimitedCallsParser):
    name = "deepseek_v4"
    section_start = f"<{DSML}tool_calls>"
    section_end = f"</{DSML}tool_calls>"
    call_start = f'<{DSML}invoke name="'
    call_end = f"</{DSML}invoke>"
    # ｜DSML｜ is the tokenizer's one token in these; the rest is plain text
    markers = (DSML,)
    template_signature = (DSML, 'invoke name="', 'parameter name="')

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        ends = tuple(f"</{DSML}{s}>" for s in SECTIONS)
        self._text_markers = tuple(f"<{DSML}{s}>" for s in SECTIONS)
        self._section_markers = (self.call_start, *ends)
        self._call_markers = (self.call_end, *ends)

    def parse_call(self, body: str, index: int) -> Piece:
        raw = self.call_start + body + self.call_end
        name, closed, params = body.partition('">')
        arguments = self._arguments(name.strip(), params) if closed else None
        return self.call_or_content(name, arguments, raw)

    def _arguments(self, function: str, text: str) -> dict | None:
        """The parameters of one invoke, or None where its markup is broken."""
        parts = text.split(PARAM_START)
        if parts[0].strip():
            return None
        out: dict[str, Any] = {}
        for part in parts[1:]:
            head = _PARAM_HEAD.match(part)
            if head is None:
                return None
            value, closed, tail = part[head.end() :].partition(PARAM_END)
            if not closed or tail.strip():
                return None
            name, is_string = head.group(1), head.group(2) == "true"
            out[name] = self._value(value, is_string, self.parameter_schema(function, name))
        return self._unwrapped(function, out)

    @staticmethod
    def _value(text: str, is_string: bool, schema: dict) -> Any:
        value: Any = text
        if not is_string:
            try:
                value = json_value(text)
            except ValueError:
                pass
        return fit_to_schema(value, schema)

    def _unwrapped(self, function: str, args: dict) -> dict:
        """``{"arguments": {...declared parameters...}}`` -> the inner object (where not itself declared)."""
        params = (self.tools.get(function) or {}).get("parameters")
        declared = params.get("properties") if isinstance(params, dict) else None
        if len(args) != 1 or not isinstance(declared, dict) or not declared:
            return args
        ((key, inner),) = args.items()
        if key not in _WRAPPERS or key in declared:
            return args
        if isinstance(inner, str):
            try:
                inner = json_value(inner)
            except ValueError:
                return args
        return inner if isinstance(inner, dict) and set(inner) <= set(declared) else args


def schema_types(schema: dict) -> set[str]:
    """The JSON types a parameter's schema allows (from type, enum, anyOf/oneOf/allOf); empty: any."""
    kind, enum = schema.get("type"), schema.get("enum")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    types = {t.strip().lower() for t in kinds if isinstance(t, str)}
    if isinstance(enum, list):
        types |= {_json_type(v) for v in enum}
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict):
                types |= schema_types(choice)
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def fit_to_schema(value: Any, schema: dict) -> Any:
    """A parameter's value in a type its schema allows, where it can be read as one."""
    types = schema_types(schema)
    if not types or _json_type(value) in types or (_json_type(value) == "integer" and "number" in types):
        return value
    if types == {"string"}:
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        return value
    word = value.strip()
    if "null" in types and word.lower() == "null":
        return None
    if "integer" in types:
        try:
            return int(word)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = finite_number(word)
            return int(number) if number.is_integer() else number
        except ValueError:
            pass
    if "boolean" in types and word.lower() in ("true", "false", "1", "0"):
        return word.lower() in ("true", "1")
    if types & {"object", "array"}:
        try:
            parsed = json_value(word)
            if _json_type(parsed) in types:
                return parsed
        except ValueError:
            pass
    return value
