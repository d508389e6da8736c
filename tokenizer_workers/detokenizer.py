"""Incremental detokenization with stop strings, one state per running request.

``tokenizers.decoders.DecodeStream`` turns each new token into text, holding back
incomplete UTF-8. Stop strings are matched on the text: a possible stop-string prefix
at the end is held back until it is decided, and text from a match on is never sent.
When the request ends, a full decode of all its tokens settles the tail, so the text a
client receives is exactly ``decode(all token ids)`` (cut at the first stop string).

A request with an output parser (tool calls, reasoning) is decoded with special tokens
kept, so the parser sees its markers even where they are special tokens; special tokens
that are not markers are dropped before decoding when ``skip_special_tokens`` asks for it.
The text then goes through the parser, and the delta carries its pieces in order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict

import msgspec
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tokenmill.scheduler_client.protocol import frame_to_ids
from tokenmill.tokenizer_workers.conversion.plan import DetokSpec
from tokenmill.tokenizer_workers.logprobs import (
    TokenTexts,
    chat_entries,
    completion_lists,
    echo_completion_lists,
    join_lists,
    prompt_logprobs,
    token_id_name,
)
from tokenmill.tokenizer_workers.messages import DetokDelta, DetokItem, OutPiece
from tokenmill.tokenizer_workers.output_parsers import CALL, REASONING, OutputParser

_json = msgspec.json.Encoder()


class _Stream:
    __slots__ = (
        "stream",
        "ids",
        "stop",
        "hold",
        "skip_special",
        "streamed",
        "pending",
        "parser",
        "drop_ids",
        "include_reasoning",
        "parser_name",
        "top_n",
        "chat",
        "text_offset",
        "count",
        "include_stop",
        "tail",
        "tail_len",
        "tokens_as_ids",
        "prefix",
        "show_ids",
        "stop_end",
        "added",
        "last_added",
        "plain",
        "stop_hit",
        "stop_reason_ids",
        "last_token",
        "prompt_top_n",
        "prompt_ids",
        "show_prompt",
        "echo_top_n",
    )

    def __init__(self, spec: DetokSpec, drop_ids: frozenset = frozenset(), added: dict | None = None):
        self.parser: OutputParser | None = spec.parser
        # with a parser, DecodeStream keeps specials and drop_ids does what skip_special_tokens would
        self.skip_special = spec.skip_special_tokens and self.parser is None
        self.drop_ids = drop_ids if self.parser is not None and spec.skip_special_tokens else frozenset()
        self.stream = DecodeStream(skip_special_tokens=self.skip_special)
        self.ids: list[int] = []
        self.stop = spec.stop
        longest = max((len(s) for s in spec.stop), default=1) - 1
        # vLLM's include_stop_str_in_output: nothing is held back (text before a stop string is
        # output either way), and a match is searched for in the sent text's last characters too
        self.include_stop = spec.include_stop and bool(spec.stop)
        self.hold = 0 if self.include_stop else longest
        self.tail = ""  # with include_stop: the last tail_len characters sent
        self.tail_len = longest
        self.streamed = ""  # everything DecodeStream produced (the decode of ids so far)
        self.pending = ""  # produced but not yet sent, because it may start a stop string
        self.include_reasoning = spec.include_reasoning
        self.parser_name = spec.tool_parser_name
        self.top_n = spec.logprobs  # None: no logprobs
        self.tokens_as_ids = spec.tokens_as_ids
        self.prefix = spec.prefix  # completions' echo: goes out with the first text
        self.chat = spec.chat
        self.text_offset = 0  # completions' logprobs.text_offset so far
        self.count = 0  # tokens taken so far, dropped special tokens included (usage in every chunk)
        self.show_ids = spec.token_ids  # vLLM's return_token_ids: each delta says its generated token IDs
        self.stop_end = 0  # where the matched stop string ends, counted from the start of pending
        self.stop_hit: str | None = None  # the stop string that matched (vLLM's stop_reason)
        self.stop_reason_ids = spec.stop_reason_ids  # stop tokens vLLM names in stop_reason
        self.last_token: int | None = None
        # spaces_between_special_tokens false (with skip_special_tokens false): an added token right after
        # another is its bare content, without the space the decoder may put before it (vLLM's fast
        # detokenizer); added: added token ID -> content, else None
        self.added = added
        self.last_added = False
        self.plain = ""  # with added: what DecodeStream produced (streamed holds what was sent)
        # vLLM's prompt_logprobs (show_prompt: the response shows them) and completions' echo with logprobs
        # (echo_top_n: the prompt's top count the engine returns; the legacy logprobs start with the
        # prompt's): the prompt's IDs until the first output has brought their logprobs
        self.prompt_top_n = spec.prompt_logprobs or 0
        self.show_prompt = spec.prompt_logprobs is not None
        self.echo_top_n = spec.echo_logprobs if spec.logprobs is not None else None
        self.prompt_ids = spec.prompt_ids if self.show_prompt or self.echo_top_n is not None else None


class Detokenizer:
    """Holds one _Stream per request; bounded so a leak cannot exhaust a worker."""

    def __init__(self, tokenizer: Tokenizer, max_states: int = 65536):
        self.tokenizer = tokenizer
        self.max_states = max_states
        self.states: OrderedDict[str, _Stream] = OrderedDict()
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._drop_ids: dict[tuple, frozenset] = {}
        self._texts: TokenTexts | None = None  # each token's own text, for logprobs (made on first use)
        self._added: dict[int, str] | None = None  # added token ID -> content (made on first use)
        self.parse_failures: dict[str, int] = {}  # since the last take_failures()

    def open(self, spec: DetokSpec) -> None:
        added = None
        if not spec.spaces_between and not spec.skip_special_tokens:
            if self._added is None:
                self._added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
            added = self._added or None
        drop = frozenset()
        if spec.parser is not None:
            markers = spec.parser.markers
            drop = self._drop_ids.get(markers)
            if drop is None:  # special tokens skip_special_tokens drops, less the parser's markers
                keep = {self.tokenizer.token_to_id(m) for m in markers}
                drop = self._drop_ids[markers] = self.special_ids - keep
        self.states[spec.request_id] = _Stream(spec, drop, added)
        while len(self.states) > self.max_states:
            self.states.popitem(last=False)

    def replay(self, request_id: str, history: bytes, chunks) -> None:
        """Take an opened stream through the token frames another worker answered, in the batches it
        had them (``chunks``: tokens per batch), throwing the output away: the client has it. The
        stream is left exactly as that worker left it (tokenizer_workers/resume.py)."""
        state = self.states[request_id]
        start = 0
        for n in chunks:
            frame = history[start : start + 4 * n]
            start += 4 * n
            if state.prompt_ids is not None:  # the first output brought the prompt's logprobs: no longer needed
                if state.echo_top_n is not None:  # completions' echo: its offsets counted the prompt's text
                    self._skip_echo_offset(state)
                state.prompt_ids = None
            if state.top_n is not None and not state.chat and n:
                texts = self._token_texts()
                names = token_id_name if state.tokens_as_ids else texts
                state.text_offset += sum(len(names(t)) for t in frame_to_ids(frame))
            self._advance(request_id, state, frame, False)
        if start != len(history):
            raise ValueError(f"token history of {len(history)} bytes, but batches of {start} bytes")
        if request_id not in self.states:
            raise ValueError("the token history ends the stream (a stop string matched)")

    def _token_texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.tokenizer)
        return self._texts

    def _skip_echo_offset(self, state: _Stream) -> None:
        texts = self._token_texts()
        first_id = int(state.prompt_ids[0])
        if state.tokens_as_ids:
            names, first = token_id_name, token_id_name(first_id)
        else:
            names, first = texts, self.tokenizer.decode([first_id], skip_special_tokens=False)
        state.text_offset += len(first) + sum(len(names(int(t))) for t in state.prompt_ids[1:])

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def step(self, items: list[DetokItem]) -> list[DetokDelta]:
        out = []
        for item in items:
            state = self.states.get(item.request_id)
            if state is None:  # released (the gateway no longer waits), or never opened here: fail it, not cut it short
                out.append(DetokDelta(item.request_id, "", False, True, error="this worker holds no state for it"))
                continue
            delta = self._advance(item.request_id, state, item.token_ids, item.finished)
            prompt = item.prompt_logprobs if state.prompt_ids is not None else None
            if prompt is not None and self._texts is None:
                self._texts = TokenTexts(self.tokenizer)
            echoed = None  # with echo: the prompt's legacy logprobs, ahead of the first output's
            if prompt is not None and state.echo_top_n is not None:
                echoed = self._echo_logprobs(state, prompt)
            if state.top_n is not None and item.logprobs:
                delta.logprobs = self._logprobs(state, item)
            if echoed is not None:
                delta.logprobs = join_lists(echoed, delta.logprobs)
            if prompt is not None:
                if state.show_prompt:
                    delta.prompt_logprobs = prompt_logprobs(self._texts, state.prompt_top_n, state.prompt_ids, prompt)
                state.prompt_ids = None
            out.append(delta)
        return out

    def _logprobs(self, state: _Stream, item: DetokItem) -> list[bytes]:
        if self._texts is None:
            self._texts = TokenTexts(self.tokenizer)
        arrays = (item.token_ids, item.logprobs, item.top_ids, item.top_logprobs)
        names = token_id_name if state.tokens_as_ids else None
        if state.chat:
            return [chat_entries(self._texts, state.top_n, *arrays, names=names)]
        parts, state.text_offset = completion_lists(names or self._texts, state.top_n, state.text_offset, *arrays)
        return parts

    def _echo_logprobs(self, state: _Stream, packed) -> list[bytes]:
        """The prompt's tokens in the legacy object, as vLLM's echo puts them: the first one named as
        vLLM names a token without logprobs (decoded alone, or its token_id name)."""
        first_id = int(state.prompt_ids[0])
        if state.tokens_as_ids:
            names, first = token_id_name, token_id_name(first_id)
        else:
            names, first = self._texts, self.tokenizer.decode([first_id], skip_special_tokens=False)
        parts, state.text_offset = echo_completion_lists(
            names, first, state.top_n, state.text_offset, state.prompt_ids, state.echo_top_n, packed
        )
        return parts

    def take_failures(self) -> dict[str, int]:
        out, self.parse_failures = self.parse_failures, {}
        return out

    def _advance(self, rid: str, state: _Stream, frame: bytes, finished: bool) -> DetokDelta:
        raw = new_ids = frame_to_ids(frame)
        state.count += len(new_ids)
        if len(raw):
            state.last_token = int(raw[-1])
        if state.drop_ids:
            new_ids = [t for t in new_ids if t not in state.drop_ids]
        # with stop strings: where each new token's text ends, to tell which token completed a stop
        # string (vLLM counts no token generated after it in the same step, and shows none of their IDs)
        ends = [] if state.stop else None
        state.ids.extend(new_ids)
        for tid in new_ids:
            try:
                piece = state.stream.step(self.tokenizer, tid)
            except Exception:  # "Invalid prefix" and friends: rebuild from the full decode below
                state.stream = DecodeStream(skip_special_tokens=state.skip_special)
                piece = None
            if state.added is not None:
                state.plain += piece or ""
                content = state.added.get(tid)
                if content is not None and state.last_added:
                    piece = content
                state.last_added = content is not None
            if piece:
                state.streamed += piece
                state.pending += piece
            if ends is not None:
                ends.append(len(state.streamed))
        settled = 0  # text the final decode added (what the stream held back)
        if finished:
            full = self.tokenizer.decode(state.ids, skip_special_tokens=state.skip_special)
            decoded = state.streamed if state.added is None else state.plain
            rest = full[len(decoded) :]
            # The bytes of a character the output ended inside decode to U+FFFD: vLLM's detokenizer never
            # shows them (its stream holds them back, and nothing flushes it at the end), so neither do we.
            if full.startswith(decoded) and rest.strip("\ufffd"):
                settled = len(rest)
                state.pending += rest
        pending_start = len(state.streamed) + settled - len(state.pending)
        text, stopped = self._cut(state, finished)
        if stopped and ends:
            ends[-1] += settled
            # keep the tokens up to the one whose text reaches the end of the stop string
            kept = bisect_left(ends, pending_start + state.stop_end) + 1
            if len(new_ids) != len(raw):  # dropped special tokens made no text: find the kept-th decoded one
                decoded, cut = 0, len(raw)
                for k, tid in enumerate(raw):
                    decoded += tid not in state.drop_ids
                    if decoded == kept:
                        cut = k + 1
                        break
                kept = cut
            state.count -= len(raw) - kept  # usage counts them no more than vLLM does
            raw = raw[:kept]
        shown = None
        if state.show_ids:
            shown = _json.encode(raw.tolist() if hasattr(raw, "tolist") else raw)[1:-1]
        prefix = ""
        if state.prefix:  # after the stop strings: they are looked for in the generated text only, as vLLM does
            prefix, state.prefix = state.prefix, ""
            if state.parser is None:
                text, prefix = prefix + text, ""
        reason = None
        if stopped or finished:
            del self.states[rid]
            if stopped:
                reason = state.stop_hit
            elif state.last_token is not None and state.last_token in state.stop_reason_ids:
                reason = state.last_token  # a stop token ended it (the engine stops at once on one)
        if state.parser is None:
            return DetokDelta(
                rid, text, stopped, stopped or finished, tokens=state.count, token_ids=shown, stop_reason=reason
            )
        pieces = self._parse(state, text, stopped or finished)
        if prefix:  # chat's echo is content, ahead of what the parser makes of the output
            pieces.insert(0, OutPiece("content", prefix))
        return DetokDelta(
            rid, "", stopped, stopped or finished, pieces, tokens=state.count, token_ids=shown, stop_reason=reason
        )

    def _parse(self, state: _Stream, text: str, last: bool) -> list[OutPiece]:
        parser = state.parser
        pieces = parser.feed(text) if text else []
        if last:
            pieces += parser.finish()
            if parser.failures:
                name = state.parser_name
                self.parse_failures[name] = self.parse_failures.get(name, 0) + parser.failures
        out = []
        for kind, value in pieces:
            if kind == CALL:
                out.append(OutPiece(kind, value.arguments, value.name, value.id or "", value.index))
            elif kind != REASONING or state.include_reasoning:
                out.append(OutPiece(kind, value))
        return out

    @staticmethod
    def _cut(state: _Stream, finished: bool) -> tuple[str, bool]:
        pending = state.pending
        if state.include_stop:
            return Detokenizer._cut_after(state, pending)
        if state.stop:
            hits = [(i, i + len(s)) for s, i in ((s, pending.find(s)) for s in state.stop) if i >= 0]
            if hits:
                state.pending = ""
                start, state.stop_end = min(hits)
                state.stop_hit = pending[start : state.stop_end]
                return pending[:start], True
        if finished or not state.hold:
            state.pending = ""
            return pending, False
        # keep back the longest tail that could still grow into a stop string
        keep = 0
        for s in state.stop:
            for k in range(min(len(s) - 1, len(pending)), keep, -1):
                if s.startswith(pending[-k:]):
                    keep = k
                    break
        cut = len(pending) - keep
        state.pending = pending[cut:]
        return pending[:cut], False

    @staticmethod
    def _cut_after(state: _Stream, pending: str) -> tuple[str, bool]:
        """include_stop_str_in_output: the text up to the end of the stop string that ends first
        (the first in the list among equals), as vLLM's check_stop_strings picks it."""
        state.pending = ""
        if not pending:
            return "", False
        text = state.tail + pending
        end = -1
        for s in state.stop:
            i = text.find(s)
            if i >= 0 and (end < 0 or i + len(s) < end):
                end = i + len(s)
                state.stop_hit = s
        if end >= 0:
            state.stop_end = end - len(state.tail)
            return text[len(state.tail) : end], True
        state.tail = text[-state.tail_len :] if state.tail_len else ""
        return pending, False
