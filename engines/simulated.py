"""A simulated GPU scheduler: the scheduler side of docs/scheduler-protocol.md without a GPU.

It binds a ZeroMQ ROUTER, answers Hello with Welcome, and "generates" tokens for
Generate requests with a simple performance model:

* prefill is one shared resource: admitted requests are prefilled one after another,
  each taking ``prompt tokens / prefill_tokens_per_s`` seconds, before their first token;
* decoding runs in steps every ``inter_token_latency`` seconds; in every step each
  decoding request gets exactly one token, and all outputs of a step for one front end
  travel in ONE Outputs message;
* at most ``max_running`` requests are admitted (prefilling + decoding); the rest wait
  in FIFO order.

Generated tokens are deterministic for a given ``sampling.seed`` (together with the
prompt), deterministic from the prompt alone with ``seed`` None and temperature 0, and
random otherwise. With a tokenizer (``--model``) they are drawn sentence by sentence from
a fixed English paragraph so that demo output reads as text; without one, uniformly from
``[0, vocab_size)`` minus the request's stop token IDs. ``--mode echo`` repeats the
prompt instead. ``--replies FILE`` scripts the output: a request whose prompt contains a
reply's ``match`` generates that reply's text, then the model's EOS (docs/scheduler-protocol.md §10).

Protocol 1.1 (``Welcome.features`` lists everything in ``protocol.FEATURES``; without a
tokenizer, all but the ``structured.*`` ones):

* ``structured``: constrained decoding under llguidance over the served vocabulary
  (:mod:`tokenmill.engines.guided`): each step draws one of the tokens the matcher allows with the request's
  generator (so deterministic for (seed, prompt)); once the grammar is complete the first stop
  token ends it with ``"stop"``; ``max_new_tokens`` still cuts it (``"length"``). A spec llguidance
  refuses is refused with its message (``bad_request``, ``param`` "structured").
* ``logprobs``: every generated token (a final stop token included) gets a logprob in
  (-3, 0), a hash of the request's key (seed and prompt, or random when unseeded) and its
  position; with N > 0 the top N are the chosen token first, then N-1 other distinct IDs
  (from the palette, else the vocabulary) with strictly lower, descending logprobs whose
  probabilities sum with the chosen one's to at most 1. Requests without logprobs take the
  unchanged fast path.
* ``min_tokens``: no stop token ends a request before it has that many tokens: random mode
  skips ``--eos-probability`` and palette stop tokens, echo mode skips the prompt's stop
  tokens, and a scripted reply that ends early holds its stop token back, random-mode text
  filling up to ``min_tokens``. A structured request does not stop where its grammar could go
  on before ``min_tokens``; where the grammar allows nothing more, it stops anyway.
* ``logit_bias`` (random mode only): a token with bias <= -100 is never drawn (nor emitted
  by ``--eos-probability``); the token with the highest bias >= 100 (the lowest ID among
  equals) is drawn at every step instead (unless it is a stop token held back by
  ``min_tokens``). Other biases have no effect.
* ``min_p`` and ``repetition_penalty`` are accepted and have no visible effect: the
  simulator has no distribution to reshape.

Protocol 1.2 (docs/scheduler-protocol.md §10.3): ``cache_salt``, ``allowed_token_ids`` and
``bad_words`` are always listed, ``priority`` only with ``--scheduling priority``:

* ``priority``: the waiting queue is a heap on (priority, arrival): lowest first, FIFO among equals;
* ``cache_salt``: starts the ``--prefix-cache-tokens`` model's chain of block hashes;
* ``allowed_token_ids`` / ``bad_words`` (random mode): draws keep to the allowed IDs and never
  complete a banned sequence (its last token after the others as the latest generated tokens);
* ``structured.disable_any_whitespace`` / ``structured.whitespace_pattern`` (listed with a tokenizer):
  a JSON constraint is compiled without optional whitespace, or with the pattern as llguidance's
  whitespace (:func:`tokenmill.engines.guided.grammar_of`); other kinds are unchanged.

Run it as ``tokenmill simulate-scheduler --bind ENDPOINT`` or
``python -m tokenmill.engines.simulated --bind ENDPOINT``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import itertools
import json
import logging
import math
import random
import signal
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from tokenmill.engines.busy_cores import BusyCores
from tokenmill.engines.guided import Decoder, Guide, GuideError
from tokenmill.engines.held_images import HeldImages
from tokenmill.scheduler_client import shared_pixels, structured
from tokenmill.scheduler_client.protocol import (
    FEATURE_IMAGES_SHM,
    FEATURE_PRIORITY,
    FEATURES,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    PROTOCOL_VERSION,
    STRUCTURED_FEATURES,
    STRUCTURED_OPTION_FEATURES,
    Generate,
    Outputs,
    PromptLogprobs,
    RequestOutput,
    Stats,
    Structured,
    Welcome,
    encode,
    floats_to_bytes,
    ids_to_frame,
)
from tokenmill.scheduler_client.scheduler_side import (
    ERR_BAD_REQUEST,
    ERR_DUPLICATE,
    ERR_UNKNOWN_MESSAGE,
    ERR_UNSUPPORTED,
    ERR_VERSION_MISMATCH,
    Rejected,
    SchedulerServer,
    Session,
    read_curve_secret,
)

log = logging.getLogger("tokenmill.simulated_scheduler")

SCHEDULER_NAME = "tokenmill-simulated"
DEFAULT_VOCAB_SIZE = 129280  # DeepSeek-V3/V4, the embedded default model

__all__ = [
    "SimulatedScheduler",
    "add_arguments",
    "main",
    "resolve_model_dir",
    "run",
    "scheduler_from_args",
    # the error codes this scheduler sends (docs/scheduler-protocol.md lists them)
    "ERR_BAD_REQUEST",
    "ERR_DUPLICATE",
    "ERR_UNKNOWN_MESSAGE",
    "ERR_UNSUPPORTED",
    "ERR_VERSION_MISMATCH",
]

# Demo text: generated tokens are whole sentences of this paragraph, picked at random.
PALETTE_TEXT = (
    "The river wound slowly through the valley, carrying the last light of the afternoon. "
    "On the far bank, a small boat rested against the reeds, its paint faded by many summers. "
    "An old man sat on the steps of the mill and watched the water turn the great wheel. "
    "He had worked there since he was a boy, and he knew every sound the machinery made. "
    "Today the grinding stones were quiet, because the harvest had not yet come in. "
    "Children ran along the path with a kite that refused to rise in the still air. "
    "Somewhere in the village a bell rang, and the swallows lifted from the rooftops. "
    "The baker closed his shutters and walked home with a loaf under each arm. "
    "Clouds gathered over the hills, promising rain before the night was over. "
    "In the morning, the fields would be bright and the wheel would turn again. "
    "Nobody was in a hurry, and the evening settled gently over the houses. "
    "A dog barked twice at a passing cart and then lay down in the warm dust."
)


# --------------------------------------------------------------------------- token sources


class _TokenSource:
    """Where random-mode tokens come from: a tokenized palette, or a uniform ID range."""

    def __init__(self, vocab_size: int, sentences: list[list[int]] | None = None) -> None:
        self.vocab_size = vocab_size
        self.sentences = [s for s in (sentences or []) if s]

    @property
    def uses_palette(self) -> bool:
        return bool(self.sentences)


def _build_palette(tokenizer, vocab_size: int | None) -> tuple[int, list[list[int]]]:
    """(vocab size, the palette paragraph tokenized one sentence at a time)."""
    size = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(with_added_tokens=True)
    added = set(tokenizer.get_added_tokens_decoder())
    sentences = []
    for sentence in PALETTE_TEXT.split(". "):
        text = " " + sentence.rstrip(".") + "."
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        ids = [i for i in ids if i < size and i not in added]
        if ids:
            sentences.append(ids)
    return size, sentences


class ScriptedReplies:
    """``--replies FILE``: JSON lines of {"match": "...", "text": "..."}.

    A request whose decoded prompt contains a reply's ``match`` generates that reply's
    ``text``, tokenized with the served tokenizer (markers and other special tokens as
    single tokens), and then stops with the request's first stop token (the model's EOS).
    Where several replies match, the one whose match stands latest in the prompt wins: in
    a chat that is the one in the newest message, so an agent's turns can be scripted by
    their last user or tool message.
    """

    def __init__(self, path: str | Path, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.replies: list[tuple[str, list[int]]] = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
                if not (
                    isinstance(entry, dict)
                    and isinstance(entry.get("match"), str)
                    and entry["match"]
                    and isinstance(entry.get("text"), str)
                ):
                    raise ValueError(f'{path}:{number}: expected {{"match": "non-empty string", "text": "string"}}')
                ids = tokenizer.encode(entry["text"], add_special_tokens=False).ids
                self.replies.append((entry["match"], ids))
        if not self.replies:
            raise ValueError(f"{path} holds no replies")

    def for_prompt(self, prompt: Sequence[int]) -> list[int] | None:
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        best, where = None, -1
        for match, ids in self.replies:
            at = text.rfind(match)
            if at > where:
                best, where = ids, at
        return best


def resolve_model_dir(model: str) -> Path:
    """``default`` -> the embedded default model's directory, else the path itself."""
    if model == "default":
        from tokenmill.tokenizer_workers.model import default_model_dir

        return default_model_dir()
    return Path(model)


class PrefixCache:
    """A model of an engine's prefix cache (vLLM's automatic prefix caching), for data-parallel tests.

    Prompts are cut into blocks of ``BLOCK`` tokens; a block is cached when the same block with the
    same prefix was prefilled before (a chained hash), and the least recently used blocks go first
    once ``capacity_tokens`` are held. ``admit`` returns the prompt tokens served from the cache and
    caches the rest; the simulator prefills only those that were not.
    """

    BLOCK = 16

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(1, capacity_tokens // self.BLOCK)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def admit(self, prompt_bytes: bytes, salt: str | None = None) -> int:
        step = 4 * self.BLOCK
        # a cache_salt (1.2) starts the chain elsewhere: only prompts with the same salt share blocks
        chain, hit, counting = (0 if salt is None else hash(("salt", salt))), 0, True
        for start in range(0, len(prompt_bytes) - step + 1, step):
            chain = hash((chain, prompt_bytes[start : start + step]))
            if counting and chain in self.blocks:
                self.blocks.move_to_end(chain)
                hit += self.BLOCK
                continue
            counting = False
            self.blocks[chain] = None
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


# --------------------------------------------------------------------------- requests

_WAITING, _PREFILLING, _DECODING = "waiting", "prefilling", "decoding"
_PACK1 = struct.Struct("<I").pack


@dataclass(eq=False)
class _Request:
    identity: bytes
    request_id: str
    prompt: Sequence[int]  # array('I')
    max_new_tokens: int
    stop_ids: frozenset[int]
    first_stop_id: int | None  # what --eos-probability emits
    ignore_eos: bool
    rng: random.Random
    script: list[int] | None = None  # a scripted reply's tokens (--replies), or a structured output's
    # 1.1 (defaults: not asked for)
    min_tokens: int = 0
    banned: frozenset[int] = frozenset()  # logit_bias <= -100
    forced: int | None = None  # the token with the highest logit_bias >= 100
    logprobs: int | None = None
    lp_key: int = 0  # what the logprob hash starts from
    # 1.2
    priority: int = 0
    arrival: int = 0  # its place in the --scheduling priority queue
    allowed: tuple[int, ...] | None = None  # sampling.allowed_token_ids
    allowed_set: frozenset[int] | None = None
    bad_words: dict[int, list[tuple[int, ...]]] | None = None  # a banned sequence's last token -> the tokens before it
    history: list[int] | None = None  # generated tokens, kept for bad_words
    prompt_logprobs: int | None = None  # Generate.prompt_logprobs, until the first output has carried them
    kv_out: dict | None = None  # what the final output's kv_transfer_params says (kv_transfer_params, extra_args)
    decoder: Decoder | None = None  # structured: the request's llguidance matcher
    next_token: Callable[[_Request], tuple[int | None, str | None]] | None = None  # set at accept
    state: str = _WAITING
    generated: int = 0
    cached: int = 0  # prompt tokens found in the prefix cache (--prefix-cache-tokens)
    prefill_start: float = 0.0
    ready_at: float = 0.0
    # palette cursor: (sentence index, position in it)
    sentence: int = -1
    position: int = 0
    key: tuple[bytes, str] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.identity, self.request_id)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


_UNSEEDED = random.Random()
_CLOCK_SLACK = 0.001  # the resolution of uvloop's loop.time()


_M64 = (1 << 64) - 1
_LN2 = math.log(2.0)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _logprob_key(generate: Generate, prompt_bytes: bytes) -> int:
    """Deterministic where the tokens are (seed and prompt; prompt with seed None and temperature 0)."""
    seed = generate.sampling.seed
    if seed is None and generate.sampling.temperature != 0:
        return _UNSEEDED.getrandbits(64)
    salt = b"greedy" if seed is None else seed.to_bytes(16, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(b"logprobs" + salt + prompt_bytes, digest_size=8).digest(), "little")


def _make_rng(generate: Generate, prompt_bytes: bytes) -> random.Random:
    """Deterministic for (seed, prompt); for the prompt alone with seed None and temperature 0."""
    seed = generate.sampling.seed
    if seed is not None:
        digest = hashlib.blake2b(seed.to_bytes(16, "little", signed=True) + prompt_bytes, digest_size=16)
    elif generate.sampling.temperature == 0:
        digest = hashlib.blake2b(b"greedy" + prompt_bytes, digest_size=16)
    else:
        return _UNSEEDED  # seeding a new generator from os.urandom per request costs more than the request
    return random.Random(int.from_bytes(digest.digest(), "little"))


# --------------------------------------------------------------------------- the scheduler


class SimulatedScheduler(SchedulerServer):
    """The scheduler side of the protocol, with simulated timing and tokens.

    ``await serve(endpoint)`` binds and runs until ``await close()`` (or cancellation).
    After binding, ``endpoint`` holds the bound address (useful with ``tcp://127.0.0.1:0``)
    and ``await wait_ready()`` returns. Sockets, sessions and validation come from
    :class:`tokenmill.scheduler_client.scheduler_side.SchedulerServer`.
    """

    log = log
    vocab_hint = "(start the simulated scheduler with --model or --vocab-size)"

    def __init__(
        self,
        *,
        prefill_tokens_per_s: float = 200_000.0,
        inter_token_latency_s: float = 0.020,
        max_running: int = 256,
        mode: str = "random",
        model: str | Path | None = None,
        vocab_size: int | None = None,
        eos_probability: float = 0.0,
        stats_interval_s: float = 1.0,
        heartbeat_ivl_ms: int = 2000,
        heartbeat_timeout_ms: int = 10000,
        curve_secret_key: bytes | str | None = None,
        scheduler_name: str = SCHEDULER_NAME,
        replies: str | Path | None = None,
        tokens_per_step: int = 1,
        max_model_len: int | None = None,
        prefix_cache_tokens: int = 0,
        busy_cores: int = 0,
        scheduling: str = "fcfs",
        image_cache_bytes: int = 4 << 30,
    ) -> None:
        if tokens_per_step < 1:
            raise ValueError("tokens_per_step must be at least 1")
        if scheduling not in ("fcfs", "priority"):
            raise ValueError(f"scheduling must be 'fcfs' or 'priority', not {scheduling!r}")
        if mode not in ("random", "echo"):
            raise ValueError(f"mode must be 'random' or 'echo', not {mode!r}")
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        if prefill_tokens_per_s < 0 or inter_token_latency_s < 0:
            raise ValueError("prefill speed and inter-token latency must not be negative")
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError("eos_probability must be within [0, 1]")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError("vocab_size must be at least 1")
        super().__init__(
            scheduler_name=scheduler_name,
            stats_interval_s=stats_interval_s,
            heartbeat_ivl_ms=heartbeat_ivl_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            curve_secret_key=curve_secret_key,
        )

        if replies is not None and model is None:
            model = "default"
        self.replies: ScriptedReplies | None = None
        self._tokenizer = None  # with --model: structured outputs are decoded over its vocabulary
        self._guide: Guide | None = None  # built from it at the first structured request
        # structured requests that arrived while the guide is being built (in a thread, off the loop)
        self._awaiting_guide: list[tuple[Session, Generate, list]] | None = None
        if model is not None:
            from tokenizers import Tokenizer  # only needed with --model

            directory = resolve_model_dir(str(model))
            tokenizer_file = directory / "tokenizer.json"
            if not tokenizer_file.is_file():
                raise ValueError(f"{directory} has no tokenizer.json")
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
            size, sentences = _build_palette(self._tokenizer, vocab_size)
            self._tokens = _TokenSource(size, sentences)
            if replies is not None:
                self.replies = ScriptedReplies(replies, self._tokenizer)
        else:
            self._tokens = _TokenSource(vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE)
        # 1.1: structured outputs need a tokenizer to turn their text into tokens
        self._features = (
            frozenset(FEATURES)
            if self._tokenizer is not None
            else frozenset(FEATURES) - frozenset(STRUCTURED_FEATURES) - frozenset(STRUCTURED_OPTION_FEATURES)
        )
        # 1.2: priority is honoured (and listed) only when the queue is ordered by it, as vLLM's --scheduling-policy
        self.scheduling = scheduling
        if scheduling != "priority":
            self._features -= {FEATURE_PRIORITY}
        if not shared_pixels.available():
            self._features -= {FEATURE_IMAGES_SHM}
        self.max_logprobs = min(20, self._tokens.vocab_size)
        self.image_placeholder_tokens = 0  # 1.2 images: placeholder tokens of the prompts accepted
        # 1.2 images.by_hash: the images it would hold (sizes only: it has no vision tower to feed them to)
        self.held_images = HeldImages(image_cache_bytes)
        # distinct token IDs the top-N alternatives come from (the palette's, else the vocabulary)
        self._alternatives = list(dict.fromkeys(t for sentence in self._tokens.sentences for t in sentence))

        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.tokens_per_step = tokens_per_step  # >1: several tokens per step, as speculative decoding emits
        self.max_model_len = max_model_len or None  # prompt and output together, as an engine's context
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.busy_cores_wanted = busy_cores  # spinners start with serving (busy_cores.py)
        self.busy_cores: BusyCores | None = None
        self.inter_token_latency_s = float(inter_token_latency_s)
        self.max_running = int(max_running)
        self.mode = mode
        self.eos_probability = float(eos_probability)

        self._requests: dict[tuple[bytes, str], _Request] = {}
        self._waiting: dict[tuple[bytes, str], _Request] = {}  # insertion order = FIFO
        # --scheduling priority: (priority, arrival, key) of the waiting requests (stale entries are skipped)
        self._queue: list[tuple[int, int, tuple[bytes, str]]] = []
        self._arrivals = itertools.count()
        self._prefilling: dict[tuple[bytes, str], _Request] = {}  # in prefill order
        self._decoding: dict[tuple[bytes, str], _Request] = {}
        self._prefill_busy_until = 0.0
        self._next_step_at = 0.0
        self._wake: asyncio.Event | None = None

    @property
    def vocab_size(self) -> int:
        return self._tokens.vocab_size

    @property
    def features(self) -> frozenset[str]:  # a subclass may override it with a class attribute
        return self._features

    @property
    def num_running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ SchedulerServer hooks

    def describe(self) -> str:
        return "mode %s, max_running %d, itl %.1f ms, prefill %.0f tok/s, vocab %d%s" % (
            self.mode,
            self.max_running,
            self.inter_token_latency_s * 1000,
            self.prefill_tokens_per_s,
            self.vocab_size,
            ", palette" if self._tokens.uses_palette else "",
        )

    def background(self) -> list:
        self._wake = asyncio.Event()
        if self.busy_cores_wanted and self.busy_cores is None:
            self.busy_cores = BusyCores(self.busy_cores_wanted)
        return [self._engine_loop()]

    def welcome(self) -> Welcome:
        return Welcome(
            protocol_version=PROTOCOL_VERSION,
            scheduler_name=self.scheduler_name,
            max_running_requests=self.max_running,
            max_model_len=self.max_model_len,
            features=sorted(self.features),
            max_logprobs=self.max_logprobs,
            vocab_size=self.vocab_size,
        )

    def holds_image(self, content_hash: str) -> bool:
        return content_hash in self.held_images

    def check(self, gen: Generate) -> None:
        limit = self.max_model_len
        if limit is not None and gen.prompt_token_count >= limit:
            raise Rejected(
                f"the prompt has {gen.prompt_token_count} tokens; this engine handles at most {limit} "
                "tokens (prompt and completion together)"
            )
        if gen.structured is not None:
            try:
                structured.check(gen.structured, "structured")
            except structured.StructuredError as exc:
                param = "structured.whitespace_pattern" if exc.where == "whitespace_pattern" else "structured"
                raise Rejected(str(exc), param=param) from None
            if self._tokenizer is not None:  # without one the feature is not listed: the base class refuses it
                pattern = gen.structured.whitespace_pattern
                if pattern and gen.structured.kind in ("json_schema", "json_object"):
                    try:
                        self.guide.compile(Structured("regex", pattern))
                    except GuideError as exc:
                        raise Rejected(f"whitespace_pattern: {exc}", param="structured.whitespace_pattern") from None
                try:
                    self.guide.compile(gen.structured)
                except GuideError as exc:
                    raise Rejected(f"structured: {exc}", param="structured") from None

    def stats(self) -> Stats:
        return Stats(num_running=self.num_running, num_waiting=self.num_waiting)

    def has_request(self, identity: bytes, request_id: str) -> bool:
        if (identity, request_id) in self._requests:
            return True
        return any(s.identity == identity and g.request_id == request_id for s, g, _ in self._awaiting_guide or ())

    def on_teardown(self) -> None:
        if self.busy_cores is not None:
            self.busy_cores.close()
            self.busy_cores = None
        self._awaiting_guide = None
        self._requests.clear()
        self._waiting.clear()
        self._queue.clear()
        self._prefilling.clear()
        self._decoding.clear()

    def drop_session(self, identity: bytes) -> int:
        self._forget_awaiting(identity)
        gone = [req for req in self._requests.values() if req.identity == identity]
        for req in gone:
            self._remove(req)
        if gone:
            self._reschedule_prefills(asyncio.get_running_loop().time())
            self._wake_engine()
        return len(gone)

    def accept(
        self, session: Session, gen: Generate, prompt: array, prompt_bytes: bytes, pixels: Sequence[memoryview] = ()
    ) -> None:
        # 1.2 images: their placeholder tokens are prompt tokens like any other here (no vision tower)
        self.image_placeholder_tokens += sum(item.length for item in gen.images)
        for item, frame in zip(gen.images, pixels):
            self.held_images.use(item.content_hash, len(frame))
        max_new = gen.max_new_tokens
        if self.max_model_len is not None:
            max_new = min(max_new, self.max_model_len - len(prompt))  # the context ends it with "length"
        req = _Request(
            identity=session.identity,
            request_id=gen.request_id,
            prompt=prompt,
            max_new_tokens=max_new,
            stop_ids=frozenset(gen.stop_token_ids),
            first_stop_id=gen.stop_token_ids[0] if gen.stop_token_ids else None,
            ignore_eos=gen.ignore_eos,
            rng=_make_rng(gen, prompt_bytes),
            script=self.replies.for_prompt(prompt) if self.replies is not None and gen.structured is None else None,
        )
        sampling = gen.sampling
        req.min_tokens = sampling.min_tokens
        if sampling.logit_bias:
            bias = sampling.logit_bias
            req.banned = frozenset(t for t, b in bias.items() if b <= -100)
            top = max(bias.values())
            if top >= 100:
                req.forced = min(t for t, b in bias.items() if b == top)
        if gen.structured is not None:
            req.decoder = Decoder(self.guide, self.guide.compile(gen.structured), req.rng, req.min_tokens)
        if gen.logprobs is not None:
            req.logprobs = gen.logprobs
            req.lp_key = _logprob_key(gen, prompt_bytes)
        req.prompt_logprobs = gen.prompt_logprobs
        if gen.kv_transfer_params is not None or gen.extra_args is not None:
            # no KV connector here: the final output's kv_transfer_params shows what the engine was given
            req.kv_out = {"simulated": True, "kv_transfer_params": gen.kv_transfer_params, "extra_args": gen.extra_args}
        if sampling.allowed_token_ids is not None:
            req.allowed = tuple(dict.fromkeys(sampling.allowed_token_ids))
            req.allowed_set = frozenset(req.allowed)
        if sampling.bad_words:
            req.bad_words = {}
            for seq in sampling.bad_words:
                req.bad_words.setdefault(seq[-1], []).append(tuple(seq[:-1]))
            req.history = []
        masked = req.allowed is not None or req.bad_words is not None
        if req.decoder is not None:
            req.next_token = self._next_token_guided
        elif masked:
            req.next_token = self._next_token_masked
        elif req.min_tokens or sampling.logit_bias:
            req.next_token = self._next_token_11
        else:
            req.next_token = self._next_token
        if self.prefix_cache is not None:
            req.cached = self.prefix_cache.admit(prompt_bytes, gen.cache_salt)
        self._requests[req.key] = req
        self._waiting[req.key] = req
        if self.scheduling == "priority":
            req.priority, req.arrival = gen.priority, next(self._arrivals)
            heapq.heappush(self._queue, (req.priority, req.arrival, req.key))
        self._wake_engine()

    @property
    def guide(self) -> Guide:
        """llguidance over the served vocabulary (built by :meth:`_on_generate` before it is asked for)."""
        if self._guide is None:
            self._guide = self._build_guide()
        return self._guide

    def _build_guide(self) -> Guide:
        palette = {t for sentence in self._tokens.sentences for t in sentence}
        return Guide(self._tokenizer.to_str(), self._tokens.vocab_size, palette)

    def _on_generate(self, session: Session, gen: Generate, extra: list) -> None:
        """A structured request before the guide exists waits for it, built in a thread: about a second of
        llguidance's vocabulary analysis (GIL released) that would otherwise stall every stream's tokens."""
        if gen.structured is None or self._tokenizer is None or self._guide is not None:
            super()._on_generate(session, gen, extra)
            return
        if self._awaiting_guide is None:
            self._awaiting_guide = []
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, self._build_guide).add_done_callback(
                lambda done: loop.call_soon_threadsafe(self._guide_built, done)
            )
        self._awaiting_guide.append((session, gen, extra))

    def _guide_built(self, done) -> None:
        waiting, self._awaiting_guide = self._awaiting_guide or [], None
        if done.exception() is not None:
            log.error("llguidance could not take the served vocabulary: %s", done.exception())
            for session, gen, _ in waiting:
                message = f"structured outputs are unavailable: {done.exception()}"
                self.send_error(session.identity, message, ERR_UNSUPPORTED, gen.request_id, "structured")
            return
        self._guide = done.result()
        for session, gen, extra in waiting:
            super()._on_generate(session, gen, extra)

    def _forget_awaiting(self, identity: bytes, request_ids: set[str] | None = None) -> int:
        """Drop requests still waiting for the guide (an abort, or all of a session's); how many."""
        if not self._awaiting_guide:
            return 0
        before = len(self._awaiting_guide)
        self._awaiting_guide[:] = [
            (session, gen, extra)
            for session, gen, extra in self._awaiting_guide
            if session.identity != identity or (request_ids is not None and gen.request_id not in request_ids)
        ]
        return before - len(self._awaiting_guide)

    def abort(self, identity: bytes, request_ids: list[str]) -> None:
        self._forget_awaiting(identity, set(request_ids))
        finals = []
        for request_id in request_ids:
            req = self._requests.get((identity, request_id))
            if req is None:
                continue  # unknown or already finished: ignored
            self._remove(req)
            finals.append(self._output(req, b"", FINISH_ABORT))
        if finals:
            self._reschedule_prefills(asyncio.get_running_loop().time())
            self._wake_engine()
            self.send(identity, encode(Outputs(outputs=finals)))

    def _wake_engine(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _remove(self, req: _Request) -> None:
        self._requests.pop(req.key, None)
        self._waiting.pop(req.key, None)
        self._prefilling.pop(req.key, None)
        self._decoding.pop(req.key, None)

    # ------------------------------------------------------------------ the engine

    def _prefill_cost(self, req: _Request) -> float:
        if self.prefill_tokens_per_s <= 0:
            return 0.0
        return (req.prompt_tokens - req.cached) / self.prefill_tokens_per_s

    def _admit(self, now: float) -> None:
        while self._waiting and self.num_running < self.max_running:
            if self.scheduling == "priority":  # the lowest priority first, FIFO among equals
                _, arrival, key = heapq.heappop(self._queue)
                req = self._waiting.get(key)
                if req is None or req.arrival != arrival:  # aborted (or its session gone) while waiting
                    continue
                del self._waiting[key]
            else:
                key = next(iter(self._waiting))
                req = self._waiting.pop(key)
            start = max(now, self._prefill_busy_until)
            req.state = _PREFILLING
            req.prefill_start = start
            req.ready_at = start + self._prefill_cost(req)
            self._prefill_busy_until = req.ready_at
            self._prefilling[key] = req

    def _reschedule_prefills(self, now: float) -> None:
        """After removals: queued prefills move up into the freed prefill time."""
        t = now
        for req in self._prefilling.values():
            if req.prefill_start <= now:  # already being prefilled
                t = max(t, req.ready_at)
            else:
                req.prefill_start = t
                req.ready_at = t + self._prefill_cost(req)
                t = req.ready_at
        self._prefill_busy_until = t

    def _finish_prefills(self, now: float) -> None:
        while self._prefilling:
            key = next(iter(self._prefilling))
            req = self._prefilling[key]
            if req.ready_at > now:
                break
            del self._prefilling[key]
            if not self._decoding:
                self._next_step_at = now
            req.state = _DECODING
            self._decoding[key] = req

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        itl = self.inter_token_latency_s
        # uvloop's clock ticks in milliseconds: anything due within a tick is due now, or the
        # loop would spin until the tick turns over
        slack = _CLOCK_SLACK
        while True:
            now = loop.time() + slack
            self._admit(now)
            self._finish_prefills(now)
            if self._decoding and now >= self._next_step_at:
                try:
                    self._step()
                except Exception:
                    log.exception("decode step failed")
                now = loop.time() + slack
                self._next_step_at = max(self._next_step_at + itl, now - slack)
                self._admit(now)
                self._finish_prefills(now)
                if itl <= 0:
                    await asyncio.sleep(0)  # as fast as possible, but let messages in
                    continue
            deadline = None
            if self._decoding:
                deadline = self._next_step_at
            if self._prefilling:
                ready = next(iter(self._prefilling.values())).ready_at
                deadline = ready if deadline is None else min(deadline, ready)
            self._wake.clear()
            if self.busy_cores is not None:
                self.busy_cores.set(deadline is not None or bool(self._waiting))
            if deadline is None:
                await self._wake.wait()
                continue
            if deadline <= loop.time() + slack:
                await asyncio.sleep(0)
                continue
            timer = loop.call_at(deadline, self._wake.set)  # cheaper than asyncio.timeout at every step
            await self._wake.wait()
            timer.cancel()

    def _step(self) -> None:
        """One decode step: tokens_per_step tokens for every decoding request, one Outputs per front end."""
        batches: dict[bytes, list[RequestOutput]] = {}
        per_step = self.tokens_per_step
        for req in list(self._decoding.values()):
            next_token = req.next_token
            if req.logprobs is None:
                tokens = b""
                for _ in range(per_step):
                    token, reason = next_token(req)
                    if token is not None:
                        req.generated += 1
                        tokens += _PACK1(token)
                    if reason is not None:
                        break
                if reason is not None:
                    self._remove(req)
                out = self._output(req, tokens, reason)
            else:
                out = self._step_logprobs(req, next_token, per_step)
            batch = batches.get(req.identity)
            if batch is None:
                batches[req.identity] = [out]
            else:
                batch.append(out)
        for identity, outputs in batches.items():
            self.send(identity, encode(Outputs(outputs=outputs)))

    def _step_logprobs(self, req: _Request, next_token, per_step: int) -> RequestOutput:
        """_step for one request that asked for logprobs."""
        ids: list[int] = []
        lps: list[float] = []
        top_ids: list[int] = []
        top_lps: list[float] = []
        reason = None
        for _ in range(per_step):
            token, reason = next_token(req)
            if token is not None:
                self._logprobs(req, token, lps, top_ids, top_lps)
                req.generated += 1
                ids.append(token)
            if reason is not None:
                break
        if reason is not None:
            self._remove(req)
        out = self._output(req, ids_to_frame(ids), reason)
        if ids:
            out.logprobs = floats_to_bytes(lps)
            if req.logprobs:
                out.top_ids = ids_to_frame(top_ids)
                out.top_logprobs = floats_to_bytes(top_lps)
        return out

    def _logprobs(self, req: _Request, token: int, lps: list, top_ids: list, top_lps: list) -> None:
        """The chosen token's logprob, and the top N, for the token at position req.generated."""
        h = _mix64(req.lp_key ^ _mix64(req.generated))
        u = (h >> 11) * (1.0 / (1 << 53))
        chosen = -(0.001 + 2.99 * u * u)  # in (-3, 0), mostly near 0 as a confident model's
        lps.append(chosen)
        n = req.logprobs
        if not n:
            return
        top_ids.append(token)
        top_lps.append(chosen)
        # the others share what the chosen token leaves, each at most half the one before
        p = math.exp(chosen)
        lp = math.log(min(p, 1.0 - p))
        pool = self._alternatives
        vocab = self._tokens.vocab_size
        taken = {token}
        start = h % (len(pool) if pool else vocab)
        j = 0
        for _ in range(n - 1):
            h = _mix64(h)
            lp -= _LN2 + 0.7 * ((h >> 11) * (1.0 / (1 << 53)))
            while True:  # the next distinct ID: through the palette, then the vocabulary
                other = pool[(start + j) % len(pool)] if j < len(pool) else (start + j) % vocab
                j += 1
                if other not in taken:
                    break
            taken.add(other)
            top_ids.append(other)
            top_lps.append(lp)

    def _next_token(self, req: _Request) -> tuple[int | None, str | None]:
        if req.script is not None:
            if req.generated < len(req.script):
                token = req.script[req.generated]
            elif req.first_stop_id is not None and not req.ignore_eos:
                return req.first_stop_id, FINISH_STOP
            else:
                return None, FINISH_STOP
        elif self.mode == "echo":
            token = req.prompt[req.generated % len(req.prompt)]
        elif (
            self.eos_probability > 0
            and not req.ignore_eos
            and req.first_stop_id is not None
            and req.rng.random() < self.eos_probability
        ):
            return req.first_stop_id, FINISH_STOP
        elif self._tokens.uses_palette:
            token = self._palette_token(req)
        else:
            token = req.rng.randrange(self._tokens.vocab_size)
            while token in req.stop_ids:  # stop tokens come from eos_probability only
                token = req.rng.randrange(self._tokens.vocab_size)
        if token in req.stop_ids:
            return token, FINISH_STOP
        if req.generated + 1 >= req.max_new_tokens:
            return token, FINISH_LENGTH
        return token, None

    def _next_token_guided(self, req: _Request) -> tuple[int | None, str | None]:
        """A structured request's next token: the matcher's draw, then the first stop token once the output
        is complete (the module docstring says how)."""
        token = req.decoder.next()
        if token is None:
            if req.first_stop_id is not None and not req.ignore_eos:
                return req.first_stop_id, FINISH_STOP
            return None, FINISH_STOP
        if req.generated + 1 >= req.max_new_tokens:
            return token, FINISH_LENGTH
        return token, None

    def _next_token_11(self, req: _Request) -> tuple[int | None, str | None]:
        """_next_token for a request with min_tokens or logit_bias (the module docstring says how)."""
        early = req.generated < req.min_tokens  # no stop token may end the request yet
        stop_ids = req.stop_ids
        if req.script is not None:
            if req.generated < len(req.script):
                token = req.script[req.generated]
            elif early:
                token = self._draw(req, True)  # the stop token is held back: filler up to min_tokens
            elif req.first_stop_id is not None and not req.ignore_eos:
                return req.first_stop_id, FINISH_STOP
            else:
                return None, FINISH_STOP
        elif self.mode == "echo":
            prompt = req.prompt
            token = prompt[req.position % len(prompt)]
            req.position += 1
            if early and token in stop_ids:
                for _ in range(len(prompt)):
                    token = prompt[req.position % len(prompt)]
                    req.position += 1
                    if token not in stop_ids:
                        break
                else:
                    token = self._draw(req, True)
        elif req.forced is not None and not (early and req.forced in stop_ids) and self._permitted(req, req.forced):
            token = req.forced
        elif (
            self.eos_probability > 0
            and not early
            and not req.ignore_eos
            and req.first_stop_id is not None
            and req.first_stop_id not in req.banned
            and self._permitted(req, req.first_stop_id)
            and req.rng.random() < self.eos_probability
        ):
            return req.first_stop_id, FINISH_STOP
        else:
            token = self._draw(req, early)
        if token in stop_ids and not early:
            return token, FINISH_STOP
        if req.generated + 1 >= req.max_new_tokens:
            return token, FINISH_LENGTH
        return token, None

    def _next_token_masked(self, req: _Request) -> tuple[int | None, str | None]:
        """_next_token_11 for a request with allowed_token_ids or bad_words (1.2): random-mode draws
        (and --eos-probability, and a logit_bias-forced token) keep to the allowed IDs and never
        complete a banned sequence; the generated tokens are kept for the latter."""
        token, reason = self._next_token_11(req)
        if req.history is not None and token is not None:
            req.history.append(token)
        return token, reason

    def _permitted(self, req: _Request, token: int) -> bool:
        """Whether allowed_token_ids and bad_words let ``token`` come next."""
        if req.allowed_set is not None and token not in req.allowed_set:
            return False
        if req.bad_words is not None:
            prefixes = req.bad_words.get(token)
            if prefixes:
                history = req.history
                for prefix in prefixes:
                    n = len(prefix)
                    if n == 0 or (len(history) >= n and tuple(history[-n:]) == prefix):
                        return False
        return True

    def _draw(self, req: _Request, early: bool) -> int:
        """A random-mode token that is not banned (nor, while early, a stop token)."""
        banned, stop_ids = req.banned, req.stop_ids
        if req.allowed is not None or req.bad_words is not None:
            return self._draw_masked(req, early)
        if self._tokens.uses_palette:
            for _ in range(64):
                token = self._palette_token(req)
                if token not in banned and not (early and token in stop_ids):
                    return token
        vocab = self._tokens.vocab_size
        for _ in range(64):
            token = req.rng.randrange(vocab)
            if token not in banned and token not in stop_ids:
                return token
        for token in range(vocab):  # nearly the whole vocabulary is banned
            if token not in banned and token not in stop_ids:
                return token
        return req.rng.randrange(vocab)

    def _draw_masked(self, req: _Request, early: bool) -> int:
        """_draw under allowed_token_ids / bad_words: from the palette (or the vocabulary) when that
        gives a permitted token, else from the allowed IDs; stop tokens only if nothing else is left."""
        banned, stop_ids = req.banned, req.stop_ids

        def fits(token: int, stops: bool) -> bool:
            return token not in banned and (stops or token not in stop_ids) and self._permitted(req, token)

        if req.allowed is None or self._tokens.uses_palette:
            for _ in range(64):
                token = (
                    self._palette_token(req)
                    if self._tokens.uses_palette
                    else req.rng.randrange(self._tokens.vocab_size)
                )
                if fits(token, not early and self._tokens.uses_palette):
                    return token
        pool = req.allowed if req.allowed is not None else range(self._tokens.vocab_size)
        if req.allowed is not None:
            for _ in range(16):
                token = pool[req.rng.randrange(len(pool))]
                if fits(token, False):
                    return token
        for stops in (False, not early):
            fitting = [t for t in pool if fits(t, stops)] if req.allowed is not None else None
            if fitting:
                return fitting[req.rng.randrange(len(fitting))]
            if fitting is None:  # the whole vocabulary: the first that fits
                token = next((t for t in pool if fits(t, stops)), None)
                if token is not None:
                    return token
        # nothing is permitted (every allowed token completes a banned word): an engine would emit the
        # least unlikely token anyway; so does the simulator
        return pool[req.rng.randrange(len(pool))]

    def _palette_token(self, req: _Request) -> int:
        sentences = self._tokens.sentences
        if req.sentence < 0 or req.position >= len(sentences[req.sentence]):
            req.sentence = req.rng.randrange(len(sentences))
            req.position = 0
        token = sentences[req.sentence][req.position]
        req.position += 1
        return token

    def _output(self, req: _Request, token_ids: bytes, reason: str | None) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            finish_reason=reason,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=req.cached,
            completion_tokens=req.generated,
        )
        if req.prompt_logprobs is not None and req.state == _DECODING:  # the first output after prefill
            out.prompt_logprobs = self._prompt_logprobs(req.prompt, req.prompt_logprobs)
            req.prompt_logprobs = None
        if reason is not None and req.kv_out is not None:
            out.kv_transfer_params = req.kv_out
        return out

    def _prompt_logprobs(self, prompt: Sequence[int], n: int) -> PromptLogprobs:
        """1.2's prompt logprobs, deterministic from the prompt alone: at each position after the first, a
        descending run of logprobs (the first in (-3, 0), each next one at most half as likely) of which the
        prompt token takes place 1, 2 or 3 (a hash of the prompt up to there), the other places going to
        distinct IDs from the palette (else the vocabulary), as in ``_logprobs``."""
        lps: list[float] = []
        ranks: list[int] = []
        top_ids: list[int] = []
        top_lps: list[float] = []
        pool = self._alternatives
        vocab = self._tokens.vocab_size
        h = int.from_bytes(hashlib.blake2b(b"prompt_logprobs", digest_size=8).digest(), "little")
        for i in range(1, len(prompt)):
            token = prompt[i]
            h = _mix64(h ^ _mix64(prompt[i - 1] + 1))  # chained: a hash of the prompt up to this position
            g = _mix64(h ^ token)
            rank = 1 + g % 3
            u = (g >> 11) * (1.0 / (1 << 53))
            values = [-(0.001 + 2.99 * u * u)]
            p = math.exp(values[0])
            lp = math.log(min(p, 1.0 - p))
            for _ in range(max(n, rank) - 1):
                g = _mix64(g)
                lp -= _LN2 + 0.7 * ((g >> 11) * (1.0 / (1 << 53)))
                values.append(lp)
            lps.append(values[rank - 1])
            ranks.append(rank)
            if not n:
                continue
            start = g % (len(pool) if pool else vocab)
            j = 0
            taken = {token}
            for place in range(1, n + 1):
                if place == rank:
                    other = token
                else:
                    while True:  # the next distinct ID: through the palette, then the vocabulary
                        other = pool[(start + j) % len(pool)] if j < len(pool) else (start + j) % vocab
                        j += 1
                        if other not in taken:
                            break
                    taken.add(other)
                top_ids.append(other)
                top_lps.append(values[place - 1])
        return PromptLogprobs(
            floats_to_bytes(lps),
            ids_to_frame(ranks),
            ids_to_frame(top_ids) if n else b"",
            floats_to_bytes(top_lps) if n else b"",
        )


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--title", default="simulated scheduler", help="what ps shows for this process (ignored)")
    parser.add_argument(
        "--bind",
        required=True,
        metavar="ENDPOINT",
        help="ZeroMQ endpoint to bind, e.g. ipc:///run/tokenmill/scheduler.sock or tcp://0.0.0.0:5557",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=200_000.0,
        metavar="N",
        help="prefill speed; prompts are prefilled one at a time (0: instant; default %(default).0f)",
    )
    parser.add_argument(
        "--inter-token-latency-ms",
        type=float,
        default=20.0,
        metavar="F",
        help="time between decode steps (0: as fast as possible; default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        metavar="N",
        help="the engine's context length (prompt and output), reported in Welcome; longer prompts are refused "
        "(0: none; default %(default)s)",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        metavar="N",
        help="model a prefix cache of N tokens (blocks of 16, LRU): cached prompt tokens skip prefill and "
        "are reported as cached_tokens (0: none; default %(default)s)",
    )
    parser.add_argument(
        "--tokens-per-step",
        type=int,
        default=1,
        metavar="N",
        help="tokens each request gets per decode step, as engines with speculative decoding emit (default %(default)s)",
    )
    parser.add_argument(
        "--scheduling",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="the order waiting requests are admitted in: fcfs (arrival), or priority (Generate.priority, lower "
        "first, FIFO among equals; only then is the 'priority' feature listed, as vLLM's --scheduling-policy; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=256,
        metavar="N",
        help="requests decoded at once; the rest wait (default %(default)s)",
    )
    parser.add_argument(
        "--mode",
        choices=("random", "echo"),
        default="random",
        help="random: generated tokens; echo: repeat the prompt's tokens (default %(default)s)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a HuggingFace model directory with tokenizer.json, or 'default' for the embedded model: "
        "random tokens are then drawn from readable English text and the vocabulary size is the tokenizer's",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help=f"vocabulary size (default: the tokenizer's with --model, else {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument(
        "--eos-probability",
        type=float,
        default=0.0,
        metavar="P",
        help="chance per generated token to emit the request's first stop token and finish "
        "with 'stop' (random mode; not with ignore_eos; default %(default)s)",
    )
    parser.add_argument(
        "--stats-interval-s",
        type=float,
        default=1.0,
        metavar="S",
        help="how often Stats go to every front end (default %(default)s)",
    )
    parser.add_argument(
        "--replies",
        metavar="FILE",
        default=None,
        help='script the output: JSON lines of {"match": "...", "text": "..."}; a request whose prompt contains '
        "match generates text (tokenized with the model's tokenizer, special tokens included) and then the "
        "model's EOS; where several match, the latest in the prompt wins (implies --model default if none given)",
    )
    parser.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        metavar="N",
        help="keep N cores busy while any request runs, as a GPU engine's CPU side spins (default %(default)s)",
    )
    parser.add_argument(
        "--image-cache-bytes",
        type=int,
        default=4 << 30,
        metavar="N",
        help="images.by_hash: the bytes of images it holds by content hash, least recently used out first "
        "(as vLLM's processor cache, 4 GiB by default); a request naming one it no longer holds gets image_missing",
    )
    parser.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        default=None,
        help="act as a ZeroMQ CURVE server with this secret key (a file holding the Z85 key, "
        "or a zmq.auth '.key_secret' certificate)",
    )


def _set_process_name() -> None:
    try:
        from tokenmill.process.procutil import die_with_supervisor, set_process_name
    except ImportError:  # pragma: no cover
        return
    die_with_supervisor()  # when started by a gateway: die with it, even after its kill -9
    set_process_name("tm-scheduler")


def scheduler_from_args(args: argparse.Namespace) -> SimulatedScheduler:
    curve = read_curve_secret(args.curve_secret_key_file) if args.curve_secret_key_file else None
    return SimulatedScheduler(
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        inter_token_latency_s=args.inter_token_latency_ms / 1000.0,
        max_running=args.max_running,
        mode=args.mode,
        model=args.model,
        vocab_size=args.vocab_size,
        eos_probability=args.eos_probability,
        stats_interval_s=args.stats_interval_s,
        curve_secret_key=curve,
        replies=args.replies,
        tokens_per_step=args.tokens_per_step,
        prefix_cache_tokens=args.prefix_cache_tokens,
        busy_cores=args.busy_cores,
        max_model_len=args.max_model_len or None,
        scheduling=getattr(args, "scheduling", "fcfs"),
        image_cache_bytes=getattr(args, "image_cache_bytes", 4 << 30),
    )


async def _serve_until_signalled(scheduler: SimulatedScheduler, endpoint: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not on Linux
            pass
    serving = asyncio.create_task(scheduler.serve(endpoint))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    await scheduler.close()
    try:
        await serving
    except zmq.ZMQError as exc:
        log.error("cannot serve %s: %s", endpoint, exc)
        return 1
    except Exception:
        log.exception("the simulated scheduler failed")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """The ``tokenmill simulate-scheduler`` command. Returns the exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _set_process_name()
    try:
        scheduler = scheduler_from_args(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"simulate-scheduler: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve_until_signalled(scheduler, args.bind))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.engines.simulated", description="A simulated GPU scheduler (simulate-scheduler)."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
