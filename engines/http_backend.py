"""The http backend: an unmodified engine server's token-in/token-out HTTP API behind the protocol.

``tokenmill engine --backend http --engine-url http://HOST:PORT`` speaks the scheduler protocol on
its socket and, for every request, HTTP to a server the operator already runs. Two flavours:

* **vllm** (this module) — ``vllm serve ... --enable-scale-out``: ``POST /inference/v1/generate``
  takes the prompt's token IDs and vLLM's ``SamplingParams`` as JSON and streams the new token IDs
  as server-sent events; ``POST /inference/v1/abort_requests`` stops a request by the ID the server
  gave it (``request_id`` of its events). Without ``--enable-scale-out`` those paths answer 403,
  and the bridge refuses to start with a message that says so.
* **sglang** (:mod:`tokenmill.engines.http_sglang`) — SGLang's own server, ``POST /generate`` with
  ``input_ids``.

``--engine-flavour auto`` (the default) waits for the server and asks it: SGLang answers
``/model_info`` (``/get_model_info`` in older releases) with its ``model_path``, vLLM does not. The
rest of this docstring is the vLLM flavour's.

**At start** (and so after every restart, since the gateway starts the bridge again when it exits)
the bridge waits for the server to answer, then checks it: it serves a model (the first of
``/v1/models`` is the one requests name) and its token-in API is on; its ``max_model_len`` becomes
the Welcome's; and a fixed canary conversation rendered and tokenized by tokenmill (the model
directory and chat template the gateway serves) must give the same prompt token IDs as the server's
own ``/v1/chat/completions/render``. A server that fails a check is refused (exit status 2) with
what differs, as a version skew or another model would make every prompt wrong without an error.

**Requests.** The protocol's fields map to vLLM's SamplingParams keys one to one (temperature,
top_p, top_k, seed, penalties, min_p, min_tokens, logit_bias, allowed_token_ids, stop_token_ids,
structured outputs, extra_args), ``cache_salt`` goes at the top level. As in the in-process vLLM
backend, ``ignore_eos`` is always set and the front end's ``stop_token_ids`` (the model's EOS among
them unless the client asked otherwise) end the request, and ``detokenize`` is off: vLLM's server
decodes nothing. ``bad_words`` go as words (the API takes only words, which vLLM tokenizes itself;
the protocol carries the workers' token sequences): :meth:`HTTPBackend.bad_words_text` recovers them
and checks they tokenize back to the same sequences. What this API cannot carry is not listed in
Welcome's features, so the gateway answers a request that uses it with a 400 naming the field: images
of a model whose pixels tokenmill cannot turn back into files (:meth:`HTTPBackend.images_as_files`
says how the others go), the structured-output whitespace options (vLLM's grammar backends ignore them per request), and
``priority`` and ``kv_transfer_params`` unless the operator says the servers honour them
(``--engine-scheduling-policy priority``, ``--engine-kv-connector``): vLLM takes both from any client
and ignores them without a word on a server that schedules first come first served or has no KV
connector, and its API does not tell which it has. ``kv_transfer_params`` go unstreamed, as the API
returns the connector's answer only in a whole answer.

**Prompt logprobs.** vLLM's token-in API returns them only in a whole answer, so a request that
asks for them goes unstreamed: its tokens arrive together, at the end.

**Logprobs.** vLLM's token-mode logprobs list the sampled token first, then the top candidates,
cut to the requested count N, so a sampled token outside the top N pushes out the N-th candidate.
Where the sampled token cannot rank below the first (greedy, and nothing that changes the choice:
no logit_bias, allowed_token_ids, constraint, penalty or min_tokens), the bridge asks for N and
the answer is exactly what vLLM's own server returns; elsewhere it asks for N + 1 (where the
server allows it: its ``--max-logprobs``, found at start) and keeps the N best by rank, where
candidates with equal logprobs may come in another order than vLLM's own server gives them (its
top-k breaks ties differently for another k).

**Aborts.** A request the front end aborts, or that ends here first (a stop token the bridge
enforces), is aborted on the server explicitly with ``abort_requests``, and its connection is closed
(which vLLM also takes as an abort). **Failures.** A 4xx answer before the first token is the
engine refusing the request (an ``error`` to the front end, with the field where vLLM names it); an
error event, a malformed event or a connection dropped mid-stream by a server that is still up ends
that request with ``finish_reason`` ``"error"``. When the server is down (a request's connection
failed and so does its health check, or it failed three health checks in a row), :meth:`watch`
returns and the bridge exits, leaving its requests unanswered: the gateway counts the rank lost and
moves them to another replica where they can go on, and starts a new bridge, which waits for the
server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenmill.engines.bridge import Backend, Chunk, EngineInfo, EngineLoad, EngineRejected, EngineRequest
from tokenmill.engines.vllm_backend import VLLM_FINISH, VLLM_PARAMS, structured_outputs
from tokenmill.scheduler_client.protocol import (
    FEATURE_DISABLE_ANY_WHITESPACE,
    FEATURE_IMAGES,
    FEATURE_IMAGES_BY_HASH,
    FEATURE_IMAGES_SHM,
    FEATURE_KV_TRANSFER_PARAMS,
    FEATURE_PRIORITY,
    FEATURE_WHITESPACE_PATTERN,
    FEATURES,
    FINISH_ERROR,
)

log = logging.getLogger("tokenmill.engine.http")

FLAVOURS = ("auto", "vllm", "sglang")
GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
RENDER = "/v1/chat/completions/render"
#: what every tokenmill checks its engine's tokenization with (a user turn with text beyond ASCII)
CANARY = {
    "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Zürich, 東京 and naïve café: spell them back, please."},
    ]
}
UNSUPPORTED = frozenset(
    {
        FEATURE_KV_TRANSFER_PARAMS,  # unless the operator says the servers run a KV connector
        FEATURE_PRIORITY,  # unless the operator says the servers schedule by priority
        FEATURE_IMAGES,  # unless the served model's images can be turned back into files (images_as_files)
        FEATURE_IMAGES_BY_HASH,
        FEATURE_IMAGES_SHM,
        FEATURE_DISABLE_ANY_WHITESPACE,
        FEATURE_WHITESPACE_PATTERN,
    }
)


class EngineRefused(ValueError):
    """The server answers but cannot be served from: not a token-in server, another model or tokenization."""


# ----------------------------------------------------------------------------- vLLM's events


class _Top(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None = None


class _Position(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None = None
    top_logprobs: list[_Top] = []


class _Logprobs(msgspec.Struct):
    content: list[_Position] = []


class _Choice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = []
    logprobs: _Logprobs | None = None


class _Error(msgspec.Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: int | str | None = None


class _Event(msgspec.Struct):
    request_id: str | None = None
    choices: list[_Choice] = []
    error: _Error | None = None


class _PromptEntry(msgspec.Struct):
    logprob: float
    rank: int | None = None


class _Answer(msgspec.Struct):
    """A whole (unstreamed) answer: what a request with prompt logprobs or kv_transfer_params gets."""

    request_id: str | None = None
    choices: list[_Choice] = []
    prompt_logprobs: list[dict[int, _PromptEntry] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # what the server's KV connector returned


_events = msgspec.json.Decoder(_Event)
_answers = msgspec.json.Decoder(_Answer)
_errors = msgspec.json.Decoder(dict[str, _Error])


def top_candidates(position: _Position, n: int) -> tuple[list[int], list[float]]:
    """The N best of a position's candidates by rank (the sampled token counted once, among them only
    if it is one of the N best)."""
    seen: dict[int, _Top] = {}
    for entry in position.top_logprobs:
        seen.setdefault(entry.token_id, entry)
    best = sorted(seen.values(), key=lambda e: e.rank if e.rank is not None else 1 << 62)[:n]
    return [e.token_id for e in best], [e.logprob for e in best]


def prompt_arrays(positions: list[dict[int, _PromptEntry] | None], prompt: list[int], top_n: int):
    """vLLM's prompt logprobs (None, then per position a map of the prompt token and the top N) -> the
    protocol's (logprobs, ranks, top IDs, top logprobs) for positions 1 .. len(prompt) - 1."""
    values: list[float] = []
    ranks: list[int] = []
    ids: list[int] = []
    tops: list[float] = []
    for token, position in zip(prompt[1:], positions[1:], strict=False):
        position = position or {}
        own = position.get(token)
        values.append(own.logprob if own is not None else -9999.0)
        ranks.append(int(own.rank) if own is not None and own.rank is not None else 0)
        if top_n:
            best = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 62)
            for token_id, entry in best[:top_n]:
                ids.append(int(token_id))
                tops.append(entry.logprob)
    return values, ranks, ids, tops


def to_chunk(choice: _Choice, top_n: int | None) -> Chunk:
    """One choice of a vLLM event -> a Chunk (its logprobs per token, the top N best first)."""
    finish = error = None
    if choice.finish_reason is not None:
        finish = VLLM_FINISH.get(choice.finish_reason)
        if finish is None:
            finish, error = FINISH_ERROR, f"vLLM finished the request with {choice.finish_reason!r}"
    chunk = Chunk(choice.token_ids, finish, error)
    if top_n is not None:
        positions = choice.logprobs.content if choice.logprobs is not None else []
        chunk.logprobs = [p.logprob for p in positions]
        if top_n:
            ids: list[int] = []
            values: list[float] = []
            for position in positions:
                top_ids, top_values = top_candidates(position, top_n)
                ids += top_ids
                values += top_values
            chunk.top_ids, chunk.top_logprobs = ids, values
    return chunk


# ----------------------------------------------------------------------------- the backend


class HTTPBackend(Backend):
    """An engine server reached over HTTP, on the bridge's event loop."""

    name = "http"
    health_timeout_s = 2.0  # a health check after a request's connection failed
    read_bufsize = 1 << 16  # aiohttp's default

    def __init__(
        self,
        url: str,
        *,
        flavour: str = "auto",
        model_dir: str | None = None,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
        canary: bool = True,
        wait_s: float = 0.0,
        group_nice: int = 0,
        rt_priority: int = 0,
        health_interval_s: float = 1.0,
        health_failures: int = 3,
        scheduling_policy: str = "fcfs",
        kv_connector: bool = False,
    ) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"--engine-flavour must be one of {', '.join(FLAVOURS)}")
        self.url = url.rstrip("/")
        self.flavour = flavour
        self.model_dir = model_dir
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs or {}
        self.canary = canary
        self.wait_s = wait_s  # 0: wait for the server as long as it takes
        self.group_nice = group_nice
        self.rt_priority = rt_priority
        self.io_rt_priority = 0  # the protocol socket's I/O thread's, once this process may run real-time
        self.health_interval_s = health_interval_s
        self.health_failures = health_failures
        # what the servers were started with that their API does not tell (the operator's word for it)
        self.scheduling_policy = scheduling_policy  # vLLM's --scheduling-policy: "priority" orders by priority
        self.kv_connector = kv_connector  # vLLM's --kv-transfer-config: kv_transfer_params reach a connector
        self.model = ""  # the served name requests carry
        self.adapters: tuple[str, ...] = ()  # the LoRA adapters the server lists, by the names requests carry
        self.vocab_limit = 1 << 32  # generated IDs must be below it: the served tokenizer's size (set at start)
        self.max_logprobs = 20  # what Welcome announces
        self.server_logprobs = 20  # what the server allows
        self._nonce = secrets.token_hex(4)  # request IDs unique across every front end of the server
        self._served: Any = None  # the served model, once loaded (served_model)
        self._images: Any = None  # the served model's image processor, False for none (image_processor)
        self._session: Any = None
        self._down: asyncio.Event | None = None  # set when a failed request found the server down
        self._engine_ids: dict[str, str] = {}  # rid -> the server's ID for it (from its first event)
        self._running: set[str] = set()
        self._aborting: set[str] = set()
        self._peak = 0
        self._cancelled = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HTTPBackend:
        if not args.engine_url:
            raise ValueError("the http backend needs --engine-url")
        kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
        return cls(
            args.engine_url,
            flavour=args.engine_flavour,
            model_dir=None if args.model in (None, "default") else args.model,
            chat_template=args.chat_template,
            template_kwargs=kwargs,
            canary=not args.no_canary,
            wait_s=args.engine_wait_s,
            group_nice=args.group_nice,
            rt_priority=args.rt_priority,
            scheduling_policy=args.engine_scheduling_policy,
            kv_connector=args.engine_kv_connector,
        )

    # ------------------------------------------------------------------ start: wait, check, describe

    def _call(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, bytes]:
        """One blocking request (start-up only): (status, body); OSError when the server does not answer."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def prepare(self) -> None:
        self._scheduling()
        self._check_server(self.wait_for("/v1/models"))

    def _scheduling(self) -> None:
        # On the token path, as the gateway's loop is: beside workers converting long prompts and an engine
        # spinning on every core, this process's threads waited in the run queue for seconds (its link's
        # heartbeats timed out). It only relays tokens, so real-time costs the others little.
        from tokenmill.process.procutil import request_realtime

        if self.rt_priority and request_realtime(self.rt_priority):
            self.io_rt_priority = self.rt_priority
        if self.group_nice:
            from tokenmill.process.procutil import set_group_nice

            if not set_group_nice(self.group_nice):
                log.warning(
                    "could not set this bridge's scheduling group nice to %d (needs CAP_SYS_NICE)", self.group_nice
                )

    def wait_for(self, path: str) -> bytes:
        """Wait until ``GET path`` answers 200 (as long as it takes, or ``wait_s``); its body."""
        started = time.monotonic()
        said = 0.0
        while True:
            try:
                status, body = self._call("GET", path, timeout=10)
                if status == 200:
                    return body
                why = f"GET {path} answered {status}"
            except (OSError, ValueError) as exc:
                why = str(getattr(exc, "reason", exc))
            waited = time.monotonic() - started
            if self.wait_s and waited >= self.wait_s:
                raise EngineRefused(f"{self.url} did not answer within {self.wait_s:g} s ({why})")
            if waited - said >= 10 or not said:
                log.info("waiting for the engine at %s (%s)", self.url, why)
                said = waited or 1e-9
            time.sleep(0.5)

    def detect(self) -> str:
        """The server's flavour, once it answers: "sglang" where SGLang's model information answers (its
        ``/model_info``, or ``/get_model_info`` before SGLang renamed it), else "vllm"."""
        self.wait_for("/v1/models")  # both serve it
        return "sglang" if self._answers_model_info() else "vllm"

    def _answers_model_info(self) -> bool:
        for path in ("/model_info", "/get_model_info"):
            try:
                status, body = self._call("GET", path, timeout=10)
                info = json.loads(body) if status == 200 else None
            except (OSError, ValueError):
                continue
            if isinstance(info, dict) and "model_path" in info:
                return True
        return False

    def _check_server(self, body: bytes) -> None:
        """vLLM's start-up checks (the module's docstring), from its ``/v1/models`` answer ``body``."""
        models = json.loads(body).get("data") or []
        if not models:
            raise EngineRefused(f"{self.url}/v1/models lists no model")
        self.model = str(models[0]["id"])
        # vLLM lists its LoRA adapters (--lora-modules, or loaded at run time) after the base, as its children
        self.adapters = tuple(str(m["id"]) for m in models[1:] if m.get("parent") == self.model)
        max_model_len = models[0].get("max_model_len")
        status, body = self._call("POST", ABORT, {"request_ids": []})
        if status == 404 and self._answers_model_info():
            raise EngineRefused(
                f"{self.url} is SGLang's server (it answers /model_info), not vLLM's: serve it with "
                "--engine-flavour sglang, or auto"
            )
        if status == 403 or status == 404:
            raise EngineRefused(
                f"{self.url} has no token-in API ({ABORT} answered {status}): start vLLM with "
                f"`vllm serve ... --enable-scale-out`; {_message(body)}"
            )
        if status != 200:
            raise EngineRefused(f"{self.url}{ABORT} answered {status}: {_message(body)}")
        self.server_logprobs = self._probe_max_logprobs()
        self.max_logprobs = min(20, self.server_logprobs)
        if self.canary:
            self._check_canary()
        else:
            from tokenmill.tokenizer_workers.model import load_model

            self.vocab_limit = load_model(self.model_dir).tokenizer.get_vocab_size(with_added_tokens=True)
        version = ""
        try:
            status, body = self._call("GET", "/version", timeout=10)
            version = json.loads(body).get("version", "") if status == 200 else ""
        except (OSError, ValueError):
            pass
        log.info(
            "engine at %s: vLLM %s, model %s, max_model_len %s, max logprobs %d%s",
            self.url,
            version or "(version unknown)",
            self.model,
            max_model_len,
            self.max_logprobs,
            ", canary tokenization equal" if self.canary else "",
        )
        self._info = EngineInfo(
            name=f"vllm-http:{self.model}@{self.url}",
            vocab_size=None,  # vLLM checks prompt IDs against its vocabulary itself (a 400 names the ID)
            max_running_requests=None,
            max_model_len=int(max_model_len) if isinstance(max_model_len, int) else None,
            features=self.features(),
            max_logprobs=self.max_logprobs,
            adapters=self.adapters,
        )

    def features(self) -> frozenset[str]:
        """What requests to this server may use: everything the protocol carries but what the token-in API
        cannot, and priority and kv_transfer_params only where the operator said the servers honour them
        (vLLM takes both from any client and ignores them without a word where they do not)."""
        features = set(FEATURES) - UNSUPPORTED
        if self.scheduling_policy == "priority":
            features.add(FEATURE_PRIORITY)
        if self.kv_connector:
            features.add(FEATURE_KV_TRANSFER_PARAMS)
        if self.image_processor() is not None:
            features.add(FEATURE_IMAGES)
        return frozenset(features)

    def image_processor(self):
        """The served model's image processor where its pixels can be turned back into the resized image
        (``resized_image``), else None: the token-in API takes images only as files (``content_parts``)."""
        if self._images is None:
            from pathlib import Path

            from tokenmill.tokenizer_workers.images import processor_for
            from tokenmill.tokenizer_workers.images.base import ImageProcessor

            processor = processor_for(Path(self.model_dir)) if self.model_dir else None
            supported = processor is not None and type(processor).resized_image is not ImageProcessor.resized_image
            self._images = processor if supported else False
        return self._images or None

    def _probe_max_logprobs(self) -> int:
        """The most logprobs per token the server allows (its --max-logprobs, at most the protocol's 20),
        read from its refusal of one token asked with 21."""
        status, body = self._call(
            "POST",
            GENERATE,
            {
                "request_id": f"tokenmill-probe-{self._nonce}",
                "token_ids": [0],
                "model": self.model,
                "sampling_params": {"max_tokens": 1, "logprobs": 21, "detokenize": False},
            },
        )
        if status == 200:
            return 21  # more than the protocol's ceiling: N + 1 always fits
        message = _message(body)
        allowed = [int(word) for word in message.replace(":", " ").replace(".", " ").split() if word.isdigit()]
        if "max allowed" in message and allowed:
            return allowed[-1]
        log.warning("could not learn the engine's logprobs limit (%s %s); assuming 20", status, message)
        return 20

    def _check_canary(self) -> None:
        """Refuse a server whose tokenization of the canary conversation differs from tokenmill's."""
        ours = self.canary_ids()
        status, body = self._call(
            "POST",
            RENDER,
            {"model": self.model, **CANARY, "max_tokens": 1, "chat_template_kwargs": self.template_kwargs or None},
        )
        if status != 200:
            raise EngineRefused(f"{self.url}{RENDER} answered {status}: {_message(body)}")
        self.compare_canary(json.loads(body).get("token_ids"), ours)

    def served_model(self):
        """The model tokenmill serves (its tokenizer and chat template), loaded once; sets ``vocab_limit``."""
        if self._served is None:
            from tokenmill.tokenizer_workers.model import load_model

            self._served = load_model(self.model_dir, chat_template_file=self.chat_template)
            self.vocab_limit = self._served.tokenizer.get_vocab_size(with_added_tokens=True)
        return self._served

    def canary_ids(self, text: bool = False) -> list[int] | str:
        """The canary conversation as tokenmill renders and tokenizes it for the model it serves (or, with
        ``text``, the rendered text)."""
        from tokenmill.tokenizer_workers.chat_template import ChatTemplates, render_conversation

        model = self.served_model()
        templates = ChatTemplates(model.templates, model.special_tokens)
        conversation = {**CANARY, "add_generation_prompt": True, "template_kwargs": self.template_kwargs}
        rendered = render_conversation(templates, conversation)
        return rendered if text else model.tokenizer.encode(rendered, add_special_tokens=False).ids

    def compare_canary(self, theirs: Any, ours: list[int], what: str = "tokenizes the canary conversation") -> None:
        """Refuse the server if its canary IDs differ from ours, saying where."""
        if theirs == ours:
            return
        theirs = theirs if isinstance(theirs, list) else []
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        at = at if at is not None else min(len(ours), len(theirs))
        raise EngineRefused(
            f"the engine at {self.url} ({self.model}) {what} differently from tokenmill's model "
            f"({self.model_dir or 'the embedded default'}): {len(theirs)} tokens there, {len(ours)} here, first "
            f"difference at token {at} (there {theirs[at : at + 4]}, here {ours[at : at + 4]}). Serve the same "
            "model directory and chat template on both sides."
        )

    async def start(self) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10),
            read_bufsize=self.read_bufsize,  # an event is one line: at most twice this
        )
        self._down = asyncio.Event()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def watch(self) -> None:
        """Return when the server is down: a failed request found it so, or it failed ``health_failures``
        health checks in a row. The bridge then exits, the gateway counts its rank lost (and moves its
        requests to another rank where they can go on), and starts a new bridge that waits for the server."""
        failures = 0
        while not self._down.is_set():
            try:
                await asyncio.wait_for(self._down.wait(), self.health_interval_s)
                break
            except asyncio.TimeoutError:
                pass
            failures = 0 if await self._healthy() else failures + 1
            if failures >= self.health_failures:
                log.error("the engine at %s failed %d health checks in a row", self.url, failures)
                return
        log.error("the engine at %s is down (a request's connection failed and so did its health check)", self.url)

    async def _healthy(self, timeout: float = 5.0) -> bool:
        import aiohttp

        try:
            async with self._session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _connection_failed(self, what: str, exc: BaseException) -> Chunk:
        """A request's connection failed. If the server is down, the request gets no answer here: the
        bridge exits (watch) and the gateway moves it to another rank; else it ends with an error."""
        if not await self._healthy(timeout=self.health_timeout_s):
            self._down.set()
            await asyncio.Event().wait()  # cancelled as the bridge shuts down
        return Chunk(finish=FINISH_ERROR, error=f"{what} {self.url}: {exc}")

    # ------------------------------------------------------------------ requests

    def sampling_params(self, request: EngineRequest) -> dict[str, Any]:
        s = request.sampling
        params: dict[str, Any] = {
            "n": 1,
            "max_tokens": request.max_new_tokens,
            "temperature": float(s.temperature),
            "top_p": float(s.top_p),
            "top_k": int(s.top_k) if s.top_k > 0 else -1,
            "presence_penalty": float(s.presence_penalty),
            "frequency_penalty": float(s.frequency_penalty),
            "min_p": float(s.min_p),
            "repetition_penalty": float(s.repetition_penalty),
            "min_tokens": min(int(s.min_tokens), request.max_new_tokens),
            "stop_token_ids": list(request.stop_token_ids),
            "ignore_eos": True,  # stop exactly at stop_token_ids (the front end put EOS there)
            "detokenize": False,
        }
        if s.seed is not None:
            params["seed"] = int(s.seed)
        if s.logit_bias:
            params["logit_bias"] = {str(int(t)): float(b) for t, b in s.logit_bias.items()}
        if s.allowed_token_ids is not None:
            params["allowed_token_ids"] = [int(t) for t in s.allowed_token_ids]
        if s.bad_words:
            params["bad_words"] = self.bad_words_text(s.bad_words)
        if request.logprobs is not None:
            top = int(request.logprobs)
            # N + 1 unless the sampled token is the top one (see the module's docstring)
            params["logprobs"] = top if top == 0 or _sampled_is_top(request) else min(top + 1, self.server_logprobs)
        if request.structured is not None:
            params["structured_outputs"] = structured_outputs(request.structured)
        if request.extra_args:
            params["extra_args"] = dict(request.extra_args)
        if request.prompt_logprobs is not None:
            params["prompt_logprobs"] = int(request.prompt_logprobs)
        return params

    def bad_words_text(self, sequences: list[list[int]]) -> list[str]:
        """The words behind the front end's bad-word token sequences, for vLLM to tokenize again.

        The protocol carries the sequences the workers made as vLLM's ``update_from_tokenizer`` does
        (each word, and the word after a space); vLLM's API takes only words. Each sequence decodes to
        its word (the spaced one to the same word, once stripped), and the words are tokenized here
        again the same way: only when that gives back exactly the sequences that came are they sent
        (the canary check has shown the server tokenizes as tokenmill does). Else the request is refused
        naming bad_words: a decode that loses something would make vLLM ban other tokens."""
        from tokenmill.tokenizer_workers.generation_params import bad_words_ids
        from tokenmill.tokenizer_workers.openai_requests import InvalidRequest

        tokenizer = self.served_model().tokenizer
        words = list(
            dict.fromkeys(tokenizer.decode(list(seq), skip_special_tokens=False).lstrip() for seq in sequences)
        )
        try:
            again = bad_words_ids(words, tokenizer, self.vocab_limit)
        except InvalidRequest:
            again = []
        if {tuple(seq) for seq in again} != {tuple(seq) for seq in sequences}:
            raise EngineRejected(
                "bad_words: these words do not decode from their tokens and tokenize back to the same tokens, "
                "so the engine's token-in API (which takes words) cannot be given them exactly",
                param="bad_words",
            )
        return words

    def images_as_files(self, request: EngineRequest) -> tuple[list[int], list[dict[str, str]]]:
        """The prompt and ``content_parts`` for a request with images, as vLLM's token-in API takes them.

        That API takes images as files it fetches and processes itself, with the prompt's placeholders not
        yet expanded (vLLM expands each image's one placeholder token to as many as its processor says).
        The workers sent each image's pixels, already resized; they are turned back into that resized
        image (``resized_image``), sent as a lossless PNG, so vLLM's processor finds nothing to resize and
        makes the same pixels and the same number of placeholder tokens. Each image's placeholder run
        becomes its one token again. The content hash goes as the item's ``uuid``: vLLM's processor cache
        keys on it, so an image sent again is not processed again there."""
        import base64
        import io

        import numpy as np
        from PIL import Image

        processor = self.image_processor()
        prompt = list(request.prompt)
        parts = []
        for item, frame in sorted(request.images, key=lambda image: -image[0].offset):  # from the end: offsets hold
            if processor is None or item.family != processor.family or item.dtype != "uint8" or not len(frame):
                raise EngineRejected(
                    f"images: this engine's API takes image files, and tokenmill gives {processor.family if processor else 'no'} "
                    f"images back as files from uint8 pixels only, not {item.family} {item.dtype}",
                    param="images",
                )
            run = prompt[item.offset : item.offset + item.length]
            if not run or len(set(run)) != 1:
                raise EngineRejected("images: an image's placeholder tokens are not one token repeated", param="images")
            try:
                image = processor.resized_image(
                    np.frombuffer(frame, np.uint8).reshape(item.shape), tuple(item.grid_thw)
                )
            except ValueError as exc:
                raise EngineRejected(f"images: {exc}", param="images") from exc
            png = io.BytesIO()
            Image.fromarray(image, "RGB").save(png, "PNG", compress_level=1)
            prompt[item.offset : item.offset + item.length] = run[:1]
            url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii")
            parts.append({"type": "image_url", "url": url, "uuid": item.content_hash})
        return prompt, parts[::-1]

    def body(self, request: EngineRequest) -> bytes:
        prompt, parts = self.images_as_files(request) if request.images else (request.prompt, None)
        body: dict[str, Any] = {
            "request_id": f"{request.rid}-{self._nonce}",
            "model": request.adapter or self.model,  # vLLM runs a LoRA adapter named as the model
            "token_ids": prompt,
            "sampling_params": self.sampling_params(request),
            "stream": _streamed(request),
        }
        if parts:
            body["content_parts"] = parts
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        # (each only with its feature listed: the bridge refuses a request using an unlisted one before this)
        if request.priority:
            body["priority"] = int(request.priority)  # lower first, as in the protocol
        if request.kv_transfer_params is not None:
            body["kv_transfer_params"] = request.kv_transfer_params
        return msgspec.json.encode(body)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        import aiohttp

        rid = request.rid
        # images are encoded as PNG files: in a thread, off this loop that relays every request's tokens
        body = await asyncio.to_thread(self.body, request) if request.images else self.body(request)
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
                        text = await response.read()
                        message = _message(text)
                        if 400 <= response.status < 500 and response.status not in (408, 429):
                            raise EngineRejected(message, param=_param_of(text))
                        yield Chunk(finish=FINISH_ERROR, error=f"the engine answered {response.status}: {message}")
                        return
                    if not _streamed(request):
                        finished = True
                        yield await self._whole(response, request)
                        return
                    sent = 0
                    try:
                        async for line in response.content:
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                break
                            event = _events.decode(data)
                            if event.request_id is not None and rid not in self._engine_ids:
                                self._engine_ids[rid] = event.request_id
                            if event.error is not None:
                                finished = True
                                code = event.error.code
                                if sent == 0 and str(code) == "400":
                                    raise EngineRejected(
                                        event.error.message, param=VLLM_PARAMS.get(event.error.param or "")
                                    )
                                yield Chunk(
                                    finish=FINISH_ERROR, error=f"the engine failed the request: {event.error.message}"
                                )
                                return
                            for choice in event.choices:
                                chunk = to_chunk(choice, request.logprobs)
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
                    except msgspec.DecodeError as exc:
                        yield Chunk(finish=FINISH_ERROR, error=f"the engine sent a malformed event: {exc}")
                        return
                finally:
                    if not finished:  # ended here first: aborted explicitly, before its connection closes
                        await self.abort(rid)
            finished = True
            yield Chunk(finish=FINISH_ERROR, error="the engine ended the stream without a finish reason")
        finally:
            if not finished:
                await self.abort(rid)
            self._running.discard(rid)
            self._engine_ids.pop(rid, None)
            self._aborting.discard(rid)

    async def _whole(self, response, request: EngineRequest) -> Chunk:
        """An unstreamed answer as one chunk (every token, the prompt's logprobs)."""
        import aiohttp

        try:
            answer = _answers.decode(await response.read())
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return Chunk(finish=FINISH_ERROR, error=f"the connection to the engine at {self.url} broke: {exc}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Chunk(finish=FINISH_ERROR, error=f"the engine sent a malformed answer: {exc}")
        if len(answer.choices) != 1 or answer.choices[0].finish_reason is None:
            return Chunk(finish=FINISH_ERROR, error="the engine's answer has no finished choice")
        chunk = to_chunk(answer.choices[0], request.logprobs)
        if chunk.token_ids and max(chunk.token_ids) >= self.vocab_limit:
            return self._outside(chunk)
        if answer.prompt_logprobs is not None and request.prompt_logprobs is not None:
            chunk.prompt_logprobs = prompt_arrays(answer.prompt_logprobs, request.prompt, int(request.prompt_logprobs))
        chunk.kv_transfer_params = answer.kv_transfer_params
        return chunk

    def _outside(self, chunk: Chunk) -> Chunk:
        """The error for a chunk with a token ID the served tokenizer does not have (a mismatched engine)."""
        token = max(chunk.token_ids)
        return Chunk(
            finish=FINISH_ERROR,
            error=f"the engine sent token ID {token}, outside the served tokenizer's vocabulary of {self.vocab_limit}",
        )

    async def abort(self, rid: str) -> None:
        """Abort on the server by the ID it gave the request (or the one it would give it)."""
        import aiohttp

        if rid not in self._running or rid in self._aborting:
            return
        self._aborting.add(rid)
        engine_id = self._engine_ids.get(rid) or f"generate-tokens-{rid}-{self._nonce}"
        self._cancelled += 1
        try:
            async with self._session.post(
                self.url + ABORT, json={"request_ids": [engine_id]}, timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.status != 200:
                    log.warning(
                        "aborting %s on %s: %s %s", engine_id, self.url, resp.status, _message(await resp.read())
                    )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            log.warning("aborting %s on %s failed: %s", engine_id, self.url, exc)

    def load(self) -> EngineLoad:
        running = len(self._running)
        self._peak = max(self._peak, running)
        return EngineLoad(num_running=running, peak_running=self._peak, cancelled_total=self._cancelled)


def _streamed(request: EngineRequest) -> bool:
    """Whether the request streams from vLLM: its token-in API returns prompt logprobs and what its KV
    connector gives back (kv_transfer_params) only in a whole answer."""
    return request.prompt_logprobs is None and request.kv_transfer_params is None


def _sampled_is_top(request: EngineRequest) -> bool:
    """Whether the sampled token is always the one with the best raw logprob: greedy, nothing changing it."""
    s = request.sampling
    return (
        s.temperature == 0
        and not s.logit_bias
        and s.allowed_token_ids is None
        and request.structured is None
        and s.presence_penalty == 0
        and s.frequency_penalty == 0
        and s.repetition_penalty == 1.0
        and not s.min_tokens
    )


def _message(body: bytes) -> str:
    """The message of an OpenAI-style error body (or the body itself, cut short)."""
    try:
        error = _errors.decode(body).get("error")
        if error is not None and error.message:
            return error.message
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    text = body.decode("utf-8", "replace").strip()
    return text[:500] or "(no body)"


def _param_of(body: bytes) -> str | None:
    try:
        error = _errors.decode(body).get("error")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return VLLM_PARAMS.get(error.param or "") if error is not None else None


# --------------------------------------------------------------------------- command line


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.description = (
        "An unmodified engine server over its token-in/token-out HTTP API (vllm serve --enable-scale-out, "
        "or SGLang's server and its /generate). "
        "--model and --chat-template name what tokenmill serves, for the canary check."
    )
    group.add_argument("--engine-url", default=None, metavar="URL", help="the engine server, e.g. http://10.0.0.5:8000")
    group.add_argument(
        "--engine-flavour",
        default="auto",
        choices=FLAVOURS,
        help="the server's API: vllm, sglang, or auto (detect: SGLang answers /model_info; default %(default)s)",
    )
    group.add_argument(
        "--engine-wait-s",
        type=float,
        default=0.0,
        metavar="S",
        help="give up (exit status 2) if the server has not answered within S seconds (0: wait as long as it takes)",
    )
    group.add_argument("--chat-template", default=None, metavar="FILE", help="the chat template tokenmill serves")
    group.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="the template variables tokenmill adds to every request",
    )
    group.add_argument(
        "--group-nice",
        type=int,
        default=0,
        metavar="N",
        help="niceness of this process's scheduling group (its session's autogroup; tokenmill serve passes its "
        "worker_group_nice): on the token path beside workers that convert long prompts (0: leave it)",
    )
    group.add_argument(
        "--rt-priority",
        type=int,
        default=0,
        metavar="N",
        help="SCHED_FIFO priority for this process's event loop and ZeroMQ I/O threads where permitted (tokenmill "
        "serve passes its loop_rt_priority; 0: never real-time)",
    )
    group.add_argument(
        "--engine-scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="how the vLLM servers order their waiting requests (their --scheduling-policy; their API does not "
        "tell): with priority, a request's priority goes to them; with fcfs (default), a non-zero priority is "
        "a 400 (the server would ignore it). SGLang's servers say it themselves.",
    )
    group.add_argument(
        "--engine-kv-connector",
        action="store_true",
        help="the vLLM servers run a KV connector (their --kv-transfer-config): a request's kv_transfer_params go "
        "to them (unstreamed, as their API returns the connector's answer only whole); without it they are a 400",
    )
    group.add_argument(
        "--no-canary",
        action="store_true",
        help="skip the canary check of the server's tokenization (for a server that cannot render a conversation)",
    )
