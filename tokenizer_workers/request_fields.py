"""Every request field of OpenAI's chat/completions APIs and vLLM's extensions, and what tokenmill
does with it: honoured, accepted without effect on the output, or refused with a 400 naming it.

A client that asks for JSON must not get prose without a word, so a field this server cannot
honour is refused unless it holds its default value (``response_format: {"type": "text"}``,
``logit_bias: {}``, ``min_p: 0``, ...), which many client libraries send on every request.
Fields not listed here (another vendor's extensions) are ignored, as vLLM ignores them.
docs/api/request-fields.md is this table for people; a test keeps the two in step and sends every
refused field to a running server.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec


def _none(value) -> bool:
    return value is None


def _false(value) -> bool:
    return value is None or value is False


def _empty(value) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _equals(default) -> Callable[[Any], bool]:
    return lambda value: value is None or (not isinstance(value, bool) and value == default)


def _text_modalities(value) -> bool:
    return value is None or value == ["text"]


_STRUCTURED = "use structured_outputs (json, regex, choice, grammar, structural_tag) or response_format"

# field -> (holds its default?, why a non-default value is refused)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "structural_tag": (_none, _STRUCTURED),
    "guided_decoding_backend": (_none, "the engine chooses its constrained-decoding backend"),
    "logits_processors": (_none, "custom logits processors cannot cross the scheduler protocol"),
    "best_of": (_equals(1), "only one sequence per choice is generated"),
    "use_beam_search": (_false, "beam search is not available"),
    "length_penalty": (_equals(1), "beam search is not available"),
    "prediction": (_none, "predicted outputs are not available"),
    "audio": (_none, "audio output is not available"),
    "modalities": (_text_modalities, "only text output"),
    "web_search_options": (_none, "web search is not available"),
    "verbosity": (_none, "the model's verbosity cannot be set"),
    "mm_processor_kwargs": (_none, "multimodal input is not available"),
}

# accepted, with no effect on the output (bookkeeping OpenAI keeps on its side)
IGNORED = {
    "user": "an end-user id for the provider's abuse monitoring",
    "safety_identifier": "the same, under its new name",
    "metadata": "tags for OpenAI's stored completions",
    "store": "OpenAI's stored completions",
    "service_tier": "OpenAI's billing tier",
    "prompt_cache_key": "a hint for OpenAI's prompt cache",
}


# the refused fields, decoded as they come so they can be checked; a base of the request Structs
RefusableFields = msgspec.defstruct("RefusableFields", [(name, Any, None) for name in REFUSED])


def refused_field(req: RefusableFields) -> tuple[str, str] | None:
    """(field, reason) of the first field holding a value this server cannot honour, else None."""
    for name, (is_default, reason) in REFUSED.items():
        if not is_default(getattr(req, name)):
            return name, reason
    return None
