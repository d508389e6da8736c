"""qwen3_coder: Qwen3-Coder's XML calls (parameter values are text, typed by the tool's schema).

    text
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

As vLLM reads it: one newline is trimmed on each side of a value, a value ends at its
``</parameter>``, at the next ``<parameter=`` or at ``</function>``; one ``<tool_call>`` may
hold several ``<function=...>`` blocks, and a bare ``<function=...>...</function>`` is a call
too. Any other text inside a call makes the whole call content. ``XmlCallsParser`` (shared
with glm45) drops whitespace just before a call, as vLLM strips content when calls are
made, and converts values as vLLM does (``schema_value``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenmill.tokenizer_workers.output_parsers.base import CALL, CONTENT, MarkerScanner, Piece
from tokenmill.tokenizer_workers.output_parsers.delimited import DelimitedCallsParser

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FUNC_START, FUNC_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"
_MANY = "calls"  # several calls from one body; flattened before they leave the parser

_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    "arr": "array",
    "list": "array",
    "sequence": "array",
}


_ENUM_TYPES = (
    (type(None), "null"),
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
)


def _types(schema: Any) -> set[str]:
    """The JSON types a schema allows: ``type``, the types of ``enum`` values, ``anyOf``/... choices."""
    if not isinstance(schema, dict):
        return {"string"}
    out: set[str] = set()
    kind = schema.get("type")
    out.update(t for t in (kind if isinstance(kind, list) else [kind]) if isinstance(t, str))
    for value in schema.get("enum") if isinstance(schema.get("enum"), list) else ():
        out.add(next((t for cls, t in _ENUM_TYPES if isinstance(value, cls)), "object"))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) if isinstance(schema.get(key), list) else ():
            out |= _types(choice) or {"string"}
    return out


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _json(text: str) -> tuple[bool, Any]:
    """(True, value) when ``text`` is JSON without infinities or NaN."""
    try:
        value = json.loads(text)
        return _finite(value), value
    except (ValueError, RecursionError):
        return False, None


def schema_value(text: str, schema: dict) -> Any:
    """A parameter's text as its schema's type (vLLM's order: null, integer, number, boolean,
    object/array, string); text no type fits is kept if string is allowed, else read as JSON."""
    types = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in (_types(schema) or {"string"})}
    if "null" in types and text.lower() == "null":
        return None
    if "integer" in types:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = float(text)
        except ValueError:
            number = math.inf
        if math.isfinite(number):
            return int(number) if number == int(number) else number
    if "boolean" in types and text.strip().lower() in ("true", "1", "false", "0"):
        return text.strip().lower() in ("true", "1")
    if types & {"object", "array"}:
        ok, value = _json(text)
        if ok:
            return value
    if "string" in types:
        return text
    ok, value = _json(text)
    return value if ok else text


def skip_space(text: str, i: int, stop: int) -> int:
    while i < stop and text[i].isspace():
        i += 1
    return i


def _find(text: str, sub: str, start: int, stop: int) -> int:
    i = text.find(sub, start, stop)
    return stop if i < 0 else i


class _Scanner(MarkerScanner):
    """A scanner that tells its parser which marker it found."""

    __slots__ = ("_found",)

    def __init__(self, found) -> None:
        super().__init__()
        self._found = found

    def scan(self, markers: tuple[str, ...]) -> tuple[str, str | None]:
        before, marker = super().scan(markers)
        if marker is not None:
            self._found(marker)
        return before, marker


class XmlCallsParser(DelimitedCallsParser):
    """Delimited calls whose whitespace just before a call is dropped; a body may give several calls."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._space: list[str] = []  # whitespace at the end of the content so far

    def parse_body(self, body: str) -> list[tuple[str, dict]] | None:
        """A call's body -> its (name, arguments) calls, or None when it is not a valid call."""
        raise NotImplementedError

    def complete(self, body: str) -> bool:
        """Whether a call still open when the output ended is whole anyway."""
        return False

    def parse_call(self, body: str, index: int) -> Piece:
        return self.result(self.parse_body(body), self.call_start + body + self.call_end)

    def parse_unclosed(self, body: str, index: int) -> Piece | None:
        whole = self.complete(body)
        return self.result(self.parse_body(body) if whole else None, self.call_start + body)

    def result(self, calls: list[tuple[str, dict]] | None, raw: str) -> Piece:
        """The calls, or ``raw`` (with the whitespace before it) as content when any is invalid."""
        space = "".join(self._space)
        self._space = []
        failures = self.failures
        pieces = [self.call_or_content(name, args, raw) for name, args in calls or ()]
        if not pieces or any(kind != CALL for kind, _ in pieces):
            self.failures = failures + 1
            return (CONTENT, space + raw)
        return pieces[0] if len(pieces) == 1 else (_MANY, pieces)

    def feed(self, text: str) -> list[Piece]:
        return _flat(super().feed(text))

    def finish(self) -> list[Piece]:
        out = _flat(super().finish())
        if self._space and (not self._after_call or not self._calls):  # not after a call
            out.append((CONTENT, "".join(self._space)))
        self._space = []
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        body = text.rstrip()
        if not body:
            if text:
                self._space.append(text)
            return
        space = "".join(self._space)
        self._space = [text[len(body) :]] if len(body) < len(text) else []
        super()._text(space + body, out)


def _flat(pieces: list[Piece]) -> list[Piece]:
    if not any(kind == _MANY for kind, _ in pieces):
        return pieces
    return [p for kind, value in pieces for p in (value if kind == _MANY else [(kind, value)])]


class Qwen3CoderParser(XmlCallsParser):
    name = "qwen3_coder"
    call_start = TOOL_START
    call_end = TOOL_END
    markers = (TOOL_START, TOOL_END, FUNC_START, FUNC_END, PARAM_START, PARAM_END)
    template_signature = (TOOL_START, FUNC_START, PARAM_START)

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._text_markers = (TOOL_START, FUNC_START)
        self._scanner = _Scanner(self._opened)

    def _opened(self, marker: str) -> None:
        """A call opens with <tool_call> (closed by </tool_call>) or a bare <function= (</function>)."""
        if marker in self._text_markers:  # only openers are scanned for outside calls
            self.call_start, self.call_end = (TOOL_START, TOOL_END) if marker == TOOL_START else (FUNC_START, FUNC_END)
            self._call_markers = (self.call_end,)

    def parse_body(self, body: str) -> list[tuple[str, dict]] | None:
        if self.call_start == FUNC_START:
            body = FUNC_START + body + FUNC_END
        calls, i, n = [], skip_space(body, 0, len(body)), len(body)
        while i < n:
            if not body.startswith(FUNC_START, i):
                return None
            gt = body.find(">", i + len(FUNC_START))
            if gt < 0:
                return None
            end = body.find(FUNC_END, gt + 1)
            name = body[i + len(FUNC_START) : gt].strip()
            if "<" in name:  # a tag missing its '>'
                return None
            args = self._parameters(name, body, gt + 1, n if end < 0 else end)
            if args is None:
                return None
            calls.append((name, args))
            if end < 0:  # the function was closed by </tool_call>
                break
            i = skip_space(body, end + len(FUNC_END), n)
        return calls or None

    def complete(self, body: str) -> bool:
        return self.call_start == TOOL_START and body.rstrip().endswith(FUNC_END)

    def _parameters(self, function: str, text: str, i: int, stop: int) -> dict | None:
        args: dict[str, Any] = {}
        close = following = -1  # the next </parameter> and <parameter= (stop: none left)
        i = skip_space(text, i, stop)
        while i < stop:
            if not text.startswith(PARAM_START, i):
                return None
            gt = text.find(">", i + len(PARAM_START), stop)
            if gt < 0:
                return None
            if close <= gt:
                close = _find(text, PARAM_END, gt + 1, stop)
            if following <= gt:
                following = _find(text, PARAM_START, gt + 1, stop)
            end = min(close, following)
            value = text[gt + 1 : end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            name = text[i + len(PARAM_START) : gt].lstrip()
            schema = self.parameter_schema(function, name)
            args[name] = schema_value(value, schema) if schema else value
            closed = end == close and close < stop
            i = skip_space(text, end + len(PARAM_END) if closed else end, stop)
        return args
