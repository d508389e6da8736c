"""The simulated scheduler's loop: admission, prefill and decode steps, aborts and sessions.

:class:`SimulatedScheduler` binds a ZeroMQ ROUTER, answers Hello with Welcome (sockets, sessions and
validation come from :class:`~tokenmill.scheduler_client.scheduler_side.SchedulerServer`), and
"generates" tokens for Generate requests with a simple performance model:

* prefill is one shared resource: admitted requests are prefilled one after another,
  each taking ``prompt tokens / prefill_tokens_per_s`` seconds, before their first token
  (less the tokens :mod:`.prefix_cache` finds cached);
* decoding runs in steps every ``inter_token_latency`` seconds; in every step each
  decoding request gets exactly one token, and all outputs of a step for one front end
  travel in ONE Outputs message;
* at most ``max_running`` requests are admitted (prefilling + decoding); the rest wait
  in FIFO order, or with ``--scheduling priority`` (protocol 1.2) in a heap on (priority, arrival):
  lowest first, FIFO among equals.

Which token each step emits is :mod:`.sampling`'s; the logprobs that come with it, :mod:`.logprobs`'.

``Welcome.features`` lists everything in ``protocol.FEATURES``; without a tokenizer, all but the
``structured.*`` ones; ``priority`` only with ``--scheduling priority`` (docs/engines/scheduler-protocol.md §10.3).
Structured requests are checked at admission: a spec llguidance refuses is refused with its message
(``bad_request``, ``param`` "structured"). ``structured.disable_any_whitespace`` /
``structured.whitespace_pattern`` (listed with a tokenizer): a JSON constraint is compiled without
optional whitespace, or with the pattern as llguidance's whitespace
(:func:`tokenmill.engines.guided.grammar_of`); other kinds are unchanged.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path

from tokenmill.engines.busy_cores import BusyCores
from tokenmill.engines.guided import Decoder, Guide, GuideError
from tokenmill.engines.held_images import HeldImages
from tokenmill.engines.simulated.logprobs import MadeUpLogprobs, logprob_key
from tokenmill.engines.simulated.prefix_cache import PrefixCache
from tokenmill.engines.simulated.replies import ScriptedReplies, resolve_model_dir
from tokenmill.engines.simulated.request import DECODING, PREFILLING, SimulatedRequest
from tokenmill.engines.simulated.sampling import TokenSampler, TokenSource, build_palette, make_rng
from tokenmill.scheduler_client import shared_pixels, structured
from tokenmill.scheduler_client.protocol import (
    FEATURE_IMAGES_SHM,
    FEATURE_PRIORITY,
    FEATURES,
    FINISH_ABORT,
    PROTOCOL_VERSION,
    STRUCTURED_FEATURES,
    STRUCTURED_OPTION_FEATURES,
    Generate,
    Outputs,
    RequestOutput,
    Stats,
    Structured,
    Welcome,
    encode,
    floats_to_bytes,
    ids_to_frame,
)
from tokenmill.scheduler_client.scheduler_side import (
    ERR_UNSUPPORTED,
    Rejected,
    SchedulerServer,
    Session,
)

log = logging.getLogger("tokenmill.simulated_scheduler")

SCHEDULER_NAME = "tokenmill-simulated"
DEFAULT_VOCAB_SIZE = 129280  # DeepSeek-V3/V4, the embedded default model

_PACK1 = struct.Struct("<I").pack
_CLOCK_SLACK = 0.001  # the resolution of uvloop's loop.time()


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
            size, sentences = build_palette(self._tokenizer, vocab_size)
            self._tokens = TokenSource(size, sentences)
            if replies is not None:
                self.replies = ScriptedReplies(replies, self._tokenizer)
        else:
            self._tokens = TokenSource(vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE)
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
        # which token comes next (mode and eos_probability live there), and the logprobs that come with it
        self._sampler = TokenSampler(self._tokens, mode, float(eos_probability))
        self._logprobs = MadeUpLogprobs(self._tokens)

        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.tokens_per_step = tokens_per_step  # >1: several tokens per step, as speculative decoding emits
        self.max_model_len = max_model_len or None  # prompt and output together, as an engine's context
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.busy_cores_wanted = busy_cores  # spinners start with serving (busy_cores.py)
        self.busy_cores: BusyCores | None = None
        self.inter_token_latency_s = float(inter_token_latency_s)
        self.max_running = int(max_running)

        self._requests: dict[tuple[bytes, str], SimulatedRequest] = {}
        self._waiting: dict[tuple[bytes, str], SimulatedRequest] = {}  # insertion order = FIFO
        # --scheduling priority: (priority, arrival, key) of the waiting requests (stale entries are skipped)
        self._queue: list[tuple[int, int, tuple[bytes, str]]] = []
        self._arrivals = itertools.count()
        self._prefilling: dict[tuple[bytes, str], SimulatedRequest] = {}  # in prefill order
        self._decoding: dict[tuple[bytes, str], SimulatedRequest] = {}
        self._prefill_busy_until = 0.0
        self._next_step_at = 0.0
        self._wake: asyncio.Event | None = None

    @property
    def mode(self) -> str:
        return self._sampler.mode

    @property
    def eos_probability(self) -> float:
        return self._sampler.eos_probability

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
        req = SimulatedRequest(
            identity=session.identity,
            request_id=gen.request_id,
            prompt=prompt,
            max_new_tokens=max_new,
            stop_ids=frozenset(gen.stop_token_ids),
            first_stop_id=gen.stop_token_ids[0] if gen.stop_token_ids else None,
            ignore_eos=gen.ignore_eos,
            rng=make_rng(gen, prompt_bytes),
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
            req.lp_key = logprob_key(gen, prompt_bytes)
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
            req.next_token = self._sampler.next_token_guided
        elif masked:
            req.next_token = self._sampler.next_token_masked
        elif req.min_tokens or sampling.logit_bias:
            req.next_token = self._sampler.next_token_biased
        else:
            req.next_token = self._sampler.next_token_plain
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

    def _remove(self, req: SimulatedRequest) -> None:
        self._requests.pop(req.key, None)
        self._waiting.pop(req.key, None)
        self._prefilling.pop(req.key, None)
        self._decoding.pop(req.key, None)

    # ------------------------------------------------------------------ the engine

    def _prefill_cost(self, req: SimulatedRequest) -> float:
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
            req.state = PREFILLING
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
            req.state = DECODING
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

    def _step_logprobs(self, req: SimulatedRequest, next_token, per_step: int) -> RequestOutput:
        """_step for one request that asked for logprobs."""
        ids: list[int] = []
        lps: list[float] = []
        top_ids: list[int] = []
        top_lps: list[float] = []
        reason = None
        for _ in range(per_step):
            token, reason = next_token(req)
            if token is not None:
                self._logprobs.for_token(req, token, lps, top_ids, top_lps)
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

    def _output(self, req: SimulatedRequest, token_ids: bytes, reason: str | None) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            finish_reason=reason,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=req.cached,
            completion_tokens=req.generated,
        )
        if req.prompt_logprobs is not None and req.state == DECODING:  # the first output after prefill
            out.prompt_logprobs = self._logprobs.for_prompt(req.prompt, req.prompt_logprobs)
            req.prompt_logprobs = None
        if reason is not None and req.kv_out is not None:
            out.kv_transfer_params = req.kv_out
        return out
