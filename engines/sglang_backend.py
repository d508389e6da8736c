"""The SGLang backend: ``sglang.Engine`` (offline engine API) fed with token IDs.

The engine is created with ``skip_tokenizer_init=True`` (token IDs in, token IDs out) and
``stream_output=True`` (each streamed chunk holds only the new tokens), and every request
goes through ``Engine.async_generate(input_ids=..., sampling_params=..., stream=True,
rid=...)``.

**Threading.** SGLang binds its TokenizerManager to the engine's own event loop
(``engine.loop``, created by ``Engine.__init__``): the manager's receive loop and every
request's state live there, and the synchronous ``Engine.generate`` drives that loop with
``run_until_complete`` — so two concurrent callers fail with "This event loop is already
running", and a bridge that serialised calls behind a lock would run one request at a time.
This bridge therefore runs ``engine.loop`` on ONE persistent daemon thread for the engine's
whole lifetime and submits every call — each request's generate-and-stream coroutine,
aborts, state queries — to that loop with ``asyncio.run_coroutine_threadsafe``. Nothing is
serialised: all requests are in the engine together, and chunks come back to the server's
event loop with ``call_soon_threadsafe``. ``close()`` shuts the engine down first, then
stops the loop and joins the thread.

Sampling parameters (docs/engines/tokenmill-engine.md has the table): temperature (0 is greedy in SGLang),
top_p, top_k (0 -> -1, SGLang's "disabled"), presence/frequency penalties and
``max_new_tokens`` map one to one. ``stop_token_ids`` become SGLang's ``stop_token_ids``.
SGLang's ``ignore_eos`` also disables ``stop_token_ids``, so with ``ignore_eos`` the bridge
sends ``ignore_eos=True`` and enforces the request's stop token IDs itself (the engine
server ends the request with "stop" and aborts it inside SGLang). ``seed`` with a
temperature above 0 becomes ``sampling_seed``, which SGLang honours only when started with
``--engine-arg enable_deterministic_inference=true``; otherwise such a request is rejected.

Protocol 1.1 (SGLang's ``SamplingParams`` in python/sglang/srt/sampling/sampling_params.py):
``min_p`` and ``repetition_penalty`` map one to one, ``logit_bias`` becomes SGLang's
``{"<token id>": bias}``, ``min_tokens`` -> ``min_new_tokens``; ``structured`` becomes
``json_schema`` (json_schema; ``'{"type": "object"}'`` for json_object), ``regex``, ``ebnf``
(grammar; a choice list as ``root ::= "a" | "b"``) or ``structural_tag``; ``logprobs`` N ->
``async_generate(..., return_logprob=True, top_logprobs_num=N)``, whose ``meta_info`` has
``output_token_logprobs`` (one ``(logprob, token_id, text|None)`` per output token) and
``output_top_logprobs`` (per output token, a best-first list of N such tuples, or None). With
``incremental_streaming_output`` (newer SGLang) these lists hold the new tokens' entries only;
with the older ``stream_output`` they are cumulative while ``output_ids`` holds only the new
tokens: the bridge takes the entries for the new tokens either way.

SGLang builds its grammar backend and honours ``min_new_tokens`` only with a tokenizer
(``skip_tokenizer_init=True`` disables the grammar backend and makes min_new_tokens a
ValueError). This bridge starts SGLang token-only by default (SGLang would otherwise detokenize
every output in its detokenizer process), so by default it offers logprobs, min_p,
repetition_penalty and logit_bias; ``--engine-arg skip_tokenizer_init=false`` adds min_tokens
and the structured kinds (unless ``grammar_backend`` is "none").

A constrained request is admitted only once SGLang's own grammar backend has compiled its spec
(engines/sglang_grammar.py): a spec it refuses is an ``EngineRejected`` with ``param`` "structured" (a
400 naming the request field) before the request reaches the engine. A grammar failure SGLang's
scheduler reports later (an ``abort`` finish whose message speaks of the grammar, with no token
generated) is refused the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.engines import engine_kwargs, parse_engine_args, require
from tokenmill.engines.bridge import Backend, Chunk, EngineInfo, EngineLoad, EngineRejected, EngineRequest
from tokenmill.engines.sglang_grammar import GrammarCheck
from tokenmill.scheduler_client.protocol import (
    FEATURE_LOGPROBS,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    STRUCTURED_FEATURES,
    Generate,
    Structured,
)
from tokenmill.scheduler_client.scheduler_side import Rejected

log = logging.getLogger("tokenmill.engine.sglang")

_QUERY_TIMEOUT_S = 30.0
#: what SGLang honours with skip_tokenizer_init (token IDs only), and what only with its tokenizer
TOKEN_ONLY_FEATURES = frozenset({FEATURE_LOGPROBS, "min_p", "repetition_penalty", "logit_bias"})
TOKENIZER_FEATURES = frozenset({"min_tokens", *STRUCTURED_FEATURES})
MAX_LOGPROBS = 20  # SGLang sets no limit on top_logprobs_num; OpenAI's top_logprobs stops at 20


class SGLangBackend(Backend):
    """``sglang.Engine`` on its own event-loop thread."""

    name = "sglang"

    def __init__(
        self,
        *,
        engine_kwargs: dict[str, Any] | None = None,
        engine_factory: Callable[..., Any] | None = None,
        label: str | None = None,
    ) -> None:
        kwargs = dict(engine_kwargs or {})
        # token IDs in and out; skip_tokenizer_init=false (min_tokens, structured outputs) also works
        kwargs.setdefault("skip_tokenizer_init", True)
        kwargs["stream_output"] = True
        self.engine_kwargs = kwargs
        self._factory = engine_factory
        self.label = label or str(kwargs.get("model_path") or "model")
        self.engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._info: EngineInfo | None = None
        self._deterministic = False
        self._running: dict[str, concurrent.futures.Future] = {}  # rid -> its pump on the engine loop
        self._aborting: set[str] = set()
        self._peak = 0
        self._cancelled = 0
        self.grammar: GrammarCheck | None = None  # SGLang's grammar backend, judging specs at admission

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SGLangBackend:
        kwargs = engine_kwargs(args, "sglang", "model_path", "context_length", "max_running_requests")
        return cls(engine_kwargs=kwargs, label=args.model)

    # ------------------------------------------------------------------ lifecycle

    def prepare(self) -> None:
        factory = self._factory
        if factory is None:
            require("sglang", "sglang")
            import sglang

            factory = sglang.Engine
        # On the main thread, outside any running loop: Engine.__init__ launches its
        # processes (and may install signal handlers) and creates engine.loop.
        self.engine = factory(**self.engine_kwargs)
        loop = getattr(self.engine, "loop", None)
        if loop is None:
            raise RuntimeError("this sglang.Engine has no event loop (engine.loop)")
        self._loop = loop
        self._thread = threading.Thread(target=self._run_loop, name="sglang-loop", daemon=True)
        self._thread.start()
        server_args = getattr(self.engine, "server_args", None)
        self._deterministic = bool(getattr(server_args, "enable_deterministic_inference", False))
        try:
            max_model_len, vocab_size, max_running = self._call(self._query_capacity()).result(_QUERY_TIMEOUT_S)
        except BaseException:
            self.engine.shutdown()
            loop.call_soon_threadsafe(loop.stop)
            raise
        features = set(TOKEN_ONLY_FEATURES)
        if not getattr(server_args, "skip_tokenizer_init", self.engine_kwargs["skip_tokenizer_init"]):
            features |= TOKENIZER_FEATURES
            if str(getattr(server_args, "grammar_backend", None)).lower() == "none":
                features -= set(STRUCTURED_FEATURES)
            else:
                self.grammar = self._grammar_check()
        self._info = EngineInfo(
            name=f"sglang:{self.label}",
            vocab_size=vocab_size,
            max_running_requests=max_running,
            max_model_len=max_model_len,
            features=frozenset(features),
            max_logprobs=MAX_LOGPROBS,
        )
        log.info(
            "sglang engine ready: max_model_len %s, vocab %s, max_running %s, features %s",
            max_model_len,
            vocab_size,
            max_running,
            ", ".join(sorted(features)),
        )

    def _grammar_check(self) -> GrammarCheck | None:
        """SGLang's grammar backend in this process, or None (specs are then judged in SGLang's scheduler
        only, whose grammar aborts are still refused with param "structured")."""
        try:
            return GrammarCheck.for_engine(self.engine)
        except Exception as exc:
            log.warning("structured-output specs are not checked at admission: %s: %s", type(exc).__name__, exc)
            return None

    def _run_loop(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            asyncio.set_event_loop(None)

    def _call(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the engine's loop thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _query_capacity(self) -> tuple[int | None, int | None, int | None]:
        """A state query, on the engine loop: context length, vocabulary, running-request limit."""
        engine = self.engine
        manager = getattr(engine, "tokenizer_manager", None)
        server_args = getattr(engine, "server_args", None)
        max_model_len = getattr(manager, "context_len", None) or getattr(server_args, "context_length", None)
        vocab_size = getattr(getattr(manager, "model_config", None), "vocab_size", None)
        max_running = None
        try:
            states = await asyncio.wait_for(manager.get_internal_state(), 10.0)
            if states:
                max_running = states[0].get("max_running_requests")
        except Exception as exc:  # optional: older versions, or a busy engine
            log.debug("get_internal_state failed: %r", exc)
        if max_running is None:
            max_running = getattr(server_args, "max_running_requests", None)
        return max_model_len, vocab_size, max_running

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self._thread is not None and not self._thread.is_alive():
                log.error("the sglang event-loop thread has stopped")
                return

    async def close(self) -> None:
        """Shut the engine down, then stop its loop thread."""
        for future in list(self._running.values()):
            future.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join, 30)

    # ------------------------------------------------------------------ requests

    def check(self, gen: Generate) -> None:
        s = gen.sampling
        if s.seed is not None and s.temperature > 0:
            if not self._deterministic:
                raise Rejected(
                    "this SGLang engine cannot seed a request: start it with "
                    "--engine-arg enable_deterministic_inference=true, or leave seed unset"
                )
            if not -(2**63) <= s.seed < 2**63:
                raise Rejected("seed must fit in a signed 64-bit integer for SGLang")

    @staticmethod
    def sampling_params(request: EngineRequest) -> dict[str, Any]:
        s = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": request.max_new_tokens,
            "temperature": float(s.temperature),
            "top_p": float(s.top_p),
            "top_k": int(s.top_k) if s.top_k > 0 else -1,
            "presence_penalty": float(s.presence_penalty),
            "frequency_penalty": float(s.frequency_penalty),
        }
        if request.ignore_eos:
            params["ignore_eos"] = True  # SGLang then ignores stop_token_ids too: the server enforces them
        elif request.stop_token_ids:
            params["stop_token_ids"] = list(request.stop_token_ids)
        if s.seed is not None and s.temperature > 0:
            params["sampling_seed"] = int(s.seed)
        # protocol 1.1, sent only when set (older SGLang versions lack some of these keys)
        if s.min_p:
            params["min_p"] = float(s.min_p)
        if s.repetition_penalty != 1.0:
            params["repetition_penalty"] = float(s.repetition_penalty)
        if s.min_tokens:
            params["min_new_tokens"] = min(int(s.min_tokens), request.max_new_tokens)
        if s.logit_bias:
            params["logit_bias"] = {str(int(t)): float(b) for t, b in s.logit_bias.items()}
        if request.structured is not None:
            params.update(structured_params(request.structured))
        return params

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        rid = request.rid
        params = self.sampling_params(request)
        if request.structured is not None and self.grammar is not None:
            refusal = await self.grammar.refusal(params)
            if refusal is not None:
                raise EngineRejected(refusal, param="structured")
        here = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def emit(item) -> None:  # called on the engine loop thread
            here.call_soon_threadsafe(chunks.put_nowait, item)

        self._running[rid] = self._call(self._pump(request, params, emit))
        self._peak = max(self._peak, len(self._running))
        finished = False
        try:
            while True:
                kind, payload = await chunks.get()
                if kind == "chunk":
                    finished = payload.finish is not None
                    yield payload
                    if finished:
                        return
                elif kind == "reject":
                    finished = True
                    raise EngineRejected(payload, param=_param_of(payload, request))
                else:  # "error"
                    finished = True
                    yield Chunk(finish=FINISH_ERROR, error=payload)
                    return
        finally:
            if not finished:
                await self.abort(rid)
            self._running.pop(rid, None)
            self._aborting.discard(rid)

    async def _pump(
        self, request: EngineRequest, params: dict[str, Any], emit: Callable[[tuple[str, Any]], None]
    ) -> None:
        """On the engine loop: run one request and hand its chunks over."""
        sent = 0
        try:
            logprobs = {}
            if request.logprobs is not None:
                logprobs = {"return_logprob": True, "top_logprobs_num": int(request.logprobs)}
            stream = await self.engine.async_generate(
                input_ids=request.prompt,
                sampling_params=params,
                stream=True,
                rid=request.rid,
                **logprobs,
            )
            async for out in stream:
                chunk, sent = _to_chunk(out, sent, request.logprobs)
                if chunk.finish == FINISH_ABORT and sent == 0 and _param_of(chunk.error or "", request):
                    emit(("reject", chunk.error))  # SGLang's scheduler could not compile the constraint
                    return
                emit(("chunk", chunk))
                if chunk.finish is not None:
                    return
            emit(("error", "SGLang ended the request without a finish reason"))
        except asyncio.CancelledError:
            raise
        except ValueError as exc:  # SGLang's request validation (length, parameters)
            emit(("reject", str(exc)) if sent == 0 else ("error", str(exc)))
        except Exception as exc:
            emit(("error", f"{type(exc).__name__}: {exc}"))

    async def abort(self, rid: str) -> None:
        pump = self._running.get(rid)
        if pump is None or rid in self._aborting:
            return  # unknown, finished, or already being aborted
        self._aborting.add(rid)
        try:
            await asyncio.wrap_future(self._call(self._abort_on_loop(rid)))
        finally:
            pump.cancel()  # the pump on the engine loop stops streaming
        self._cancelled += 1

    async def _abort_on_loop(self, rid: str) -> None:
        self.engine.tokenizer_manager.abort_request(rid=rid)

    def load(self) -> EngineLoad:
        running = len(self._running)
        self._peak = max(self._peak, running)
        return EngineLoad(num_running=running, num_waiting=0, peak_running=self._peak, cancelled_total=self._cancelled)


_GRAMMAR_WORDS = ("grammar", "schema", "regex", "ebnf", "json", "structural", "xgrammar", "outlines", "guidance")


def _param_of(message: str, request: EngineRequest) -> str | None:
    """ "structured" for a constrained request whose refusal speaks of its grammar backend's work (the
    client's 400 then names the request field the constraint came from), else None."""
    if request.structured is not None and any(w in message.lower() for w in _GRAMMAR_WORDS):
        return "structured"
    return None


def structured_params(structured: Structured) -> dict[str, str]:
    """A protocol Structured as SGLang sampling_params keys."""
    kind = structured.kind
    if kind == "json_schema":
        return {"json_schema": structured.spec}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}  # what SGLang's own server sends for json_object
    if kind == "regex":
        return {"regex": structured.spec}
    if kind == "grammar":
        return {"ebnf": structured.spec}
    if kind == "choice":
        return {"ebnf": choice_grammar(structured.choices)}
    if kind == "structural_tag":
        return {"structural_tag": structured.spec}
    raise EngineRejected(f"unknown structured kind {kind!r}", param="structured")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar (xgrammar's dialect) whose language is exactly ``choices``."""

    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ch == "\n":
                out.append("\\n")
            elif ch == "\r":
                out.append("\\r")
            elif ch == "\t":
                out.append("\\t")
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _logprobs_of(meta: dict, sent: int, count: int, top_n: int) -> tuple[list[float], list[int], list[float]]:
    """The logprobs of the ``count`` tokens after the first ``sent``, from SGLang's meta_info.

    ``output_token_logprobs`` holds ``(logprob, token_id, text)`` per token and
    ``output_top_logprobs`` a best-first list of such tuples per token; both are either the new
    tokens' entries (incremental streaming) or every token's so far (cumulative)."""
    entries = meta.get("output_token_logprobs") or []
    tops = (meta.get("output_top_logprobs") or []) if top_n else []
    if len(entries) > count:  # cumulative: every token so far
        entries = entries[sent : sent + count]
        tops = tops[sent : sent + count]
    chosen = [float(entry[0]) for entry in entries]
    ids: list[int] = []
    values: list[float] = []
    if top_n:
        for position in tops:
            for value, token_id, *_ in (position or [])[:top_n]:
                ids.append(int(token_id))
                values.append(float(value))
    return chosen, ids, values


def _to_chunk(out: dict, sent: int, top_n: int | None = None) -> tuple[Chunk, int]:
    """One SGLang output dict -> a Chunk of new tokens; ``sent`` counts tokens handed over so far.

    ``top_n``: the request's logprobs (None: it asked for none)."""
    ids = list(out.get("output_ids") or [])
    meta = out.get("meta_info") or {}
    completion = meta.get("completion_tokens")
    if isinstance(completion, int) and len(ids) > completion - sent >= 0:
        ids = ids[len(ids) - (completion - sent) :]  # a cumulative (not incremental) output
    reason = meta.get("finish_reason")
    finish = error = None
    if reason is not None:
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        if kind == "stop":
            finish = FINISH_STOP
            matched = reason.get("matched") if isinstance(reason, dict) else None
            if isinstance(matched, int) and (not ids or ids[-1] != matched):
                ids.append(matched)  # SGLang matched a stop token but trimmed it from the output
        elif kind == "length":
            finish = FINISH_LENGTH
        elif kind == "abort":
            finish = FINISH_ABORT
            error = reason.get("message") if isinstance(reason, dict) else None
        else:
            finish, error = FINISH_ERROR, f"SGLang finished the request with {reason!r}"
    cached = meta.get("cached_tokens")
    chunk = Chunk(ids, finish, error, cached if isinstance(cached, int) else None)
    if top_n is not None:
        chunk.logprobs, chunk.top_ids, chunk.top_logprobs = _logprobs_of(meta, sent, len(ids), top_n)
    return chunk, sent + len(ids)


# --------------------------------------------------------------------------- command line


def from_args(args: argparse.Namespace) -> SGLangBackend:
    """The backend ``tokenmill engine --backend ...`` asked for."""
    return SGLangBackend.from_args(args)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """SGLang takes its options through the shared --model, --max-model-len, --max-running, --dtype
    and --engine-arg KEY=VALUE (any ``sglang.Engine`` / ServerArgs keyword)."""
    group.description = (
        "--model, --max-model-len (context_length), --max-running (max_running_requests), --dtype, and "
        "--engine-arg KEY=VALUE for any other sglang.Engine keyword, e.g. tp_size=2, mem_fraction_static=0.85, "
        "or skip_tokenizer_init=false (min_tokens and structured outputs, at the cost of SGLang detokenizing)"
    )


__all__ = ["from_args", "SGLangBackend", "parse_engine_args", "structured_params", "choice_grammar", "add_arguments"]
