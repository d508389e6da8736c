"""Request conversion: raw HTTP body in, validated scheduler requests (or a finished answer) out.

This is all the CPU work between an OpenAI request and the GPU scheduler: JSON parsing,
validation, chat-template rendering and tokenization. It runs in tokenizer worker
processes; the benchmark's baseline modes run the very same code on the gateway loop
or in its thread pool.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import zlib
from array import array
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import msgspec
import numpy as np

from tokenmill.scheduler_client import protocol
from tokenmill.tokenizer_workers import anthropic_messages as am
from tokenmill.tokenizer_workers import generation_params as gp
from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers import openai_responses as responses
from tokenmill.tokenizer_workers.chat_messages import ImageRef, to_template_messages
from tokenmill.tokenizer_workers.chat_template import ChatTemplates, TemplateError
from tokenmill.tokenizer_workers.images.pipeline import ImageError, ImagePipeline, ProcessedImage, processor_for
from tokenmill.tokenizer_workers.messages import (
    ApiError,
    CacheReport,
    ChoicePlan,
    CompletionShape,
    ConvertDone,
    ConvertJob,
    Limits,
    ResponsesShape,
    Timing,
)
from tokenmill.tokenizer_workers.model import Model, load_model
from tokenmill.tokenizer_workers.output_parsers import OutputParser, ParserChoice, choose_parsers
from tokenmill.tokenizer_workers.segment_cache import SegmentEncoder
from tokenmill.tokenizer_workers.settings import ConverterSettings

_json = msgspec.json.Encoder()
_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


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
    done: ConvertDone
    frames: list[bytes] = field(default_factory=list)  # per choice: Generate header, prompt tokens
    detok: list[DetokSpec] = field(default_factory=list)


class EncodeCpu:
    """The process's CPU while prompts are encoded, divided among the encodings running at the
    time. A process clock read around one encoding also counts what the process's other threads
    encode meanwhile: with two conversion threads each request was charged about twice its CPU."""

    def __init__(self, clock=time.process_time):
        self.clock = clock
        self.lock = threading.Lock()
        self.active = 0  # encodings running now
        self.share = 0.0  # CPU seconds per encoding so far (the integral of dCPU / active)
        self.last = clock()

    def _advance(self) -> None:
        now = self.clock()
        if self.active:
            self.share += (now - self.last) / self.active
        self.last = now

    def start(self) -> float:
        with self.lock:
            self._advance()
            self.active += 1
            return self.share

    def stop(self, started: float) -> float:
        """This encoding's CPU: its share of the process's CPU since start()."""
        with self.lock:
            self._advance()
            self.active -= 1
            return self.share - started


FIM_MARKERS = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")  # DeepSeek's fill-in-the-middle tokens


class Converter:
    def __init__(self, settings: ConverterSettings, model: Model | None = None):
        self.settings = settings
        self.model = model or load_model(settings.model_dir, settings.chat_template_file, settings.max_model_len)
        self.model_name = settings.served_model_name or self.model.name
        self.tokenizer = self.model.tokenizer
        self.vocab_size = self.model.vocab_size
        self.max_model_len = self.model.max_model_len
        self.engine = gp.Engine()  # what the scheduler honours, from its Welcome (limit_context)
        # completions' suffix (fill in the middle) in DeepSeek's form, where the vocabulary has its markers,
        # as vLLM renders it for DeepSeek-V4; other models have no FIM rendering there either
        self.fim = all(self.tokenizer.token_to_id(marker) is not None for marker in FIM_MARKERS)
        self.templates = ChatTemplates(
            self.model.templates, self.model.special_tokens, settings.default_chat_template_kwargs
        )
        self.segments = SegmentEncoder(
            self.tokenizer, settings.tokenize_cache_bytes, verify=settings.verify_tokenize_cache
        )
        self.encode_cpu = EncodeCpu()  # shared by the threads that convert with this converter
        self.images = self._image_pipeline(settings)
        self._inline_system: bool | None = None  # see _merge_inline_system
        self.parsers: ParserChoice = choose_parsers(
            settings.tool_call_parser, settings.reasoning_parser, "\n".join(self.model.templates.values())
        )

    def _image_pipeline(self, settings: ConverterSettings) -> ImagePipeline | None:
        """The model's image pipeline: a processor of a known family (preprocessor_config.json) whose
        placeholder token is in the vocabulary and in a template; None for a text-only model."""
        processor = processor_for(self.model.directory if self.settings.model_dir else None)
        if processor is None:
            return None
        self.image_token_id = self.tokenizer.token_to_id(processor.placeholder_token)
        if self.image_token_id is None or not any(
            processor.placeholder_token in t or "image" in t for t in self.model.templates.values()
        ):
            return None
        return ImagePipeline(processor, settings.image_cache_bytes, settings.image_max_pixels, settings.image_fetch)

    def fingerprint(self) -> str:
        """What must be equal for two workers to convert a request to the same tokens: the tokenizer,
        the templates, their special tokens, the context length and the image processor (a remote worker
        is refused on a difference, since it would answer differently from the rest of the pool)."""
        digest = hashlib.sha256(self.tokenizer.to_str().encode())
        digest.update(
            json.dumps(
                [self.model.templates, self.model.special_tokens, self.model.max_model_len], sort_keys=True, default=str
            ).encode()
        )
        if self.images is not None:
            digest.update(self.images.processor.fingerprint().encode())
        return digest.hexdigest()[:32]

    def limit_context(self, limits: Limits) -> None:
        """The engine's Welcome: check requests against its context length too, where it is the
        smaller, and against the protocol 1.1 features it honours."""
        own = self.model.max_model_len
        self.max_model_len = min(own, limits.max_model_len) if limits.max_model_len else own
        self.engine = gp.Engine(limits.features, limits.max_logprobs)
        if self.images is not None:
            self.images.forget_sent()
            # shared-memory pixels: only a scheduler on this host lists the feature to the workers (the
            # gateway drops it for a remote one), and only a worker on this host writes them
            self.images.use_shared_memory(
                self.settings.image_shared_memory and protocol.FEATURE_IMAGES_SHM in (limits.features or ())
            )

    def pixel_frames(self, content_hashes: list[str]) -> list | None:
        """The cached pixels of these images, for an engine that lost them (PixelsWanted); None if gone."""
        return self.images.pixel_frames(content_hashes) if self.images is not None else None

    def encode_chat(self, prompt: str) -> tuple:
        """A rendered chat prompt to token IDs (through the segment cache), with the cache's report."""
        segments = self.segments
        evicted = segments.cache.evictions
        ids, stats = segments.encode(prompt)
        report = CacheReport(
            stats.hits,
            stats.misses,
            stats.cached_tokens,
            stats.fresh_tokens,
            stats.mismatches,
            segments.cache.evictions - evicted,
            segments.bytes_used,
            stats.prefix_hits,
        )
        return ids, report

    # ---- entry point ----------------------------------------------------------------

    def convert(self, job: ConvertJob, body: bytes) -> Conversion:
        try:
            handler = getattr(self, f"_convert_{job.kind}")
            return handler(job, body)
        except oa.InvalidRequest as exc:
            return self._error(job, exc.status, exc.message, exc.param, exc.code)
        except TemplateError as exc:
            return self._error(job, 400, f"Chat template error: {exc}", "messages", "chat_template_error")
        except RecursionError:
            return self._error(job, 400, "The request (or its chat template) recursed too deeply.", None, "too_deep")
        except MemoryError:
            return self._error(
                job,
                400,
                "The request (or its chat template) needed more memory than a worker may use.",
                None,
                "too_much_memory",
            )

    def _error(self, job: ConvertJob, status: int, message: str, param=None, code=None) -> Conversion:
        kind = "NotFoundError" if status == 404 else "BadRequestError"
        return Conversion(ConvertDone(job.job_id, error=ApiError(status, message, kind, param, code)))

    # ---- kinds ----------------------------------------------------------------------

    def _convert_chat(self, job: ConvertJob, body: bytes) -> Conversion:
        return self._chat(job, oa.parse("chat", body))

    def _convert_responses(self, job: ConvertJob, body: bytes) -> Conversion:
        """The Responses API over the chat core: its body converted to a chat request (openai_responses.py),
        plus what the gateway's Responses framer needs to name the output items."""
        converted = responses.convert(body)
        conversion = self._chat(job, converted.chat)
        done = conversion.done
        done.completion = None  # framed by the Responses framer, from this instead:
        done.responses = ResponsesShape(converted.custom_tools, converted.namespaces, converted.echo)
        if converted.affinity is not None:  # the client's name for the conversation beats the messages' hash
            done.conversation = zlib.crc32(converted.affinity.encode())
        return conversion

    def _convert_messages(self, job: ConvertJob, body: bytes) -> Conversion:
        """Anthropic's /v1/messages: converted to the chat request (anthropic_messages.py), then the chat path."""
        req = am.parse(body)
        self._check_model(req.model)
        conversion = self._chat(job, am.to_chat_request(req, self._merge_inline_system()))
        conversion.done.completion = None  # the Messages framer shows none of chat's extras
        return conversion

    def _convert_count_tokens(self, job: ConvertJob, body: bytes) -> Conversion:
        """Anthropic's /v1/messages/count_tokens: the prompt /v1/messages would render, counted."""
        t0 = time.perf_counter()
        req = am.parse(body)
        self._check_model(req.model)
        chat = am.to_chat_request(req, self._merge_inline_system(), count_only=True)
        refs: list[ImageRef] = []
        prompt = self.render(chat.messages, chat, refs)
        images = self._load_images(refs)  # decoded and processed (and cached) as /v1/messages would
        ids = self._expand_images(self.encode_chat(prompt)[0], images)[0]
        # as vLLM answers (and Anthropic's beta with context_management): nothing is cleared here
        body = _json.encode({"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}})
        return Conversion(ConvertDone(job.job_id, body=body, timing=Timing(tokenize_s=time.perf_counter() - t0)))

    def _convert_messages_render(self, job: ConvertJob, body: bytes) -> Conversion:
        """/v1/messages/render (vLLM's route of that name): the prompt token IDs /v1/messages would send."""
        req = am.parse(body)
        self._check_model(req.model)
        return self._render_ids(job, am.to_chat_request(req, self._merge_inline_system(), count_only=True))

    def _convert_responses_render(self, job: ConvertJob, body: bytes) -> Conversion:
        """/v1/responses/render (vLLM's route of that name): the prompt token IDs /v1/responses would send."""
        chat = responses.convert(body).chat
        self._check_model(chat.model)
        return self._render_ids(job, chat)

    def _render_ids(self, job: ConvertJob, chat: oa.ChatCompletionRequest) -> Conversion:
        """``{"token_ids": [...]}``: the field of vLLM's render answer (a GenerateRequest) that holds the
        prompt; its sampling parameters are not repeated here."""
        t0 = time.perf_counter()
        refs: list[ImageRef] = []
        ids = self.encode_chat(self.render(chat.messages, chat, refs))[0]
        if refs:
            raise oa.InvalidRequest("Images are not rendered by this route.", refs[0].where)
        body = _json.encode({"token_ids": ids.tolist() if hasattr(ids, "tolist") else list(ids)})
        return Conversion(ConvertDone(job.job_id, body=body, timing=Timing(tokenize_s=time.perf_counter() - t0)))

    def _merge_inline_system(self) -> bool:
        """Whether system messages inside a conversation must join the leading system prompt: the
        default template refuses a system message after the first (probed once, as vLLM probes it)."""
        if self._inline_system is None:
            probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
            try:
                self.templates.render(probe)
                self._inline_system = False
            except TemplateError:
                self._inline_system = True
        return self._inline_system

    def _chat(self, job: ConvertJob, req: oa.ChatCompletionRequest) -> Conversion:
        self._check_model(req.model)
        oa.check_sampling(req)
        functions = _legacy_functions(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self._check_max_tokens(
            max_tokens, "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        # everything that can be refused is refused before rendering
        forced_spec, forced = gp.forced_tools(req, self.engine)
        spec, fields = gp.structured(req, self.engine)
        if forced_spec is not None and spec is not None:
            raise oa.InvalidRequest(
                "A forced tool_choice constrains the output already; drop the other output "
                "constraint or use tool_choice 'auto'.",
                "tool_choice",
            )
        params = self._generation(req, max_tokens, forced_spec or spec, chat=True)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        t0 = time.perf_counter()
        refs: list[ImageRef] = []
        prompt = self.render(req.messages, req, refs)
        if refs:
            self.engine.require(protocol.FEATURE_IMAGES, refs[0].where, "Image input")
        images = self._load_images(refs)
        t1, cpu = time.perf_counter(), self.encode_cpu.start()
        try:
            ids, report = self.encode_chat(prompt)
        finally:
            cpu = self.encode_cpu.stop(cpu)
        ids, items = self._expand_images(ids, images)
        t2 = time.perf_counter()
        timing = Timing(render_s=t1 - t0, tokenize_s=t2 - t1, tokenize_cpu_s=cpu, cache=report)
        conversion = self._plan(
            job, req, [ids], max_tokens, "messages", timing, params, images=list(zip(items, images))
        )
        done, shape = conversion.done, conversion.done.completion
        echo = _chat_echo(req)
        for spec_ in conversion.detok:
            self._attach_parser(spec_, req, prompt, parse_tools, forced)
            spec_.prefix = echo
        if req.return_token_ids and not req.include_reasoning and any(s.parser for s in conversion.detok):
            for spec_ in conversion.detok:  # as vLLM: with a parser at work and the reasoning left out, the
                spec_.token_ids = False  # generated IDs are not shown (they would tell the reasoning)
            shape.token_ids = False
        done.fields = {"structured": "tool_choice"} if forced_spec is not None else fields
        # forced: the named function (calls finish "stop", as OpenAI's), "" for "required", None when not forced
        done.calls_finish = "stop" if forced else "function_call" if functions else "tool_calls"
        shape.forced_calls = forced is not None
        shape.functions = functions
        shape.role = _answer_role(req)
        done.conversation = _conversation_key(req.messages)
        return conversion

    def _convert_completion(self, job: ConvertJob, body: bytes) -> Conversion:
        req: oa.CompletionRequest = oa.parse("completion", body)
        self._check_model(req.model)
        oa.check_sampling(req)
        self._check_max_tokens(req.max_tokens, "max_tokens")
        spec, fields = gp.structured(req, self.engine)
        params = self._generation(req, req.max_tokens, spec, chat=False)
        echo_logprobs = gp.echo_prompt_logprobs(req, self.engine, self.vocab_size)
        t0 = time.perf_counter()
        prompts = self._completion_prompts(req.prompt)
        if req.suffix is not None:
            prompts = self._fill_in_the_middle(req, prompts)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = (
            iter(e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)) if texts else iter(())
        )
        id_lists = [next(encoded) if isinstance(p, str) else p for p in prompts]
        echo = None
        # as vLLM: the prompt as given, a token-ID prompt decoded (special tokens kept), before truncation;
        # with return_token_ids vLLM echoes no text (the prompt's IDs are in the response instead)
        if req.echo and not req.return_token_ids:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        t1 = time.perf_counter()
        timing = Timing(tokenize_s=t1 - t0)
        conversion = self._plan(job, req, id_lists, req.max_tokens, "prompt", timing, params, echo, echo_logprobs)
        conversion.done.fields = fields
        return conversion

    def _convert_tokenize(self, job: ConvertJob, body: bytes) -> Conversion:
        req: oa.TokenizeRequest = oa.parse("tokenize", body)
        self._check_model(req.model)
        render_s = 0.0
        images: list[ProcessedImage] = []
        t0 = time.perf_counter()
        if req.messages is not None:
            if req.prompt is not None:
                raise oa.InvalidRequest("Give either prompt or messages, not both.", "prompt")
            refs: list[ImageRef] = []
            prompt = self.render(req.messages, req, refs)
            images = self._load_images(refs)
            add_special = bool(req.add_special_tokens)  # default False for chat prompts
            render_s = time.perf_counter() - t0
        elif req.prompt is not None:
            prompt, add_special = req.prompt, req.add_special_tokens is not False
        else:
            raise oa.InvalidRequest("Give prompt (a string) or messages (a chat).", "prompt")
        t1 = time.perf_counter()
        if req.messages is not None and not add_special and not req.return_token_strs:
            ids = self.encode_chat(prompt)[0].tolist()
            strs = None
        else:
            enc = self.tokenizer.encode_batch([prompt], add_special_tokens=add_special)[0]
            ids, strs = enc.ids, (enc.tokens if req.return_token_strs else None)
        if images:  # the prompt the engine gets: each image placeholder expanded to the image's tokens
            pad = self.image_token_id
            if strs is not None:
                counts = iter(image.tokens for image in images)
                strs = [s for i, s in zip(ids, strs) for s in ([s] * (next(counts, 1) if i == pad else 1))]
            ids = self._expand_images(array("I", ids), images)[0].tolist()
        answer = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}
        timing = Timing(render_s=render_s, tokenize_s=time.perf_counter() - t1)
        return Conversion(ConvertDone(job.job_id, body=_json.encode(answer), timing=timing))

    def _convert_detokenize(self, job: ConvertJob, body: bytes) -> Conversion:
        req: oa.DetokenizeRequest = oa.parse("detokenize", body)
        self._check_model(req.model)
        self._check_token_ids(req.tokens, "tokens")
        text = self.tokenizer.decode_batch([req.tokens], skip_special_tokens=False)[0]
        return Conversion(ConvertDone(job.job_id, body=_json.encode({"prompt": text}), timing=Timing()))

    # ---- pieces ---------------------------------------------------------------------

    def _generation(self, req, max_tokens, spec, chat: bool) -> "_Generation":
        """The request's generation fields as protocol values, every one checked (generation_params.py)."""
        if not 1 <= req.n <= self.settings.max_n:
            raise oa.InvalidRequest(f"n must be between 1 and {self.settings.max_n}.", "n")
        sampling = gp.sampling(req, self.engine, self.vocab_size, max_tokens)
        gp.token_masks(req, self.engine, self.tokenizer, self.vocab_size, sampling)
        return _Generation(
            sampling,
            spec,
            gp.logprobs(req, chat, self.engine),
            req.n,
            gp.priority(req, self.engine),
            gp.cache_salt(req, self.engine),
            gp.prompt_logprobs(req, chat, self.engine, self.vocab_size),
            gp.kv_transfer_params(req, self.engine),
            gp.extra_args(req, self.engine),
        )

    def _attach_parser(self, spec: DetokSpec, req, prompt: str, parse_tools: bool, forced: str | None) -> None:
        max_calls = 1 if req.parallel_tool_calls is False else 0
        recipe = (req.tools if parse_tools else None, self.parsers.prompt_hint(prompt), forced, max_calls)
        parser = self.parsers.make(*recipe)
        if parser is not None:
            spec.parser = parser
            spec.parser_recipe = recipe
            spec.include_reasoning = req.include_reasoning
            spec.tool_parser_name = "forced" if forced is not None else self.parsers.tool_name

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise oa.InvalidRequest(
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                "model",
                status=404,
                code="model_not_found",
            )

    @staticmethod
    def _check_max_tokens(max_tokens: int | None, param: str) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise oa.InvalidRequest(f"{param} must be at least 1, got {max_tokens}.", param)

    def _check_token_ids(self, ids: list, param: str) -> None:
        bad = next(
            (t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise oa.InvalidRequest(f"Token ID {bad!r} is out of range [0, {self.vocab_size}).", param)

    def _load_images(self, refs: list[ImageRef]) -> list[ProcessedImage]:
        """Each image part fetched or decoded, processed (or found in the cache by content hash)."""
        if not refs:
            return []
        try:
            return [self.images.load_image_part(ref.url, ref.where, ref.media_type) for ref in refs]
        except ImageError as exc:
            raise oa.InvalidRequest(str(exc), exc.param, code="invalid_image") from None

    def _expand_images(self, ids: array, images: list[ProcessedImage]) -> tuple[array, list[protocol.ImageItem]]:
        """Each image's one placeholder token repeated to its token count, and the protocol items
        saying where each image's placeholder run lies (the template put one per image part)."""
        if not images:
            return ids, []
        pad = self.image_token_id
        flat = np.frombuffer(ids, dtype=np.uint32) if len(ids) else np.zeros(0, np.uint32)
        where = np.flatnonzero(flat == pad)
        if len(where) != len(images):
            raise oa.InvalidRequest(
                f"The prompt holds {len(where)} image placeholder(s) for {len(images)} image(s): the chat template "
                "did not render one per image part, or a text part holds the placeholder token itself.",
                "messages",
            )
        counts = np.ones(len(flat), dtype=np.int64)
        counts[where] = [image.tokens for image in images]
        expanded = np.repeat(flat, counts)
        starts = where + np.concatenate(([0], np.cumsum(counts[where] - 1)[:-1])).astype(np.int64)
        items = [
            protocol.ImageItem(
                family=image.family,
                dtype=str(image.pixels.dtype),
                shape=list(image.pixels.shape),
                grid_thw=list(image.grid_thw),
                offset=int(start),
                length=image.tokens,
                content_hash=image.content_hash,
            )
            for image, start in zip(images, starts)
        ]
        out = array("I")
        out.frombytes(expanded.astype("<u4").tobytes())
        return out, items

    def render(self, messages: list[dict], req, images: list[ImageRef] | None = None) -> str:
        if not messages:
            raise oa.InvalidRequest("messages must be a non-empty list.", "messages")
        for i, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str) or role not in _CHAT_ROLES:
                raise oa.InvalidRequest(
                    f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}, got {role!r}.", f"messages[{i}].role"
                )
        if req.chat_template is not None and not self.settings.trust_request_chat_template:
            raise oa.InvalidRequest(
                "A request-supplied chat_template is refused; the server must be started with "
                "--trust-request-chat-template to accept one.",
                "chat_template",
            )
        source = req.chat_template or self.templates.select(None, req.tools)
        fmt = self.settings.content_format
        if fmt == "auto":
            fmt = self.templates.content_format(source)
        if req.continue_final_message and req.add_generation_prompt:  # as vLLM 0.32 and transformers refuse it
            raise oa.InvalidRequest(
                "continue_final_message and add_generation_prompt are not compatible: set "
                "add_generation_prompt to false to continue the final message.",
                "continue_final_message",
            )
        try:
            template_messages = to_template_messages(
                messages,
                fmt,
                source,
                images if self.images is not None else None,
                self.images.processor.placeholder_text if self.images is not None else "",
            )
        except ValueError as exc:
            raise oa.InvalidRequest(str(exc), getattr(exc, "param", "messages")) from None
        return self.templates.render(
            template_messages,
            tools=req.tools,
            documents=getattr(req, "documents", None),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_source=req.chat_template,
            kwargs=_template_kwargs(req),
        )

    def _completion_prompts(self, prompt) -> list:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise oa.InvalidRequest("prompt must be a non-empty string, token list, or list of those.", "prompt")
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            self._check_token_ids(prompt, "prompt")
            return [prompt]
        if all(isinstance(p, list) and p for p in prompt):
            for p in prompt:
                self._check_token_ids(p, "prompt")
            return list(prompt)
        raise oa.InvalidRequest(
            "prompt must be a string, a list of strings, a list of token IDs, or a list of token-ID lists.", "prompt"
        )

    def _fill_in_the_middle(self, req, prompts: list) -> list[str]:
        """vLLM's completions suffix: each text prompt becomes begin, prompt, hole, suffix, end."""
        if req.echo:
            raise oa.InvalidRequest("Echo is unsupported with suffix.", "suffix")
        if req.truncate_prompt_tokens is not None:
            raise oa.InvalidRequest("suffix is not supported with truncate_prompt_tokens", "suffix")
        if not all(isinstance(p, str) for p in prompts):
            raise oa.InvalidRequest("suffix requires text prompt input for FIM completion rendering", "suffix")
        if not self.fim:
            raise oa.InvalidRequest("suffix is only supported for models with FIM completion rendering", "suffix")
        begin, hole, end = FIM_MARKERS
        return [f"{begin}{p}{hole}{req.suffix}{end}" for p in prompts]

    def _truncation(self, req) -> tuple[int | None, bool]:
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
        limit = self.max_model_len
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

    def _plan(
        self,
        job,
        req,
        id_lists,
        max_tokens,
        what,
        timing: Timing,
        params: "_Generation",
        echo: list[str] | None = None,
        echo_logprobs: int | None = None,
        images: list[tuple[protocol.ImageItem, ProcessedImage]] = (),
    ) -> Conversion:
        """Scheduler requests for each prompt, n apiece (prompt-major, as vLLM numbers its choices):
        choices of one prompt share its token frame, and choice i samples with seed + i as vLLM does.
        The prompt's logprobs are asked once per prompt (its other choices show the first one's), but of
        every choice with echo_logprobs (completions' echo with logprobs: each choice's legacy logprobs
        start with the prompt's, which must arrive with its own first output)."""
        if req.stop_token_ids:
            self._check_token_ids(req.stop_token_ids, "stop_token_ids")  # one the model cannot emit is a mistake
        stop_ids = ([] if req.ignore_eos else list(self.model.eos_token_ids)) + list(req.stop_token_ids or [])
        named_stops = frozenset(req.stop_token_ids or ()) - frozenset(
            () if req.ignore_eos else self.model.eos_token_ids
        )
        stops = oa.stop_strings(req)
        seed = params.sampling.seed
        keep, left = self._truncation(req)
        choices, frames, detok = [], [], []
        by_hash = bool(images) and protocol.FEATURE_IMAGES_BY_HASH in self.engine.features
        # each image's frame: its pixels, or empty for one the engine holds or maps from shared memory
        pixel_frames, ways = [], []
        for item, image in images:
            frame, item.shm, way = self.images.engine_frame(image, by_hash)
            pixel_frames.append(frame)
            ways.append(way)
        prompt_ids = [] if req.return_token_ids else None
        for p, ids in enumerate(id_lists):
            if keep is not None and len(ids) > keep:
                ids = ids[len(ids) - keep :] if left else ids[:keep]
            n = len(ids)
            limit = self.max_model_len
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
            for i in range(params.n):
                rid = f"{job.request_id}-{len(choices)}"
                shown = params.prompt_logprobs if i == 0 else None  # the response's prompt_logprobs
                sampling = params.sampling
                if i and seed is not None:
                    sampling = msgspec.structs.replace(sampling, seed=_wrap_seed(seed + i))
                header = protocol.Generate(
                    request_id=rid,
                    prompt_token_count=n,
                    max_new_tokens=max_tokens if max_tokens is not None else limit - n,
                    sampling=sampling,
                    stop_token_ids=stop_ids,
                    ignore_eos=req.ignore_eos,
                    logprobs=params.logprobs,
                    structured=params.structured,
                    priority=params.priority,
                    cache_salt=params.cache_salt,
                    prompt_logprobs=echo_logprobs if echo_logprobs is not None else shown,
                    kv_transfer_params=params.kv_transfer_params,
                    extra_args=params.extra_args,
                    images=[item for item, _ in images],
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
                        logprobs=params.logprobs,
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
            timing=timing,
            completion=CompletionShape(
                include_usage=include_usage,
                # as vLLM: continuous_usage_stats counts only with include_usage
                continuous_usage=include_usage and req.stream_options.continuous_usage_stats,
                logprobs=params.logprobs is not None,
                prompt_token_ids=prompt_ids,
                token_ids=bool(req.return_token_ids),
                prompt_logprobs=params.prompt_logprobs is not None,
                kv_transfer_params=params.kv_transfer_params is not None,
            ),
            frames_per_choice=2 + len(images),
            images_by_hash=[image.content_hash for _, image in images] if any(w != "pixels" for w in ways) else [],
            images_shm=ways.count("shm") * len(choices),
        )
        return Conversion(done, frames, detok)


@dataclass
class _Generation:
    sampling: protocol.SamplingParams
    structured: protocol.Structured | None
    logprobs: int | None
    n: int
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    kv_transfer_params: dict | None = None
    extra_args: dict | None = None


def _wrap_seed(seed: int) -> int:
    """seed + i stays a signed 64-bit integer."""
    return (seed + 2**63) % 2**64 - 2**63


def _legacy_functions(req) -> bool:
    """OpenAI's deprecated functions and function_call, mapped as OpenAI does: functions are tools of
    type function, function_call "none", "auto" or {"name": N} the matching tool_choice, and (as
    OpenAI's legacy answer holds one function_call) at most one call. True when the request used them."""
    functions, call = req.functions, req.function_call
    if functions is None:
        if call is not None:
            raise oa.InvalidRequest("function_call needs functions: none were given.", "function_call")
        return False
    if req.tools is not None:
        raise oa.InvalidRequest("Give either tools or functions (their deprecated form), not both.", "functions")
    if not functions or not all(
        isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"] for f in functions
    ):
        raise oa.InvalidRequest("functions must be a non-empty list of objects, each with a name.", "functions")
    if call is not None and req.tool_choice is not None:
        raise oa.InvalidRequest(
            "Give either tool_choice or function_call (its deprecated form), not both.", "function_call"
        )
    if call in ("none", "auto"):
        req.tool_choice = call
    elif isinstance(call, dict) and set(call) == {"name"}:
        if call["name"] not in {f["name"] for f in functions}:
            raise oa.InvalidRequest(
                f"function_call names {call['name']!r}, which is not among the functions.", "function_call"
            )
        req.tool_choice = {"type": "function", "function": {"name": call["name"]}}
    elif call is not None:
        raise oa.InvalidRequest("function_call must be 'none', 'auto' or {'name': ...}.", "function_call")
    req.tools = [{"type": "function", "function": f} for f in functions]
    req.parallel_tool_calls = False
    return True


def _answer_role(req) -> str:
    """The answer's role, as vLLM 0.32 names it: the assistant's, or with add_generation_prompt false
    the last message's own (the model goes on writing that message)."""
    if req.add_generation_prompt or not req.messages:
        return "assistant"
    role = req.messages[-1].get("role")
    return role if isinstance(role, str) and role else "assistant"


def _chat_echo(req) -> str:
    """vLLM's chat echo: the last message's content, when its role is the answer's (the assistant's,
    or with add_generation_prompt false the last message's own); parts' texts joined by newlines."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    role = _answer_role(req)
    content = last.get("content")
    if last.get("role") != role or not content:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def _conversation_key(messages: list[dict]) -> int:
    """What identifies a conversation on every turn: its messages up to the first user message (a
    system prompt alone is shared by many), for the scheduler rank holding its history."""
    end = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1) + 1
    return _crc_of(messages[:end], 0)


_WHOLE = 65536  # characters: a longer string (a data: URL's megabytes of base64) is hashed by its ends


def _crc_of(value, crc: int) -> int:
    """CRC-32 of a JSON value's structure and contents, without encoding it: a first turn carrying
    four screenshots is megabytes of base64 that every turn would otherwise encode and checksum
    (~14% of a worker's CPU for a resent image); a string past 64K characters counts by its length and
    its first and last 4K, plenty to tell conversations apart (the key only picks a scheduler rank)."""
    if isinstance(value, str):
        if len(value) > _WHOLE:
            value = f"{len(value)}:{value[:4096]}{value[-4096:]}"
        return zlib.crc32(value.encode("utf-8", "surrogatepass"), zlib.crc32(b"s", crc))
    if isinstance(value, dict):
        crc = zlib.crc32(b"{", crc)
        for key, item in value.items():
            crc = _crc_of(item, _crc_of(key, crc))
        return crc
    if isinstance(value, list):
        crc = zlib.crc32(b"[", crc)
        for item in value:
            crc = _crc_of(item, crc)
        return zlib.crc32(b"]", crc)
    return zlib.crc32(repr(value).encode(), crc)


def _template_kwargs(req) -> dict | None:
    """chat_template_kwargs, with OpenAI's reasoning_effort as a template variable, as vLLM 0.32 passes
    it: it wins over a reasoning_effort in chat_template_kwargs, and it sets enable_thinking (false for
    "none") unless chat_template_kwargs sets that."""
    effort = getattr(req, "reasoning_effort", None)
    if effort is None:
        return req.chat_template_kwargs
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs["reasoning_effort"] = effort
    kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs
