"""llama3_json: Llama 3.1, 3.2 and 3.3 JSON tool calls (the output is the calls, no end marker).

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", "parameters": {}}

The ``<|python_tag|>`` prefix is optional; ``"arguments"`` is read where the model writes it
instead of ``"parameters"``. An output that starts (after whitespace) with ``{`` or
``<|python_tag|>`` is taken as calls, as is the rest of an output from a ``<|python_tag|>``
onwards (text before it is content). The calls are collected and parsed when the output ends:
objects one after another, separated by ``;`` and whitespace (dropped). What is not a call
comes back as content word for word: an object that is not ``{"name", "parameters"}`` (and
all after it), an unfinished or invalid object (and all after it), an unknown function, text
after the last call. An output whose first object is no call is content as a whole
(``{"answer": 42}``).
"""

from __future__ import annotations

import re

from tokenmill.tokenizer_workers.output_parsers.base import CONTENT, MarkerScanner, Piece, ToolParser, json_prefix

TAG = "<|python_tag|>"
_SEPARATORS = re.compile(r"(?:\s|;|<\|python_tag\|>)*")
_START, _TEXT, _CALLS = 0, 1, 2


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (TAG,)
    template_signature = ("<|start_header_id|>", "Environment: ipython", '"parameters": dictionary of argument name')

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._scanner = MarkerScanner()
        self._state = _START
        self._space: list[str] = []  # whitespace held: at the start, or at the end of the content so far
        self._gap = ""  # whitespace between content and a <|python_tag|>: dropped unless the calls fail
        self._body: list[str] = []

    def feed(self, text: str) -> list[Piece]:
        if self._state == _CALLS:
            self._body.append(text)
            return []
        self._scanner.push(text)
        before, marker = self._scanner.scan(self.markers)
        out: list[Piece] = []
        if self._state == _START:
            stripped = before.lstrip()
            if not stripped and marker is None:
                self._space.append(before)
                return out
            if stripped.startswith("{") or not stripped:  # the output starts with a call
                self._start_calls("".join(self._space) + before + (marker or ""), "")
                return out
            self._state = _TEXT
        self._content(before, out)
        if marker is not None:
            self._start_calls(marker, "".join(self._space))
        return out

    def finish(self) -> list[Piece]:
        if self._state != _CALLS:
            rest = "".join(self._space) + self._scanner.rest()
            self._space = []
            return [(CONTENT, rest)] if rest else []
        text, self._body = "".join(self._body), []
        pieces = self._parse(text)
        if self._gap and pieces and pieces[0][0] == CONTENT:
            pieces[0] = (CONTENT, self._gap + pieces[0][1])
        return pieces

    def _content(self, text: str, out: list[Piece]) -> None:
        """Content, less trailing whitespace, which is held until text follows (dropped before calls)."""
        kept = text.rstrip()
        if kept:
            out.append((CONTENT, "".join(self._space) + kept))
            self._space = []
        if len(kept) < len(text):
            self._space.append(text[len(kept) :])

    def _start_calls(self, head: str, gap: str) -> None:
        self._state = _CALLS
        self._gap = gap
        self._space = []
        self._body = [head, self._scanner.rest()]

    def _parse(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        end = 0  # where the last call ended
        while True:
            at = _SEPARATORS.match(text, end).end()
            if at == len(text) and out:  # separators after the last call are dropped
                return out if any(kind != CONTENT for kind, _ in out) else [(CONTENT, text)]
            start = 0 if not out else at  # the first call's text includes what led to it
            try:
                if text[at] != "{":
                    raise ValueError
                obj, stop = json_prefix(text, at)
            except (ValueError, IndexError):
                return self._rest(out, text, end, start)
            key = "arguments" if "arguments" in obj else "parameters"
            if "name" not in obj or key not in obj:  # valid JSON, but not a call: no more calls
                return self._rest(out, text, end, start)
            out.append(self.call_or_content(obj["name"], obj[key], text[start:stop]))
            end = stop

    def _rest(self, out: list[Piece], text: str, end: int, start: int) -> list[Piece]:
        """Text that ends the calls: an object that failed, from its start; other text after a call, word for word."""
        broken = text[start:].lstrip().startswith("{")
        self.failures += broken or not out
        if not any(kind != CONTENT for kind, _ in out):  # no call at all: the output is content
            return [(CONTENT, text)]
        return [*out, (CONTENT, text[start:] if broken else text[end:])]
