"""Incremental detokenization with stop strings, one state per running request.

``tokenizers.decoders.DecodeStream`` turns each new token into text, holding back
incomplete UTF-8. Stop strings are matched on the text: a possible stop-string prefix
at the end is held back until it is decided, and text from a match on is never sent.
When the request ends, a full decode of all its tokens settles the tail, so the text a
client receives is exactly ``decode(all token ids)`` (cut at the first stop string).
"""

from __future__ import annotations

from collections import OrderedDict

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from scheduler_client.protocol import frame_to_ids
from tokenizer_workers.converter import DetokSpec
from tokenizer_workers.messages import DetokDelta, DetokItem


class _Stream:
    __slots__ = ("stream", "ids", "stop", "hold", "skip_special", "streamed", "pending")

    def __init__(self, spec: DetokSpec):
        self.stream = DecodeStream(skip_special_tokens=spec.skip_special_tokens)
        self.ids: list[int] = []
        self.stop = spec.stop
        self.hold = max((len(s) for s in spec.stop), default=1) - 1
        self.skip_special = spec.skip_special_tokens
        self.streamed = ""  # everything DecodeStream produced (the decode of ids so far)
        self.pending = ""  # produced but not yet sent, because it may start a stop string


class Detokenizer:
    """Holds one _Stream per request; bounded so a leak cannot exhaust a worker."""

    def __init__(self, tokenizer: Tokenizer, max_states: int = 65536):
        self.tokenizer = tokenizer
        self.max_states = max_states
        self.states: OrderedDict[str, _Stream] = OrderedDict()

    def open(self, spec: DetokSpec) -> None:
        self.states[spec.request_id] = _Stream(spec)
        while len(self.states) > self.max_states:
            self.states.popitem(last=False)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def step(self, items: list[DetokItem]) -> list[DetokDelta]:
        out = []
        for item in items:
            state = self.states.get(item.request_id)
            if state is None:  # released, or never opened: tell the gateway it is over
                out.append(DetokDelta(item.request_id, "", False, True))
                continue
            out.append(self._advance(item.request_id, state, item.token_ids, item.finished))
        return out

    def _advance(self, rid: str, state: _Stream, frame: bytes, finished: bool) -> DetokDelta:
        new_ids = frame_to_ids(frame)
        state.ids.extend(new_ids)
        for tid in new_ids:
            try:
                piece = state.stream.step(self.tokenizer, tid)
            except Exception:  # "Invalid prefix" and friends: rebuild from the full decode below
                state.stream = DecodeStream(skip_special_tokens=state.skip_special)
                piece = None
            if piece:
                state.streamed += piece
                state.pending += piece
        if finished:
            full = self.tokenizer.decode(state.ids, skip_special_tokens=state.skip_special)
            if full.startswith(state.streamed):
                state.pending += full[len(state.streamed) :]
        text, stopped = self._cut(state, finished)
        if stopped or finished:
            del self.states[rid]
        return DetokDelta(rid, text, stopped, stopped or finished)

    @staticmethod
    def _cut(state: _Stream, finished: bool) -> tuple[str, bool]:
        pending = state.pending
        if state.stop:
            hits = [i for i in (pending.find(s) for s in state.stop) if i >= 0]
            if hits:
                state.pending = ""
                return pending[: min(hits)], True
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
