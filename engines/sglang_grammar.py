"""SGLang's own grammar backend judges a structured-output spec before the SGLang bridge admits it.

SGLang compiles a constraint in its scheduler, after the request was admitted; a spec its backend
cannot compile ends the request there with an abort ("Failed to compile json grammar: ..."). The bridge
asks first: it builds the backend class SGLang's scheduler builds for the engine's ``grammar_backend``
(xgrammar by default, llguidance, outlines, or one registered with SGLang), once, with the engine's
tokenizer and vocabulary and the engine's JSON whitespace options, and compiles each constrained
request's spec with it through the scheduler's own entry (``get_cached_or_future_value``, which also
refuses NUL bytes), on that backend's thread pool. A refusal is SGLang's message, a 400 naming the
request field. Verdicts are cached (the compiled grammars are dropped); when the cache is full it and
the backend's compiler cache are cleared, so memory stays bounded. Written against SGLang 0.5.23
(sglang/srt/constrained/); tests/engines/test_structured_sglang.py runs the spec table through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import OrderedDict
from typing import Any

log = logging.getLogger("tokenmill.engine.sglang")

#: SGLang's scheduler gives a compile at least SGLANG_GRAMMAR_POLL_INTERVAL (0.005 s) times
#: SGLANG_GRAMMAR_MAX_POLL_ITERATIONS (10,000) before it aborts the request ("timed out"): as long here
COMPILE_TIMEOUT_S = 50.0
MAX_VERDICTS = 512

#: SGLang sampling_params key -> the key type SGLang's GrammarManager compiles it as
_KEY_TYPES = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}


def grammar_key(params: dict[str, Any]) -> tuple[str, str] | None:
    """The (key type, spec) SGLang's scheduler compiles for these sampling params, or None (unconstrained)."""
    for name, key_type in _KEY_TYPES.items():
        if params.get(name) is not None:
            return key_type, params[name]
    return None


def build_backend(server_args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Any) -> Any:
    """The grammar backend SGLang's ``create_grammar_backend`` makes for ``server_args.grammar_backend``
    (None until SGLang resolves it: xgrammar), without the reasoning wrapper (a spec compiles the same).
    SGLang's own factory reads a process-wide config that only a launched engine publishes, so the
    choice of class and its arguments are taken from ``server_args`` here; None for "none"."""
    name = str(getattr(server_args, "grammar_backend", None) or "xgrammar")
    any_whitespace = not getattr(server_args, "constrained_json_disable_any_whitespace", False)
    pattern = getattr(server_args, "constrained_json_whitespace_pattern", None)
    from sglang.srt.constrained import base_grammar_backend as base

    if name in base.GRAMMAR_BACKEND_REGISTRY:
        return base.GRAMMAR_BACKEND_REGISTRY[name](server_args, tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        return XGrammarGrammarBackend(
            tokenizer,
            vocab_size=vocab_size,
            model_eos_token_ids=list(eos_token_ids) if eos_token_ids else None,
            any_whitespace=any_whitespace,
            max_whitespace_cnt=getattr(server_args, "constrained_json_max_whitespace_cnt", None),
        )
    if name == "llguidance":
        from sglang.srt.constrained.llguidance_backend import GuidanceBackend

        return GuidanceBackend(
            tokenizer=tokenizer,
            any_whitespace=any_whitespace,
            whitespace_pattern=pattern,
            n_vocab=vocab_size,
            eos_token_ids=eos_token_ids,
        )
    if name == "outlines":
        from sglang.srt.constrained.outlines_backend import OutlinesGrammarBackend

        return OutlinesGrammarBackend(tokenizer, whitespace_pattern=pattern)
    if name == "none":
        return None
    raise ValueError(f"unknown SGLang grammar backend {name!r}")


class GrammarCheck:
    """One SGLang grammar backend and the verdicts it has given."""

    def __init__(self, backend: Any, timeout_s: float = COMPILE_TIMEOUT_S, max_verdicts: int = MAX_VERDICTS) -> None:
        from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

        self.backend = backend
        self.timeout_s = timeout_s
        self.max_verdicts = max_verdicts
        self._invalid = InvalidGrammarObject
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()

    @classmethod
    def for_engine(cls, engine: Any) -> GrammarCheck | None:
        """The check for a started ``sglang.Engine`` that compiles grammars (it has a tokenizer and a
        grammar backend), else None."""
        server_args = engine.server_args
        manager = engine.tokenizer_manager
        tokenizer = getattr(manager, "tokenizer", None)
        if getattr(server_args, "skip_tokenizer_init", False) or tokenizer is None:
            return None
        config = manager.model_config
        backend = build_backend(server_args, tokenizer, config.vocab_size, getattr(config, "hf_eos_token_id", None))
        return None if backend is None else cls(backend)

    async def refusal(self, params: dict[str, Any]) -> str | None:
        """SGLang's reason to refuse the constraint in ``params`` (its sampling params), or None."""
        key = grammar_key(params)
        if key is None:
            return None
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return self._verdicts[key]
        try:
            verdict = await asyncio.wait_for(self._compile(key), self.timeout_s)
        except TimeoutError:  # remembered, as SGLang's scheduler does (its compile thread runs on)
            verdict = f"Grammar preprocessing timed out after {self.timeout_s:g} s: {key[0]} grammar"
        if len(self._verdicts) >= self.max_verdicts:
            self._verdicts.clear()
            self.backend.reset()  # the compiler's cache of compiled grammars too
        self._verdicts[key] = verdict
        return verdict

    async def _compile(self, key: tuple[str, str]) -> str | None:
        value, _ = self.backend.get_cached_or_future_value(key, False)
        try:
            if isinstance(value, concurrent.futures.Future):
                value = await asyncio.wrap_future(value)
        except Exception as exc:  # SGLang's scheduler turns these into the same abort
            return f"Failed to compile {key[0]} grammar: Grammar compilation failed: {exc}"
        if isinstance(value, self._invalid):
            return f"Failed to compile {key[0]} grammar: {value.error_message}"
        return None


__all__ = ["COMPILE_TIMEOUT_S", "GrammarCheck", "build_backend", "grammar_key"]
