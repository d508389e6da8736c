"""What every output parser shares: the pieces it yields, its interface, and a marker scanner.

A parser reads a model's output text as it streams in, in pieces cut anywhere (inside a
marker, a JSON string escape or a multi-byte character's text), and yields *pieces*:

    ("content", text)     text for the user
    ("reasoning", text)   the model's thinking
    ("call", ToolCall)    one whole tool call

Three rules make the stream exact (issue: vLLM and SGLang break each of them):

* **Chunking-invariant.** The pieces of ``feed(a); feed(b); finish()``, with adjacent texts of
  one kind joined, equal those of ``feed(a + b); finish()`` for every cut. A parser decides
  nothing on a chunk boundary: text that could still become a marker is held back, and a
  call is yielded only once it is complete and valid.
* **Linear.** Each character is looked at a bounded number of times: the scanner keeps only
  the short tail that could begin a marker, and call bodies are collected in lists and
  joined once.
* **Nothing lost.** Text the parser could not turn into a call (invalid JSON, a function not
  in ``tools``, a call cut off by ``max_tokens``) comes back as content, the call's own text
  word for word, and is counted in ``failures``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

CONTENT = "content"
REASONING = "reasoning"
CALL = "call"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized as json.dumps(..., ensure_ascii=False)
    id: str | None = None  # set when the format names its calls (Kimi K2's functions.NAME:IDX)
    index: int = 0  # the call's place among the choice's calls (set by OutputParser)


Piece = tuple[str, Any]  # (CONTENT | REASONING, str) or (CALL, ToolCall)


class MarkerScanner:
    """Finds markers in text that arrives in pieces, holding back only what could begin one.

    ``push(text)`` adds text; ``scan(markers)`` consumes up to and including the earliest
    marker (the longest one where several start at the same place) and returns
    ``(text before it, marker)``; with no marker in sight it returns ``(text, None)``,
    keeping back the longest tail that is a proper prefix of a marker. ``rest()`` hands
    back what was held when the output ends.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = ""

    def push(self, text: str) -> None:
        self._pending += text

    def scan(self, markers: tuple[str, ...]) -> tuple[str, str | None]:
        text = self._pending
        best, found = -1, None
        for marker in markers:
            i = text.find(marker)
            if i >= 0 and (best < 0 or i < best or (i == best and len(marker) > len(found))):
                best, found = i, marker
        if found is not None:
            self._pending = text[best + len(found) :]
            return text[:best], found
        keep = _held_tail(text, markers)
        self._pending = text[len(text) - keep :] if keep else ""
        return (text[: len(text) - keep] if keep else text), None

    def peek(self) -> str:
        return self._pending

    def rest(self) -> str:
        text, self._pending = self._pending, ""
        return text


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    longest = min(len(text), max((len(m) for m in markers), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class ToolParser:
    """Turns streamed output text into content and tool calls; one instance per choice.

    Subclasses set ``name`` (vLLM's parser name), ``markers`` (the texts the parser must see:
    the worker keeps them in the text even where they are special tokens that
    ``skip_special_tokens`` would drop) and implement ``feed`` and ``finish``.
    """

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    # a template containing all of these is taken to speak this format (--tool-call-parser auto)
    template_signature: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = {t["name"]: t for t in functions(tools)}
        self.failures = 0  # calls that came back as content

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    # ---- helpers for subclasses -------------------------------------------------------

    def call_or_content(self, name: str, arguments: Any, raw: str, call_id: str | None = None) -> Piece:
        """A call when ``name`` is a declared tool and ``arguments`` a JSON object (or its
        text), else ``raw`` as content, counted as a failure."""
        name = name.strip() if isinstance(name, str) else name
        if isinstance(arguments, str):
            try:
                arguments = json_value(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
        if (
            not isinstance(name, str)
            or not name
            or not isinstance(arguments, dict)
            or (self.tools and name not in self.tools)
        ):
            self.failures += 1
            return (CONTENT, raw)
        return (CALL, ToolCall(name, json.dumps(arguments, ensure_ascii=False), call_id))

    def parameter_schema(self, function: str, parameter: str) -> dict:
        """The JSON schema of one parameter of a declared function ({} when unknown)."""
        params = (self.tools.get(function) or {}).get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        schema = props.get(parameter) if isinstance(props, dict) else None
        return schema if isinstance(schema, dict) else {}


_UNDECIDED, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    """Splits streamed output text into reasoning and content; one instance per choice.

    ``prompt`` is the rendered prompt: a template that opened the thinking block in the
    generation prompt (``...<think>``) or closed it (thinking off: ``...</think>``) decides
    how the output starts, which the output alone cannot tell.

    The state machine the formats share runs here; a parser states only what differs:

    * **The start.** Leading whitespace is held until the output shows whether it opens with
      one of ``openers``; if so, the opener (and that whitespace) is dropped and the output
      is in reasoning, with ``self.opener`` saying which one. Otherwise it starts where
      :meth:`starts_in_reasoning` says, its text kept as is.
    * **Reasoning** runs to one of :meth:`reasoning_ends`; :meth:`on_marker` decides what a
      marker found there does (by default: it ends the reasoning and is dropped). Reasoning
      text goes out through :meth:`reasoning` as it arrives.
    * **Content** is the rest, word for word but for the markers of :meth:`content_drops`.
    * **The end.** What was held back comes out as what it was held in.

    A format with a machine of its own (Harmony's messages) overrides ``feed`` and ``finish``.
    """

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    template_signature: ClassVar[tuple[str, ...]] = ()
    openers: ClassVar[tuple[str, ...]] = ()  # what opens reasoning at the very start of the output

    def __init__(self, prompt: str = "") -> None:
        self.prompt = prompt
        self.opener: str | None = None  # the opener the output began with, if any
        self._scanner = MarkerScanner()
        self._state = _UNDECIDED

    @classmethod
    def prompt_hint(cls, prompt: str) -> str:
        """What of the whole rendered prompt this format reads (the ``prompt`` it is made with).

        Kept small: it travels with a stream's state when the stream moves to another worker.
        By default the prompt's last 256 characters."""
        return prompt[-256:]

    # ---- what a format states ---------------------------------------------------------

    def starts_in_reasoning(self) -> bool:
        """Whether an output that begins with no opener starts in reasoning (asked once)."""
        return False

    def reasoning_ends(self) -> tuple[str, ...]:
        """The markers looked for in reasoning."""
        return ()

    def on_marker(self, marker: str, out: list[Piece]) -> bool:
        """A marker of ``reasoning_ends()`` met in reasoning: whether it ends the reasoning. It is
        dropped unless this puts it in ``out``."""
        return True

    def reasoning(self, text: str, out: list[Piece]) -> None:
        """Reasoning text as it arrives (possibly empty), and what is left of it at the end."""
        if text:
            out.append((REASONING, text))

    def content_drops(self) -> tuple[str, ...]:
        """Markers dropped from the content."""
        return ()

    # ---- the machine ------------------------------------------------------------------

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._scanner.push(text)
        while True:
            if self._state == _UNDECIDED:
                if not self._decide_start():
                    return out
            elif self._state == _REASONING:
                before, marker = self._scanner.scan(self.reasoning_ends())
                self.reasoning(before, out)
                if marker is None:
                    return out
                if self.on_marker(marker, out):
                    self._state = _CONTENT
            elif drops := self.content_drops():
                before, marker = self._scanner.scan(drops)
                if before:
                    out.append((CONTENT, before))
                if marker is None:
                    return out
            else:
                rest = self._scanner.rest()
                if rest:
                    out.append((CONTENT, rest))
                return out

    def finish(self) -> list[Piece]:
        if self._state == _UNDECIDED:
            self._state = _REASONING if self.starts_in_reasoning() else _CONTENT
        out = self.feed("")
        rest = self._scanner.rest()
        if self._state == _REASONING:
            self.reasoning(rest, out)
        elif rest:
            out.append((CONTENT, rest))
        return out

    def _decide_start(self) -> bool:
        """Whether the output opens with an opener; False while that cannot be told yet."""
        body = self._scanner.peek().lstrip()
        if not body:
            return False
        for opener in self.openers:
            if body.startswith(opener):
                self._scanner.rest()
                self._scanner.push(body[len(opener) :])
                self.opener = opener
                self._state = _REASONING
                return True
        if any(opener.startswith(body) for opener in self.openers):
            return False  # could still be one
        self._state = _REASONING if self.starts_in_reasoning() else _CONTENT
        return True


def finite_number(text: str) -> float:
    number = float(text)
    if math.isinf(number) or math.isnan(number):
        raise ValueError(f"{text} is no finite number")
    return number


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def json_value(text: str) -> Any:
    """``json.loads``, refusing what could not be written back as JSON (NaN, Infinity, 1e999) or is
    nested too deeply to read (ValueError in every case)."""
    try:
        return json.loads(text, parse_float=finite_number, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


_DECODER = json.JSONDecoder(parse_float=finite_number, parse_constant=_no_constant)


def json_prefix(text: str, at: int = 0) -> tuple[Any, int]:
    """The JSON value starting at ``at`` and where it ends, with json_value's refusals (ValueError)."""
    try:
        return _DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def functions(tools: list[dict] | None) -> list[dict]:
    """The function definitions of an OpenAI ``tools`` list (entries without a name skipped)."""
    out = []
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.append(fn)
    return out


def join_pieces(pieces: list[Piece]) -> list[Piece]:
    """Adjacent texts of one kind joined, empty texts dropped: the canonical form of a stream."""
    out: list[Piece] = []
    for kind, value in pieces:
        if kind == CALL:
            out.append((kind, value))
        elif value:
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + value)
            else:
                out.append((kind, value))
    return out
