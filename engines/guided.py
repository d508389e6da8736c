"""Constrained decoding for the simulated scheduler, judged by llguidance (one of vLLM's own backends).

A :class:`Guide` wraps the served model's vocabulary (llguidance's ``LLTokenizer`` built from the
``tokenizer.json`` the simulator serves) and compiles a protocol ``Structured`` spec as vLLM 0.32's
guidance backend does (vllm/v1/structured_output/backend_guidance.py: JSON Schema through
llguidance's JSON compiler, ``json_object`` as the schema ``{"type": "object"}``, regexes, Lark or
GBNF grammars (GBNF converted to Lark), a choice as a Lark alternation, a structural tag of the
``{"structures", "triggers"}`` form as llguidance's ``StructTag`` grammar). A spec llguidance
cannot compile is refused with llguidance's own message (:class:`GuideError`).

Decoding (:class:`Decoder`): at every step the matcher's mask says which tokens may follow; one is
drawn with the request's generator (so seeded as the simulator's other draws are), and the request
ends when the matcher is accepting (when nothing else may follow, else with even odds, after
``min_tokens``) or at ``max_tokens``. Draws favour closing brackets and quotes (ever more as the
output grows) and the palette's words so that outputs finish in a few dozen tokens, as a model would
write them, instead of a uniform walk through the vocabulary that would rarely close a string; a JSON
schema is compiled with ``additionalProperties: false`` where it says nothing (vLLM's
``disable_additional_properties``: every output is still valid under the schema as given); whitespace-only tokens are drawn only where nothing
else may follow (JSON's optional whitespace would otherwise fill the output).

Bounds: :data:`LIMITS` caps llguidance's work when compiling (lexer fuel) and at every step (step
fuel, Earley items) and its memory (lexer states, grammar size); a spec over them is refused at
admission, and a matcher that runs out mid-decode ends the request (``stop``), as vLLM's backend does.
"""

from __future__ import annotations

import json
import logging
import random
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenmill.scheduler_client.protocol import Structured

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("tokenmill.simulated_scheduler")

# llguidance's defaults, with memory lowered: each lexer state costs about 1-2 kB, so 50k states stay
# under ~100 MB per spec; fuel is llguidance's unit of work (~50k/ms at compile, ~14k/ms per step)
LIMITS = dict(
    initial_lexer_fuel=1_000_000,  # ~20 ms building the lexer
    step_lexer_fuel=200_000,  # ~15 ms per token
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=200_000,
)
_CACHE_SIZE = 64  # compiled specs kept (a fresh request copies one: no recompilation)
_CLOSERS = '"}])'  # tokens of only these characters end strings, objects, arrays and groups
_P_CLOSER = 0.2  # the odds a draw picks among the allowed closers, rising to 1 over _CLOSE_BY tokens ...
_CLOSE_BY = 48
_P_WORD = 0.6  # ... else those of picking among the allowed palette words
_P_STOP = 0.5  # the odds of stopping where the grammar is complete but could go on

__all__ = ["LIMITS", "Decoder", "Guide", "GuideError"]


def short(message: str, limit: int = 400) -> str:
    """llguidance's message without the parser state and grammar it appends (which can be the whole spec)."""
    head = message.split("\n<state>", 1)[0].split("\n<grammar>", 1)[0].strip()
    return head if len(head) <= limit else head[: limit - 3] + "..."


class GuideError(ValueError):
    """A spec llguidance refuses; ``str()`` is llguidance's message."""


class Guide:
    """The served vocabulary for llguidance, and a small cache of compiled specs."""

    def __init__(self, tokenizer_json: str, vocab_size: int, palette: Iterable[int] = ()) -> None:
        import llguidance  # here, as in the functions below: a simulator loads it at its first structured request

        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size)
        self.vocab_size = self.tokenizer.vocab_size
        self.limits = llguidance.LLParserLimits(**LIMITS)
        never = 0
        for t in self.tokenizer.eos_tokens:  # the end comes from the request's stop token, not a draw
            never |= 1 << t
        self._not_eos = ~never
        closers = blank = 0
        for t in range(self.vocab_size):
            text = self.tokenizer.decode_bytes([t]).decode("utf-8", "replace")
            if text and not text.strip():
                blank |= 1 << t
            elif text and all(c in _CLOSERS for c in text.strip()):
                closers |= 1 << t
        self.closers = closers
        self._not_blank = ~blank
        words = 0
        for t in palette:
            if 0 <= t < self.vocab_size:
                words |= 1 << t
        self.words = words
        self._cache: OrderedDict[tuple, llguidance.LLMatcher | str] = OrderedDict()

    def compile(self, s: Structured) -> llguidance.LLMatcher:
        """A fresh matcher for ``s``; :class:`GuideError` with llguidance's message if it refuses it."""
        import llguidance

        key = (s.kind, s.spec, tuple(s.choices), s.disable_any_whitespace, s.whitespace_pattern)
        found = self._cache.get(key)
        if found is None:
            try:
                grammar = grammar_of(s)
            except (ValueError, KeyError, TypeError) as exc:
                found = f"invalid grammar specification: {short(str(exc))}"
            else:
                matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
                found = f"grammar error: {short(matcher.get_error())}" if matcher.is_error() else matcher
            self._cache[key] = found
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(found, str):
            raise GuideError(found)
        return found.deep_copy()


def grammar_of(s: Structured) -> str:
    """The llguidance grammar of a spec, built as vLLM 0.32's guidance backend builds it (with
    ``disable_additional_properties``)."""
    import llguidance

    kind = s.kind
    if kind in ("json_schema", "json_object"):
        options = {"whitespace_flexible": not s.disable_any_whitespace}
        if s.whitespace_pattern is not None and not s.disable_any_whitespace:
            options["whitespace_pattern"] = s.whitespace_pattern
        schema = _closed(json.loads(s.spec)) if kind == "json_schema" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.grammar_from("regex", s.spec)
    if kind == "grammar":
        return llguidance.grammar_from("grammar", s.spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(s.choices))
    if kind == "structural_tag":
        return _structural_tag(json.loads(s.spec), s)
    raise ValueError(f"unknown kind {kind!r}")


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def _closed(schema, depth: int = 0):
    """A copy of a schema in which objects that name their properties allow no others (unless they say)."""
    if not isinstance(schema, dict) or depth > 64:
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v, depth + 1) for k, v in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], depth + 1)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v, depth + 1) for v in out[key]]
    if "additionalProperties" not in out and isinstance(out.get("properties"), dict):
        out["additionalProperties"] = False
    return out


def _structural_tag(tag: dict, s: Structured) -> str:
    import llguidance

    if "structures" not in tag or "triggers" not in tag:
        raise ValueError(
            'llguidance takes structural tags as {"structures": [{"begin", "schema", "end"}], "triggers": [...]}'
        )
    triggers = tag["triggers"]
    tags = []
    for item in tag["structures"]:
        begin = item["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"trigger {begin} not found in triggers {triggers}")
        schema = item["schema"] if isinstance(item["schema"], str) else json.dumps(item["schema"])
        inner = Structured("json_schema", schema, disable_any_whitespace=s.disable_any_whitespace)
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=grammar_of(inner), end=item["end"]))
    if not tags:
        raise ValueError("no structural tags found in the grammar spec")
    return llguidance.StructTag.to_grammar(tags)


class Decoder:
    """One request's constrained decoding: :meth:`next` draws the next token, or None at the end."""

    __slots__ = ("guide", "matcher", "rng", "min_tokens", "generated")

    def __init__(self, guide: Guide, matcher: llguidance.LLMatcher, rng: random.Random, min_tokens: int) -> None:
        self.guide = guide
        self.matcher = matcher
        self.rng = rng
        self.min_tokens = min_tokens
        self.generated = 0

    def next(self) -> int | None:
        """The next token the spec allows; None when the output is complete (or the matcher gave up)."""
        m = self.matcher
        if m.is_error():
            log.warning("constrained decoding stopped: %s", short(m.get_error()))
            return None
        allowed = int.from_bytes(m.compute_bitmask(), "little") & self.guide._not_eos
        complete = m.is_accepting()
        if complete and (not allowed or (self.generated >= self.min_tokens and self.rng.random() < _P_STOP)):
            return None
        if not allowed:  # not complete, yet nothing may follow: the matcher failed
            log.warning("constrained decoding stopped: %s", short(m.get_error()) or "no token is allowed")
            return None
        rng = self.rng
        pool = allowed & self.guide._not_blank or allowed  # whitespace only where nothing else may follow
        closing = _P_CLOSER + (1 - _P_CLOSER) * min(1.0, self.generated / _CLOSE_BY)
        if rng.random() < closing and pool & self.guide.closers:
            pool &= self.guide.closers
        elif rng.random() < _P_WORD and pool & self.guide.words:
            pool &= self.guide.words
        token = _nth_bit(pool, rng.randrange(pool.bit_count()))
        m.consume_token(token)
        self.generated += 1
        return token


def _nth_bit(x: int, n: int) -> int:
    """The position of the n-th (from 0) set bit of x: halving by popcount, then a short scan."""
    base = 0
    width = x.bit_length()
    while width > 256:
        half = width // 2
        low = x & ((1 << half) - 1)
        count = low.bit_count()
        if n < count:
            x, width = low, half
        else:
            n -= count
            x >>= half
            base += half
            width -= half
    while True:
        lowest = x & -x
        if n == 0:
            return base + lowest.bit_length() - 1
        x ^= lowest
        n -= 1
