"""Messages between the gateway and its tokenizer workers (an internal protocol).

A gateway reaches the workers it spawned over socket pairs (tokenmill/transport/pipe_link.py) and
workers on other hosts, or shared with the node's other gateways, over a ZeroMQ ROUTER; the
messages are the same. Frames after the first (the msgpack header) are opaque to the gateway:
raw request bodies going in, ready-made scheduler ``Generate`` headers and uint32 token
frames coming out.
"""

from __future__ import annotations

import msgspec

from tokenmill.scheduler_client.protocol import PromptLogprobs

# ---- gateway -> worker ------------------------------------------------------------


class ConvertJob(msgspec.Struct, tag="convert"):
    """Convert one HTTP request body. Frame 2 is the raw body."""

    job_id: int
    kind: str  # "chat" | "completion" | "responses" | "tokenize" | "detokenize"
    request_id: str  # the scheduler request id prefix for this HTTP request
    quick: bool = False  # a small body: convert it on the IO thread at once, beside any long conversion


class DetokItem(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: bytes  # raw little-endian uint32 from the scheduler, untouched
    finished: bool  # the scheduler ended this request: flush and free its state
    # the scheduler's logprob arrays for these tokens (RequestOutput's), untouched; empty without logprobs
    logprobs: bytes = b""
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    prompt_logprobs: PromptLogprobs | None = None  # RequestOutput's (the first output of a request that asked)


class DetokBatch(msgspec.Struct, tag="detok"):
    items: list[DetokItem]


class Release(msgspec.Struct, tag="release"):
    """Forget the detokenizer state of these requests (aborted, failed, disconnected)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str = ""  # to a refused remote worker: why (it logs it and exits with an error)


class Limits(msgspec.Struct, tag="limits"):
    """What the engine's Welcome said: requests are checked against the smaller of its context length
    and the model's, so a prompt the engine would refuse is a 400 that says why, and a field the
    engine does not list among its protocol 1.1 features is refused by name."""

    max_model_len: int | None = None
    features: list[str] | None = None
    max_logprobs: int | None = None
    adapters: list[str] | None = None  # LoRA adapters every engine serves: other model names requests may use


class WorkerSettings(msgspec.Struct, tag="settings"):
    """The answer to a remote worker's hello: its place in the pool and the converter settings
    (ConverterSettings as JSON), so a worker on another host converts exactly as local ones do."""

    worker_index: int
    settings: bytes


class Rejoin(msgspec.Struct, tag="rejoin"):
    """To a remote worker the gateway no longer counts (it went silent, or the gateway restarted):
    forget every request and say hello again."""


class Placed(msgspec.Struct, tag="placed"):
    """With --gateways N and several scheduler ranks: a gateway put a turn of this conversation on this
    rank. The worker that converts the conversation's turns (the same one, whichever gateway takes
    them) remembers it and says it in the next turn's ConvertDone, so every gateway sends the
    conversation where its history is cached."""

    conversation: int
    rank: int


class ResumeStream(msgspec.Struct, array_like=True):
    """One stream moving to this worker from one that died or was lost (tokenizer_workers/resume.py)."""

    request_id: str
    spec: bytes  # the ConvertDone's resume entry for this choice, as the converting worker encoded it
    history: bytes  # the token frames the old worker answered, concatenated (uint32)
    chunks: bytes  # tokens per answered batch (uint32): the replay batches them the same way
    items: list[DetokItem]  # what the old worker had not answered: detokenized as usual after the replay


class Resume(msgspec.Struct, tag="resume"):
    """Take these streams over: rebuild each one's state silently, then answer ``items`` (a DetokOut)."""

    streams: list[ResumeStream]


class PixelsWanted(msgspec.Struct, tag="pixels_wanted"):
    """The engine no longer holds an image this request sent by its hash alone (protocol 1.2
    ``image_missing``): the pixel frames of these images, in this order, from the worker's image cache."""

    request_id: str
    content_hashes: list[str]


ToWorker = (
    ConvertJob | DetokBatch | Release | Shutdown | Limits | WorkerSettings | Rejoin | Placed | Resume | PixelsWanted
)

# ---- worker -> gateway ------------------------------------------------------------


class WorkerReady(msgspec.Struct, tag="ready"):
    worker_index: int
    pid: int
    max_model_len: int
    tokenize_cache: bool = False  # the segment-separability self-test passed and the cache is on
    tokenize_cache_reason: str = ""
    tool_call_parser: str = ""  # the parsers the worker applies ("" = none), "auto" resolved
    reasoning_parser: str = ""
    vocab_size: int = 0  # the tokenizer's, with added tokens: a scheduler rank must take every ID below it
    fingerprint: str = ""  # hash of tokenizer, templates and context length: a remote worker must match
    conversion_threads: int = 1  # non-quick jobs it converts at once (a worker that does not say: one)


class WorkerHello(msgspec.Struct, tag="hello"):
    """A remote worker (``tokenmill worker --connect``) asks to join the pool."""

    pid: int
    host: str
    index: int = -1  # its index in the gateway that spawned it: the same place in every pool keeps affinity


class Heartbeat(msgspec.Struct, tag="beat"):
    """A remote worker is alive (sent every second): a host that vanishes sends no FIN, so silence is
    the only sign, and its jobs must move on within seconds."""


class CacheReport(msgspec.Struct, array_like=True):
    """The tokenization cache's work on one conversion, and its state after it."""

    hits: int
    misses: int
    cached_tokens: int
    fresh_tokens: int
    mismatches: int
    evictions: int  # pieces evicted during this conversion (a count per conversion adds up across gateways)
    bytes_used: int
    prefix_hits: int = 0  # 1 when the prompt began with the IDs of an earlier prompt of this worker


class ApiError(msgspec.Struct):
    """An OpenAI-style error the gateway returns as is."""

    status: int
    message: str
    type: str = "BadRequestError"
    param: str | None = None
    code: str | None = None


class ChoicePlan(msgspec.Struct, array_like=True):
    """One scheduler request of an HTTP request (a completions prompt list has several)."""

    request_id: str
    prompt_tokens: int
    counts_prompt: bool = True  # False for the 2nd..nth choice of one prompt: usage counts a prompt once


class Timing(msgspec.Struct, array_like=True):
    """Where one conversion's time went: the gateway's Server-Timing header, its conversion metrics, and
    its dispatch's estimate of what a cold conversion costs."""

    render_s: float = 0.0
    tokenize_s: float = 0.0
    # the worker process's CPU while tokenizing (all its threads), divided among concurrent encodings
    tokenize_cpu_s: float = 0.0
    queue_s: float = 0.0  # time between arrival at the worker and the start of conversion
    cache: CacheReport | None = None


class CompletionShape(msgspec.Struct):
    """What chat.completion and text_completion responses show beyond the text, as the request asked
    (gateway/openai_format.py's Framer); the Messages and Responses APIs frame their own answers."""

    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    logprobs: bool = False  # the choices carry logprobs (null in the response otherwise)
    # vLLM's return_token_ids: each prompt's token IDs as a JSON array (the choices are prompt-major, n per
    # prompt); None when not asked. token_ids: the choices' generated IDs are shown (vLLM hides them when
    # a parser is at work and include_reasoning is false)
    prompt_token_ids: list[bytes] | None = None
    token_ids: bool = False
    functions: bool = False  # the request used OpenAI's legacy functions: answer with message.function_call
    role: str = "assistant"  # chat: the answer's role (the last message's with add_generation_prompt false, as vLLM)
    forced_calls: bool = False  # tool_choice forced the calls: a message with calls has content "" (as vLLM)
    # vLLM's prompt_logprobs (non-streamed): the response carries them (chat: at the top, completions: per
    # choice), null where the engine sent none; kv_transfer_params: the request passed some to the engine,
    # so the response carries what the engine returned (null if nothing)
    prompt_logprobs: bool = False
    kv_transfer_params: bool = False


class ResponsesShape(msgspec.Struct):
    """What the Responses API's framer needs beyond the chat answer: the tools whose calls are
    custom_tool_call items, and the request fields the response object repeats."""

    custom_tools: list[str] = []
    tool_namespaces: dict[str, str] = {}  # a namespace's function as the model saw it (ns__name) -> the namespace
    response_fields: bytes | None = None  # a JSON object the gateway splices in as it is


class ConvertDone(msgspec.Struct, tag="done"):
    """Result of a ConvertJob.

    For generation kinds, ``frames_per_choice`` frames per choice follow: the encoded scheduler
    ``Generate`` header, the prompt token frame and one pixel frame per image, which the gateway
    forwards as they are.
    For tokenize/detokenize, ``body`` is the finished JSON response.
    What only some APIs read is in the shapes: ``completion`` for chat and completions, ``responses``
    for the Responses API (None otherwise); ``timing`` for every answer but an error.
    """

    job_id: int
    error: ApiError | None = None
    body: bytes | None = None
    choices: list[ChoicePlan] = []
    stream: bool = False
    client_request_id: str | None = None  # the request's own request_id (vLLM's): the response id's tail
    adapter: str | None = None  # the LoRA adapter the request named as its model: the response's model
    conversation: int | None = None  # chat: a hash of the messages up to the first user message, equal on every turn
    home_rank: int = -1  # the scheduler rank a gateway last placed this conversation on (Placed); -1: none known
    # Generate fields -> the request fields they came from ("structured" -> "response_format", ...): an
    # engine's refusal of one names the request field in its 400
    fields: dict[str, str] = {}
    # the finish reason of a choice that ends in tool calls: "stop" when tool_choice named the function
    # (as OpenAI's), "function_call" for OpenAI's legacy functions
    calls_finish: str = "tool_calls"
    timing: Timing | None = None
    completion: CompletionShape | None = None
    responses: ResponsesShape | None = None
    frames_per_choice: int = 2  # header, prompt, then one per image (protocol 1.2 images)
    # per choice: its detokenizer spec as bytes the gateway keeps without reading, so that another worker
    # can take the stream over if this one dies (tokenizer_workers/resume.py); empty: not resumable
    resume: list[bytes] = []
    # the content hashes of the request's images, in order, when at least one went without its pixels (an
    # empty pixel frame: protocol 1.2 images.by_hash, or images.shm): the gateway keeps the frames it sent until the
    # engine answers, and asks for these pixels (PixelsWanted) if the engine says image_missing
    images_by_hash: list[str] = []
    # of those, how many went as a shared-memory file the engine maps (images.shm), over all choices
    images_shm: int = 0


class OutPiece(msgspec.Struct, array_like=True):
    """One parsed piece of a choice's output, in order (requests with a tool or reasoning parser)."""

    kind: str  # "content" | "reasoning" | "call"
    text: str  # the content or reasoning text; a call's arguments (a JSON object)
    name: str = ""  # a call's function name
    call_id: str = ""
    index: int = 0  # a call's index among the choice's calls


class DetokDelta(msgspec.Struct, array_like=True):
    request_id: str
    text: str  # the new text (requests without parsers; with parsers it is in ``pieces``)
    stopped: bool  # a stop string matched: the gateway ends the choice and aborts it
    final: bool  # the worker has freed this request's state; no more deltas follow
    pieces: list[OutPiece] = []
    # logprobs of this delta's tokens as JSON fragments, entries comma-joined without brackets:
    # chat: [content]; completions: [tokens, token_logprobs, top_logprobs, text_offset]
    logprobs: list[bytes] = []
    tokens: int = 0  # the request's tokens the detokenizer has taken so far (usage in every chunk)
    # vLLM's return_token_ids: this delta's generated token IDs, comma-joined without brackets; None when
    # the request did not ask for them
    token_ids: bytes | None = None
    # the last delta's: vLLM's stop_reason, the stop string or the stop token ID that ended the choice
    stop_reason: str | int | None = None
    # vLLM's prompt_logprobs: the JSON array of the prompt's logprobs (null first), with the request's first delta
    prompt_logprobs: bytes | None = None
    # a stream this worker could not take over (Resume): why; the gateway fails that request with it
    error: str = ""


class DetokOut(msgspec.Struct, tag="detok_out"):
    items: list[DetokDelta]
    detok_s: float = 0.0
    parse_failures: dict[str, int] = {}  # tool-call parser name -> calls returned as content


class WorkerBusy(msgspec.Struct, tag="busy"):
    """To a gateway sharing this worker with others (--gateways N): the worker started converting
    another gateway's job (busy), or converts none any more, so that it queues no long jobs behind those."""

    busy: bool


class Pixels(msgspec.Struct, tag="pixels"):
    """The answer to PixelsWanted: with ``found``, one pixel frame per hash asked follows; without, the
    worker no longer has them all (the gateway fails that request, to be retried)."""

    request_id: str
    found: bool


FromWorker = WorkerReady | ConvertDone | DetokOut | WorkerHello | Heartbeat | WorkerBusy | Pixels

encoder = msgspec.msgpack.Encoder()
to_worker = msgspec.msgpack.Decoder(ToWorker)
from_worker = msgspec.msgpack.Decoder(FromWorker)
