"""The common shape of most tool-call formats: content, then calls between markers.

    content  [SECTION_START]  CALL_START body CALL_END  ...  [SECTION_END]  more content

A format module subclasses :class:`DelimitedCallsParser`, names its markers and turns one
call's body into a piece (``parse_call``). This class does the streaming: content is yielded
as it arrives (less a tail that could begin a marker), a call's body is collected until its
end marker and parsed once, whitespace between and after calls is dropped (as vLLM drops
it, and whitespace before the first call too), and anything left unfinished when the output ends comes back as content.
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.tokenizer_workers.output_parsers.base import CONTENT, MarkerScanner, Piece, ToolParser

_TEXT, _SECTION, _CALL = 0, 1, 2


class DelimitedCallsParser(ToolParser):
    call_start: ClassVar[str] = ""
    call_end: ClassVar[str] = ""
    section_start: ClassVar[str | None] = None  # formats that wrap all calls in one section
    section_end: ClassVar[str | None] = None

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._scanner = MarkerScanner()
        self._state = _TEXT
        self._body: list[str] = []
        # whitespace at the start and after a call is held: dropped if a call follows, else sent with the text
        self._after_call = True
        self._held_space = ""
        self._calls = 0
        opener = self.section_start or self.call_start
        self._text_markers = (opener,)
        self._section_markers = (self.call_start, self.section_end) if self.section_end else ()
        self._call_markers = (self.call_end, self.section_end) if self.section_end else (self.call_end,)

    # ---- what a format provides ----------------------------------------------------------

    def parse_call(self, body: str, index: int) -> Piece:
        """One complete call's body (the text between its markers) -> a call, or content."""
        raise NotImplementedError

    def parse_unclosed(self, body: str, index: int) -> Piece | None:
        """A call still open when the output ended: a piece if it is complete anyway, else None."""
        return None

    # ---- streaming -------------------------------------------------------------------------

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._scanner.push(text)
        while True:
            if self._state == _TEXT:
                before, marker = self._scanner.scan(self._text_markers)
                self._text(before, out)
                if marker is None:
                    return out
                self._held_space = ""  # whitespace between calls (or sections) is dropped
                self._state = _SECTION if self.section_start else _CALL
                self._after_call = True  # and so is whitespace between a section's start and its first call
            elif self._state == _SECTION:
                before, marker = self._scanner.scan(self._section_markers)
                self._text(before, out)
                if marker is None:
                    return out
                self._held_space = ""
                if marker == self.call_start:
                    self._state = _CALL
                else:  # the section ended
                    self._state = _TEXT
            else:
                before, marker = self._scanner.scan(self._call_markers)
                self._body.append(before)
                if marker is None:
                    return out
                body = "".join(self._body)
                self._body = []
                if marker == self.call_end:
                    out.append(self.parse_call(body, self._calls))
                    self._calls += 1
                    self._state = _SECTION if self.section_start else _TEXT
                    self._after_call = True
                else:  # the section closed inside a call: the call is broken
                    self.failures += 1
                    out.append((CONTENT, self.call_start + body + marker))
                    self._state = _TEXT

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest = self._scanner.rest()
        if self._state == _CALL:
            body = "".join(self._body) + rest
            self._body = []
            piece = self.parse_unclosed(body, self._calls)
            if piece is None:
                self.failures += 1
                out.append((CONTENT, self.call_start + body))
            else:
                out.append(piece)
        else:
            self._text(rest, out)
        self._held_space = ""
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        """Text outside calls: content, except whitespace right after a call until text follows."""
        if not text:
            return
        if self._after_call:
            stripped = text.lstrip()
            if not stripped:
                self._held_space += text
                return
            text = self._held_space + text
            self._held_space = ""
            self._after_call = False
        out.append((CONTENT, text))
