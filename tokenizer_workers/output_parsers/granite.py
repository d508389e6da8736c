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

from tokenmill.tokenizer_workers.output_parsers.base import ReasoningParser

THINK_PHRASES = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_PHRASES = ("Here is my response:", "Here's my response:")
THINK_START, THINK_END = "<think>", "</think>"
RESPONSE_TAGS = ("<response>", "</response>")


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    template_signature = ("<|start_of_role|>", "<|end_of_role|>", "thought process")
    openers = (*THINK_PHRASES, THINK_START)

    def reasoning_ends(self) -> tuple[str, ...]:
        return (THINK_END,) if self.opener == THINK_START else RESPONSE_PHRASES

    def content_drops(self) -> tuple[str, ...]:
        return RESPONSE_TAGS if self.opener == THINK_START else ()  # the tags answer a <think>
