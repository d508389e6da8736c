"""mistral: Mistral 7B v0.3, Nemo, Small, Large and later ([TOOL_CALLS], no end marker).

    text[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   pre-v11 tokenizers
    text[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{}            v11+ tokenizers

Both forms are read whatever the tokenizer (a v11 output whose ``[ARGS]`` was dropped,
``NAME{...}``, too). Content before the first ``[TOOL_CALLS]`` streams out (its trailing
whitespace is dropped when calls follow); from there on the output is collected and parsed
when it ends, one ``[TOOL_CALLS]`` segment at a time. What is not a call comes back as content
word for word: a segment whose JSON is invalid or unfinished (marker included), an array
entry naming an unknown function, text after a call's JSON.
"""

from __future__ import annotations

import re

from tokenmill.tokenizer_workers.output_parsers.base import CONTENT, MarkerScanner, Piece, ToolParser, json_prefix

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_SPACE = re.compile(r"\s*")


class MistralParser(ToolParser):
    name = "mistral"
    markers = (BOT, ARGS)
    template_signature = ("[AVAILABLE_TOOLS]", "[TOOL_CALLS]")

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._scanner = MarkerScanner()
        self._space: list[str] = []  # trailing whitespace of the content so far, held until text follows
        self._body: list[str] | None = None  # the output from the first [TOOL_CALLS] on
        self._gap = ""

    def feed(self, text: str) -> list[Piece]:
        if self._body is not None:
            self._body.append(text)
            return []
        self._scanner.push(text)
        before, marker = self._scanner.scan((BOT,))
        out: list[Piece] = []
        kept = before.rstrip()
        if kept:
            out.append((CONTENT, "".join(self._space) + kept))
            self._space = []
        if len(kept) < len(before):
            self._space.append(before[len(kept) :])
        if marker is not None:
            self._gap, self._space = "".join(self._space), []
            self._body = [self._scanner.rest()]
        return out

    def finish(self) -> list[Piece]:
        if self._body is None:
            rest = "".join(self._space) + self._scanner.rest()
            self._space = []
            return [(CONTENT, rest)] if rest else []
        segments, self._body = "".join(self._body).split(BOT), None
        out: list[Piece] = []
        for i, segment in enumerate(segments):
            pieces = self._segment(segment)
            if i == 0 and self._gap and pieces[0][0] == CONTENT:
                pieces[0] = (CONTENT, self._gap + pieces[0][1])
            out += pieces
        return out

    def _segment(self, seg: str) -> list[Piece]:
        """One [TOOL_CALLS] segment -> its calls, and as content what is no call."""
        at = _SPACE.match(seg).end()
        if seg[at : at + 1] in ("[", "{"):  # pre-v11: a JSON array of calls, or one call
            return self._json_calls(seg, at)
        args_at = seg.find(ARGS)
        brace = seg.find("{")
        if args_at >= 0 and (brace < 0 or args_at < brace):
            name, at = seg[:args_at], args_at + len(ARGS)
        elif brace >= 0:
            name, at = seg[:brace], brace
        else:
            return self._failed(seg)
        at = _SPACE.match(seg, at).end()
        try:
            if seg[at : at + 1] != "{":
                raise ValueError
            args, end = json_prefix(seg, at)
        except ValueError:
            return self._failed(seg)
        piece = self.call_or_content(name, args, BOT + seg)
        return [piece] if piece[0] == CONTENT else [piece, *self._after(seg, end)]

    def _json_calls(self, seg: str, at: int) -> list[Piece]:
        items = []  # (object, its text)
        try:
            if seg[at] == "{":
                obj, end = json_prefix(seg, at)
                items.append((obj, seg[at:end]))
            else:  # walk the array entry by entry, to know each one's text
                end = at + 1
                while True:
                    end = _SPACE.match(seg, end).end()
                    if seg[end : end + 1] == "]" and not items:
                        end += 1
                        break
                    obj, stop = json_prefix(seg, end)
                    items.append((obj, seg[end:stop]))
                    end = _SPACE.match(seg, stop).end()
                    if seg[end : end + 1] == "]":
                        end += 1
                        break
                    if seg[end : end + 1] != ",":
                        raise ValueError
                    end += 1
        except ValueError:
            return self._failed(seg)
        failures = self.failures
        pieces = [
            self.call_or_content(obj.get("name"), {} if obj.get("arguments") is None else obj["arguments"], raw)
            if isinstance(obj, dict)
            else self._failed_text(raw)
            for obj, raw in items
        ]
        if not any(kind != CONTENT for kind, _ in pieces):  # no call at all: the segment is content
            self.failures = failures
            return self._failed(seg)
        return pieces + self._after(seg, end)

    def _failed_text(self, raw: str) -> Piece:
        self.failures += 1
        return (CONTENT, raw)

    def _failed(self, seg: str) -> list[Piece]:
        return [self._failed_text(BOT + seg)]

    @staticmethod
    def _after(seg: str, end: int) -> list[Piece]:
        """Text after a call's JSON: dropped when it is whitespace, else content word for word."""
        rest = seg[end:]
        return [(CONTENT, rest)] if rest.strip() else []
