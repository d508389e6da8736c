"""gpt-oss's Harmony format: vLLM's ``openai`` tool parser and ``openai_gptoss`` reasoning parser.

The generation prompt opens a message (``<|start|>assistant``); the output finishes its
header and goes on message after message::

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary<|message|>PREAMBLE<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"SF"}<|call|>
    <|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query":"q"}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(one line each here; nothing lies between the messages). A message's header names its
channel and maybe a recipient, before or after the channel. What a message becomes:

* recipient ``functions.NAME`` (or a bare ``NAME`` that is no built-in tool), on any
  channel: a call to NAME whose arguments are the body;
* channel ``analysis``: reasoning (a built-in tool's input there too, as vLLM has it);
* no recipient (``final``, a ``commentary`` preamble, any other channel): content;
* anything else (a built-in tool called on ``commentary``, a role other than assistant):
  its text, markup and all, as content.

Texts of one kind from different messages are joined by a newline, as vLLM joins them.
A body ends at ``<|end|>``, ``<|call|>`` or ``<|return|>`` (those stop tokens may also be
missing: the output's end closes the message), or where a new ``<|start|>`` begins one.
Text outside any message (output that is no Harmony at all) is content, word for word.

The two parsers share this scanner and differ only in what a call message becomes, so that
each is sound alone and the pair, chained as ``OutputParser`` chains them, gives vLLM's result:

* ``HarmonyReasoningParser`` yields a call message as content with its markup, exactly as
  the model wrote it (alone, that is all it can do without the tools);
* ``HarmonyToolParser`` turns it into a call (or, when it is not one, returns that text).
  Chained, it reads the reasoning parser's content: plain text stays content and the
  call messages in it are parsed. Alone, it reads the whole output and yields the analysis
  as reasoning (vLLM drops it when no reasoning parser is set).
"""

from __future__ import annotations

import re

from tokenmill.tokenizer_workers.output_parsers.base import (
    CONTENT,
    REASONING,
    MarkerScanner,
    Piece,
    ReasoningParser,
    ToolParser,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL_END, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CALL_END, RETURN, CONSTRAIN)
SIGNATURE = (START, CHANNEL, MESSAGE)

_ENDS = (END, CALL_END, RETURN)
_HEADER_STOPS = (MESSAGE, START, *_ENDS)
_BODY_STOPS = (*_ENDS, START)
# how the output's first header may begin (the prompt holds its <|start|>assistant)
_OPENERS = (START, CHANNEL, MESSAGE, " to=", "to=")
_BUILTIN_TOOLS = frozenset(("python", "browser", "container"))
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")

_FIRST, _BARE, _HEADER, _BODY = range(4)
_MARKUP, _CALL = "markup", "call"  # message kinds besides REASONING and CONTENT


def classify(header: str) -> tuple[str, str | None]:
    """A header (its text before ``<|message|>``) -> (kind, function name for calls)."""
    role = "assistant"
    if header.startswith(START):
        header = header[len(START) :]
        role = re.match(r"[^\s<]*", header).group()
        header = header[len(role) :]
    match = _CHANNEL.search(header)
    channel = match.group(1) if match else None
    match = _RECIPIENT.search(header)
    recipient = match.group(1) if match else None
    if role != "assistant":
        return _MARKUP, None
    if recipient and recipient != "assistant" and recipient.split(".", 1)[0] not in _BUILTIN_TOOLS:
        name = recipient.removeprefix("functions.")
        if name:
            return _CALL, name
    if channel == "analysis":
        return REASONING, None
    if recipient is None:
        return CONTENT, None
    return _MARKUP, None


class _HarmonyScanner:
    """Splits Harmony output into messages; ``_call`` says what a call message becomes."""

    markers = MARKERS
    template_signature = SIGNATURE

    def _start(self) -> None:
        self._scanner = MarkerScanner()
        self._state = _FIRST
        self._header: list[str] = []
        self._body: list[str] = []
        self._kind = CONTENT
        self._name: str | None = None
        self._head = ""  # the open message's header as written, <|message|> included
        self._fresh = True  # no text of the open message yielded yet
        self._said = {REASONING: False, CONTENT: False}

    def _call(self, name: str, body: str, raw: str) -> Piece:
        raise NotImplementedError

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._scanner.push(text)
        while True:
            if self._state == _FIRST:
                pending = self._scanner.peek()
                if not any(o.startswith(pending) or pending.startswith(o) for o in _OPENERS):
                    self._state = _BARE
                elif pending.startswith(START):
                    self._scanner.scan((START,))
                    self._open_header()
                elif any(pending.startswith(o) for o in _OPENERS):
                    self._state = _HEADER
                else:
                    return out  # could still open a header
            elif self._state == _BARE:
                before, marker = self._scanner.scan((START,))
                self._text(CONTENT, before, out)
                if marker is None:
                    return out
                self._open_header()
            elif self._state == _HEADER:
                before, marker = self._scanner.scan(_HEADER_STOPS)
                self._header.append(before)
                if marker is None:
                    return out
                header = "".join(self._header)
                if marker == MESSAGE:
                    self._kind, self._name = classify(header)
                    self._head = header + marker
                    self._state, self._fresh = _BODY, True
                elif marker == START:  # a header never finished: its text is content
                    out.append((CONTENT, header))
                    self._open_header()
                else:
                    out.append((CONTENT, header + marker))
                    self._state = _BARE
            else:
                before, marker = self._scanner.scan(_BODY_STOPS)
                if self._kind in (REASONING, CONTENT):
                    self._text(self._kind, before, out)
                else:
                    self._body.append(before)
                if marker is None:
                    return out
                self._close(marker if marker != START else "", out)
                if marker == START:
                    self._open_header()
                else:
                    self._state = _BARE

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest = self._scanner.rest()
        if self._state in (_FIRST, _BARE):
            self._text(CONTENT, rest, out)
        elif self._state == _HEADER:
            out.append((CONTENT, "".join(self._header) + rest))
        elif self._kind in (REASONING, CONTENT):
            self._text(self._kind, rest, out)
        else:
            self._body.append(rest)
            self._close("", out)
        self._start()
        return out

    def _open_header(self) -> None:
        self._header = [START]
        self._state = _HEADER

    def _close(self, end: str, out: list[Piece]) -> None:
        """The open message ended (at ``end``, "" for none): a call or markup message is due."""
        if self._kind in (REASONING, CONTENT):
            return
        body = "".join(self._body)
        self._body = []
        raw = self._head + body + end
        out.append(self._call(self._name, body, raw) if self._kind == _CALL else (CONTENT, raw))

    def _text(self, kind: str, text: str, out: list[Piece]) -> None:
        """Body text of a reasoning or content message (or text between messages)."""
        if not text:
            return
        if self._state == _BODY and self._fresh and self._said[kind]:
            text = "\n" + text
        self._fresh = False
        self._said[kind] = True
        out.append((kind, text))


class HarmonyToolParser(_HarmonyScanner, ToolParser):
    """Calls from ``functions.NAME`` messages; reasoning and content from the rest (see above)."""

    name = "openai"

    def __init__(self, tools: list[dict] | None = None) -> None:
        ToolParser.__init__(self, tools)
        self._start()

    def _call(self, name: str, body: str, raw: str) -> Piece:
        return self.call_or_content(name, body, raw)


class HarmonyReasoningParser(_HarmonyScanner, ReasoningParser):
    """Analysis as reasoning, answers as content, call messages as content with their markup.

    The output is taken to begin inside the header the generation prompt opened
    (``<|start|>assistant``), as gpt-oss's template has it.
    """

    name = "openai_gptoss"

    def __init__(self, prompt: str = "") -> None:
        ReasoningParser.__init__(self, prompt)
        self._start()

    def _call(self, name: str, body: str, raw: str) -> Piece:
        return (CONTENT, raw)
