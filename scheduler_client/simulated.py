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
prompt instead.

Run it as ``tokenmill simulate-scheduler --bind ENDPOINT`` or
``python -m scheduler_client.simulated --bind ENDPOINT``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import random
import signal
import stat
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from scheduler_client.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    PROTOCOL_VERSION,
    Abort,
    Error,
    Generate,
    Hello,
    Outputs,
    RequestOutput,
    Stats,
    Welcome,
    decode_to_scheduler,
    encode,
    frame_to_ids,
)

log = logging.getLogger("tokenmill.simulated_scheduler")

SCHEDULER_NAME = "tokenmill-simulated"
DEFAULT_VOCAB_SIZE = 129280  # DeepSeek-V3/V4, the embedded default model

# Error codes this scheduler sends (docs/scheduler-protocol.md lists them).
ERR_BAD_REQUEST = "bad_request"
ERR_UNKNOWN_MESSAGE = "unknown_message"
ERR_VERSION_MISMATCH = "version_mismatch"
ERR_DUPLICATE = "duplicate_request_id"

_KNOWN_TYPES = ("hello", "generate", "abort")

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


def _build_palette(tokenizer_file: Path, vocab_size: int | None) -> tuple[int, list[list[int]]]:
    """(vocab size, the palette paragraph tokenized one sentence at a time)."""
    from tokenizers import Tokenizer  # only needed with --model

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
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


def resolve_model_dir(model: str) -> Path:
    """``default`` -> the embedded default model's directory, else the path itself."""
    if model == "default":
        from tokenizer_workers.model import default_model_dir

        return default_model_dir()
    return Path(model)


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
    state: str = _WAITING
    generated: int = 0
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


@dataclass(eq=False)
class _Client:
    identity: bytes
    rejected: bool = False  # its last Hello had an unsupported version


def _make_rng(generate: Generate, prompt_bytes: bytes) -> random.Random:
    """Deterministic for (seed, prompt); for the prompt alone with seed None and temperature 0."""
    seed = generate.sampling.seed
    if seed is not None:
        digest = hashlib.blake2b(seed.to_bytes(16, "little", signed=True) + prompt_bytes, digest_size=16)
    elif generate.sampling.temperature == 0:
        digest = hashlib.blake2b(b"greedy" + prompt_bytes, digest_size=16)
    else:
        return random.Random()
    return random.Random(int.from_bytes(digest.digest(), "little"))


class _Rejected(Exception):
    def __init__(self, message: str, code: str = ERR_BAD_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# --------------------------------------------------------------------------- the scheduler


class SimulatedScheduler:
    """The scheduler side of the protocol, with simulated timing and tokens.

    ``await serve(endpoint)`` binds and runs until ``await close()`` (or cancellation).
    After binding, ``endpoint`` holds the bound address (useful with ``tcp://127.0.0.1:0``)
    and ``await wait_ready()`` returns.
    """

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
    ) -> None:
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
        if stats_interval_s <= 0:
            raise ValueError("stats_interval_s must be positive")

        if model is not None:
            directory = resolve_model_dir(str(model))
            tokenizer_file = directory / "tokenizer.json"
            if not tokenizer_file.is_file():
                raise ValueError(f"{directory} has no tokenizer.json")
            size, sentences = _build_palette(tokenizer_file, vocab_size)
            self._tokens = _TokenSource(size, sentences)
        else:
            self._tokens = _TokenSource(vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE)

        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.inter_token_latency_s = float(inter_token_latency_s)
        self.max_running = int(max_running)
        self.mode = mode
        self.eos_probability = float(eos_probability)
        self.stats_interval_s = float(stats_interval_s)
        self.heartbeat_ivl_ms = int(heartbeat_ivl_ms)
        self.heartbeat_timeout_ms = int(heartbeat_timeout_ms)
        self.curve_secret_key = curve_secret_key
        self.scheduler_name = scheduler_name
        self.endpoint: str | None = None

        self._requests: dict[tuple[bytes, str], _Request] = {}
        self._waiting: dict[tuple[bytes, str], _Request] = {}  # insertion order = FIFO
        self._prefilling: dict[tuple[bytes, str], _Request] = {}  # in prefill order
        self._decoding: dict[tuple[bytes, str], _Request] = {}
        self._clients: dict[bytes, _Client] = {}
        self._prefill_busy_until = 0.0
        self._next_step_at = 0.0

        self._sock: zmq.asyncio.Socket | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._ipc_path: str | None = None
        self._wake: asyncio.Event | None = None
        self._ready: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._serving = False

    @property
    def vocab_size(self) -> int:
        return self._tokens.vocab_size

    @property
    def num_running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ lifecycle

    def _events(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
            self._ready = asyncio.Event()
            self._closing = asyncio.Event()
            self._closed = asyncio.Event()

    async def wait_ready(self) -> str:
        """Wait until serve() has bound its socket; returns the bound endpoint."""
        self._events()
        await self._ready.wait()
        return self.endpoint

    async def serve(self, endpoint: str) -> None:
        """Bind ``endpoint`` and serve until close() is called."""
        self._events()
        if self._serving or self._closing.is_set():
            raise RuntimeError("a SimulatedScheduler serves once")
        self._serving = True
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            self._configure(sock)
            sock.bind(endpoint)
        except BaseException:
            sock.close(linger=0)
            ctx.term()
            self._serving = False
            self._closed.set()
            raise
        self._ctx, self._sock = ctx, sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
            self._ipc_path = endpoint[len("ipc://") :]
        log.info(
            "simulated scheduler listening on %s (mode %s, max_running %d, itl %.1f ms, prefill %.0f tok/s, vocab %d%s)",
            self.endpoint,
            self.mode,
            self.max_running,
            self.inter_token_latency_s * 1000,
            self.prefill_tokens_per_s,
            self.vocab_size,
            ", palette" if self._tokens.uses_palette else "",
        )
        self._ready.set()
        tasks = [
            asyncio.create_task(self._recv_loop(), name="sim-recv"),
            asyncio.create_task(self._engine_loop(), name="sim-engine"),
            asyncio.create_task(self._stats_loop(), name="sim-stats"),
        ]
        closing = asyncio.create_task(self._closing.wait())
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait([*tasks, closing], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not closing and not task.cancelled() and task.exception() is not None:
                    failure = task.exception()
        finally:
            closing.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, closing, return_exceptions=True)
            self._teardown()
        if failure is not None:
            raise failure

    async def close(self) -> None:
        """Stop serving: close the socket and remove the ipc socket file. Idempotent."""
        self._events()
        self._closing.set()
        if self._serving:
            await self._closed.wait()

    def _configure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished front end raises EHOSTUNREACH
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a front end with a fixed routing id may reconnect
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.heartbeat_ivl_ms > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ivl_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
        if self.curve_secret_key is not None:
            if not zmq.has("curve"):
                raise RuntimeError("this libzmq has no CURVE support")
            key = self.curve_secret_key
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, key.encode() if isinstance(key, str) else key)

    def _teardown(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._ipc_path:
            try:
                if stat.S_ISSOCK(os.stat(self._ipc_path).st_mode):
                    os.unlink(self._ipc_path)
            except OSError:
                pass
        self._requests.clear()
        self._waiting.clear()
        self._prefilling.clear()
        self._decoding.clear()
        self._clients.clear()
        self._serving = False
        self._closed.set()
        log.info("simulated scheduler closed")

    # ------------------------------------------------------------------ sending

    def _send(self, identity: bytes, payload: bytes) -> bool:
        """Send one message without ever blocking; False (and the client forgotten) if it is gone."""
        sock = self._sock
        if sock is None:
            return False
        try:
            future = sock.send_multipart([identity, payload], flags=zmq.DONTWAIT, copy=False)
            if future.done():
                future.result()
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._client_gone(identity)
            else:  # with unlimited HWMs this should not happen
                log.warning("send to %s failed: %s", identity.hex(), exc)
            return False

    def _send_error(self, identity: bytes, message: str, code: str, request_id: str | None) -> None:
        log.warning("rejected message from %s: %s (%s)", identity.hex(), message, code)
        self._send(identity, encode(Error(message=message, code=code, request_id=request_id)))

    def _client_gone(self, identity: bytes) -> None:
        """The front end disconnected: free its requests silently."""
        self._clients.pop(identity, None)
        gone = [req for req in self._requests.values() if req.identity == identity]
        for req in gone:
            self._remove(req)
        if gone:
            self._reschedule_prefills(asyncio.get_running_loop().time())
            self._wake.set()
        log.info("front end %s is gone; freed %d request(s)", identity.hex(), len(gone))

    # ------------------------------------------------------------------ receiving

    async def _recv_loop(self) -> None:
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("receive failed: %s", exc)
                continue
            try:
                self._handle(frames)
            except Exception:  # never let one message take the scheduler down
                log.exception("error handling a message")

    def _handle(self, frames: list) -> None:
        identity = frames[0].bytes
        body = frames[1:]
        client = self._clients.get(identity)
        if client is None:
            client = self._clients[identity] = _Client(identity)
        if not body:
            self._send_error(identity, "empty message", ERR_BAD_REQUEST, None)
            return
        head = body[0].buffer
        try:
            message = decode_to_scheduler(head)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            code, request_id = self._diagnose(head)
            self._send_error(identity, f"cannot decode message: {exc}", code, request_id)
            return

        if isinstance(message, Generate):
            self._on_generate(client, message, body[1:])
        elif isinstance(message, Abort):
            if len(body) != 1:
                self._send_error(identity, f"abort takes 1 frame, got {len(body)}", ERR_BAD_REQUEST, None)
                return
            self._on_abort(identity, message)
        elif isinstance(message, Hello):
            if len(body) != 1:
                self._send_error(identity, f"hello takes 1 frame, got {len(body)}", ERR_BAD_REQUEST, None)
                return
            self._on_hello(client, message)

    @staticmethod
    def _diagnose(head) -> tuple[str, str | None]:
        """Best effort for an undecodable message: its error code and request_id, if any."""
        try:
            raw = msgspec.msgpack.decode(head)
        except Exception:
            return ERR_BAD_REQUEST, None
        if not isinstance(raw, dict):
            return ERR_BAD_REQUEST, None
        request_id = raw.get("request_id")
        request_id = request_id if isinstance(request_id, str) else None
        if raw.get("type") not in _KNOWN_TYPES:
            return ERR_UNKNOWN_MESSAGE, request_id
        return ERR_BAD_REQUEST, request_id

    def _on_hello(self, client: _Client, hello: Hello) -> None:
        # A Hello starts a new session for this identity: whatever it still had running
        # belongs to a connection the front end has given up on.
        stale = [req for req in self._requests.values() if req.identity == client.identity]
        for req in stale:
            self._remove(req)
        if stale:
            self._reschedule_prefills(asyncio.get_running_loop().time())
            self._wake.set()
        if hello.protocol_version != PROTOCOL_VERSION:
            client.rejected = True
            self._send_error(
                client.identity,
                f"protocol version {hello.protocol_version} is not supported; "
                f"this scheduler speaks version {PROTOCOL_VERSION}",
                ERR_VERSION_MISMATCH,
                None,
            )
            return
        client.rejected = False
        log.info("front end %s (%s) connected", client.identity.hex(), hello.client_name)
        welcome = Welcome(
            protocol_version=PROTOCOL_VERSION,
            scheduler_name=self.scheduler_name,
            max_running_requests=self.max_running,
            max_model_len=None,
        )
        if self._send(client.identity, encode(welcome)):
            self._send(client.identity, encode(Stats(num_running=self.num_running, num_waiting=self.num_waiting)))

    def _on_generate(self, client: _Client, gen: Generate, extra: list) -> None:
        identity = client.identity
        try:
            req = self._validate(client, gen, extra)
        except _Rejected as exc:
            self._send_error(identity, exc.message, exc.code, gen.request_id)
            return
        self._requests[req.key] = req
        self._waiting[req.key] = req
        self._wake.set()

    def _validate(self, client: _Client, gen: Generate, extra: list) -> _Request:
        if client.rejected:
            raise _Rejected("the handshake failed: protocol version not supported", ERR_VERSION_MISMATCH)
        if not gen.request_id:
            raise _Rejected("request_id must not be empty")
        if (client.identity, gen.request_id) in self._requests:
            raise _Rejected(f"request_id {gen.request_id!r} is already in flight", ERR_DUPLICATE)
        if len(extra) != 1:
            what = "is missing" if not extra else f"must be one frame, got {len(extra)} frames"
            raise _Rejected(f"the prompt frame {what}")
        if gen.prompt_token_count < 1:
            raise _Rejected("prompt_token_count must be at least 1")
        if gen.max_new_tokens < 1:
            raise _Rejected("max_new_tokens must be at least 1")
        sampling = gen.sampling
        if not sampling.temperature >= 0:
            raise _Rejected("sampling.temperature must be >= 0")
        if not 0 < sampling.top_p <= 1:
            raise _Rejected("sampling.top_p must be in (0, 1]")
        if sampling.top_k < 0:
            raise _Rejected("sampling.top_k must be >= 0 (0 disables it)")
        if any(t < 0 or t > 0xFFFFFFFF for t in gen.stop_token_ids):
            raise _Rejected("stop_token_ids must be uint32 values")
        buf = extra[0].buffer
        if len(buf) != 4 * gen.prompt_token_count:
            raise _Rejected(
                f"the prompt frame has {len(buf)} bytes, expected 4 * prompt_token_count = {4 * gen.prompt_token_count}"
            )
        prompt = frame_to_ids(buf)
        highest = max(prompt)
        if highest >= self.vocab_size:
            raise _Rejected(
                f"prompt token id {highest} is out of range for vocabulary size {self.vocab_size} "
                "(start the simulated scheduler with --model or --vocab-size)"
            )
        prompt_bytes = bytes(buf)
        return _Request(
            identity=client.identity,
            request_id=gen.request_id,
            prompt=prompt,
            max_new_tokens=gen.max_new_tokens,
            stop_ids=frozenset(gen.stop_token_ids),
            first_stop_id=gen.stop_token_ids[0] if gen.stop_token_ids else None,
            ignore_eos=gen.ignore_eos,
            rng=_make_rng(gen, prompt_bytes),
        )

    def _on_abort(self, identity: bytes, abort: Abort) -> None:
        finals = []
        for request_id in abort.request_ids:
            req = self._requests.get((identity, request_id))
            if req is None:
                continue  # unknown or already finished: ignored
            self._remove(req)
            finals.append(self._output(req, b"", FINISH_ABORT))
        if finals:
            self._reschedule_prefills(asyncio.get_running_loop().time())
            self._wake.set()
            self._send(identity, encode(Outputs(outputs=finals)))

    def _remove(self, req: _Request) -> None:
        self._requests.pop(req.key, None)
        self._waiting.pop(req.key, None)
        self._prefilling.pop(req.key, None)
        self._decoding.pop(req.key, None)

    # ------------------------------------------------------------------ the engine

    def _prefill_cost(self, req: _Request) -> float:
        if self.prefill_tokens_per_s <= 0:
            return 0.0
        return req.prompt_tokens / self.prefill_tokens_per_s

    def _admit(self, now: float) -> None:
        while self._waiting and self.num_running < self.max_running:
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
        while True:
            now = loop.time()
            self._admit(now)
            self._finish_prefills(now)
            if self._decoding and now >= self._next_step_at:
                try:
                    self._step()
                except Exception:
                    log.exception("decode step failed")
                now = loop.time()
                self._next_step_at = max(self._next_step_at + itl, now)
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
            if deadline is None:
                await self._wake.wait()
                continue
            delay = deadline - loop.time()
            if delay <= 0:
                await asyncio.sleep(0)
                continue
            try:
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _step(self) -> None:
        """One decode step: one token for every decoding request, one Outputs per front end."""
        batches: dict[bytes, list[RequestOutput]] = {}
        for req in list(self._decoding.values()):
            token, reason = self._next_token(req)
            req.generated += 1
            if reason is not None:
                self._remove(req)
            out = self._output(req, _PACK1(token), reason)
            batch = batches.get(req.identity)
            if batch is None:
                batches[req.identity] = [out]
            else:
                batch.append(out)
        for identity, outputs in batches.items():
            self._send(identity, encode(Outputs(outputs=outputs)))

    def _next_token(self, req: _Request) -> tuple[int, str | None]:
        if self.mode == "echo":
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

    def _palette_token(self, req: _Request) -> int:
        sentences = self._tokens.sentences
        if req.sentence < 0 or req.position >= len(sentences[req.sentence]):
            req.sentence = req.rng.randrange(len(sentences))
            req.position = 0
        token = sentences[req.sentence][req.position]
        req.position += 1
        return token

    def _output(self, req: _Request, token_ids: bytes, reason: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            finish_reason=reason,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=0,
            completion_tokens=req.generated,
        )

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            try:
                payload = encode(Stats(num_running=self.num_running, num_waiting=self.num_waiting))
                for identity, client in list(self._clients.items()):
                    if not client.rejected:
                        self._send(identity, payload)
            except Exception:
                log.exception("sending stats failed")


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
        "--max-running", type=int, default=256, metavar="N", help="requests decoded at once; the rest wait (default %(default)s)"
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
        "--curve-secret-key-file",
        metavar="FILE",
        default=None,
        help="act as a ZeroMQ CURVE server with this secret key (a file holding the Z85 key, "
        "or a zmq.auth '.key_secret' certificate)",
    )


def _read_curve_secret(path: str) -> bytes:
    text = Path(path).read_text()
    if "secret-key" in text:
        import zmq.auth

        _public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise ValueError(f"{path} holds no secret key")
        return secret
    key = text.strip().encode()
    if len(key) != 40:
        raise ValueError(f"{path} must hold a 40-character Z85 CURVE secret key")
    return key


def _set_process_name() -> None:
    try:
        from tokenmill.procutil import die_with_supervisor, set_process_name
    except ImportError:  # pragma: no cover
        return
    die_with_supervisor()  # when started by a gateway: die with it, even after its kill -9
    set_process_name("tm-scheduler")


def scheduler_from_args(args: argparse.Namespace) -> SimulatedScheduler:
    curve = _read_curve_secret(args.curve_secret_key_file) if args.curve_secret_key_file else None
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
        prog="python -m scheduler_client.simulated", description="A simulated GPU scheduler (simulate-scheduler)."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
