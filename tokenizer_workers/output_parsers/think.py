"""Reasoning between <think> and </think>: deepseek_r1, deepseek_v3, qwen3, glm45.

Where the output starts is read from the prompt, which the output alone cannot tell: a
generation prompt that ends in an open ``<think>`` means the output starts in reasoning;
one that ends in ``</think>`` (thinking switched off) means it starts in content. Without
either, the format's habit decides: DeepSeek-R1 opens thinking in its template, so its
output starts in reasoning; the others start in content unless the output opens ``<think>``.
A ``<think>`` at the very start of the output (after whitespace) opens reasoning in any case.
"""

from __future__ import annotations

from tokenizer_workers.output_parsers.base import CONTENT, REASONING, MarkerScanner, Piece, ReasoningParser

_START, _REASONING, _CONTENT = 0, 1, 2


class ThinkParser(ReasoningParser):
    start = "<think>"
    end = "</think>"
    markers = (start, end)
    reasoning_first = False  # without a hint from the prompt, does the output start in reasoning?

    def __init__(self, prompt: str = "") -> None:
        super().__init__(prompt)
        self._scanner = MarkerScanner()
        self._lead = ""  # whitespace before the first text, held until the start is decided
        opened, closed = prompt.rfind(self.start), prompt.rfind(self.end)
        if opened > closed:
            self._default = _REASONING
        elif closed > opened:
            self._default = _CONTENT
        else:
            self._default = _REASONING if self.reasoning_first else _CONTENT
        self._state = _START

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._scanner.push(text)
        while True:
            if self._state == _START:
                if not self._decide_start():
                    return out
            elif self._state == _REASONING:
                before, marker = self._scanner.scan((self.end,))
                if before:
                    out.append((REASONING, before))
                if marker is None:
                    return out
                self._state = _CONTENT
            else:
                rest = self._scanner.rest()
                if rest:
                    out.append((CONTENT, rest))
                return out

    def _decide_start(self) -> bool:
        """Decide whether the output opens with <think>; False while it cannot be told yet."""
        pending = self._scanner.peek()
        body = pending.lstrip()
        if not body:
            return False
        if body.startswith(self.start):
            self._scanner.rest()
            self._scanner.push(body[len(self.start) :])
            self._state = _REASONING
            return True
        if self.start.startswith(body):
            return False  # could still be <think>
        self._state = self._default
        return True

    def finish(self) -> list[Piece]:
        if self._state == _START:
            self._state = self._default
        out = self.feed("")
        rest = self._scanner.rest()
        if rest:
            out.append((REASONING if self._state == _REASONING else CONTENT, rest))
        return out


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek_r1"
    reasoning_first = True
    template_signature = ("</think>",)  # R1's own template only strips thinking from history


class DeepSeekV3ReasoningParser(ThinkParser):
    """vLLM's deepseek_v3 follows the thinking kwarg; the prompt tells us the same."""

    name = "deepseek_v3"


class Qwen3ReasoningParser(ThinkParser):
    name = "qwen3"
    template_signature = ("<think>", "</think>", "<|im_start|>")


class Glm45ReasoningParser(ThinkParser):
    name = "glm45"
    template_signature = ("<think>", "</think>", "<|assistant|>")
