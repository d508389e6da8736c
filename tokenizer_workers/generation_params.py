"""What an OpenAI request asks of generation, as scheduler-protocol fields, checked before it leaves.

Sampling (min_p, repetition_penalty, min_tokens, logit_bias), constrained decoding
(response_format, vLLM's structured_outputs and guided_* fields, and the schema a forced
tool_choice implies, built as vLLM builds it), logprobs and n. Everything is validated here, in
the worker: an invalid schema, regex or grammar, a token ID outside the vocabulary or a value out
of range is a 400 naming the field, and so is a field the connected engine did not list among the
protocol 1.1 features it honours (a 1.0 scheduler would ignore it without a word).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from tokenmill.scheduler_client import protocol
from tokenmill.scheduler_client.structured import StructuredError, whitespace_problem
from tokenmill.scheduler_client.structured import check as check_structured
from tokenmill.tokenizer_workers.openai_requests import InvalidRequest
from tokenmill.tokenizer_workers.output_parsers.base import functions as tool_functions

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit, and vLLM's default max_logprobs
# vLLM 0.32's limits on bad_words after tokenization (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024
# vLLM 0.32's validate_cache_salt
MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")

# structured_outputs keys that choose the constraint (vLLM's StructuredOutputsParams), and the kind each means
_STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
    "structural_tag": "structural_tag",
}
# structured_outputs keys that are options of the constraint (protocol 1.2's Structured fields)
_STRUCTURED_OPTIONS = {
    "disable_any_whitespace": protocol.FEATURE_DISABLE_ANY_WHITESPACE,
    "whitespace_pattern": protocol.FEATURE_WHITESPACE_PATTERN,
}
# vLLM's guided_* fields (older releases) and the kind each means
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class Engine:
    """What the connected engine said it honours (its Welcome, relayed to the workers as Limits)."""

    def __init__(self, features: list[str] | None = None, max_logprobs: int | None = None) -> None:
        self.features = frozenset(features or ())
        self.known = features is not None  # None: a 1.0 scheduler, or none connected yet
        self.max_logprobs = max_logprobs if max_logprobs is not None else MAX_LOGPROBS

    def require(self, feature: str, param: str, what: str) -> None:
        if feature not in self.features:
            why = "does not say it can" if self.known else "speaks scheduler protocol 1.0, which cannot carry it"
            raise InvalidRequest(
                f"{what} is not available: the engine behind this server {why} ({feature}).", param, code="unsupported"
            )


def sampling(
    req, engine: Engine, vocab_size: int, max_tokens: int | None, defaults: dict | None = None
) -> protocol.SamplingParams:
    """The request's sampling settings; the 1.1 ones only when set, and only if the engine has them.

    ``defaults``: the model's generation_config.json values (temperature, top_p, top_k, min_p,
    repetition_penalty) for the ones the request leaves out, as vLLM's servers apply them."""
    defaults = defaults or {}

    def given(name: str, fallback):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    top_k = given("top_k", 0)
    params = protocol.SamplingParams(
        temperature=float(given("temperature", 1.0)),
        top_p=float(given("top_p", 1.0)),
        top_k=0 if top_k in (None, -1) else int(top_k),
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
    )
    min_p = given("min_p", None)
    if min_p is not None and min_p != 0:
        if not 0.0 <= min_p <= 1.0:
            raise InvalidRequest("min_p must be between 0 and 1.", "min_p")
        engine.require("min_p", "min_p", "min_p")
        params.min_p = float(min_p)
    repetition_penalty = given("repetition_penalty", None)
    if repetition_penalty is not None and repetition_penalty != 1:
        if not (0.0 < repetition_penalty <= 2.0):
            raise InvalidRequest("repetition_penalty must be greater than 0 and at most 2.", "repetition_penalty")
        engine.require("repetition_penalty", "repetition_penalty", "repetition_penalty")
        params.repetition_penalty = float(repetition_penalty)
    if req.min_tokens:
        if req.min_tokens < 0:
            raise InvalidRequest("min_tokens must be at least 0.", "min_tokens")
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens"
            )
        engine.require("min_tokens", "min_tokens", "min_tokens")
        params.min_tokens = req.min_tokens
    if req.logit_bias:
        params.logit_bias = _logit_bias(req.logit_bias, vocab_size)
        engine.require("logit_bias", "logit_bias", "logit_bias")
    return params


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token IDs, got {key!r}.", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias has token ID {token}, outside the vocabulary [0, {vocab_size}).", "logit_bias"
            )
        if not (isinstance(value, (int, float)) and math.isfinite(value) and -100 <= value <= 100):
            raise InvalidRequest(
                f"logit_bias values must be between -100 and 100, got {value!r} for {token}.", "logit_bias"
            )
        out[token] = float(value)
    return out


def token_masks(req, engine: Engine, tokenizer, vocab_size: int, params: protocol.SamplingParams) -> None:
    """allowed_token_ids and bad_words (protocol 1.2) into ``params``, checked as vLLM 0.32 checks them."""
    allowed = req.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise InvalidRequest("allowed_token_ids must not be empty.", "allowed_token_ids")
        bad = [t for t in allowed if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(
                f"allowed_token_ids has token IDs outside the vocabulary [0, {vocab_size}): {bad[:10]}.",
                "allowed_token_ids",
            )
        engine.require("allowed_token_ids", "allowed_token_ids", "allowed_token_ids")
        params.allowed_token_ids = list(allowed)
    if req.bad_words:
        params.bad_words = bad_words_ids(req.bad_words, tokenizer, vocab_size)
        engine.require("bad_words", "bad_words", "bad_words")


def bad_words_ids(words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """The token sequences vLLM 0.32 bans for ``bad_words`` (SamplingParams.update_from_tokenizer):
    each word (duplicates dropped, leading whitespace stripped) encoded without special tokens as it
    stands, and once more after a space when that gives a different first token and as many tokens
    (the word in mid-text, for tokenizers that mark a preceding space)."""
    if any(not w for w in words):
        raise InvalidRequest("bad_words cannot contain an empty string.", "bad_words")
    out: list[list[int]] = []
    for word in dict.fromkeys(words):
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
        if not bare:
            raise InvalidRequest(
                f"bad_words entries must tokenize to at least one token; {word!r} does not.", "bad_words"
            )
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
        if len(out) > MAX_BAD_WORDS:
            raise InvalidRequest(
                f"Too many bad words after tokenization: {len(out)}. The max number is {MAX_BAD_WORDS}.", "bad_words"
            )
    outside = [t for seq in out for t in seq if not 0 <= t < vocab_size]
    if outside:
        raise InvalidRequest(
            f"bad_words tokenize to token IDs outside the vocabulary [0, {vocab_size}): {outside[:10]}.", "bad_words"
        )
    total = sum(len(seq) for seq in out)
    if total > MAX_BAD_WORDS_TOKENS:
        raise InvalidRequest(
            f"Too many total bad word tokens: {total}. The max is {MAX_BAD_WORDS_TOKENS}.", "bad_words"
        )
    return out


def priority(req, engine: Engine) -> int:
    """vLLM's priority (lower is scheduled earlier): a signed 64-bit integer; a non-zero one needs an
    engine that schedules by priority."""
    value = req.priority
    if value is None or value == 0:
        return 0
    if isinstance(value, bool) or not -(2**63) <= value < 2**63:
        raise InvalidRequest("priority must be a signed 64-bit integer.", "priority")
    engine.require(protocol.FEATURE_PRIORITY, "priority", "priority")
    return value


def cache_salt(req, engine: Engine) -> str | None:
    """vLLM 0.32's cache_salt: a non-empty string of at most 128 characters without '@', '/', '\\' or NUL."""
    salt = req.cache_salt
    if salt is None:
        return None
    if not salt:
        raise InvalidRequest("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise InvalidRequest(
            f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters and must "
            "not contain '@', '/', '\\', or NUL.",
            "cache_salt",
        )
    engine.require(protocol.FEATURE_CACHE_SALT, "cache_salt", "cache_salt")
    return salt


def prompt_logprobs(req, chat: bool, engine: Engine, vocab_size: int) -> int | None:
    """Generate.prompt_logprobs (protocol 1.2), checked as vLLM 0.32 checks it: -1 (the whole vocabulary)
    or at least 0, at most the engine's max_logprobs, and not with stream (0 excepted, which shows
    nothing there). Without it, echo asks for as many as the output's logprobs (vLLM's default: chat's
    top_logprobs, completions' logprobs); that implicit ask goes to the engine only if it can, and
    streamed responses carry no prompt logprobs, so then none are asked for."""
    value = req.prompt_logprobs
    explicit = value is not None
    if explicit:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest("`prompt_logprobs` must be an integer.", "prompt_logprobs")
        if req.stream and (value > 0 or value == -1):
            raise InvalidRequest("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if value < -1:
            raise InvalidRequest("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    elif req.echo:
        value = (req.top_logprobs or 0) if chat else req.logprobs
        if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
    else:
        return None
    count = vocab_size if value == -1 else value
    if explicit:
        if count > engine.max_logprobs:
            raise InvalidRequest(
                f"Requested prompt logprobs of {count}, which is greater than max allowed: {engine.max_logprobs}",
                "prompt_logprobs",
            )
        if req.stream:
            return None
        engine.require(protocol.FEATURE_PROMPT_LOGPROBS, "prompt_logprobs", "prompt_logprobs")
    elif req.stream or protocol.FEATURE_PROMPT_LOGPROBS not in engine.features or count > engine.max_logprobs:
        return None
    return count


def echo_prompt_logprobs(req, engine: Engine, vocab_size: int) -> int | None:
    """Completions' echo with logprobs: the prompt's logprobs the engine must return for the legacy object,
    which shows the prompt's tokens ahead of the generated ones (vLLM sets prompt_logprobs from logprobs
    when the request has none). Asked of every choice, streamed or not; an engine without the feature
    cannot give them, so the request is refused there, naming echo."""
    if not req.echo or req.logprobs is None:
        return None
    value = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs
    engine.require(protocol.FEATURE_PROMPT_LOGPROBS, "echo", "echo with logprobs (the prompt's logprobs)")
    return vocab_size if value == -1 else value


def kv_transfer_params(req, engine: Engine) -> dict | None:
    """vLLM's kv_transfer_params (protocol 1.2): any JSON object, for the engine's KV connector; an empty
    one is not passed on (vLLM's ``if self.kv_transfer_params``)."""
    value = req.kv_transfer_params
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("kv_transfer_params must be an object.", "kv_transfer_params")
    if not value:
        return None
    engine.require(protocol.FEATURE_KV_TRANSFER_PARAMS, "kv_transfer_params", "kv_transfer_params")
    return value


def _xarg(value) -> bool:
    """A vllm_xargs value vLLM's model takes (str | int | float); a bool is an int to pydantic."""
    if isinstance(value, int):
        return -(2**63) <= value < 2**64  # vLLM's _verify_extra_args: what msgpack carries
    return isinstance(value, (str, float))


def extra_args(req, engine: Engine) -> dict | None:
    """vLLM's vllm_xargs (protocol 1.2 extra_args): an object whose values are strings, numbers or lists
    of those, passed to the engine as they are (vLLM's SamplingParams.extra_args); empty: not passed."""
    value = req.vllm_xargs
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("vllm_xargs must be an object.", "vllm_xargs")
    out = {}
    for key, item in value.items():
        if isinstance(item, list) and all(_xarg(v) for v in item) or _xarg(item):
            out[key] = (
                [int(v) if isinstance(v, bool) else v for v in item]
                if isinstance(item, list)
                else int(item)
                if isinstance(item, bool)
                else item
            )
        else:
            raise InvalidRequest(
                f"vllm_xargs.{key} must be a string, a number, or a list of those (integers between "
                "-2**63 and 2**64 - 1).",
                f"vllm_xargs.{key}",
            )
    if not out:
        return None
    engine.require(protocol.FEATURE_EXTRA_ARGS, "vllm_xargs", "vllm_xargs")
    return out


def logprobs(req, chat: bool, engine: Engine) -> int | None:
    """Generate.logprobs: None (none asked), 0 (the chosen tokens'), or the top-N count."""
    if chat:
        top = req.top_logprobs
        if req.logprobs not in (None, True, False):
            raise InvalidRequest("logprobs must be true or false.", "logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}.", "top_logprobs")
        if top and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true.", "top_logprobs")
        count, param = (top or 0, "top_logprobs") if req.logprobs else (None, "logprobs")
    else:
        value = req.logprobs
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be an integer between 0 and {MAX_LOGPROBS}.", "logprobs")
        count, param = value, "logprobs"
    if count is None:
        return None
    engine.require(protocol.FEATURE_LOGPROBS, "logprobs", "logprobs")
    if count > engine.max_logprobs:
        raise InvalidRequest(f"{param} must be at most {engine.max_logprobs} on this engine.", param)
    return count


def structured(req, engine: Engine) -> tuple[protocol.Structured | None, dict[str, str]]:
    """The output constraint asked for by response_format, structured_outputs or guided_*, and the request
    fields behind its Generate fields ("structured", "structured.whitespace_pattern"): what an engine's
    refusal of one names in its 400."""
    found: list[tuple[str, str, protocol.Structured]] = []  # (field, the part of it holding the spec, spec)
    rf = req.response_format
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            where = "response_format.json_schema.schema" if spec.kind == "json_schema" else "response_format"
            found.append(("response_format", where, spec))
    options: dict[str, tuple[str, Any]] = {}  # the constraint's whitespace options (protocol 1.2) -> (field, value)
    if req.structured_outputs is not None:
        key, spec, options = _structured_outputs(req.structured_outputs)
        found.append(("structured_outputs", f"structured_outputs.{key}", spec))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, name, _spec(kind, value, name)))
    pattern = req.guided_whitespace_pattern  # older vLLM's name for structured_outputs.whitespace_pattern
    if pattern is not None:
        if "whitespace_pattern" in options:
            raise InvalidRequest(
                "Give structured_outputs.whitespace_pattern or guided_whitespace_pattern, not both.",
                "guided_whitespace_pattern",
            )
        _whitespace_pattern(pattern, "guided_whitespace_pattern")
        options["whitespace_pattern"] = ("guided_whitespace_pattern", pattern)
    if not found:
        return None, {}  # a whitespace pattern without a constraint shapes nothing (older vLLM dropped it too)
    if len(found) > 1:
        raise InvalidRequest(f"Give one output constraint, not {' and '.join(f[0] for f in found)}.", found[1][0])
    param, where, spec = found[0]
    validate(spec, param, engine, where)
    for name, feature in _STRUCTURED_OPTIONS.items():
        if name in options:
            field, value = options[name]
            engine.require(feature, field, field)
            setattr(spec, name, value)
    fields = {"structured": where}
    if "whitespace_pattern" in options:
        fields["structured.whitespace_pattern"] = options["whitespace_pattern"][0]
    return spec, fields


def validate(spec: protocol.Structured, param: str, engine: Engine, where: str | None = None) -> None:
    """A 400 naming ``where`` (the spec's place in the request) for an invalid spec; then one naming
    ``param`` if the engine cannot honour this kind."""
    where = where or param
    try:
        check_structured(spec, where)
    except StructuredError as exc:
        raise InvalidRequest(str(exc), where) from None
    engine.require(f"structured.{spec.kind}", param, f"{param} ({spec.kind})")


def _response_format(rf: dict) -> protocol.Structured | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return protocol.Structured("json_object")
    if kind == "json_schema":
        body = rf.get("json_schema")
        if not isinstance(body, dict):
            raise InvalidRequest(
                "response_format.json_schema must be an object with a schema.", "response_format.json_schema"
            )
        schema = body.get("schema", body.get("json_schema"))
        if schema is None:
            raise InvalidRequest("response_format.json_schema.schema is missing.", "response_format.json_schema.schema")
        return _spec("json_schema", schema, "response_format.json_schema.schema")
    if kind == "structural_tag":
        return protocol.Structured("structural_tag", json.dumps(rf, ensure_ascii=False))
    raise InvalidRequest(
        f"response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}.",
        "response_format.type",
    )


def _structured_outputs(so: dict) -> tuple[str, protocol.Structured, dict[str, tuple[str, Any]]]:
    """(the key holding the constraint, its spec, the whitespace options set -> (field, value)); the
    options stay off the spec until it has been validated."""
    chosen = [key for key in _STRUCTURED_KEYS if so.get(key) not in (None, False)]
    others = [
        key
        for key, value in so.items()
        if key not in _STRUCTURED_KEYS and key not in _STRUCTURED_OPTIONS and value not in (None, False)
    ]
    if others:
        raise InvalidRequest(
            f"structured_outputs.{others[0]} is not supported by this server: the engine's "
            "constrained-decoding backend decides it.",
            f"structured_outputs.{others[0]}",
        )
    if len(chosen) != 1:
        raise InvalidRequest(
            "structured_outputs must set exactly one of " + ", ".join(_STRUCTURED_KEYS) + ".", "structured_outputs"
        )
    key = chosen[0]
    spec = _spec(_STRUCTURED_KEYS[key], so[key], f"structured_outputs.{key}")
    options: dict[str, tuple[str, Any]] = {}
    if "disable_any_whitespace" in so:  # vLLM's StructuredOutputsParams field: a bool (null is refused too)
        value = so["disable_any_whitespace"]
        if not isinstance(value, bool):
            raise InvalidRequest(
                "structured_outputs.disable_any_whitespace must be a boolean.",
                "structured_outputs.disable_any_whitespace",
            )
        if value:
            options["disable_any_whitespace"] = ("structured_outputs.disable_any_whitespace", True)
    pattern = so.get("whitespace_pattern")
    if pattern is not None:
        _whitespace_pattern(pattern, "structured_outputs.whitespace_pattern")
        options["whitespace_pattern"] = ("structured_outputs.whitespace_pattern", pattern)
    return key, spec, options


def _whitespace_pattern(pattern: Any, param: str) -> None:
    """A 400 naming ``param`` unless ``pattern`` is a string (as vLLM's pydantic model checks) holding a
    regex of the dialect structured ``regex`` specs use (the engine compiles it into its JSON grammar)."""
    if not isinstance(pattern, str):
        raise InvalidRequest(f"{param} must be a string.", param)
    problem = whitespace_problem(pattern)
    if problem is not None:
        raise InvalidRequest(f"{param}: {problem}", param)


def _spec(kind: str, value: Any, param: str) -> protocol.Structured:
    if kind == "json_object":
        return protocol.Structured("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{param} must be a non-empty list of strings.", param)
        return protocol.Structured("choice", choices=list(value))
    if kind in ("json_schema", "structural_tag"):
        if isinstance(value, str):
            return protocol.Structured(kind, value)
        if isinstance(value, (dict, bool)):
            return protocol.Structured(kind, json.dumps(value, ensure_ascii=False))
        raise InvalidRequest(f"{param} must be a JSON schema (an object, or its JSON text).", param)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string.", param)
    return protocol.Structured(kind, value)


# ---- forced tool calls -----------------------------------------------------------------


def forced_tools(req, engine: Engine) -> tuple[protocol.Structured | None, str | None]:
    """For tool_choice "required" or a named function: the JSON schema the output must follow (as
    vLLM builds it) and what the worker's parser reads ("" for required, else the function name).
    (None, None) for "auto" and "none"."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None, None
    if choice != "required" and not isinstance(choice, dict):
        raise InvalidRequest(
            f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}.", "tool_choice"
        )
    functions = tool_functions(req.tools)
    if not functions:
        raise InvalidRequest("tool_choice needs tools: none were given.", "tool_choice")
    if choice == "required":
        items = []
        defs: dict[str, Any] = {}
        for fn in functions:
            params = copy.deepcopy(fn.get("parameters")) or None
            if isinstance(params, dict) and "$defs" in params:
                more = params.pop("$defs")
                if not isinstance(more, dict):
                    raise InvalidRequest(f"$defs in the parameters of tool {fn['name']!r} must be an object.", "tools")
                for name, schema in more.items():
                    if name in defs and defs[name] != schema:
                        raise InvalidRequest(f"Tools define {name!r} in $defs differently.", "tools")
                    defs[name] = schema
            items.append(
                {
                    "properties": {
                        "name": {"type": "string", "enum": [fn["name"]]},
                        "parameters": params or {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        forced = ""
    else:
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise InvalidRequest(
                "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}.",
                "tool_choice",
            )
        match = next((f for f in functions if f["name"] == name), None)
        if match is None:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
        schema = match.get("parameters") or {"type": "object", "properties": {}}
        forced = name
    spec = protocol.Structured("json_schema", json.dumps(schema, ensure_ascii=False))
    validate(spec, "tool_choice", engine)
    return spec, forced
