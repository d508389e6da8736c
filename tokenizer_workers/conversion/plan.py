"""The step every generating kind ends in: rendered, tokenized prompts and the request's checked
generation fields become the scheduler's Generate frames, the gateway's ChoicePlans and the
detokenizer's specs."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from tokenmill.scheduler_client import protocol
from tokenmill.tokenizer_workers import generation_params as gp
from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers.messages import ChoicePlan, CompletionShape, ConvertDone, ConvertJob, Timing
from tokenmill.tokenizer_workers.output_parsers import OutputParser

if TYPE_CHECKING:
    from tokenmill.tokenizer_workers.conversion.core import ConverterCore
    from tokenmill.tokenizer_workers.images.pipeline import ProcessedImage

_json = msgspec.json.Encoder()


@dataclass
class DetokSpec:
    """What the detokenizer needs to stream one scheduler request's text."""

    request_id: str
    stop: list[str] = field(default_factory=list)
    _: KW_ONLY  # the rest by name: a field added in the middle must not shift the others' meaning
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the text ends with the stop string
    skip_special_tokens: bool = True
    parser: OutputParser | None = None  # tool calls and reasoning, for chat requests that use them
    include_reasoning: bool = True
    tool_parser_name: str = ""
    logprobs: int | None = None  # None: no logprobs; else how many top tokens to show per token
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    prefix: str = ""  # echo (completions: the prompt; chat: the last message), sent before the first generated text
    chat: bool = True  # logprobs in chat's shape, else in completions'
    token_ids: bool = False  # vLLM's return_token_ids: each delta carries its generated token IDs
    spaces_between: bool = True  # vLLM's spaces_between_special_tokens (has effect only without skip_special_tokens)
    # the request's stop_token_ids that vLLM names in stop_reason when one ends the choice (the model's EOS
    # is not named unless ignore_eos)
    stop_reason_ids: frozenset = frozenset()
    # vLLM's prompt_logprobs: how many top tokens per prompt position (None: not asked), and the prompt's
    # token IDs (the engine's prompt), whose own entries head each position's
    prompt_logprobs: int | None = None
    prompt_ids: Any = None
    # completions' echo with logprobs: the prompt's top count the engine returns (None: no echo logprobs);
    # the legacy logprobs then start with the prompt's tokens (the first one without a logprob)
    echo_logprobs: int | None = None
    # how ``parser`` was made (ParserChoice.make's arguments), so another worker can make it again when
    # the stream moves there (tokenizer_workers/resume.py)
    parser_recipe: tuple | None = None


@dataclass
class Conversion:
    """A converted request: the answer to the gateway, and for generating kinds the frames it forwards
    and the specs the worker's detokenizer opens."""

    done: ConvertDone
    frames: list[bytes] = field(default_factory=list)  # per choice: Generate header, prompt tokens
    detok: list[DetokSpec] = field(default_factory=list)


@dataclass
class GenerateFields:
    """The request's fields that every Generate header of its choices carries, each checked and in
    its protocol form (generation_params.py), and how many choices each prompt gets."""

    sampling: protocol.SamplingParams
    structured: protocol.Structured | None
    logprobs: int | None
    n: int
    max_tokens: int | None
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    kv_transfer_params: dict | None = None
    extra_args: dict | None = None
    adapter: str | None = None  # the LoRA adapter the request's model names (None: the base model)


@dataclass
class RenderedPrompts:
    """A request's prompts, rendered and tokenized, and what came with them."""

    ids: list  # each prompt's token IDs (a chat request has one)
    what: str  # "messages" (chat: logprobs in chat's shape) or "prompt" (completions): errors name it
    timing: Timing
    echo: list[str] | None = None  # per prompt, the text sent before its generated text
    echo_logprobs: int | None = None  # completions' echo with logprobs: the prompt's top count
    images: list[tuple[protocol.ImageItem, ProcessedImage]] = ()


def default_max_tokens(cv: ConverterCore, room: int) -> int:
    """A request without max_tokens: the rest of the context, or the model's generation_config
    max_new_tokens where smaller (as vLLM's servers have it)."""
    configured = cv.sampling_defaults.get("max_new_tokens")
    return min(room, int(configured)) if isinstance(configured, int) and configured > 0 else room


def generate_fields(cv: ConverterCore, req, max_tokens: int | None, spec, chat: bool) -> GenerateFields:
    """The request's generation fields as protocol values, every one checked (generation_params.py)."""
    if not 1 <= req.n <= cv.settings.max_n:
        raise oa.InvalidRequest(f"n must be between 1 and {cv.settings.max_n}.", "n")
    sampling = gp.sampling(req, cv.engine, cv.vocab_size, max_tokens, cv.sampling_defaults)
    gp.token_masks(req, cv.engine, cv.tokenizer, cv.vocab_size, sampling)
    return GenerateFields(
        sampling,
        spec,
        gp.logprobs(req, chat, cv.engine),
        req.n,
        max_tokens,
        priority=gp.priority(req, cv.engine),
        cache_salt=gp.cache_salt(req, cv.engine),
        prompt_logprobs=gp.prompt_logprobs(req, chat, cv.engine, cv.vocab_size),
        kv_transfer_params=gp.kv_transfer_params(req, cv.engine),
        extra_args=gp.extra_args(req, cv.engine),
        adapter=cv.adapter_of(req.model),
    )


def truncation(cv: ConverterCore, req) -> tuple[int | None, bool]:
    """vLLM's truncate_prompt_tokens: (how many prompt tokens to keep, or None; keep the last ones?).
    As vLLM: -1 is as many as the context holds with one token left for the output, more than
    the context is a 400, and the side is truncation_side, else the left (generative models'
    default). 0 would leave nothing to generate from, and is a 400 too."""
    keep = req.truncate_prompt_tokens
    side = req.truncation_side
    if side not in (None, "left", "right"):
        raise oa.InvalidRequest("truncation_side must be either 'left' or 'right'.", "truncation_side")
    if keep is None:
        return None, True
    limit = cv.max_model_len
    if keep == -1:
        keep = limit - 1
    elif keep < 1:
        raise oa.InvalidRequest(
            f"truncate_prompt_tokens must be -1 (as many as fit) or at least 1, got {keep}.",
            "truncate_prompt_tokens",
        )
    elif keep > limit:
        raise oa.InvalidRequest(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len={limit}. "
            "Please request a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    return keep, side != "right"


def plan(cv: ConverterCore, job: ConvertJob, req, fields: GenerateFields, prompts: RenderedPrompts) -> Conversion:
    """Scheduler requests for each prompt, n apiece (prompt-major, as vLLM numbers its choices):
    choices of one prompt share its token frame, and choice i samples with seed + i as vLLM does.
    The prompt's logprobs are asked once per prompt (its other choices show the first one's), but of
    every choice with echo_logprobs (completions' echo with logprobs: each choice's legacy logprobs
    start with the prompt's, which must arrive with its own first output)."""
    if req.stop_token_ids:
        cv.check_token_ids(req.stop_token_ids, "stop_token_ids")  # one the model cannot emit is a mistake
    stop_ids = ([] if req.ignore_eos else list(cv.model.eos_token_ids)) + list(req.stop_token_ids or [])
    named_stops = frozenset(req.stop_token_ids or ()) - frozenset(() if req.ignore_eos else cv.model.eos_token_ids)
    stops = oa.stop_strings(req)
    seed = fields.sampling.seed
    max_tokens, what = fields.max_tokens, prompts.what
    echo, echo_logprobs, images = prompts.echo, prompts.echo_logprobs, prompts.images
    keep, left = truncation(cv, req)
    choices, frames, detok = [], [], []
    by_hash = bool(images) and protocol.FEATURE_IMAGES_BY_HASH in cv.engine.features
    # each image's frame: its pixels, or empty for one the engine holds or maps from shared memory
    pixel_frames, ways = [], []
    for item, image in images:
        frame, item.shm, way = cv.images.engine_frame(image, by_hash)
        pixel_frames.append(frame)
        ways.append(way)
    prompt_ids = [] if req.return_token_ids else None
    for p, ids in enumerate(prompts.ids):
        if keep is not None and len(ids) > keep:
            ids = ids[len(ids) - keep :] if left else ids[:keep]
        n = len(ids)
        limit = cv.max_model_len
        if n + (max_tokens or 0) > limit or n >= limit:
            asked = n + (max_tokens or 0)
            raise oa.InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested {asked} tokens "
                f"({n} in the {what}, {max_tokens or 0} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                what,
                code="context_length_exceeded",
            )
        if n == 0:
            raise oa.InvalidRequest(f"The {what} is empty after tokenization.", what)
        prompt_frame = protocol.ids_to_frame(ids)
        if prompt_ids is not None:  # the IDs the engine gets (truncated), as vLLM returns them
            prompt_ids.append(_json.encode(ids.tolist() if hasattr(ids, "tolist") else ids))
        for i in range(fields.n):
            rid = f"{job.request_id}-{len(choices)}"
            shown = fields.prompt_logprobs if i == 0 else None  # the response's prompt_logprobs
            sampling = fields.sampling
            if i and seed is not None:
                sampling = msgspec.structs.replace(sampling, seed=_wrap_seed(seed + i))
            header = protocol.Generate(
                request_id=rid,
                prompt_token_count=n,
                max_new_tokens=max_tokens if max_tokens is not None else default_max_tokens(cv, limit - n),
                sampling=sampling,
                stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos,
                logprobs=fields.logprobs,
                structured=fields.structured,
                priority=fields.priority,
                cache_salt=fields.cache_salt,
                prompt_logprobs=echo_logprobs if echo_logprobs is not None else shown,
                kv_transfer_params=fields.kv_transfer_params,
                extra_args=fields.extra_args,
                images=[item for item, _ in images],
                adapter=fields.adapter,
            )
            choices.append(ChoicePlan(rid, n, i == 0))
            frames.append(protocol.encode(header))
            frames.append(prompt_frame)
            frames += pixel_frames
            detok.append(
                DetokSpec(
                    rid,
                    stops,
                    include_stop=bool(req.include_stop_str_in_output),
                    skip_special_tokens=req.skip_special_tokens,
                    logprobs=fields.logprobs,
                    tokens_as_ids=bool(req.return_tokens_as_token_ids),
                    chat=what == "messages",
                    prefix=echo[p] if echo else "",
                    token_ids=bool(req.return_token_ids),
                    spaces_between=req.spaces_between_special_tokens is not False,
                    stop_reason_ids=named_stops,
                    prompt_logprobs=shown,
                    prompt_ids=ids if shown is not None or echo_logprobs is not None else None,
                    echo_logprobs=echo_logprobs,
                )
            )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    done = ConvertDone(
        job.job_id,
        choices=choices,
        stream=req.stream,
        client_request_id=req.request_id,
        adapter=fields.adapter,
        timing=prompts.timing,
        completion=CompletionShape(
            include_usage=include_usage,
            # as vLLM: continuous_usage_stats counts only with include_usage
            continuous_usage=include_usage and req.stream_options.continuous_usage_stats,
            logprobs=fields.logprobs is not None,
            prompt_token_ids=prompt_ids,
            token_ids=bool(req.return_token_ids),
            prompt_logprobs=fields.prompt_logprobs is not None,
            kv_transfer_params=fields.kv_transfer_params is not None,
        ),
        frames_per_choice=2 + len(images),
        images_by_hash=[image.content_hash for _, image in images] if any(w != "pixels" for w in ways) else [],
        images_shm=ways.count("shm") * len(choices),
    )
    return Conversion(done, frames, detok)


def _wrap_seed(seed: int) -> int:
    """seed + i stays a signed 64-bit integer."""
    return (seed + 2**63) % 2**64 - 2**63
