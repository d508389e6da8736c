"""The vLLM backend: ``vllm.v1.engine.async_llm.AsyncLLM`` fed with token IDs.

The engine is built with ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., ...))``.
``AsyncLLM`` is an asyncio client of vLLM's engine-core process and is meant to be driven
from one event loop, concurrently: every request is one ``generate({"prompt_token_ids": ids},
SamplingParams(..., detokenize=False, output_kind=RequestOutputKind.DELTA), request_id)``
async generator on the engine server's own loop, and ``abort(request_id)`` cancels it inside
the engine (so does closing the generator early: AsyncLLM aborts a request whose generator is
cancelled or closed).

**The tokenizer.** Prompts go in as token IDs and ``detokenize=False`` keeps vLLM from
decoding outputs, so vLLM would need no tokenizer at all — except for structured outputs:
vLLM's grammar backends (xgrammar, guidance, outlines) build their token masks from the
tokenizer's vocabulary and vLLM refuses ``structured_outputs`` under ``skip_tokenizer_init``.
The bridge therefore lets vLLM load the model's tokenizer (``skip_tokenizer_init=False``, the
default; it costs a second at start-up and nothing per request). ``--engine-arg
skip_tokenizer_init=true`` starts vLLM without one (for a checkpoint without tokenizer files);
the engine then does not offer the ``structured.*`` features.

Sampling parameters (docs/engines/tokenmill-engine.md has the table) map one to one: temperature (0 is
greedy), top_p, top_k (0 -> -1, "disabled"), seed (per request), presence/frequency
penalties, ``max_new_tokens`` -> ``max_tokens``, ``stop_token_ids``; protocol 1.1's min_p,
repetition_penalty, min_tokens (capped at max_tokens), logit_bias, ``logprobs`` ->
``logprobs`` (with ``flat_logprobs``) and ``structured`` -> ``structured_outputs``
(StructuredOutputsParams: json, json_object, regex, grammar, choice, structural_tag). The
bridge always sets ``ignore_eos=True``: the front end already put the model's EOS IDs into
``stop_token_ids`` (unless the client asked for ``ignore_eos``), and vLLM's ``ignore_eos``
leaves ``stop_token_ids`` working, so the request stops exactly at ``stop_token_ids`` as the
protocol says. vLLM's own validation errors (prompt too long, a token ID outside the
vocabulary, a parameter out of range, a schema its grammar backend cannot compile) become
protocol errors carrying the request_id and, where vLLM names it, the field at fault.

Protocol 1.2: ``priority`` -> ``AsyncLLM.generate(..., priority=)`` (the feature is listed only when
vLLM schedules by priority, ``--engine-arg scheduling_policy=priority``: with its default "fcfs"
vLLM 0.32 accepts a priority and ignores it), ``cache_salt`` -> the prompt dict's ``cache_salt``
(vLLM mixes it into the first block's prefix-cache hash), ``allowed_token_ids`` ->
``allowed_token_ids``, and ``bad_words`` (token sequences the front end tokenized as vLLM's
``SamplingParams.update_from_tokenizer`` does) -> the sequences vLLM bans
(``SamplingParams._bad_words_token_ids``; the ``bad_words`` strings stay empty, so vLLM does not
tokenize anything again), ``prompt_logprobs`` -> ``prompt_logprobs`` (vLLM's RequestOutput.prompt_logprobs
of the first output, flat or per-position dicts, become the protocol's packed arrays),
``kv_transfer_params`` and ``extra_args`` -> ``SamplingParams.extra_args`` as vLLM's OpenAI server
builds it (the extra args, with ``kv_transfer_params`` beside them), and the finished output's
``kv_transfer_params`` (its KV connector's) go back in the final RequestOutput. The
``kv_transfer_params`` feature is listed only with a KV connector (``--engine-arg
kv_transfer_config=...``): without one vLLM 0.32 takes the field and ignores it.
``Structured.disable_any_whitespace`` and ``whitespace_pattern`` -> StructuredOutputsParams' fields of
those names, but vLLM 0.32's grammar backends read neither per request: xgrammar and guidance
compile JSON without optional whitespace only when the engine's ``structured_outputs_config`` says
``disable_any_whitespace`` (and vLLM allows that only with one of those two backends), and nothing
reads ``whitespace_pattern``. So the ``structured.disable_any_whitespace`` feature is listed only with
``--engine-arg structured_outputs_config='{"backend": "xgrammar", "disable_any_whitespace": true}'``
(then every JSON output is compact, which honours a request with or without it), and
``structured.whitespace_pattern`` never.

Images (1.2 ``images``): each item's pixel frame becomes a torch tensor over the frame's own memory
(no copy) and the request goes in as vLLM's prebuilt multimodal input, ``vllm.inputs.mm_input``
(prompt IDs with the placeholders already expanded, ``MultiModalKwargsItems`` of ``pixel_values`` and
``image_grid_thw`` built with the same field layout as vLLM's Qwen2-VL processor, one
``PlaceholderRange`` per item, and the item's ``content_hash`` as its ``mm_hash``). Before it is added,
the items go through vLLM's own processor-cache sender (``InputProcessor.inject_into_mm_cache``): an
item whose hash the engine core already holds travels to it as a reference, not as pixels, as in
vLLM's own server. The feature is listed only for a model whose vLLM implementation reads the
``qwen2_vl`` family (Qwen2-VL, Qwen2.5-VL), and only with vLLM's default ``mm_device_do_normalize``
on: the workers send uint8 pixels, resized and patched but not rescaled or normalised, the array
vLLM's own processor hands its engine in that mode, and the model rescales and normalises them on the
device with its own ``image_mean`` / ``image_std``. Only ``uint8`` items are taken; a ``float32``
(already normalised) item is refused with ``param`` ``images``, since the device would normalise it
a second time.

Logprobs are vLLM's (its default ``logprobs_mode`` "raw_logprobs": the model's distribution
before temperature, penalties, logit_bias and grammar masks, as vLLM's own server returns
them): per position, the sampled token's logprob and the top N in vLLM's rank order.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.engines import engine_kwargs, require
from tokenmill.engines.bridge import Backend, Chunk, EngineInfo, EngineLoad, EngineRejected, EngineRequest
from tokenmill.scheduler_client import shared_pixels
from tokenmill.scheduler_client.protocol import (
    ERR_IMAGE_MISSING,
    FEATURE_DISABLE_ANY_WHITESPACE,
    FEATURE_IMAGES,
    FEATURE_IMAGES_BY_HASH,
    FEATURE_IMAGES_SHM,
    FEATURE_KV_TRANSFER_PARAMS,
    FEATURE_PRIORITY,
    FEATURE_WHITESPACE_PATTERN,
    FEATURES,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    SHM_DIR,
    STRUCTURED_FEATURES,
    STRUCTURED_OPTION_FEATURES,
    Structured,
)

log = logging.getLogger("tokenmill.engine.vllm")

VLLM_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}

# vLLM model classes that take the ``qwen2_vl`` family's pixel_values / image_grid_thw as they are
QWEN2_VL_ARCHITECTURES = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})


def vllm_multimodal_prompt(request: EngineRequest) -> dict[str, Any]:
    """The request as ``vllm.inputs.mm_input``: its token IDs, and its images' pixels (tensors over the
    pixel frames, no copy; None for an item sent by hash alone), grids, placeholder ranges and content hashes."""
    import warnings

    import torch
    from vllm.inputs import mm_input
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems, PlaceholderRange

    items, hashes, ranges = [], [], []
    for i, (image, buffer) in enumerate(request.images):
        if image.family != "qwen2_vl" or len(image.shape) != 2 or len(image.grid_thw) != 3:
            raise EngineRejected(f"images[{i}]: this engine reads the qwen2_vl family only", param="images")
        if image.dtype != "uint8":
            raise EngineRejected(
                f"images[{i}]: this engine takes uint8 pixels (vLLM normalises them on the device), not {image.dtype}",
                param="images",
            )
        t, h, w = image.grid_thw
        if t * h * w != image.shape[0]:
            raise EngineRejected(
                f"images[{i}]: grid_thw {image.grid_thw} does not match shape {image.shape}", param="images"
            )
        hashes.append(image.content_hash)
        ranges.append(PlaceholderRange(offset=image.offset, length=image.length))
        if not len(buffer):  # images.by_hash: the engine core holds it (checked by the caller)
            items.append(None)
            continue
        with warnings.catch_warnings():  # the frame is read-only; vLLM only reads it
            warnings.simplefilter("ignore", UserWarning)
            pixels = torch.frombuffer(buffer, dtype=torch.uint8).view(*image.shape)
        fields = {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", torch.tensor([image.shape[0]])),
            "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }
        hf = {"pixel_values": pixels, "image_grid_thw": torch.tensor([image.grid_thw])}
        items.append(MultiModalKwargsItems.from_hf_inputs(hf, fields)["image"][0])
    return mm_input(
        request.prompt,
        MultiModalKwargsItems({"image": items}),
        {"image": hashes},
        {"image": ranges},
        cache_salt=request.cache_salt,
    )


def vllm_sampling_params(**kwargs: Any):
    """vLLM's SamplingParams for token-ID streaming: no detokenization, delta outputs.

    ``structured_outputs`` comes as a dict of StructuredOutputsParams keywords."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = kwargs.pop("structured_outputs", None)
    if structured is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
    if "flat_logprobs" in kwargs and "flat_logprobs" not in getattr(SamplingParams, "__struct_fields__", ()):
        del kwargs["flat_logprobs"]  # an older vLLM: per-position dicts, which convert_logprobs reads too
    bad_words = kwargs.pop("bad_words_token_ids", None)
    params = SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA, **kwargs)
    if bad_words:
        # The front end tokenized bad_words as vLLM's update_from_tokenizer does; vLLM keeps the token
        # sequences in this field (its sampler bans their last tokens), and leaves it alone when
        # ``bad_words`` (the strings) is empty. It travels to the engine core with the rest.
        params._bad_words_token_ids = [list(seq) for seq in bad_words]
    return params


def structured_outputs(structured: Structured) -> dict[str, Any]:
    """A protocol Structured as StructuredOutputsParams keywords (the constraint and its options)."""
    options: dict[str, Any] = {}
    if structured.disable_any_whitespace:
        options["disable_any_whitespace"] = True
    if structured.whitespace_pattern is not None:
        options["whitespace_pattern"] = structured.whitespace_pattern
    return {**_constraint(structured), **options}


def _constraint(structured: Structured) -> dict[str, Any]:
    kind = structured.kind
    if kind == "json_schema":
        return {"json": structured.spec}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "regex":
        return {"regex": structured.spec}
    if kind == "grammar":
        return {"grammar": structured.spec}
    if kind == "choice":
        return {"choice": list(structured.choices)}
    if kind == "structural_tag":
        return {"structural_tag": structured.spec}
    raise EngineRejected(f"unknown structured kind {kind!r}", param="structured")


def convert_logprobs(positions, token_ids, top_n: int) -> tuple[list[float], list[int], list[float]]:
    """vLLM's sample logprobs of some positions -> (chosen logprobs, top IDs, top logprobs), top N per
    position flattened in vLLM's rank order.

    ``positions`` is a FlatLogprobs (``flat_logprobs=True``: per position, the entries from
    ``start_indices[i]`` to ``end_indices[i]`` are the sampled token, then ranks 1..N, or, for a position
    that vLLM merged from several deltas, the sampled token, then the ranks it is not) or a list of
    ``{token_id: Logprob(logprob, rank, decoded_token)}`` dicts (the sampled token's entry merged
    with its top-N entry when it is among them)."""
    chosen: list[float] = []
    ids: list[int] = []
    values: list[float] = []
    if positions is None:
        return chosen, ids, values
    starts = getattr(positions, "start_indices", None)
    if starts is not None:
        flat_ids, flat_values, flat_ranks = positions.token_ids, positions.logprobs, positions.ranks
        for start, end in zip(starts, positions.end_indices, strict=True):
            chosen.append(flat_values[start])
            if top_n:
                entries = range(start + 1, end)
                if len(entries) < top_n:
                    # A position that went through a dict on the way (vLLM's RequestOutput.add merges a slow
                    # consumer's deltas that way) holds the sampled token once, with its top-N rank.
                    entries = sorted(range(start, end), key=flat_ranks.__getitem__)
                for i in entries[:top_n]:
                    ids.append(flat_ids[i])
                    values.append(flat_values[i])
        return chosen, ids, values
    for token, position in zip(token_ids, positions, strict=False):
        chosen.append(position[token].logprob)
        if top_n:
            for token_id, entry in sorted(position.items(), key=lambda item: item[1].rank)[:top_n]:
                ids.append(token_id)
                values.append(entry.logprob)
    return chosen, ids, values


def convert_prompt_logprobs(positions, prompt, top_n: int):
    """vLLM's RequestOutput.prompt_logprobs -> (logprobs, ranks, top IDs, top logprobs) for prompt positions
    1 .. len(prompt) - 1, top N per position flattened in rank order.

    ``positions`` is a FlatLogprobs (its first position empty; then per position the prompt token, then
    ranks 1..N) or a list (None first, then ``{token_id: Logprob(logprob, rank, decoded_token)}`` dicts,
    the prompt token's entry merged with its top-N entry when it is among them)."""
    values: list[float] = []
    ranks: list[int] = []
    ids: list[int] = []
    tops: list[float] = []
    starts = getattr(positions, "start_indices", None)
    if starts is not None:
        flat_ids, flat_values, flat_ranks = positions.token_ids, positions.logprobs, positions.ranks
        for start in starts[1:]:
            values.append(flat_values[start])
            ranks.append(int(flat_ranks[start]))
            if top_n:
                ids.extend(flat_ids[start + 1 : start + 1 + top_n])
                tops.extend(flat_values[start + 1 : start + 1 + top_n])
        return values, ranks, ids, tops
    for token, position in zip(prompt[1:], list(positions)[1:], strict=False):
        own = position[token]
        values.append(own.logprob)
        ranks.append(int(own.rank))
        if top_n:
            for token_id, entry in sorted(position.items(), key=lambda item: item[1].rank)[:top_n]:
                ids.append(token_id)
                tops.append(entry.logprob)
    return values, ranks, ids, tops


def extra_args(request: EngineRequest) -> dict[str, Any] | None:
    """SamplingParams.extra_args as vLLM's OpenAI server builds it: vllm_xargs, and kv_transfer_params beside."""
    out = dict(request.extra_args or {})
    if request.kv_transfer_params:
        out["kv_transfer_params"] = request.kv_transfer_params
    return out or None


# vLLM's names for the fields its validation errors name (VLLMValidationError.parameter) -> the protocol's
# (also what its HTTP server's error bodies give as "param": engines/http_backend.py)
VLLM_PARAMS = {
    "logprobs": "logprobs",
    "allowed_token_ids": "sampling.allowed_token_ids",
    "bad_words": "sampling.bad_words",
    "cache_salt": "cache_salt",
    "prompt_logprobs": "prompt_logprobs",
    "extra_args": "extra_args",
    "max_tokens": "max_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "structured_outputs": "structured",
    **{
        name: f"sampling.{name}"
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "logit_bias",
        )
    },
}
_STRUCTURED_WORDS = (
    "structured",
    "grammar",
    "schema",
    "regex",
    "json",
    "choice",
    "structural",
    "trigger",
    "xgrammar",
    "guidance",
)


def _param_of(exc: BaseException, request: EngineRequest) -> str | None:
    """The protocol field a vLLM validation error is about, when it says (or, for a constrained request
    whose error speaks of grammars or schemas, "structured")."""
    param = getattr(exc, "parameter", None)
    if param in VLLM_PARAMS:
        return VLLM_PARAMS[param]
    if request.structured is not None and any(w in str(exc).lower() for w in _STRUCTURED_WORDS):
        return "structured"
    return None


def _is_client_error(exc: BaseException) -> bool:
    """vLLM's request-validation errors (VLLMClientError/VLLMValidationError, ValueError in older versions)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, (ValueError, TypeError)) or bool(names & {"VLLMClientError", "VLLMValidationError"})


class VLLMBackend(Backend):
    """vLLM's AsyncLLM on the engine server's event loop."""

    name = "vllm"

    def __init__(
        self,
        *,
        engine: Any = None,
        engine_args: dict[str, Any] | None = None,
        engine_factory: Callable[[dict[str, Any]], Any] | None = None,
        make_sampling_params: Callable[..., Any] | None = None,
        label: str | None = None,
    ) -> None:
        args = dict(engine_args or {})
        args.setdefault("skip_tokenizer_init", False)  # structured outputs need vLLM's tokenizer
        self.engine_args = args
        self.engine = engine
        self._factory = engine_factory
        self._make_params = make_sampling_params or vllm_sampling_params
        self.label = label or str(args.get("model") or "model")
        self._info: EngineInfo | None = None
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._peak = 0
        self._cancelled = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VLLMBackend:
        engine_args = engine_kwargs(args, "vllm", "model", "max_model_len", "max_num_seqs")
        return cls(engine_args=engine_args, label=args.model)

    # ------------------------------------------------------------------ lifecycle

    def prepare(self) -> None:
        if self.engine is None:
            factory = self._factory or _default_factory
            # Outside the event loop: AsyncLLM starts its output handler lazily, on the
            # first generate(), in the loop that calls it.
            self.engine = factory(self.engine_args)
        self._info = self._describe()

    def _describe(self) -> EngineInfo:
        engine = self.engine
        config = getattr(engine, "vllm_config", None)
        model_config = getattr(engine, "model_config", None) or getattr(config, "model_config", None)
        scheduler_config = getattr(config, "scheduler_config", None)
        vocab = None
        if model_config is not None and hasattr(model_config, "get_vocab_size"):
            vocab = int(model_config.get_vocab_size())
        max_model_len = getattr(model_config, "max_model_len", None)
        max_running = getattr(scheduler_config, "max_num_seqs", None)
        features = set(FEATURES)
        if not self._reads_qwen2_vl(model_config):
            features.discard(FEATURE_IMAGES)
        if FEATURE_IMAGES not in features or self._sender_cache() is None:
            features.discard(FEATURE_IMAGES_BY_HASH)
        if FEATURE_IMAGES not in features or not shared_pixels.available():
            features.discard(FEATURE_IMAGES_SHM)
        no_tokenizer = getattr(model_config, "skip_tokenizer_init", None)
        if no_tokenizer is None:
            no_tokenizer = bool(self.engine_args.get("skip_tokenizer_init"))
        if no_tokenizer:  # vLLM refuses structured outputs without its tokenizer
            features -= set(STRUCTURED_FEATURES) | set(STRUCTURED_OPTION_FEATURES)
        # vLLM 0.32's grammar backends ignore the request's whitespace options: compact JSON only with
        # the engine-wide structured_outputs_config.disable_any_whitespace, a whitespace pattern never
        so_config = (
            getattr(config, "structured_outputs_config", None)
            if config is not None
            else self.engine_args.get("structured_outputs_config")
        )
        so_compact = so_config.get("disable_any_whitespace") if isinstance(so_config, dict) else None
        if so_compact is None:
            so_compact = getattr(so_config, "disable_any_whitespace", False)
        if not so_compact:
            features.discard(FEATURE_DISABLE_ANY_WHITESPACE)
        features.discard(FEATURE_WHITESPACE_PATTERN)
        policy = getattr(scheduler_config, "policy", None) or self.engine_args.get("scheduling_policy")
        if str(getattr(policy, "value", policy)) != "priority":  # vLLM's "fcfs" ignores a request's priority
            features.discard(FEATURE_PRIORITY)
        kv_config = (
            getattr(config, "kv_transfer_config", None)
            if config is not None
            else self.engine_args.get("kv_transfer_config")
        )
        if kv_config is None:  # no KV connector: vLLM takes kv_transfer_params and ignores them
            features.discard(FEATURE_KV_TRANSFER_PARAMS)
        max_logprobs = getattr(model_config, "max_logprobs", 20)
        if not isinstance(max_logprobs, int) or max_logprobs < 0:  # -1: the whole vocabulary
            max_logprobs = vocab if vocab is not None else 20
        log.info(
            "vllm engine ready: max_model_len %s, vocab %s, max_num_seqs %s, max_logprobs %s, structured outputs %s",
            max_model_len,
            vocab,
            max_running,
            max_logprobs,
            "off (no tokenizer)" if no_tokenizer else "on",
        )
        return EngineInfo(
            name=f"vllm:{self.label}",
            vocab_size=vocab,
            max_running_requests=max_running,
            max_model_len=max_model_len,
            features=frozenset(features),
            max_logprobs=max_logprobs,
        )

    @staticmethod
    def _reads_qwen2_vl(model_config: Any) -> bool:
        """Whether the model takes the workers' ``qwen2_vl`` uint8 pixels as they are: a Qwen2-VL-family
        vLLM model that rescales and normalises its pixel input on the device (``mm_device_do_normalize``,
        vLLM's default for these models)."""
        mm_config = getattr(model_config, "multimodal_config", None)
        if mm_config is None or not getattr(mm_config, "mm_device_do_normalize", False):
            return False
        limit = getattr(mm_config, "get_limit_per_prompt", None)
        if limit is not None and limit("image") < 1:
            return False
        return bool(QWEN2_VL_ARCHITECTURES & set(getattr(model_config, "architectures", None) or ()))

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if getattr(self.engine, "errored", False):
                log.error("the vLLM engine died: %s", getattr(self.engine, "dead_error", None))
                return

    async def close(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)
        # let go of it now: left to the interpreter's exit, AsyncLLM.__del__ shuts it down again with its
        # module half torn down and prints "Exception ignored ... TypeError" into the service's log
        self.engine = None

    # ------------------------------------------------------------------ requests

    def sampling_params(self, request: EngineRequest):
        s = request.sampling
        kwargs: dict[str, Any] = dict(
            n=1,
            max_tokens=request.max_new_tokens,
            temperature=float(s.temperature),
            top_p=float(s.top_p),
            top_k=int(s.top_k) if s.top_k > 0 else -1,
            seed=s.seed,
            presence_penalty=float(s.presence_penalty),
            frequency_penalty=float(s.frequency_penalty),
            min_p=float(s.min_p),
            repetition_penalty=float(s.repetition_penalty),
            # past max_tokens, the length limit ends the request first (vLLM refuses min_tokens > max_tokens)
            min_tokens=min(int(s.min_tokens), request.max_new_tokens),
            logit_bias={int(t): float(b) for t, b in s.logit_bias.items()} or None,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=True,  # stop exactly at stop_token_ids (the front end put EOS there)
            skip_special_tokens=False,
        )
        if request.logprobs is not None:
            kwargs["logprobs"] = int(request.logprobs)
            kwargs["flat_logprobs"] = True  # flat lists instead of a dict per position
        if request.structured is not None:
            kwargs["structured_outputs"] = structured_outputs(request.structured)
        if s.allowed_token_ids is not None:
            kwargs["allowed_token_ids"] = [int(t) for t in s.allowed_token_ids]
        if s.bad_words:
            kwargs["bad_words_token_ids"] = [[int(t) for t in seq] for seq in s.bad_words]
        if request.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = int(request.prompt_logprobs)
        extra = extra_args(request)
        if extra is not None:
            kwargs["extra_args"] = extra
        return self._make_params(**kwargs)

    def _sender_cache(self) -> Any:
        """vLLM's processor-cache sender (its API-server side), which mirrors what the engine core holds by
        hash; None when vLLM runs without a processor cache (``mm_processor_cache_gb`` 0)."""
        processor = getattr(self.engine, "input_processor", None)
        return getattr(getattr(processor, "renderer", None), "mm_processor_cache", None)

    def holds_image(self, content_hash: str) -> bool:
        """images.by_hash: an item sent without pixels is served from vLLM's engine core, which holds it
        when vLLM's sender cache says so (the two evict in the same order)."""
        cache = self._sender_cache()
        return cache is not None and cache.is_cached_item(content_hash)

    def prompt(self, request: EngineRequest) -> dict[str, Any]:
        """vLLM's TokensPrompt for the request: its token IDs, and its cache_salt (1.2) when set; with
        images, vLLM's prebuilt multimodal input, its items passed through vLLM's processor-cache sender
        (an item the engine core holds goes as its hash alone; one the front end sent by hash must be
        held, else the request is refused with image_missing and the front end sends the pixels)."""
        if request.images:
            prompt = vllm_multimodal_prompt(request)
            inject = getattr(getattr(self.engine, "input_processor", None), "inject_into_mm_cache", None)
            if inject is not None:
                items = list(prompt["mm_kwargs"]["image"])
                hashes = prompt["mm_hashes"]["image"]
                by_hash = [i for i, item in enumerate(items) if item is None]
                held = [self.holds_image(h) for h in hashes]
                if not all(held[i] for i in by_hash):
                    raise EngineRejected(
                        "an image sent by its hash is no longer in vLLM's processor cache: send its pixels",
                        ERR_IMAGE_MISSING,
                        param="images",
                    )
                for i in by_hash:  # used again: the most recent in the sender's LRU, as in the engine core's;
                    # with vLLM's shared-memory cache (the bridge's default) the item becomes its address there
                    items[i] = self._sender_cache().get_and_update_item(None, hashes[i])[0]
                inject({"image": hashes}, {"image": items})
                prompt["mm_kwargs"]["image"] = items
                if any(held):
                    log.info(
                        "%s: %d of %d image(s) already in vLLM's processor cache, sent without pixels",
                        request.rid,
                        sum(held),
                        len(items),
                    )
            elif any(not len(buffer) for _, buffer in request.images):
                raise EngineRejected("this vLLM keeps no images: send their pixels", ERR_IMAGE_MISSING, param="images")
            return prompt
        prompt: dict[str, Any] = {"prompt_token_ids": request.prompt}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        return prompt

    @staticmethod
    def generate_kwargs(request: EngineRequest) -> dict[str, Any]:
        """AsyncLLM.generate's keyword arguments beyond prompt, params and request ID: priority (1.2)."""
        return {"priority": int(request.priority)} if request.priority else {}

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        rid = request.rid
        try:
            params = self.sampling_params(request)
        except EngineRejected:
            raise
        except Exception as exc:
            if _is_client_error(exc):
                raise EngineRejected(
                    f"vLLM rejected the sampling parameters: {exc}", param=_param_of(exc, request)
                ) from exc
            raise
        try:
            prompt = self.prompt(request)
        except EngineRejected:
            raise
        except Exception as exc:
            if request.images and _is_client_error(exc):
                raise EngineRejected(f"vLLM refused the images: {exc}", param="images") from exc
            raise
        top_n = request.logprobs
        prompt_top = request.prompt_logprobs  # None once sent
        self._running.add(rid)
        self._peak = max(self._peak, len(self._running))
        stream = self.engine.generate(prompt, params, rid, **self.generate_kwargs(request))
        produced = completed = stopped = False
        try:
            async for out in stream:
                completion = out.outputs[0] if out.outputs else None
                tokens = list(completion.token_ids) if completion is not None else []
                finish = error = None
                if out.finished:
                    reason = completion.finish_reason if completion is not None else None
                    finish = VLLM_FINISH.get(reason)
                    if finish is None:
                        finish, error = FINISH_ERROR, f"vLLM finished the request with {reason!r}"
                    # vLLM's generator ends right after its finished output; closing it before that
                    # counts (and logs) as an abort, so let it end first
                    async for _ in stream:
                        pass
                    if finish == FINISH_ERROR and not produced and not tokens and request.structured is not None:
                        # the engine core's grammar compilation failed (xgrammar refuses what its validation
                        # let through, e.g. \p{L} classes): vLLM's own server answers such a request with a 400
                        completed = True
                        raise EngineRejected(
                            "vLLM's grammar backend could not compile the structured-output constraint",
                            param="structured",
                        )
                    completed = finish != FINISH_ABORT
                produced = True
                chunk = Chunk(tokens, finish, error, getattr(out, "num_cached_tokens", None))
                if top_n is not None:
                    positions = getattr(completion, "logprobs", None) if tokens else None
                    chunk.logprobs, chunk.top_ids, chunk.top_logprobs = convert_logprobs(positions, tokens, top_n)
                if prompt_top is not None and getattr(out, "prompt_logprobs", None):
                    chunk.prompt_logprobs = convert_prompt_logprobs(out.prompt_logprobs, request.prompt, prompt_top)
                    prompt_top = None
                if out.finished:
                    chunk.kv_transfer_params = getattr(out, "kv_transfer_params", None)
                yield chunk
                if finish is not None:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            stopped = True  # closing the stream aborts the request inside vLLM
            raise
        except EngineRejected:
            raise
        except Exception as exc:
            if not produced and _is_client_error(exc):
                raise EngineRejected(str(exc), param=_param_of(exc, request)) from exc
            cause = exc.__cause__ or exc
            raise RuntimeError(f"{type(cause).__name__}: {cause}") from exc
        finally:
            # One place counts a request stopped from outside, however vLLM surfaced it: a cancelled
            # task, a closed generator, or an abort that vLLM answered with a finished output or an error.
            task = asyncio.current_task()
            if not completed and (stopped or rid in self._aborted or (task is not None and task.cancelling())):
                self._cancelled += 1
            await _aclose(stream)  # AsyncLLM aborts a request whose generator is closed early
            self._running.discard(rid)
            self._aborted.discard(rid)

    async def abort(self, rid: str) -> None:
        if rid not in self._running or rid in self._aborted:
            return
        self._aborted.add(rid)  # its generator counts it when it ends
        await self.engine.abort(rid)

    def load(self) -> EngineLoad:
        running = len(self._running)
        self._peak = max(self._peak, running)
        return EngineLoad(num_running=running, num_waiting=0, peak_running=self._peak, cancelled_total=self._cancelled)


async def _aclose(stream) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # an engine already torn down
            log.debug("closing a vLLM stream failed", exc_info=True)


def _default_factory(engine_args: dict[str, Any]):
    require("vllm", "vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = images_in_shared_memory(engine_args, AsyncEngineArgs.mm_processor_cache_gb)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))


def images_in_shared_memory(engine_args: dict[str, Any], default_gb: float, shm_dir: str = SHM_DIR) -> dict[str, Any]:
    """vLLM's processor cache in shared memory (``mm_processor_cache_type=shm``) unless the operator chose one.

    With vLLM's default ("lru") each new image's pixels go from this process to vLLM in one ZeroMQ
    message, which libzmq's I/O thread writes with one ``sendto`` of megabytes: 3-14 ms inside the
    kernel per image, measured here, and on a kernel built without preemption that holds the CPU even
    from the gateway's real-time loop. With "shm" the pixels are copied once, in user space, into
    vLLM's ring buffer, which its model runner reads, and only their address crosses the socket.
    Kept at vLLM's default when /dev/shm has no room for the whole cache (``mm_processor_cache_gb``,
    vLLM's ``default_gb`` unless set; a write past a full tmpfs would kill the process) or the cache is
    off. Text-only models ignore it."""
    if "mm_processor_cache_type" in engine_args:
        return engine_args
    size_gb = float(engine_args.get("mm_processor_cache_gb", default_gb))
    if size_gb <= 0:
        return engine_args
    try:
        fs = os.statvfs(shm_dir)
    except OSError:
        return engine_args
    room = fs.f_bavail * fs.f_frsize
    if room < size_gb * 2**30:
        log.warning(
            "%s has %.1f GiB free, less than vLLM's %.1f GiB processor cache: images go to vLLM's engine "
            "through its socket (mm_processor_cache_type lru)",
            shm_dir,
            room / 2**30,
            size_gb,
        )
        return engine_args
    log.info("images go to vLLM through its processor cache in %s (mm_processor_cache_type shm)", shm_dir)
    return {**engine_args, "mm_processor_cache_type": "shm"}


# --------------------------------------------------------------------------- command line


def from_args(args: argparse.Namespace) -> VLLMBackend:
    """The backend ``tokenmill engine --backend ...`` asked for."""
    return VLLMBackend.from_args(args)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.description = (
        "--model, --max-model-len (max_model_len), --max-running (max_num_seqs), --dtype, and "
        "--engine-arg KEY=VALUE for any other AsyncEngineArgs field, e.g. tensor_parallel_size=2, "
        "gpu_memory_utilization=0.9, max_logprobs=20, or skip_tokenizer_init=true (no tokenizer: no "
        "structured outputs)"
    )


__all__ = [
    "from_args",
    "VLLMBackend",
    "vllm_sampling_params",
    "structured_outputs",
    "convert_logprobs",
    "add_arguments",
    "convert_prompt_logprobs",
    "extra_args",
]
