"""What every request kind converts with: the model, its templates, the tokenization and image
caches, and the checks and rendering steps the kinds share."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from array import array
from typing import TYPE_CHECKING

from tokenmill.scheduler_client import protocol
from tokenmill.tokenizer_workers import generation_params as gp
from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers.chat_messages import ImageRef, to_template_messages
from tokenmill.tokenizer_workers.chat_template import ChatTemplates, TemplateError
from tokenmill.tokenizer_workers.images import processor_for
from tokenmill.tokenizer_workers.messages import CacheReport, Limits
from tokenmill.tokenizer_workers.model import Model, load_model
from tokenmill.tokenizer_workers.output_parsers import ParserChoice, choose_parsers
from tokenmill.tokenizer_workers.segment_cache import SegmentEncoder
from tokenmill.tokenizer_workers.settings import ConverterSettings

if TYPE_CHECKING:  # the image modules (numpy, Pillow) load only for a model that takes images
    from tokenmill.tokenizer_workers.images.pipeline import ImagePipeline, ProcessedImage

_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
FIM_MARKERS = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")  # DeepSeek's fill-in-the-middle tokens


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


class ConverterCore:
    """The model and its caches, shared by every request kind (and by the threads converting with it)."""

    def __init__(self, settings: ConverterSettings, model: Model | None = None):
        self.settings = settings
        self.model = model or load_model(settings.model_dir, settings.chat_template_file, settings.max_model_len)
        self.model_name = settings.served_model_name or self.model.name
        self.tokenizer = self.model.tokenizer
        self.vocab_size = self.model.vocab_size
        self.max_model_len = self.model.max_model_len
        self.engine = gp.Engine()  # what the scheduler honours, from its Welcome (limit_context)
        self.adapters: frozenset[str] = frozenset()  # the LoRA adapters it serves, by name (limit_context)
        # what a request that leaves a sampling setting out gets (the model's generation_config.json)
        self.sampling_defaults = self.model.sampling_defaults if settings.generation_config == "auto" else {}
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
        self._inline_system: bool | None = None  # see merge_inline_system
        self.parsers: ParserChoice = choose_parsers(
            settings.tool_call_parser, settings.reasoning_parser, "\n".join(self.model.templates.values())
        )

    def _image_pipeline(self, settings: ConverterSettings) -> ImagePipeline | None:
        """The model's image pipeline: a processor of a known family (preprocessor_config.json) whose
        placeholder token is in the vocabulary and in a template; None for a text-only model."""
        processor = processor_for(self.model.directory if self.settings.model_dir else None)
        if processor is None:
            return None  # text-only: the image pipeline (numpy, Pillow) is never imported
        self.image_token_id = self.tokenizer.token_to_id(processor.placeholder_token)
        if self.image_token_id is None or not any(
            processor.placeholder_token in t or "image" in t for t in self.model.templates.values()
        ):
            return None
        from tokenmill.tokenizer_workers.images.pipeline import ImagePipeline

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
        self.adapters = frozenset(limits.adapters or ())
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

    def merge_inline_system(self) -> bool:
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

    # ---- checks ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.adapters:
            served = ", ".join(f"`{name}`" for name in (self.model_name, *sorted(self.adapters)))
            raise oa.InvalidRequest(
                f"The model `{model}` does not exist. This server serves {served}.",
                "model",
                status=404,
                code="model_not_found",
            )

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's model names (one the engines serve), or None for the base model."""
        return model if model in self.adapters and model != self.model_name else None

    @staticmethod
    def check_max_tokens(max_tokens: int | None, param: str) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise oa.InvalidRequest(f"{param} must be at least 1, got {max_tokens}.", param)

    def check_token_ids(self, ids: list, param: str) -> None:
        bad = next(
            (t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise oa.InvalidRequest(f"Token ID {bad!r} is out of range [0, {self.vocab_size}).", param)

    # ---- images ---------------------------------------------------------------------

    def load_images(self, refs: list[ImageRef]) -> list[ProcessedImage]:
        """Each image part fetched or decoded, processed (or found in the cache by content hash)."""
        if not refs:
            return []
        from tokenmill.tokenizer_workers.images.base import ImageError

        try:
            return [self.images.load_image_part(ref.url, ref.where, ref.media_type) for ref in refs]
        except ImageError as exc:
            raise oa.InvalidRequest(str(exc), exc.param, code="invalid_image") from None

    def expand_images(self, ids: array, images: list[ProcessedImage]) -> tuple[array, list[protocol.ImageItem]]:
        """Each image's one placeholder token repeated to its token count, and the protocol items
        saying where each image's placeholder run lies (the template put one per image part)."""
        if not images:
            return ids, []
        import numpy as np

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

    # ---- chat templates -------------------------------------------------------------

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
