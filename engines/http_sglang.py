"""The http backend's SGLang flavour: an unmodified SGLang server's native ``/generate`` behind the protocol.

``tokenmill engine --backend http --engine-url URL --engine-flavour sglang`` (or ``auto``, which finds
SGLang by its ``/model_info``) drives ``python -m sglang.launch_server`` as it runs: no flag of SGLang's
is needed. The shapes below are SGLang 0.5.23's (python/sglang/srt/entrypoints/http_server.py, its
``GenerateReqInput`` in managers/io_struct.py, the JSON contract in api/v1/api_types.py).

**Requests.** ``POST /generate`` with ``rid`` (ours, unique across this server's front ends),
``input_ids``, ``stream: true`` and ``sampling_params``. SGLang refuses a ``sampling_params`` key it
does not know (a 400 "unknown field"), so only its own keys go there: ``max_new_tokens``,
``temperature`` (0 is greedy there), ``top_p``, ``top_k`` (-1: off), ``min_p``, the presence, frequency
and repetition penalties, ``stop_token_ids``, ``min_new_tokens``, ``logit_bias``, ``sampling_seed`` and
one of ``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag``. ``cache_salt`` and ``priority`` go
at the top level, logprobs as ``return_logprob`` and ``top_logprobs_num``.

**Stop tokens.** SGLang's ``ignore_eos`` also switches ``stop_token_ids`` off (``Req`` checks neither
then), and without it SGLang also stops at EOS tokens of its own: those of config.json and
generation_config.json, the tokenizer's, and a few turn-final markers (:func:`engine_stop_ids` reads them
from the model directory tokenmill serves). So a request whose ``stop_token_ids`` (the model's EOS among
them, as the front end sends them) hold all of SGLang's goes without ``ignore_eos`` and SGLang ends it by
itself; one that asked for ``ignore_eos``, or where SGLang would stop at a token tokenmill does not stop
at, goes with it, and the bridge ends the request at its stop tokens and aborts it on the server.

**What SGLang cannot honour** is not in Welcome's features, so the gateway answers a 400 naming the
field: ``allowed_token_ids``, ``bad_words``, prompt logprobs (SGLang gives no rank for a prompt token),
``kv_transfer_params``, ``extra_args`` (vLLM's), images and the structured-output whitespace options
(server-wide settings there); ``priority`` unless the server schedules by it
(``--enable-priority-scheduling``); ``min_tokens`` and structured outputs on a server started with
``--skip-tokenizer-init`` (SGLang needs its tokenizer for both), structured outputs with
``--grammar-backend none``. A ``seed`` with a temperature above 0 is refused (naming ``seed``) unless the
server runs with ``--enable-deterministic-inference``: elsewhere SGLang ignores per-request seeds.

**Outputs.** Each event is ``data: {"output_ids": [...], "meta_info": {...}}``; ``output_ids`` holds
every token so far unless the server runs with ``--incremental-streaming-output`` (then only the new
ones). The bridge takes the last ``completion_tokens - sent`` IDs of each event, which is right in both
modes, and so the logprobs (``output_token_logprobs``: ``[logprob, token_id, text]`` per token,
``output_top_logprobs``: a best-first list of those per token). ``meta_info.finish_reason`` is an
object: ``{"type": "stop", "matched": ...}``, ``{"type": "length", ...}`` or ``{"type": "abort",
"message": ..., "status_code": ...}``; an abort with a 4xx status before the first token is SGLang
refusing the request (a grammar it cannot compile, a parameter out of range), an error event
(``{"error": {"message", "code"}}``) likewise.

**Aborts.** SGLang notices a client that went away only by polling (every few seconds), so the bridge
aborts explicitly: ``POST /abort_request {"rid": ...}``, then closes the connection.

**At start** the bridge waits for ``/v1/models`` and ``/health`` (503 while SGLang warms up), then
checks: the model generates (``is_generation``); its ``model_type`` and ``architectures`` (``/model_info``)
are those of the model directory tokenmill serves, where both have them; its ``max_model_len``
(``/v1/models``) becomes the rank's context length; its settings (``/server_info``) say what it can
honour; and the canary: ``POST /v1/tokenize`` with the canary conversation's ``messages`` renders and
tokenizes it as a chat completion would, and must give tokenmill's IDs. A SGLang whose ``/v1/tokenize``
takes no ``messages`` tokenizes tokenmill's rendering of the canary instead (the tokenizer is compared,
the chat template is not); one started with ``--skip-tokenizer-init`` has nothing to compare with, and
the bridge says so in its log. A failed check refuses the server (exit status 2) with what differs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp.http_exceptions import LineTooLong

from tokenmill.engines.bridge import Chunk, EngineInfo, EngineRejected, EngineRequest
from tokenmill.engines.http_backend import CANARY, EngineRefused, HTTPBackend
from tokenmill.engines.sglang_backend import structured_params
from tokenmill.scheduler_client.protocol import (
    FEATURE_CACHE_SALT,
    FEATURE_LOGPROBS,
    FEATURE_PRIORITY,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    STRUCTURED_FEATURES,
    Generate,
)
from tokenmill.scheduler_client.scheduler_side import Rejected

log = logging.getLogger("tokenmill.engine.http")

GENERATE = "/generate"
ABORT = "/abort_request"
TOKENIZE = "/v1/tokenize"
#: what every SGLang server honours, and what only one with its tokenizer (not --skip-tokenizer-init)
FEATURES = frozenset({FEATURE_LOGPROBS, "min_p", "repetition_penalty", "logit_bias", FEATURE_CACHE_SALT})
TOKENIZER_FEATURES = frozenset({"min_tokens"})
MAX_LOGPROBS = 20  # SGLang sets no limit on top_logprobs_num; the protocol's ceiling
#: the sampling key SGLang's validation message starts with -> the Generate field behind it
SGLANG_PARAMS = {
    **{name: f"sampling.{name}" for name in ("temperature", "top_p", "top_k", "min_p", "logit_bias")},
    **{name: f"sampling.{name}" for name in ("frequency_penalty", "presence_penalty", "repetition_penalty")},
    "min_new_tokens": "sampling.min_tokens",
    "max_new_tokens": "max_new_tokens",
    "sampling_seed": "sampling.seed",
    "stop_token_ids": "stop_token_ids",
    "priority": "priority",
    **{name: "structured" for name in ("json_schema", "regex", "ebnf", "structural_tag")},
}
#: turn-final markers SGLang stops at where the tokenizer has them (srt/utils/hf_transformers/common.py)
SGLANG_TURN_ENDS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")
_GRAMMAR_WORDS = ("grammar", "schema", "regex", "ebnf", "json", "structural", "xgrammar", "outlines", "guidance")
_LEADING_NAME = re.compile(r"[a-z_]+")


# ----------------------------------------------------------------------------- SGLang's events


class _Meta(msgspec.Struct):
    finish_reason: dict[str, Any] | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    output_token_logprobs: list[list[Any]] | None = None  # [logprob (null: -inf), token_id, text]
    output_top_logprobs: list[list[list[Any]] | None] | None = None


class _Error(msgspec.Struct):
    message: str = ""
    code: int | str | None = None


class _Output(msgspec.Struct):
    output_ids: list[int] = []
    meta_info: _Meta | None = None
    error: _Error | None = None


_outputs = msgspec.json.Decoder(_Output)


def _logprob(value: Any) -> float:
    return float("-inf") if value is None else float(value)  # SGLang's JSON writes -inf as null


class Mismatch(ValueError):
    """An event whose token counts do not add up."""


def to_chunk(out: _Output, sent: int, top_n: int | None, incremental: bool) -> Chunk:
    """One SGLang event -> a Chunk of the tokens new since the ``sent`` handed over before.

    ``meta_info.completion_tokens`` counts every token so far: the new ones are the last
    ``completion_tokens - sent`` of ``output_ids`` (all of them with incremental output, the tail of
    the cumulative list otherwise); without it, the server's setting (``incremental``) says."""
    meta = out.meta_info or _Meta()
    ids = out.output_ids
    if meta.completion_tokens is not None:
        new = meta.completion_tokens - sent
        if new < 0 or new > len(ids):
            raise Mismatch(
                f"the engine counts {meta.completion_tokens} tokens, {sent} were here already and its event "
                f"holds {len(ids)}"
            )
    else:
        new = len(ids) if incremental else len(ids) - sent
        if new < 0:
            raise Mismatch(f"the engine's output holds {len(ids)} tokens, fewer than the {sent} sent")
    ids = ids[len(ids) - new :]
    finish = error = None
    reason = meta.finish_reason
    if reason is not None:
        kind = reason.get("type")
        if kind == "stop":
            finish = FINISH_STOP
        elif kind == "length":
            finish = FINISH_LENGTH
        elif kind == "abort":
            finish, error = FINISH_ABORT, str(reason.get("message") or "SGLang aborted the request")
        else:
            finish, error = FINISH_ERROR, f"SGLang finished the request with {reason!r}"
    chunk = Chunk(ids, finish, error, meta.cached_tokens)
    if top_n is not None:
        entries = meta.output_token_logprobs or []
        chunk.logprobs = [_logprob(entry[0]) for entry in entries[len(entries) - new :]] if new else []
        if top_n:
            positions = meta.output_top_logprobs or []
            top_ids: list[int] = []
            values: list[float] = []
            for position in positions[len(positions) - new :] if new else []:
                for entry in (position or [])[:top_n]:
                    values.append(_logprob(entry[0]))
                    top_ids.append(int(entry[1]))
            chunk.top_ids, chunk.top_logprobs = top_ids, values
    return chunk


def param_of(message: str, request: EngineRequest) -> str | None:
    """The Generate field an SGLang refusal names: its validation messages begin with the sampling key
    ("top_p must be in (0, 1], got 1.5."); a constrained request's grammar failures name none."""
    match = _LEADING_NAME.match(message)
    if match is not None and match.group() in SGLANG_PARAMS:
        return SGLANG_PARAMS[match.group()]
    if request.structured is not None and any(word in message.lower() for word in _GRAMMAR_WORDS):
        return "structured"
    return None


def message_of(body: bytes) -> str:
    """The message of an SGLang error body: ``{"error": "..."}`` (its JSON contract), ``{"error":
    {"message": ...}}`` (a refused request), ``{"detail": ...}`` (FastAPI's validation), or the body."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, str) and error:
            return error
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if data.get("detail"):
            return str(data["detail"])[:500]
    return body.decode("utf-8", "replace").strip()[:500] or "(no body)"


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _model_config(model_dir: str | None) -> dict:
    return {} if model_dir is None else _read_json(Path(model_dir) / "config.json")


def engine_stop_ids(model) -> frozenset[int]:
    """The token IDs SGLang ends a request at by itself unless ``ignore_eos``, from the model directory as it
    reads them: ``eos_token_id`` of config.json and of generation_config.json, the tokenizer's EOS token, and
    the turn-final markers it adds where the vocabulary has them."""
    ids = set(model.eos_token_ids)
    for name in ("config.json", "generation_config.json"):
        eos = _read_json(Path(model.directory) / name).get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if isinstance(token, int):
                ids.add(token)
    for text in (model.special_tokens.get("eos_token"), *SGLANG_TURN_ENDS):
        token = model.tokenizer.token_to_id(text) if text else None
        if token is not None:
            ids.add(token)
    return frozenset(ids)


# ----------------------------------------------------------------------------- the backend


class SGLangHTTPBackend(HTTPBackend):
    """An SGLang server reached over HTTP, on the bridge's event loop."""

    health_timeout_s = 5.0  # SGLang's /health waits a second at least (it runs a one-token request when idle)
    read_bufsize = 1 << 22  # cumulative output_ids: a 265k-token answer's last event is megabytes on one line

    def __init__(self, url: str, **kwargs: Any) -> None:
        kwargs["flavour"] = "sglang"
        super().__init__(url, **kwargs)
        self.incremental = False  # the server's --incremental-streaming-output
        self.deterministic = False  # --enable-deterministic-inference: per-request seeds are honoured
        self.priority_sign = 0  # with --enable-priority-scheduling: 1 if lower values go first there, else -1
        self.engine_stops: frozenset[int] = frozenset()  # where SGLang ends a request by itself (engine_stop_ids)

    def prepare(self) -> None:
        self._scheduling()
        models = self.wait_for("/v1/models")
        self.wait_for("/health")  # 503 while SGLang starts and warms up
        self._check_server(models)

    def _get_json(self, *paths: str) -> dict:
        """The first of ``paths`` that answers (SGLang renamed /get_model_info and /get_server_info)."""
        answers = []
        for path in paths:
            status, body = self._call("GET", path, timeout=30)
            if status == 200:
                data = json.loads(body)
                if isinstance(data, dict):
                    return data
            answers.append(f"{path} answered {status}")
        raise EngineRefused(f"{self.url} is not an SGLang server: {', '.join(answers)}")

    def _check_server(self, body: bytes) -> None:
        models = json.loads(body).get("data") or []
        if not models:
            raise EngineRefused(f"{self.url}/v1/models lists no model")
        self.model = str(models[0]["id"])
        # SGLang lists its LoRA adapters (--enable-lora --lora-paths, or loaded at run time) as the base's children
        self.adapters = tuple(str(m["id"]) for m in models[1:] if m.get("parent") == self.model)
        model_info = self._get_json("/model_info", "/get_model_info")
        server = self._get_json("/server_info", "/get_server_info")
        if model_info.get("is_generation") is False:
            raise EngineRefused(f"{self.url} serves {model_info.get('model_path')}, which does not generate")
        self._check_model(model_info)
        max_model_len = models[0].get("max_model_len") or server.get("context_length")
        tokenizer = not server.get("skip_tokenizer_init", False)
        self.incremental = bool(server.get("incremental_streaming_output", False))
        self.deterministic = bool(server.get("enable_deterministic_inference", False))
        if server.get("enable_priority_scheduling"):
            self.priority_sign = 1 if server.get("schedule_low_priority_values_first") else -1
        features = set(FEATURES)
        if tokenizer:
            features |= TOKENIZER_FEATURES
            if str(server.get("grammar_backend")).lower() != "none":
                features |= set(STRUCTURED_FEATURES)
        if self.priority_sign:
            features.add(FEATURE_PRIORITY)
        self.engine_stops = engine_stop_ids(self.served_model())
        if not self.canary:
            canary = "not checked (--no-canary)"
        elif tokenizer:
            canary = self._check_canary()
        else:
            canary = "NOT checked: the server runs with --skip-tokenizer-init and cannot tokenize"
            log.warning("the engine at %s: the canary tokenization is %s", self.url, canary)
        log.info(
            "engine at %s: SGLang %s, model %s (%s), max_model_len %s, %s output, canary %s",
            self.url,
            server.get("version") or "(version unknown)",
            self.model,
            model_info.get("model_path"),
            max_model_len,
            "incremental" if self.incremental else "cumulative",
            canary,
        )
        self._info = EngineInfo(
            name=f"sglang-http:{self.model}@{self.url}",
            vocab_size=None,  # SGLang checks prompt IDs against its vocabulary itself
            max_running_requests=None,
            max_model_len=int(max_model_len) if isinstance(max_model_len, int) else None,
            features=frozenset(features),
            max_logprobs=MAX_LOGPROBS,
            adapters=self.adapters,
        )

    def _check_model(self, model_info: dict) -> None:
        """Refuse a server whose model type or architectures differ from the served model directory's."""
        ours = _model_config(self.model_dir)
        for key in ("model_type", "architectures"):
            theirs = model_info.get(key)
            if ours.get(key) is not None and theirs is not None and ours[key] != theirs:
                raise EngineRefused(
                    f"the engine at {self.url} serves {model_info.get('model_path')}, whose {key} is {theirs!r}; "
                    f"tokenmill serves {self.model_dir}, whose {key} is {ours[key]!r}. Serve the same model on "
                    "both sides."
                )

    def _check_canary(self) -> str:
        """Compare the canary's IDs with SGLang's rendering (or, where its /v1/tokenize takes no messages,
        its tokenization of ours). Returns how it was checked."""
        ours = self.canary_ids()
        kwargs = {"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {}
        status, body = self._call("POST", TOKENIZE, {"model": self.model, **CANARY, **kwargs})
        if status == 200:
            self.compare_canary(json.loads(body).get("tokens"), ours)
            return "equal (rendered and tokenized there)"
        if status == 404:
            raise EngineRefused(
                f"{self.url}{TOKENIZE} answered 404: this SGLang cannot tokenize, so the canary cannot be "
                "checked (tokenmill engine --no-canary skips it)"
            )
        why = message_of(body)
        log.warning(
            "the engine at %s does not render the canary conversation (%s %s): comparing its tokenizer only",
            self.url,
            status,
            why,
        )
        text = self.canary_ids(text=True)
        status, body = self._call("POST", TOKENIZE, {"model": self.model, "prompt": text, "add_special_tokens": False})
        if status != 200:
            raise EngineRefused(f"{self.url}{TOKENIZE} answered {status}: {message_of(body)}")
        self.compare_canary(
            json.loads(body).get("tokens"), ours, what="tokenizes tokenmill's rendering of the canary conversation"
        )
        return "tokenizer equal (its chat template not compared: its /v1/tokenize takes no messages)"

    # ------------------------------------------------------------------ requests

    def check(self, gen: Generate) -> None:
        s = gen.sampling
        if s.seed is not None and s.temperature > 0 and not self.deterministic:
            raise Rejected(
                "this SGLang server ignores per-request seeds: start it with --enable-deterministic-inference, "
                "or leave seed unset",
                param="sampling.seed",
            )

    def sampling_params(self, request: EngineRequest) -> dict[str, Any]:
        s = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": request.max_new_tokens,
            "temperature": float(s.temperature),
            "top_p": float(s.top_p),
            "top_k": int(s.top_k) if s.top_k > 0 else -1,
            "min_p": float(s.min_p),
            "presence_penalty": float(s.presence_penalty),
            "frequency_penalty": float(s.frequency_penalty),
            "repetition_penalty": float(s.repetition_penalty),
            # SGLang ends the request at these (its min_new_tokens holds them back too) ...
            "stop_token_ids": list(request.stop_token_ids),
        }
        if request.ignore_eos or not self.engine_stops <= set(request.stop_token_ids):
            # ... and at its own EOS: where that is not one of them, neither (ignore_eos turns both off), and
            # the bridge ends the request at them and aborts it
            params["ignore_eos"] = True
        if s.min_tokens:
            params["min_new_tokens"] = min(int(s.min_tokens), request.max_new_tokens)
        if s.seed is not None and s.temperature > 0:
            params["sampling_seed"] = int(s.seed)  # only with --enable-deterministic-inference (check)
        if s.logit_bias:
            params["logit_bias"] = {str(int(t)): float(b) for t, b in s.logit_bias.items()}
        if request.structured is not None:
            params.update(structured_params(request.structured))
        return params

    def body(self, request: EngineRequest) -> bytes:
        body: dict[str, Any] = {
            "rid": self.engine_rid(request.rid),
            "input_ids": request.prompt,
            "sampling_params": self.sampling_params(request),
            "stream": True,
        }
        if request.logprobs is not None:
            body["return_logprob"] = True
            body["top_logprobs_num"] = int(request.logprobs)
            body["logprob_start_len"] = -1  # the output's only
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if request.adapter is not None:
            body["lora_path"] = request.adapter  # SGLang takes an adapter's name there
        if request.priority and self.priority_sign:
            body["priority"] = self.priority_sign * int(request.priority)  # the protocol's: lower goes first
        return msgspec.json.encode(body)

    def engine_rid(self, rid: str) -> str:
        return f"{rid}-{self._nonce}"

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        import aiohttp

        rid = request.rid
        body = self.body(request)
        self._running.add(rid)
        self._peak = max(self._peak, len(self._running))
        finished = False
        try:
            try:
                response = await self._session.post(
                    self.url + GENERATE, data=body, headers={"Content-Type": "application/json"}
                )
            except (aiohttp.ClientError, OSError) as exc:
                finished = True
                yield await self._connection_failed("the engine did not take the request at", exc)
                return
            async with response:
                try:
                    if response.status != 200:
                        finished = True
                        message = message_of(await response.read())
                        if 400 <= response.status < 500 and response.status not in (408, 429):
                            raise EngineRejected(message, param=param_of(message, request))
                        yield Chunk(finish=FINISH_ERROR, error=f"the engine answered {response.status}: {message}")
                        return
                    sent = 0
                    try:
                        async for line in response.content:
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                break
                            out = _outputs.decode(data)
                            if out.error is not None:
                                finished = True
                                message = out.error.message
                                if sent == 0 and str(out.error.code).startswith("4"):
                                    raise EngineRejected(message, param=param_of(message, request))
                                yield Chunk(finish=FINISH_ERROR, error=f"the engine failed the request: {message}")
                                return
                            chunk = to_chunk(out, sent, request.logprobs, self.incremental)
                            if chunk.finish == FINISH_ABORT and sent == 0 and not chunk.token_ids:
                                finished = True  # refused before its first token (a grammar, a parameter)
                                raise EngineRejected(chunk.error or "", param=param_of(chunk.error or "", request))
                            if chunk.token_ids and max(chunk.token_ids) >= self.vocab_limit:
                                yield self._outside(chunk)
                                return
                            sent += len(chunk.token_ids)
                            finished = chunk.finish is not None
                            yield chunk
                            if finished:
                                return
                    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                        finished = True
                        yield await self._connection_failed("the connection broke to the engine at", exc)
                        return
                    except (msgspec.DecodeError, msgspec.ValidationError, Mismatch, TypeError, IndexError) as exc:
                        yield Chunk(finish=FINISH_ERROR, error=f"the engine sent a malformed event: {exc}")
                        return
                    except LineTooLong:
                        yield Chunk(
                            finish=FINISH_ERROR,
                            error=f"the engine sent an event longer than {2 * self.read_bufsize >> 20} MiB (every token so "
                            "far, each time): start SGLang with --incremental-streaming-output",
                        )
                        return
                finally:
                    if not finished:  # ended here first: abort it before its connection closes (SGLang notices
                        await self.abort(rid)  # a closed connection only by polling, seconds later)
            finished = True
            yield Chunk(finish=FINISH_ERROR, error="the engine ended the stream without a finish reason")
        finally:
            if not finished:
                await self.abort(rid)
            self._running.discard(rid)
            self._aborting.discard(rid)

    async def abort(self, rid: str) -> None:
        """``POST /abort_request`` with the request's ``rid`` (SGLang answers 200 for any)."""
        import aiohttp

        if rid not in self._running or rid in self._aborting:
            return
        self._aborting.add(rid)
        self._cancelled += 1
        engine_rid = self.engine_rid(rid)
        try:
            async with self._session.post(
                self.url + ABORT, json={"rid": engine_rid}, timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.status != 200:
                    log.warning(
                        "aborting %s on %s: %s %s", engine_rid, self.url, resp.status, message_of(await resp.read())
                    )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            log.warning("aborting %s on %s failed: %s", engine_rid, self.url, exc)
