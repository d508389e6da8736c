"""IBM Granite's reasoning: vLLM's ``granite`` reasoning parser, in plain-text phrases.

Granite 3.2 thinks after a phrase and answers after another (``Here's`` for ``Here is``
happens too, in either phrase)::

    Here is my thought process:
    THINKING
    Here is my response:
    ANSWER

Granite 3.3's template asks for tags instead, which this parser reads as well::

    <think>THINKING</think><response>ANSWER</response>

Only an output that opens with a thought-process phrase or ``<think>`` (after whitespace,
which is dropped) has reasoning; it runs to the first response phrase (or ``</think>``), and
the rest is content, word for word except the ``<response>`` tags. Reasoning is yielded as it
arrives, so an output cut off while thinking is reasoning; any other output is content.
"""

from __future__ import annotations

from tokenizer_workers.output_parsers.base import CONTENT, REASONING, MarkerScanner, Piece, ReasoningParser

THINK_PHRASES = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_PHRASES = ("Here is my response:", "Here's my response:")
THINK_START, THINK_END = "<think>", "</think>"
RESPONSE_TAGS = ("<response>", "</response>")

_START, _PHRASE_REASONING, _TAG_REASONING, _CONTENT, _TAG_CONTENT = range(5)
_OPENERS = (*THINK_PHRASES, THINK_START)


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    template_signature = ("<|start_of_role|>", "<|end_of_role|>", "thought process")

    def __init__(self, prompt: str = "") -> None:
        super().__init__(prompt)
        self._scanner = MarkerScanner()
        self._state = _START

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._scanner.push(text)
        while True:
            if self._state == _START:
                if not self._decide_start():
                    return out
            elif self._state in (_PHRASE_REASONING, _TAG_REASONING):
                ends = RESPONSE_PHRASES if self._state == _PHRASE_REASONING else (THINK_END,)
                before, marker = self._scanner.scan(ends)
                if before:
                    out.append((REASONING, before))
                if marker is None:
                    return out
                self._state = _CONTENT if self._state == _PHRASE_REASONING else _TAG_CONTENT
            elif self._state == _TAG_CONTENT:
                before, marker = self._scanner.scan(RESPONSE_TAGS)  # the tags are dropped
                if before:
                    out.append((CONTENT, before))
                if marker is None:
                    return out
            else:
                rest = self._scanner.rest()
                if rest:
                    out.append((CONTENT, rest))
                return out

    def _decide_start(self) -> bool:
        """Whether the output opens with reasoning; False while that cannot be told yet."""
        body = self._scanner.peek().lstrip()
        if not body:
            return False
        for opener in _OPENERS:
            if body.startswith(opener):
                self._scanner.rest()
                self._scanner.push(body[len(opener) :])
                self._state = _TAG_REASONING if opener == THINK_START else _PHRASE_REASONING
                return True
        if any(opener.startswith(body) for opener in _OPENERS):
            return False
        self._state = _CONTENT
        return True

    def finish(self) -> list[Piece]:
        if self._state == _START:
            self._state = _CONTENT
        out = self.feed("")
        rest = self._scanner.rest()
        if rest:
            out.append((REASONING if self._state in (_PHRASE_REASONING, _TAG_REASONING) else CONTENT, rest))
        return out
