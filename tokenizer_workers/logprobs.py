"""Logprobs in OpenAI's shapes, built in the worker from the scheduler's packed arrays.

The scheduler sends, per generated token, the chosen token's logprob and the top N (IDs and
logprobs, best first) as float32/uint32 bytes; the gateway forwards them untouched. Here they
become JSON fragments the gateway splices into its chunks without looking inside: for chat, the
entries of ``logprobs.content``; for completions, the four parallel lists of the legacy object.

The details follow vLLM's server, so a client sees the same bytes from both on the same engine:
a token's text is the token decoded alone (with a SentencePiece word marker's space put back),
``bytes`` is that text's UTF-8 (a partial character is U+FFFD's three bytes), logprobs below
-9999 are -9999, and the top list is the chosen token followed by the top N, each token once, cut
to N for chat (N + 1 for completions, which OpenAI defines as "the top N and the chosen one").
"""

from __future__ import annotations

import msgspec

from tokenmill.scheduler_client.protocol import bytes_to_floats, frame_to_ids
from tokenmill.tokenizer_workers.model import tokenizer_part

_json = msgspec.json.Encoder()
_FLOOR = -9999.0


class TokenTexts:
    """Each token's text, decoded alone, cached (bounded) per worker."""

    def __init__(self, tokenizer, max_entries: int = 1 << 16) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._cache: dict[int, str] = {}
        self.marker = _space_marker(tokenizer)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) or ""
            if self.marker:
                raw = self.tokenizer.id_to_token(token_id) or ""
                spaces = len(raw) - len(raw.lstrip(self.marker))
                missing = spaces - (len(text) - len(text.lstrip(" ")))
                if missing > 0:
                    text = " " * missing + text
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
            self._cache[token_id] = text
        return text


def _space_marker(tokenizer) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer ("▁"), else None."""
    try:
        pre = tokenizer_part(tokenizer.pre_tokenizer)
    except Exception:
        return None
    for part in [pre, *(pre.get("pretokenizers") or [])]:
        if isinstance(part, dict) and part.get("type") == "Metaspace":
            return part.get("replacement", "▁")
    return None


def _steps(token_ids: bytes, logprobs: bytes, top_ids: bytes, top_logprobs: bytes):
    """(chosen ID, its logprob, {ID: logprob} of the chosen token then the top N in order) per token."""
    ids = frame_to_ids(token_ids)
    lps = bytes_to_floats(logprobs)
    tops = frame_to_ids(top_ids)
    top_lps = bytes_to_floats(top_logprobs)
    per = len(tops) // len(ids) if ids else 0
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        ranked = {tid: lp}
        for j in range(i * per, (i + 1) * per):
            ranked[tops[j]] = top_lps[j]
        yield tid, ranked[tid], ranked  # the chosen token's value as its top entry has it, as vLLM reads it


def token_id_name(token_id: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids names it."""
    return f"token_id:{token_id}"


def chat_entries(
    texts: TokenTexts, top_n: int, token_ids: bytes, logprobs: bytes, top_ids: bytes, top_logprobs: bytes, names=None
) -> bytes:
    """The ``logprobs.content`` entries of these tokens, comma-joined (no brackets). ``names``
    (return_tokens_as_token_ids) names the tokens instead of their text; as in vLLM, the chosen
    token's ``bytes`` stay its text's, the top entries' are their names'."""
    entries = []
    names = names or texts
    for tid, lp, ranked in _steps(token_ids, logprobs, top_ids, top_logprobs):
        text = texts(tid)
        top = []
        if top_n:
            for other, other_lp in list(ranked.items())[:top_n]:
                other_text = names(other)
                top.append(
                    {
                        "token": other_text,
                        "logprob": max(other_lp, _FLOOR),
                        "bytes": list(other_text.encode("utf-8", "replace")),
                    }
                )
        entries.append(
            {
                "token": names(tid),
                "logprob": max(lp, _FLOOR),
                "bytes": list(text.encode("utf-8", "replace")),
                "top_logprobs": top,
            }
        )
    return _json.encode(entries)[1:-1]


def completion_lists(
    texts: TokenTexts, top_n: int, offset: int, token_ids: bytes, logprobs: bytes, top_ids: bytes, top_logprobs: bytes
) -> tuple[list[bytes], int]:
    """[text_offset, token_logprobs, tokens, top_logprobs] fragments of these tokens, and the
    text offset after them (offsets count the tokens' own texts, as vLLM's do)."""
    return _legacy_lists(texts, top_n, offset, _steps(token_ids, logprobs, top_ids, top_logprobs))


def _legacy_lists(texts, top_n: int, offset: int, steps, first: str | None = None) -> tuple[list[bytes], int]:
    """The legacy object's four fragments of these steps; ``first``: a token without logprobs ahead of
    them (the prompt's first, with echo), null in token_logprobs and top_logprobs as vLLM has it."""
    offsets, lps, tokens, tops = [], [], [], []
    if first is not None:
        offsets.append(offset)
        offset += len(first)
        lps.append(None)
        tokens.append(first)
        tops.append(None)
    for tid, lp, ranked in steps:
        text = texts(tid)
        offsets.append(offset)
        offset += len(text)
        lps.append(max(lp, _FLOOR))
        tokens.append(text)
        tops.append({texts(other): max(other_lp, _FLOOR) for other, other_lp in list(ranked.items())[: top_n + 1]})
    return [_json.encode(part)[1:-1] for part in (offsets, lps, tokens, tops)], offset


def _prompt_steps(prompt_ids, top_n: int, packed):
    """(prompt token ID, its logprob, {ID: logprob} of it then the top N) per prompt position after the
    first, as vLLM's prompt logprob maps hold them (the prompt token first, keeping its place when it
    is among the top)."""
    lps = bytes_to_floats(packed.logprobs)
    tops = frame_to_ids(packed.top_ids)
    top_lps = bytes_to_floats(packed.top_logprobs)
    positions = min(len(lps), max(len(prompt_ids) - 1, 0))
    per = top_n if top_n and len(tops) >= positions * top_n and len(top_lps) >= positions * top_n else 0
    for i in range(positions):
        tid = int(prompt_ids[i + 1])
        ranked = {tid: lps[i]}
        for k in range(i * per, (i + 1) * per):
            ranked[tops[k]] = top_lps[k]
        yield tid, ranked[tid], ranked


def echo_completion_lists(
    texts, first: str, top_n: int, offset: int, prompt_ids, prompt_top_n: int, packed
) -> tuple[list[bytes], int]:
    """Completions' echo with logprobs: the legacy object's fragments of the prompt's tokens (vLLM puts
    them ahead of the generated ones): ``first`` (the first prompt token's name) with null logprobs,
    then each later prompt token with its logprob and the top ``top_n`` + 1 of its position's map, whose
    ``prompt_top_n`` entries came from the engine (``packed``, PromptLogprobs); and the offset after."""
    return _legacy_lists(texts, top_n, offset, _prompt_steps(prompt_ids, prompt_top_n, packed), first)


def join_lists(first: list[bytes], then: list[bytes] | None) -> list[bytes]:
    """Two runs of legacy fragments as one (comma-joined where both have items)."""
    if not then:
        return first
    return [a + b"," + b if a and b else a or b for a, b in zip(first, then)]


def prompt_logprobs(texts: TokenTexts, top_n: int, prompt_ids, packed) -> bytes:
    """vLLM's ``prompt_logprobs`` as JSON: null for the first prompt token, then per position a map of
    token ID -> {logprob, rank, decoded_token}: the prompt token first (its rank in the vocabulary), then
    the top ``top_n`` (ranks 1..N; the prompt token keeps its place when it is among them). Logprobs
    below -9999 are -9999 (vLLM's clamp_prompt_logprobs); decoded_token is the token decoded alone."""
    lps = bytes_to_floats(packed.logprobs)
    ranks = frame_to_ids(packed.ranks)
    tops = frame_to_ids(packed.top_ids)
    top_lps = bytes_to_floats(packed.top_logprobs)
    positions = min(len(lps), len(ranks), max(len(prompt_ids) - 1, 0))
    per = top_n if top_n and len(tops) >= positions * top_n and len(top_lps) >= positions * top_n else 0
    out: list = [None]
    for i in range(positions):
        tid = prompt_ids[i + 1]
        entry = {str(tid): {"logprob": max(lps[i], _FLOOR), "rank": ranks[i], "decoded_token": texts(tid)}}
        for k in range(per):
            other = tops[i * per + k]
            entry[str(other)] = {
                "logprob": max(top_lps[i * per + k], _FLOOR),
                "rank": k + 1,
                "decoded_token": texts(other),
            }
        out.append(entry)
    return _json.encode(out)
