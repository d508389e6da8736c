"""OpenAI-style request bodies as msgspec Structs, with the range checks OpenAI and vLLM apply.

Fields OpenAI or vLLM define that this server cannot honour are refused unless they hold their
default (request_fields.py); fields nobody here defines are ignored, as vLLM does, so other
vendors' extensions keep working.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from tokenmill.tokenizer_workers.request_fields import RefusableFields, refused_field


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every streamed chunk


class SamplingFields(RefusableFields):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool | None = None  # vLLM's: a matched stop string stays in the text
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None  # vLLM's: false joins adjacent added tokens without a space
    logprobs: Any = None  # chat: a bool; completions: the number of top tokens (0-20)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:N"
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the generated token IDs in the response
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token ID (as a JSON key) -> bias
    # constrained decoding: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: Any = None  # older vLLM's structured_outputs.whitespace_pattern
    # vLLM's: keep N of the prompt's tokens (-1: as many as fit), the last N unless truncation_side "right"
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    request_id: str | None = None  # vLLM's: the response's id is chatcmpl-/cmpl- and this (X-Request-Id wins)
    # vLLM's, passed to the engine (protocol 1.2)
    priority: int | None = None  # lower is scheduled earlier
    cache_salt: str | None = None  # isolates the prompt's prefix-cache entries
    allowed_token_ids: list[int] | None = None  # only these may be generated
    bad_words: list[str] | None = None  # never generated (tokenized in the worker, as vLLM does)
    prompt_logprobs: Any = None  # the prompt's logprobs (-1: the whole vocabulary), in the whole response
    kv_transfer_params: Any = None  # for the engine's KV connector (disaggregated prefill)
    vllm_xargs: Any = None  # engine-specific extra arguments (vLLM's SamplingParams.extra_args)


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call, as vLLM keeps
    # OpenAI's deprecated forms of tools and tool_choice (vLLM ignores them; tokenmill maps them as OpenAI)
    functions: list[Any] | None = None
    function_call: Any = None
    top_logprobs: int | None = None
    include_reasoning: bool = True  # vLLM's: false drops the reasoning from the response
    # passed to the chat template (gpt-oss's and others' read it); vLLM 0.32's values
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool | None = False  # vLLM's: the last message's content first, when it has the answer's role


class CompletionRequest(SamplingFields):
    # a string, a list of strings, a list of token IDs, or a list of lists of token IDs
    prompt: str | list[Any] | None = None
    echo: bool | None = False  # the prompt's text before the completion's (as vLLM: the prompt as given)
    suffix: str | None = None  # fill in the middle: the text after the completion (models with FIM markers)


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


REQUEST_TYPES = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
}
DECODERS = {kind: msgspec.json.Decoder(t) for kind, t in REQUEST_TYPES.items()}


class InvalidRequest(Exception):
    """A 4xx answer: message, param (the offending field) and status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


_BLANK = re.compile(rb"\s*")  # what bytes.strip() strips, matched in place (a body may be a view into a read)


def is_blank(body: bytes | memoryview) -> bool:
    return _BLANK.fullmatch(body) is not None


def parse(kind: str, body: bytes | memoryview):
    return decode(DECODERS[kind], body)


def decode(decoder: msgspec.json.Decoder, body: bytes | memoryview):
    """A request body decoded into its Struct; a refusal names the field msgspec found wrong (every API's
    body goes through here: chat, completions, Anthropic Messages, Responses)."""
    if is_blank(body):
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = None
        if " - at `$." in text:
            text, _, where = text.partition(" - at `$.")
            param = where.rstrip("`")
        elif text.startswith("Expected `object`"):
            text = "The request body must be a JSON object"
        raise InvalidRequest(f"Invalid request: {text}" + (f" (field '{param}')" if param else ""), param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None


def check_sampling(req: SamplingFields) -> None:
    """Refused fields, then range checks (OpenAI's limits; vLLM's top_k convention)."""
    refused = refused_field(req)
    if refused is not None:
        name, reason = refused
        raise InvalidRequest(f"{name} is not supported by this server: {reason}.", name)
    if req.stream_options is not None and not req.stream:  # as vLLM and OpenAI refuse it
        raise InvalidRequest("stream_options can only be set when stream is true.", "stream_options")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequest("temperature must be between 0 and 2.", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequest("top_p must be in (0, 1].", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise InvalidRequest("top_k must be -1 (disabled), 0 (disabled) or positive.", "top_k")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise InvalidRequest(f"{name} must be between -2 and 2.", name)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(s == "" for s in stops):
        raise InvalidRequest("stop strings must not be empty.", "stop")
    if req.stop_token_ids and any(t < 0 for t in req.stop_token_ids):
        raise InvalidRequest("stop_token_ids must be non-negative token IDs.", "stop_token_ids")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:  # a signed 64-bit integer, as OpenAI and vLLM take
        raise InvalidRequest("seed is out of range.", "seed")


def stop_strings(req: SamplingFields) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
