"""Reasoning between <think> and </think>: deepseek_r1, deepseek_v3, qwen3, glm45.

Where the output starts is read from the prompt, which the output alone cannot tell: a
generation prompt that ends in an open ``<think>`` means the output starts in reasoning;
one that ends in ``</think>`` (thinking switched off) means it starts in content. Without
either, the format's habit decides: DeepSeek-R1 opens thinking in its template, so its
output starts in reasoning; the others start in content unless the output opens ``<think>``.
A ``<think>`` at the very start of the output (after whitespace) opens reasoning in any case.
"""

from __future__ import annotations

from tokenmill.tokenizer_workers.output_parsers.base import ReasoningParser


class ThinkParser(ReasoningParser):
    start = "<think>"
    end = "</think>"
    markers = (start, end)
    openers = (start,)
    reasoning_first = False  # without a hint from the prompt, does the output start in reasoning?

    @classmethod
    def prompt_hint(cls, prompt: str) -> str:
        """The whole prompt's last ``<think>`` or ``</think>``: a turn's thinking can be closed
        long before the generation prompt (a tool result follows it with no marker), as vLLM's
        parsers find by looking back through all of the prompt's token IDs."""
        opened, closed = prompt.rfind(cls.start), prompt.rfind(cls.end)
        if opened == closed:  # neither
            return ""
        return cls.start if opened > closed else cls.end

    def starts_in_reasoning(self) -> bool:
        opened, closed = self.prompt.rfind(self.start), self.prompt.rfind(self.end)
        if opened != closed:  # the prompt opened thinking last, or closed it
            return opened > closed
        return self.reasoning_first

    def reasoning_ends(self) -> tuple[str, ...]:
        return (self.end,)


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
