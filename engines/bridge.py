"""The part of ``tokenmill engine`` every backend shares: protocol in, engine calls out.

:class:`EngineServer` is a :class:`~tokenmill.scheduler_client.scheduler_side.SchedulerServer`
(sockets, sessions, handshake, validation) whose engine is a :class:`Backend`. For every
accepted ``generate`` it starts one task that iterates ``backend.generate(request)`` and
turns the engine's chunks into RequestOutputs:

* **deltas and counts** — each chunk carries the tokens new since the previous one; the
  server keeps ``completion_tokens`` cumulative and ``prompt_tokens`` on every output;
* **finish reasons** — the protocol's rules are enforced here whatever the engine does:
  a generated token in ``stop_token_ids`` ends the request with ``"stop"`` (that token
  included), the ``max_new_tokens``-th token with ``"length"``; if the engine would have
  gone on, the request is aborted inside it. Otherwise the engine's own reason counts;
* **one Outputs per front end per engine step** — outputs queue up and are flushed once
  the event loop has run every callback of the current step;
* **aborts** — an ``abort`` (or a vanished front end, or a new Hello) cancels the request
  inside the engine (``backend.abort``) and, for ``abort``, sends the final output at once;
* **logprobs** (protocol 1.1) — with ``Generate.logprobs`` set, every chunk carries one
  logprob per token (and, for N > 0, the top N per token, best first); the server checks
  the counts, cuts them with the tokens at a stop token or the length limit, clamps -inf
  to -9999.0 (as vLLM's OpenAI server does) and packs them as float32 / uint32 bytes;
* **features** (protocol 1.1) — the backend's :class:`EngineInfo` says which optional
  Generate fields it honours (``features``, ``max_logprobs``); Welcome announces them and
  the base class refuses any other with ``unsupported`` naming the field;
* **errors** — a backend that raises :class:`EngineRejected` before the first token (the
  engine refused the request: too long, bad parameter) produces one protocol ``error``
  carrying the request_id (and the field at fault, if known), which the gateway answers
  with HTTP 400; any later failure
  ends the request with ``finish_reason`` ``"error"``. A request is never left hanging.
  If the engine itself dies, the process exits non-zero so that its supervisor restarts it.

The ``tokenmill engine`` command line lives here too (:func:`add_arguments`, :func:`run`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import threading
from abc import ABC, abstractmethod
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tokenmill.scheduler_client.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    PROTOCOL_VERSION,
    Generate,
    ImageItem,
    PromptLogprobs,
    RequestOutput,
    SamplingParams,
    Stats,
    Structured,
    Welcome,
    floats_to_bytes,
    ids_to_frame,
)
from tokenmill.scheduler_client.scheduler_side import (
    ERR_BAD_REQUEST,
    Rejected,
    SchedulerServer,
    Session,
    read_curve_secret,
)

log = logging.getLogger("tokenmill.engine")

# --------------------------------------------------------------------------- the backend contract


@dataclass
class EngineInfo:
    """What a backend tells the front end in Welcome, and what the server checks prompts against."""

    name: str  # scheduler_name in Welcome, e.g. "transformers:Qwen/Qwen2.5-0.5B"
    vocab_size: int | None = None  # prompt token IDs must be below it (None: not checked here)
    max_running_requests: int | None = None
    max_model_len: int | None = None  # prompt + generated tokens
    # protocol 1.1: the optional Generate fields this engine honours (protocol.FEATURES); a
    # request using another is refused with "unsupported" before it reaches the backend
    features: frozenset[str] = frozenset()
    max_logprobs: int = 20  # the largest Generate.logprobs it takes (with "logprobs" in features)
    adapters: tuple[str, ...] = ()  # the LoRA adapters it serves by name (Welcome.adapters, Generate.adapter)


@dataclass
class EngineRequest:
    """One accepted ``generate``, as a backend sees it."""

    rid: str  # unique inside this engine process (front ends' request IDs may collide)
    prompt: list[int]
    max_new_tokens: int  # already clamped to the engine's max_model_len
    sampling: SamplingParams  # min_p, repetition_penalty, min_tokens, logit_bias included (1.1)
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None = None  # 1.1: None: none; 0: each chosen token's; N > 0: and the top N
    structured: Structured | None = None  # 1.1: constrained decoding
    priority: int = 0  # 1.2: lower is scheduled earlier (with "priority" in features)
    cache_salt: str | None = None  # 1.2: the prompt's prefix-cache salt (with "cache_salt" in features)
    prompt_logprobs: int | None = None  # 1.2: the prompt's logprobs (0: each prompt token's; N > 0: and the top N)
    kv_transfer_params: dict | None = None  # 1.2: for the engine's KV connector (with "kv_transfer_params")
    extra_args: dict | None = None  # 1.2: engine-specific extra arguments (with "extra_args")
    # 1.2: the prompt's images (with "images"): each item with its pixel frame's buffer (valid while the request is)
    images: list[tuple[ImageItem, memoryview]] = field(default_factory=list)
    adapter: str | None = None  # 1.2: the LoRA adapter to run with, one of EngineInfo.adapters (None: the base model)


@dataclass
class Chunk:
    """What a backend yields: tokens new since its previous chunk, and the end of the request.

    With ``EngineRequest.logprobs`` set, ``logprobs`` holds one value per token of ``token_ids``
    and, for N > 0, ``top_ids`` / ``top_logprobs`` N values per token (flattened, best first).
    """

    token_ids: Sequence[int] = ()
    finish: str | None = None  # None while running; "stop", "length", "abort" or "error"
    error: str | None = None  # why, with "error" (or with an abort the engine decided on)
    cached_tokens: int | None = None  # prompt tokens served from the engine's prefix cache
    logprobs: Sequence[float] | None = None
    top_ids: Sequence[int] | None = None
    top_logprobs: Sequence[float] | None = None
    # 1.2, with EngineRequest.prompt_logprobs set, in one chunk (the first, as a rule): per prompt position
    # 1 .. len(prompt) - 1, (logprobs, ranks, top IDs, top logprobs), N top entries per position
    prompt_logprobs: tuple[Sequence[float], Sequence[int], Sequence[int], Sequence[float]] | None = None
    kv_transfer_params: dict | None = None  # 1.2: what the engine's KV connector returned (the last chunk)


@dataclass
class EngineLoad:
    """The engine's state for ``stats``."""

    num_running: int
    num_waiting: int = 0
    peak_running: int | None = None
    cancelled_total: int | None = None


class EngineRejected(Exception):
    """Raised by ``Backend.generate`` before its first chunk: the engine refused the request.

    ``param`` names the Generate field at fault when known (e.g. ``"sampling.logit_bias"``)."""

    def __init__(self, message: str, code: str = ERR_BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


#: logprobs below this are sent as this (-inf included), as vLLM's OpenAI server does
LOGPROB_FLOOR = -9999.0


def pack_logprobs(values: Sequence[float]) -> bytes:
    """Logprobs as RequestOutput's float32 bytes, -inf (and NaN) clamped to LOGPROB_FLOOR."""
    return floats_to_bytes([v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR for v in values])


class Backend(ABC):
    """One inference engine. The server calls, in order: ``prepare()`` (blocking, before the
    event loop runs: load the model), ``await start()`` (inside the loop), then ``generate``,
    ``abort``, ``load`` and ``check`` concurrently, and finally ``await close()``."""

    name = "engine"
    _info: EngineInfo | None = None  # set by prepare()

    def prepare(self) -> None:
        """Heavy, blocking initialisation (load weights, launch engine processes)."""

    async def start(self) -> None:
        """Initialisation that needs the running event loop."""

    def info(self) -> EngineInfo:
        """What prepare() learned: name, vocabulary, context length, capacity."""
        if self._info is None:
            raise RuntimeError("prepare() has not run")
        return self._info

    def check(self, gen: Generate) -> None:
        """Reject what this engine cannot do: raise ``Rejected`` with a clear message."""

    @abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        """Run one request, yielding chunks until one has ``finish`` set.

        Closing the iterator early (``aclose()``) must stop the request inside the engine."""

    @abstractmethod
    async def abort(self, rid: str) -> None:
        """Cancel the request inside the engine. Idempotent; unknown IDs are ignored."""

    @abstractmethod
    def load(self) -> EngineLoad: ...

    async def watch(self) -> None:
        """Return or raise when the engine has died (serving then stops); the default never returns."""
        await asyncio.Event().wait()

    async def close(self) -> None:
        """Shut the engine down."""


# --------------------------------------------------------------------------- the server


@dataclass(eq=False)
class _Live:
    identity: bytes
    request_id: str
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    stop_ids: frozenset[int]
    logprobs: int | None = None  # Generate.logprobs
    prompt_logprobs: int | None = None  # Generate.prompt_logprobs, until they have been queued
    prompt_pending: PromptLogprobs | None = None  # packed, for the next output
    kv_transfer_params: dict | None = None  # the engine's, for the final output
    completion: int = 0
    cached: int = 0
    outputs: int = 0  # RequestOutputs queued so far
    done: bool = False  # the front end has its final output (or the request was dropped)
    engine_done: bool = False  # the engine has finished the request by itself
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.identity, self.request_id)


class EngineServer(SchedulerServer):
    """The scheduler side of the protocol in front of one :class:`Backend`."""

    log = log

    def __init__(
        self,
        backend: Backend,
        *,
        stats_interval_s: float = 1.0,
        heartbeat_ivl_ms: int = 2000,
        heartbeat_timeout_ms: int = 10000,
        curve_secret_key: bytes | str | None = None,
    ) -> None:
        self.backend = backend
        self._info = backend.info()
        self.features = frozenset(self._info.features)
        self.max_logprobs = int(self._info.max_logprobs)
        super().__init__(
            scheduler_name=self._info.name,
            stats_interval_s=stats_interval_s,
            heartbeat_ivl_ms=heartbeat_ivl_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            curve_secret_key=curve_secret_key,
            io_rt_priority=getattr(backend, "io_rt_priority", 0),
        )
        self.adapters = frozenset(self._info.adapters)
        self._live: dict[tuple[bytes, str], _Live] = {}
        self._pending: dict[bytes, list[RequestOutput]] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._rids = itertools.count(1)
        self._rid_prefix = f"tm{os.getpid()}-"
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ SchedulerServer hooks

    @property
    def vocab_size(self) -> int | None:
        return self._info.vocab_size

    def describe(self) -> str:
        i = self._info
        return (
            f"backend {self.backend.name}, max_running {i.max_running_requests}, max_model_len {i.max_model_len}, "
            f"vocab {i.vocab_size}, features: {', '.join(sorted(self.features)) or 'none'}"
        )

    def background(self) -> list:
        return [self._watch_engine()]

    def welcome(self) -> Welcome:
        return Welcome(
            protocol_version=PROTOCOL_VERSION,
            scheduler_name=self._info.name,
            max_running_requests=self._info.max_running_requests,
            max_model_len=self._info.max_model_len,
            features=sorted(self.features),
            max_logprobs=self.max_logprobs if "logprobs" in self.features else None,
            vocab_size=self._info.vocab_size,
            adapters=sorted(self.adapters) or None,
        )

    def stats(self) -> Stats:
        load = self.backend.load()
        return Stats(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            peak_running=load.peak_running,
            cancelled_total=load.cancelled_total,
        )

    def has_request(self, identity: bytes, request_id: str) -> bool:
        return (identity, request_id) in self._live

    def check(self, gen: Generate) -> None:
        limit = self._info.max_model_len
        if limit is not None and gen.prompt_token_count >= limit:
            raise Rejected(
                f"the prompt has {gen.prompt_token_count} tokens; this engine handles at most {limit} tokens "
                "(prompt and completion together)"
            )
        self.backend.check(gen)

    def holds_image(self, content_hash: str) -> bool:
        holds = getattr(self.backend, "holds_image", None)
        return holds is not None and holds(content_hash)

    def accept(
        self, session: Session, gen: Generate, prompt: array, prompt_bytes: bytes, pixels: Sequence[memoryview] = ()
    ) -> None:
        max_new = gen.max_new_tokens
        limit = self._info.max_model_len
        if limit is not None:
            max_new = min(max_new, limit - len(prompt))  # the context ends the request with "length"
        live = _Live(
            identity=session.identity,
            request_id=gen.request_id,
            rid=f"{self._rid_prefix}{next(self._rids)}",
            prompt_tokens=len(prompt),
            max_new_tokens=max_new,
            stop_ids=frozenset(gen.stop_token_ids),
            logprobs=gen.logprobs,
            prompt_logprobs=gen.prompt_logprobs,
        )
        request = EngineRequest(
            rid=live.rid,
            prompt=prompt.tolist(),
            max_new_tokens=max_new,
            sampling=gen.sampling,
            stop_token_ids=list(gen.stop_token_ids),
            ignore_eos=gen.ignore_eos,
            logprobs=gen.logprobs,
            structured=gen.structured,
            priority=gen.priority,
            cache_salt=gen.cache_salt,
            prompt_logprobs=gen.prompt_logprobs,
            kv_transfer_params=gen.kv_transfer_params,
            extra_args=gen.extra_args,
            images=list(zip(gen.images, pixels, strict=True)),
            adapter=gen.adapter,
        )
        self._live[live.key] = live
        live.task = asyncio.create_task(self._run(live, request), name=f"engine-{live.rid}")

    def abort(self, identity: bytes, request_ids: list[str]) -> None:
        for request_id in request_ids:
            live = self._live.get((identity, request_id))
            if live is None or live.done:
                continue  # unknown or already finished: ignored
            self._finish(live, (), FINISH_ABORT)
            self._cancel_in_engine(live)

    def drop_session(self, identity: bytes) -> int:
        self._pending.pop(identity, None)  # a new session must not see the old one's outputs
        gone = [live for live in self._live.values() if live.identity == identity]
        for live in gone:
            live.done = True
            self._live.pop(live.key, None)
            self._cancel_in_engine(live)
        return len(gone)

    def on_teardown(self) -> None:
        for live in list(self._live.values()):
            live.done = True
            if live.task is not None and not live.task.done():
                self._cancel_in_engine(live)
        self._live.clear()
        self._pending.clear()

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait, at most ``timeout`` seconds, for the requests' cleanups and aborts still running: each
        stops its request inside the engine, which must still be there to hear it (close() comes after)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    # ------------------------------------------------------------------ running requests

    async def _run(self, live: _Live, request: EngineRequest) -> None:
        stream = self.backend.generate(request)
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if live.done:
                        break
                    self._on_chunk(live, chunk)
                    if live.done:
                        break
                else:
                    if not live.done:
                        live.engine_done = True
                        self._finish(live, (), FINISH_ERROR, "the engine ended the request without a finish reason")
        except asyncio.CancelledError:
            raise
        except EngineRejected as exc:
            live.engine_done = True
            if not live.done:
                self._reject(live, exc.message, exc.code, exc.param)
        except Exception as exc:  # the engine failed this request
            live.engine_done = True
            log.warning("request %s (%s) failed in the engine: %r", live.request_id, live.rid, exc)
            if not live.done:
                self._finish(live, (), FINISH_ERROR, f"the engine failed the request: {exc}")
        finally:
            if live.done and not live.engine_done:
                # finished here (stop token, length, abort, dropped) while the engine would go on
                await self._abort_quietly(live.rid)
            if self._live.get(live.key) is live:
                del self._live[live.key]

    def _on_chunk(self, live: _Live, chunk: Chunk) -> None:
        tokens = list(chunk.token_ids)
        finish: str | None = None
        error: str | None = None
        for i, token in enumerate(tokens):  # the protocol's finish rules, whatever the engine did
            if token in live.stop_ids:
                finish = FINISH_STOP
            elif live.completion + i + 1 >= live.max_new_tokens:
                finish = FINISH_LENGTH
            else:
                continue
            tokens = tokens[: i + 1]
            break
        if chunk.cached_tokens is not None:
            live.cached = chunk.cached_tokens
        if chunk.finish is not None:
            live.engine_done = True  # nothing to abort inside the engine
        if chunk.kv_transfer_params is not None:
            live.kv_transfer_params = chunk.kv_transfer_params
        if chunk.prompt_logprobs is not None and live.prompt_logprobs is not None:
            packed = self._prompt_logprobs(live, chunk.prompt_logprobs)
            if isinstance(packed, str):
                self._finish(live, (), FINISH_ERROR, packed)
                return
            live.prompt_pending, live.prompt_logprobs = packed, None
        logprobs = self._chunk_logprobs(live, chunk, len(tokens))
        if isinstance(logprobs, str):  # the engine's logprobs do not match its tokens
            self._finish(live, (), FINISH_ERROR, logprobs)
            return
        if finish is None and chunk.finish is not None:
            if chunk.finish in (FINISH_STOP, FINISH_LENGTH):
                finish = chunk.finish
            elif chunk.finish == FINISH_ABORT:  # the engine gave up on the request by itself
                if live.outputs == 0 and not tokens:
                    self._reject(live, chunk.error or "the engine aborted the request", ERR_BAD_REQUEST)
                    return
                finish = FINISH_ABORT
            else:
                finish, error = FINISH_ERROR, chunk.error or "the engine failed the request"
        if finish is not None:
            self._finish(live, tokens, finish, error, logprobs)
        elif tokens:
            live.completion += len(tokens)
            self._queue(live, ids_to_frame(tokens), None, None, logprobs)

    @staticmethod
    def _chunk_logprobs(live: _Live, chunk: Chunk, kept: int) -> tuple[bytes, bytes, bytes] | str | None:
        """The chunk's logprobs for its first ``kept`` tokens, packed; a message if they do not fit its tokens."""
        if live.logprobs is None:
            return None
        n_tokens = len(chunk.token_ids)
        values = chunk.logprobs if chunk.logprobs is not None else ()
        if len(values) != n_tokens:
            return f"the engine returned {len(values)} logprobs for {n_tokens} tokens"
        top = live.logprobs
        if not top:
            return pack_logprobs(values[:kept]), b"", b""
        ids = chunk.top_ids if chunk.top_ids is not None else ()
        top_values = chunk.top_logprobs if chunk.top_logprobs is not None else ()
        if len(ids) != top * n_tokens or len(top_values) != top * n_tokens:
            return (
                f"the engine returned {len(ids)} top token IDs and {len(top_values)} top logprobs for "
                f"{n_tokens} tokens; expected {top} per token"
            )
        return (
            pack_logprobs(values[:kept]),
            ids_to_frame(ids[: top * kept]),
            pack_logprobs(top_values[: top * kept]),
        )

    @staticmethod
    def _prompt_logprobs(live: _Live, arrays) -> PromptLogprobs | str:
        """A chunk's prompt logprobs, checked against the prompt and packed; a message if they do not fit."""
        values, ranks, ids, top_values = arrays
        positions, top = live.prompt_tokens - 1, live.prompt_logprobs
        if len(values) != positions or len(ranks) != positions:
            return (
                f"the engine returned {len(values)} prompt logprobs and {len(ranks)} ranks for "
                f"{positions} prompt positions"
            )
        if len(ids) != top * positions or len(top_values) != top * positions:
            return (
                f"the engine returned {len(ids)} top prompt token IDs and {len(top_values)} top prompt logprobs "
                f"for {positions} prompt positions; expected {top} per position"
            )
        return PromptLogprobs(
            pack_logprobs(values),
            ids_to_frame(ranks),
            ids_to_frame(ids) if top else b"",
            pack_logprobs(top_values) if top else b"",
        )

    def _finish(
        self,
        live: _Live,
        tokens: Sequence[int],
        reason: str,
        error: str | None = None,
        logprobs: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        live.completion += len(tokens)
        live.done = True
        self._queue(live, ids_to_frame(tokens) if tokens else b"", reason, error, logprobs)
        if self._live.get(live.key) is live:
            del self._live[live.key]

    def _reject(self, live: _Live, message: str, code: str, param: str | None = None) -> None:
        """The engine refused the request before any output: a protocol error, as at acceptance."""
        live.done = True
        if self._live.get(live.key) is live:
            del self._live[live.key]
        self.send_error(live.identity, message, code, live.request_id, param)

    def _queue(
        self,
        live: _Live,
        token_bytes: bytes,
        reason: str | None,
        error: str | None,
        logprobs: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        live.outputs += 1
        lp, top_ids, top_lp = logprobs if logprobs is not None else (b"", b"", b"")
        out = RequestOutput(
            request_id=live.request_id,
            token_ids=token_bytes,
            finish_reason=reason,
            prompt_tokens=live.prompt_tokens,
            cached_tokens=live.cached,
            completion_tokens=live.completion,
            error=error,
            logprobs=lp,
            top_ids=top_ids,
            top_logprobs=top_lp,
        )
        if live.prompt_pending is not None:
            out.prompt_logprobs, live.prompt_pending = live.prompt_pending, None
        if reason is not None and live.kv_transfer_params is not None:
            out.kv_transfer_params = live.kv_transfer_params
        self._pending.setdefault(live.identity, []).append(out)
        if self._flush_handle is None:
            # after every callback already queued (all outputs of one engine step) has run
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        pending, self._pending = self._pending, {}
        for identity, outputs in pending.items():
            self.send_outputs(identity, outputs)

    def _cancel_in_engine(self, live: _Live) -> None:
        """Stop the request's task; its cleanup aborts the request inside the engine (settle waits for it)."""
        if live.task is not None and not live.task.done():
            live.task.cancel()
            self._track(live.task)
        elif not live.engine_done:
            self._track(asyncio.create_task(self._abort_quietly(live.rid)))

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await asyncio.shield(self.backend.abort(rid))
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("aborting %s in the engine failed", rid)

    def _spawn(self, coro) -> None:
        self._track(asyncio.create_task(coro))

    def _track(self, task: asyncio.Task) -> None:
        """Keep a task that must finish before the backend closes (settle waits for these)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_engine(self) -> None:
        await self.backend.watch()
        raise RuntimeError(f"the {self.backend.name} engine stopped")


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.engines import BACKENDS, backend_module

    parser.add_argument("--backend", required=True, choices=tuple(BACKENDS), help="the inference engine to run")
    parser.add_argument(
        "--bind",
        required=True,
        metavar="ENDPOINT",
        help="ZeroMQ endpoint to bind, e.g. ipc:///run/tokenmill/engine.sock or tcp://0.0.0.0:5557",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="the model to serve (a HuggingFace directory or hub name); with --random-weights, the "
        "model whose vocabulary the random model gets ('default' or unset: tokenmill's embedded model)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="prompt + completion tokens per request (default: the model's)",
    )
    parser.add_argument(
        "--max-running", type=int, default=None, metavar="N", help="requests decoded at once (default: the engine's)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and activations (default: the engine's; transformers: bfloat16 on GPU, float32 on CPU)",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sglang / vllm: one more keyword for sglang.Engine(...) or vLLM's AsyncEngineArgs(...) "
        "(repeatable; VALUE is JSON if it parses, else a string)",
    )
    parser.add_argument(
        "--stats-interval-s", type=float, default=1.0, metavar="S", help="how often Stats go out (default %(default)s)"
    )
    parser.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        default=None,
        help="act as a ZeroMQ CURVE server with this secret key (docs/engines/scheduler-protocol.md §8)",
    )
    for name in BACKENDS:
        group = parser.add_argument_group(f"{name} backend")
        backend_module(name).add_arguments(group)


def _sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about a state change; nothing when not under systemd."""
    try:
        from tokenmill.process.systemd_notify import notify
    except ImportError:  # pragma: no cover - a minimal stand-in
        path = os.environ.get("NOTIFY_SOCKET")
        if not path:
            return
        if path.startswith("@"):
            path = "\0" + path[1:]
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(path)
            sock.sendall(state.encode())
        return
    notify(state)


async def serve(backend: Backend, endpoint: str, *, stats_interval_s: float = 1.0, curve_secret_key=None) -> int:
    """Start the backend, serve ``endpoint`` until SIGTERM/SIGINT, shut down. Returns the exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    status = 0
    try:
        await backend.start()
        server = EngineServer(backend, stats_interval_s=stats_interval_s, curve_secret_key=curve_secret_key)
        serving = asyncio.create_task(server.serve(endpoint))
        ready = asyncio.create_task(server.wait_ready())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and not ready.cancelled():
            _sd_notify("READY=1")
        ready.cancel()
        await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        _exit_later_if_orphaned()
        _sd_notify("STOPPING=1")
        await server.close()
        try:
            await serving
        except Exception as exc:
            log.error("the engine server failed: %s", exc)
            status = 1
        await server.settle()  # the requests it was serving stop inside the engine before it shuts down
    except Exception:
        log.exception("the %s engine failed to start", backend.name)
        status = 1
    finally:
        try:
            await backend.close()
        except Exception:
            log.exception("shutting the %s engine down failed", backend.name)
    return status


#: how long a bridge whose gateway died has to abort its requests and stop before it exits regardless (nobody is
#: left to kill it; the gateway itself gives a bridge 10 s after SIGTERM)
ORPHAN_STOP_S = 20.0


def _exit_later_if_orphaned() -> None:
    try:
        from tokenmill.process.procutil import supervisor_gone
    except ImportError:  # pragma: no cover
        return
    if supervisor_gone():
        log.warning("the gateway that started this engine bridge is gone: stopping (at most %.0f s)", ORPHAN_STOP_S)
        timer = threading.Timer(ORPHAN_STOP_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()


def run(args: argparse.Namespace) -> int:
    """The ``tokenmill engine`` command. Returns the exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from tokenmill.process.procutil import die_with_supervisor, set_process_name, take_descendants_along

        set_process_name("tm-engine")
        # Started by a gateway (--engine-url): gone with it, even after its kill -9. A server the operator runs
        # outlives this bridge, so the http backend is told by SIGTERM and aborts its requests there before it
        # exits (serve: settle); an engine inside this process stops with it, so the others get SIGKILL.
        die_with_supervisor(signal.SIGTERM if args.backend == "http" else signal.SIGKILL)
        take_descendants_along()  # vLLM's and SGLang's own processes must not outlive a killed engine
    except ImportError:  # pragma: no cover
        pass
    from tokenmill.engines import MissingBackend, backend_module

    try:
        curve = read_curve_secret(args.curve_secret_key_file) if args.curve_secret_key_file else None
        backend = backend_module(args.backend).from_args(args)
        backend.prepare()
    except MissingBackend as exc:
        print(f"tokenmill engine: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"tokenmill engine: {exc}", file=sys.stderr)
        return 2
    except Exception:
        log.exception("the %s engine failed to start", args.backend)
        return 1
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(backend, args.bind, stats_interval_s=args.stats_interval_s, curve_secret_key=curve))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.engines.bridge",
        description="Run an inference engine behind the tokenmill scheduler protocol.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    # `python -m` runs this file as __main__, a second copy beside the tokenmill.engines.bridge the backends
    # import: run that one's, so that its `except EngineRejected` catches the class they raise
    from tokenmill.engines.bridge import main as _main

    sys.exit(_main())
