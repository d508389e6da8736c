"""The wire protocol between tokenmill and a GPU scheduler (see docs/engines/scheduler-protocol.md).

Typed msgspec Structs, encoded as MessagePack maps with a ``type`` tag so that an
engine written in any language can implement the scheduler side from the doc alone.
Token IDs never appear as MessagePack arrays: they travel as raw little-endian
uint32 bytes (a separate ZeroMQ frame for prompts, a ``bin`` field for outputs),
so neither side has to build per-token objects to move them.
"""

from __future__ import annotations

import re
import sys
from array import array
from typing import Any

import msgspec

PROTOCOL_VERSION = 1  # 1.1 and 1.2 add optional fields only; a scheduler announces what it honours in Welcome.features

# finish_reason values a scheduler may report.
FINISH_STOP = "stop"  # a stop token (EOS or one of stop_token_ids) was generated
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_ABORT = "abort"  # the request was aborted (Abort, or the scheduler gave up on it)
FINISH_ERROR = "error"  # the scheduler failed the request; ``error`` says why


class SamplingParams(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=False):
    """Sampling settings, with OpenAI's meanings. top_k 0 means disabled."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # 1.1, each honoured only by a scheduler that lists it in Welcome.features:
    min_p: float = 0.0  # 0 disables
    repetition_penalty: float = 1.0  # 1 disables
    min_tokens: int = 0  # stop tokens cannot end the request before this many tokens
    logit_bias: dict[int, float] = {}  # token ID -> bias added to its logit, in [-100, 100]
    # 1.2, likewise:
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated (None: any)
    bad_words: list[
        list[int]
    ] = []  # token sequences never generated: a sequence's last token is banned after its others


class Structured(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=False):
    """A constraint on the whole output (1.1): the engine decodes only text the spec accepts."""

    kind: str  # one of STRUCTURED_KINDS
    spec: str = ""  # json_schema / structural_tag: JSON text; regex: the pattern; grammar: EBNF; json_object: ""
    choices: list[str] = []  # kind "choice": the output is exactly one of these
    # 1.2, each with its feature: JSON (json_schema, json_object) without optional whitespace ...
    disable_any_whitespace: bool = False
    # ... or with its optional whitespace matching this regex (None: the engine's own)
    whitespace_pattern: str | None = None


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")

# What a 1.1 scheduler may list in Welcome.features: the optional Generate fields it honours.
# A front end sends none of them to a scheduler that did not list it (a 1.0 scheduler would
# silently ignore it).
FEATURE_LOGPROBS = "logprobs"
SAMPLING_FEATURES = ("min_p", "repetition_penalty", "min_tokens", "logit_bias")
STRUCTURED_FEATURES = tuple(f"structured.{kind}" for kind in STRUCTURED_KINDS)
# 1.2: scheduling, prefix-cache isolation, token masks
FEATURE_PRIORITY = "priority"  # Generate.priority (listed only by a scheduler that orders its queue by it)
FEATURE_CACHE_SALT = "cache_salt"  # Generate.cache_salt
SAMPLING_FEATURES_12 = ("allowed_token_ids", "bad_words")
# 1.2, continued: the prompt's logprobs, and what vLLM passes to its engine in SamplingParams.extra_args
FEATURE_PROMPT_LOGPROBS = "prompt_logprobs"  # Generate.prompt_logprobs, and the first RequestOutput's prompt_* arrays
FEATURE_KV_TRANSFER_PARAMS = "kv_transfer_params"  # Generate.kv_transfer_params, RequestOutput.kv_transfer_params
FEATURE_EXTRA_ARGS = "extra_args"  # Generate.extra_args (vLLM's vllm_xargs)
# 1.2, continued: the whitespace a JSON constraint allows
FEATURE_DISABLE_ANY_WHITESPACE = "structured.disable_any_whitespace"  # Structured.disable_any_whitespace
FEATURE_WHITESPACE_PATTERN = "structured.whitespace_pattern"  # Structured.whitespace_pattern
STRUCTURED_OPTION_FEATURES = (FEATURE_DISABLE_ANY_WHITESPACE, FEATURE_WHITESPACE_PATTERN)
# 1.2, continued: images (processed pixels as binary frames after the prompt frame)
FEATURE_IMAGES = "images"  # Generate.images
# 1.2, continued: the scheduler keeps the images it was sent, by content_hash, and takes an item whose pixel
# frame is empty as the one it holds; an item it no longer holds gets Error code ERR_IMAGE_MISSING, and the
# front end sends the same Generate again with the pixels
FEATURE_IMAGES_BY_HASH = "images.by_hash"
ERR_IMAGE_MISSING = "image_missing"
# 1.2, continued: an item's pixels may wait in a shared-memory file (ImageItem.shm, its frame empty) that a
# scheduler on the same host maps instead of reading them from the socket; one it cannot open gets
# ERR_IMAGE_MISSING, and the front end sends the same Generate again with the pixels in the frames
FEATURE_IMAGES_SHM = "images.shm"
SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"tokenmill-img-[A-Za-z0-9_.-]{1,200}")  # the only names a scheduler opens there
FEATURES_12 = (
    FEATURE_PRIORITY,
    FEATURE_CACHE_SALT,
    *SAMPLING_FEATURES_12,
    FEATURE_PROMPT_LOGPROBS,
    FEATURE_KV_TRANSFER_PARAMS,
    FEATURE_EXTRA_ARGS,
    *STRUCTURED_OPTION_FEATURES,
    FEATURE_IMAGES,
    FEATURE_IMAGES_BY_HASH,
    FEATURE_IMAGES_SHM,
)
FEATURES = (FEATURE_LOGPROBS, *SAMPLING_FEATURES, *STRUCTURED_FEATURES, *FEATURES_12)


class Hello(msgspec.Struct, tag="hello"):
    """Front end -> scheduler, first message after every (re)connect."""

    protocol_version: int
    client_name: str = "tokenmill"


class ImageItem(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=False):
    """One processed image of a prompt (1.2, feature ``images``); its pixels are the frame after the
    prompt frame at this item's position among ``Generate.images``."""

    family: str  # the preprocessing that made the pixels, e.g. "qwen2_vl" (Qwen2-VL's pixel_values)
    dtype: str  # of the pixel frame, little-endian: "float32" (or "uint8", "float16", "bfloat16")
    shape: list[int]  # of the pixel array, row-major; qwen2_vl: [patches, 1176]
    grid_thw: list[int]  # qwen2_vl: [1, height / 14, width / 14] (image_grid_thw)
    offset: int  # the first of the image's placeholder tokens in the prompt
    length: int  # how many placeholder tokens it occupies there
    content_hash: str  # equal hashes: equal pixels (an engine may cache by it; with images.by_hash, must)
    # 1.2 images.shm: the pixels are the file SHM_DIR/<shm> (a name matching SHM_NAME) when the frame is empty
    shm: str | None = None


IMAGE_DTYPES = {"float32": 4, "uint8": 1, "float16": 2, "bfloat16": 2}


class Generate(msgspec.Struct, tag="generate"):
    """Front end -> scheduler: start a request. The next frame holds the prompt token IDs."""

    request_id: str
    prompt_token_count: int
    max_new_tokens: int
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Token IDs that end the request with finish_reason "stop". The front end puts the
    # model's EOS IDs here itself (unless the client asked for ignore_eos), so the
    # scheduler needs no tokenizer knowledge.
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    # Whether a generated stop token is included in the output token_ids (it is: the
    # front end's detokenizer skips special tokens itself).
    ignore_eos: bool = False
    # 1.1: the logprobs of each generated token (0), and of the top N tokens at each step (N > 0)
    logprobs: int | None = None
    structured: Structured | None = None  # 1.1: constrained decoding
    # 1.2: the waiting queue is ordered by priority, lower first, FIFO among equals (int64)
    priority: int = 0
    # 1.2: mixed into the prefix-cache key of the prompt's blocks: only requests with the same salt share them
    cache_salt: str | None = None
    # 1.2: the logprob of each prompt token after the first (0), and the top N at each such position (N > 0)
    prompt_logprobs: int | None = None
    # 1.2: disaggregated prefill, for the engine's KV connector (vLLM's kv_transfer_params; any map)
    kv_transfer_params: dict[str, Any] | None = None
    # 1.2: engine-specific extra arguments (vLLM's vllm_xargs: str -> str | int | float | list of those)
    extra_args: dict[str, Any] | None = None
    # 1.2: the prompt's images, in prompt order; each one's pixels follow the prompt frame as a frame of its own
    images: list[ImageItem] = []
    # 1.2: the LoRA adapter to run the request with, one of the scheduler's Welcome.adapters (nil: the base model)
    adapter: str | None = None


class Abort(msgspec.Struct, tag="abort"):
    """Front end -> scheduler: stop these requests and free their state. Unknown IDs are ignored."""

    request_ids: list[str]


class Welcome(msgspec.Struct, tag="welcome"):
    """Scheduler -> front end: the answer to Hello when the version is supported."""

    protocol_version: int
    scheduler_name: str
    max_running_requests: int | None = None
    max_model_len: int | None = None
    # 1.1: the optional Generate fields this scheduler honours (FEATURES); None: a 1.0 scheduler
    features: list[str] | None = None
    max_logprobs: int | None = None  # the largest Generate.logprobs it takes, if it takes logprobs
    vocab_size: int | None = None  # 1.1: prompt token IDs must be below it; data-parallel ranks must agree
    # 1.2: the LoRA adapters it serves beside the base model, by name (what Generate.adapter may be); nil: none
    adapters: list[str] | None = None


class PromptLogprobs(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=False):
    """The prompt's logprobs (1.2): for each prompt position 1 .. prompt_tokens - 1 (the first token has
    none), packed like RequestOutput's logprobs."""

    logprobs: bytes = b""  # the prompt token's logprob there, float32 little-endian
    ranks: bytes = b""  # its rank among the vocabulary (1: the most likely), uint32 little-endian
    top_ids: bytes = b""  # with Generate.prompt_logprobs N > 0: the N most likely tokens there, best first
    top_logprobs: bytes = b""  # and their logprobs, float32 little-endian


class RequestOutput(msgspec.Struct):
    """New tokens of one request since its previous RequestOutput."""

    request_id: str
    token_ids: bytes = b""  # raw little-endian uint32, possibly empty
    finish_reason: str | None = None  # None while the request runs
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the scheduler's prefix cache
    completion_tokens: int = 0  # total generated so far, including these
    error: str | None = None  # set with finish_reason "error"
    # 1.1, with Generate.logprobs set: per token of token_ids, float32 little-endian
    logprobs: bytes = b""
    # and with logprobs N > 0: N per token, best first (uint32 / float32 little-endian)
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    # 1.2, with Generate.prompt_logprobs set: the prompt's logprobs, in the request's first RequestOutput only
    prompt_logprobs: PromptLogprobs | None = None
    # 1.2, with the feature kv_transfer_params: what the engine's KV connector returns, in the final output
    kv_transfer_params: dict[str, Any] | None = None


class Outputs(msgspec.Struct, tag="outputs"):
    """Scheduler -> front end: one batch of outputs, typically one per engine step."""

    outputs: list[RequestOutput]


class Stats(msgspec.Struct, tag="stats"):
    """Scheduler -> front end, optional and periodic: queue figures for metrics."""

    num_running: int
    num_waiting: int
    # Optional engine counters (docs/engines/scheduler-protocol.md §3.7); None: not reported.
    peak_running: int | None = None  # most requests running at once since the scheduler started
    cancelled_total: int | None = None  # requests the engine has cancelled (abort, front end gone) since start


class Error(msgspec.Struct, tag="error"):
    """Scheduler -> front end: a rejected message. request_id None means the connection itself."""

    message: str
    code: str = "bad_request"
    request_id: str | None = None
    param: str | None = None  # 1.1: the Generate field at fault (with code "unsupported": the one it cannot honour)


ToScheduler = Hello | Generate | Abort
FromScheduler = Welcome | Outputs | Stats | Error

_encoder = msgspec.msgpack.Encoder()
_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_from_scheduler = msgspec.msgpack.Decoder(FromScheduler)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_scheduler(frame: bytes | memoryview) -> Hello | Generate | Abort:
    return _to_scheduler.decode(frame)


def decode_from_scheduler(frame: bytes | memoryview) -> Welcome | Outputs | Stats | Error:
    return _from_scheduler.decode(frame)


def ids_to_frame(token_ids) -> bytes:
    """Token IDs (any iterable of ints, or a uint32 array) as a raw little-endian uint32 frame."""
    if isinstance(token_ids, array) and token_ids.typecode == "I" and sys.byteorder == "little":
        return token_ids.tobytes()
    arr = array("I", token_ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def floats_to_bytes(values) -> bytes:
    """Logprobs as the float32 little-endian bytes RequestOutput carries."""
    arr = array("f", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def bytes_to_floats(data: bytes | memoryview) -> array:
    arr = array("f")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def frame_to_ids(frame: bytes | memoryview) -> array:
    """The inverse of ids_to_frame: a compact uint32 array (index it, or list() it)."""
    arr = array("I")
    arr.frombytes(frame)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr
