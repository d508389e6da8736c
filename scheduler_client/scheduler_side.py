"""The scheduler side of docs/engines/scheduler-protocol.md, without the engine: a reusable ROUTER server.

:class:`SchedulerServer` owns everything a scheduler needs besides generating tokens:

* binding a ZeroMQ ROUTER with the options §1 asks for (ROUTER_MANDATORY, ROUTER_HANDOVER,
  unbounded queues, optional heartbeats and CURVE), and removing an ``ipc://`` socket file
  on shutdown;
* sessions keyed by routing id, the Hello/Welcome handshake (§4) and the version-mismatch
  rules;
* decoding every message defensively and validating ``generate`` (§6), answering ``error``
  for anything malformed without ever stopping;
* sending without blocking, and noticing a front end that went away (EHOSTUNREACH);
* periodic ``stats``.

A subclass supplies the engine through a few hooks: :meth:`accept` (a validated request),
:meth:`abort`, :meth:`drop_session`, :meth:`has_request`, :meth:`welcome`, :meth:`stats`,
and optionally :meth:`check` (extra validation), :meth:`background` (engine coroutines run
while serving) and :meth:`on_teardown`. The simulated scheduler
(``engines/simulated/``) and the real engines (``engines/``) are both built on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from array import array
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from tokenmill.scheduler_client import shared_pixels
from tokenmill.scheduler_client.protocol import (
    ERR_IMAGE_MISSING,
    FEATURE_IMAGES_BY_HASH,
    FEATURE_IMAGES_SHM,
    IMAGE_DTYPES,
    PROTOCOL_VERSION,
    STRUCTURED_KINDS,
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
from tokenmill.transport.loop_socket import LoopSocket

# Error codes a scheduler sends (docs/engines/scheduler-protocol.md §6 lists them).
ERR_BAD_REQUEST = "bad_request"
ERR_UNKNOWN_MESSAGE = "unknown_message"
ERR_VERSION_MISMATCH = "version_mismatch"
ERR_DUPLICATE = "duplicate_request_id"
ERR_UNSUPPORTED = "unsupported"  # 1.1: a Generate field this scheduler cannot honour; Error.param names it

KNOWN_TYPES = ("hello", "generate", "abort")


class Rejected(Exception):
    """A ``generate`` the scheduler will not run: becomes one ``error`` carrying its request_id."""

    def __init__(self, message: str, code: str = ERR_BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


def features_used(gen: Generate) -> list[tuple[str, str]]:
    """(feature, field) for each optional 1.1 or 1.2 Generate field this request sets."""
    used = []
    s = gen.sampling
    if gen.logprobs is not None:
        used.append(("logprobs", "logprobs"))
    if gen.structured is not None:
        used.append((f"structured.{gen.structured.kind}", "structured"))
        if gen.structured.disable_any_whitespace:
            used.append(("structured.disable_any_whitespace", "structured.disable_any_whitespace"))
        if gen.structured.whitespace_pattern is not None:
            used.append(("structured.whitespace_pattern", "structured.whitespace_pattern"))
    if s.min_p:
        used.append(("min_p", "sampling.min_p"))
    if s.repetition_penalty != 1.0:
        used.append(("repetition_penalty", "sampling.repetition_penalty"))
    if s.min_tokens:
        used.append(("min_tokens", "sampling.min_tokens"))
    if s.logit_bias:
        used.append(("logit_bias", "sampling.logit_bias"))
    if gen.priority:
        used.append(("priority", "priority"))
    if gen.cache_salt is not None:
        used.append(("cache_salt", "cache_salt"))
    if s.allowed_token_ids is not None:
        used.append(("allowed_token_ids", "sampling.allowed_token_ids"))
    if s.bad_words:
        used.append(("bad_words", "sampling.bad_words"))
    if gen.prompt_logprobs is not None:
        used.append(("prompt_logprobs", "prompt_logprobs"))
    if gen.kv_transfer_params is not None:
        used.append(("kv_transfer_params", "kv_transfer_params"))
    if gen.extra_args is not None:
        used.append(("extra_args", "extra_args"))
    if gen.images:
        used.append(("images", "images"))
    return used


@dataclass(eq=False)
class Session:
    """One front-end connection, keyed by its routing id."""

    identity: bytes
    rejected: bool = False  # its last Hello had an unsupported version


def configure_router(
    sock: zmq.Socket,
    *,
    heartbeat_ivl_ms: int = 2000,
    heartbeat_timeout_ms: int = 10000,
    curve_secret_key: bytes | str | None = None,
) -> None:
    """The ROUTER options of docs/engines/scheduler-protocol.md §1, §5 and §8."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished front end raises EHOSTUNREACH
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a front end with a fixed routing id may reconnect
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs
    sock.setsockopt(zmq.RCVHWM, 0)
    if heartbeat_ivl_ms > 0:
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
    if curve_secret_key is not None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support")
        key = curve_secret_key
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, key.encode() if isinstance(key, str) else key)


def read_curve_secret(path: str) -> bytes:
    """A Z85 CURVE secret key from a file holding just the key, or a zmq.auth ``.key_secret`` file."""
    from pathlib import Path

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


class SchedulerServer:
    """The protocol side of a scheduler; see the module docstring for the hooks.

    ``await serve(endpoint)`` binds and runs until ``await close()`` (or cancellation).
    After binding, ``endpoint`` holds the bound address (useful with ``tcp://127.0.0.1:0``)
    and ``await wait_ready()`` returns.
    """

    log = logging.getLogger("tokenmill.scheduler_side")
    #: appended to the "prompt token id out of range" message, e.g. how to fix the vocabulary
    vocab_hint = ""

    def __init__(
        self,
        *,
        scheduler_name: str,
        stats_interval_s: float = 1.0,
        heartbeat_ivl_ms: int = 2000,
        heartbeat_timeout_ms: int = 10000,
        curve_secret_key: bytes | str | None = None,
        io_rt_priority: int = 0,
    ) -> None:
        if stats_interval_s <= 0:
            raise ValueError("stats_interval_s must be positive")
        self.scheduler_name = scheduler_name
        self.stats_interval_s = float(stats_interval_s)
        self.heartbeat_ivl_ms = int(heartbeat_ivl_ms)
        self.heartbeat_timeout_ms = int(heartbeat_timeout_ms)
        self.curve_secret_key = curve_secret_key
        # SCHED_FIFO priority of the socket's ZeroMQ I/O thread (0: an ordinary thread); only where the
        # process may use it (procutil.request_realtime took), since libzmq aborts if the kernel refuses
        self.io_rt_priority = int(io_rt_priority)
        self.endpoint: str | None = None
        self.adapters: frozenset[str] = frozenset()  # what Generate.adapter may name (Welcome.adapters)
        self._sessions: dict[bytes, Session] = {}
        self._sock: LoopSocket | None = None
        self._ctx: zmq.Context | None = None
        self._ipc_path: str | None = None
        self._ready: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._serving = False

    # ------------------------------------------------------------------ hooks

    @property
    def vocab_size(self) -> int | None:
        """Prompt token IDs must be below this; None skips the check."""
        return None

    def describe(self) -> str:
        """Details for the 'listening' log line."""
        return ""

    def background(self) -> list[Coroutine[Any, Any, Any]]:
        """Coroutines that run while serving (the engine); serving stops if one fails."""
        return []

    #: the 1.1 Generate fields this scheduler honours (protocol.FEATURES); a request using
    #: another is refused with ``unsupported`` naming the field
    features: frozenset[str] = frozenset()
    max_logprobs: int = 20

    def welcome(self) -> Welcome:
        return Welcome(
            protocol_version=PROTOCOL_VERSION,
            scheduler_name=self.scheduler_name,
            features=sorted(self.features),
            max_logprobs=self.max_logprobs,
        )

    def stats(self) -> Stats:
        raise NotImplementedError

    def has_request(self, identity: bytes, request_id: str) -> bool:
        """Whether the front end ``identity`` has ``request_id`` in flight (for duplicate detection)."""
        raise NotImplementedError

    def check(self, gen: Generate) -> None:
        """Engine-specific validation after the generic checks; raise :class:`Rejected`."""

    def holds_image(self, content_hash: str) -> bool:
        """With ``images.by_hash``: whether an item sent with an empty pixel frame can be served from
        what this engine keeps (else the request is refused with ``image_missing``)."""
        return False

    def accept(
        self, session: Session, gen: Generate, prompt: array, prompt_bytes: bytes, pixels: Sequence[memoryview] = ()
    ) -> None:
        """Start a validated request. May still raise :class:`Rejected` (nothing may have been sent).
        ``pixels``: the pixel frames of ``gen.images`` (1.2), in order, checked against their items."""
        raise NotImplementedError

    def abort(self, identity: bytes, request_ids: list[str]) -> None:
        """Stop these requests of the session and send their final ``abort`` outputs; ignore unknown IDs."""
        raise NotImplementedError

    def drop_session(self, identity: bytes) -> int:
        """Free every request of the front end ``identity`` silently (new Hello, or the front end is gone). Returns how many."""
        raise NotImplementedError

    def on_teardown(self) -> None:
        """Called once the socket is closed."""

    # ------------------------------------------------------------------ lifecycle

    def _events(self) -> None:
        if self._ready is None:
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
            raise RuntimeError(f"a {type(self).__name__} serves once")
        self._serving = True
        ctx = zmq.Context()
        if self.io_rt_priority:
            ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_FIFO)
            ctx.set(zmq.THREAD_PRIORITY, self.io_rt_priority)
        sock = ctx.socket(zmq.ROUTER)
        try:
            configure_router(
                sock,
                heartbeat_ivl_ms=self.heartbeat_ivl_ms,
                heartbeat_timeout_ms=self.heartbeat_timeout_ms,
                curve_secret_key=self.curve_secret_key,
            )
            sock.bind(endpoint)
        except BaseException:
            sock.close(linger=0)
            ctx.term()
            self._serving = False
            self._closed.set()
            raise
        self._ctx, self._sock = ctx, LoopSocket(sock, self._handle)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
            self._ipc_path = endpoint[len("ipc://") :]
        detail = self.describe()
        self.log.info("%s listening on %s%s", self.scheduler_name, self.endpoint, f" ({detail})" if detail else "")
        self._ready.set()
        self._sock.start()
        tasks = [
            asyncio.create_task(self._stats_loop(), name="scheduler-stats"),
            *(asyncio.create_task(coro) for coro in self.background()),
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

    def _teardown(self) -> None:
        if self._sock is not None:
            self._sock.close()
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
        self._sessions.clear()
        try:
            self.on_teardown()
        finally:
            self._serving = False
            self._closed.set()
            self.log.info("%s closed", self.scheduler_name)

    # ------------------------------------------------------------------ sending

    def send(self, identity: bytes, payload: bytes) -> bool:
        """Send one message without ever blocking; False (and the session dropped) if the front end is gone."""
        sock = self._sock
        if sock is None:
            return False
        try:
            sock.send([identity, payload])
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self.session_gone(identity)
            else:  # with unlimited HWMs this should not happen
                self.log.warning("send to %s failed: %s", identity.hex(), exc)
            return False

    def send_outputs(self, identity: bytes, outputs: list[RequestOutput]) -> bool:
        return self.send(identity, encode(Outputs(outputs=outputs)))

    def send_error(
        self, identity: bytes, message: str, code: str, request_id: str | None, param: str | None = None
    ) -> None:
        self.log.warning("rejected message from %s: %s (%s)", identity.hex(), message, code)
        self.send(identity, encode(Error(message=message, code=code, request_id=request_id, param=param)))

    def session_gone(self, identity: bytes) -> None:
        """The front end disconnected: free its requests silently."""
        self._sessions.pop(identity, None)
        freed = self.drop_session(identity)
        self.log.info("front end %s is gone; freed %d request(s)", identity.hex(), freed)

    # ------------------------------------------------------------------ receiving

    def _handle(self, frames: list) -> None:
        identity = frames[0].bytes
        body = frames[1:]
        session = self._sessions.get(identity)
        if session is None:
            session = self._sessions[identity] = Session(identity)
        if not body:
            self.send_error(identity, "empty message", ERR_BAD_REQUEST, None)
            return
        head = body[0].buffer
        try:
            message = decode_to_scheduler(head)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            code, request_id = self._diagnose(head)
            self.send_error(identity, f"cannot decode message: {exc}", code, request_id)
            return

        if isinstance(message, Generate):
            self._on_generate(session, message, body[1:])
        elif isinstance(message, Abort):
            if len(body) != 1:
                self.send_error(identity, f"abort takes 1 frame, got {len(body)}", ERR_BAD_REQUEST, None)
                return
            self.abort(identity, message.request_ids)
        elif isinstance(message, Hello):
            if len(body) != 1:
                self.send_error(identity, f"hello takes 1 frame, got {len(body)}", ERR_BAD_REQUEST, None)
                return
            self._on_hello(session, message)

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
        if raw.get("type") not in KNOWN_TYPES:
            return ERR_UNKNOWN_MESSAGE, request_id
        return ERR_BAD_REQUEST, request_id

    def _on_hello(self, session: Session, hello: Hello) -> None:
        # A Hello starts a new session for this identity: whatever it still had running
        # belongs to a connection the front end has given up on.
        self.drop_session(session.identity)
        if hello.protocol_version != PROTOCOL_VERSION:
            session.rejected = True
            self.send_error(
                session.identity,
                f"protocol version {hello.protocol_version} is not supported; "
                f"this scheduler speaks version {PROTOCOL_VERSION}",
                ERR_VERSION_MISMATCH,
                None,
            )
            return
        session.rejected = False
        self.log.info("front end %s (%s) connected", session.identity.hex(), hello.client_name)
        if self.send(session.identity, encode(self.welcome())):
            self.send(session.identity, encode(self.stats()))

    def _on_generate(self, session: Session, gen: Generate, extra: list) -> None:
        try:
            prompt, prompt_bytes, pixels = self.validate(session, gen, extra)
            self.check(gen)
            self.accept(session, gen, prompt, prompt_bytes, pixels)
        except Rejected as exc:
            self.send_error(session.identity, exc.message, exc.code, gen.request_id, exc.param)

    def validate(self, session: Session, gen: Generate, extra: list) -> tuple[array, bytes, list[memoryview]]:
        """The generic checks of §6; returns the prompt as an array and as its raw bytes, and its images' pixels."""
        if session.rejected:
            raise Rejected("the handshake failed: protocol version not supported", ERR_VERSION_MISMATCH)
        if not gen.request_id:
            raise Rejected("request_id must not be empty")
        if self.has_request(session.identity, gen.request_id):
            raise Rejected(f"request_id {gen.request_id!r} is already in flight", ERR_DUPLICATE)
        if len(extra) != 1 + len(gen.images):
            if not extra:
                raise Rejected("the prompt frame is missing")
            raise Rejected(
                f"a generate with {len(gen.images)} image(s) takes {1 + len(gen.images)} frames after its header "
                f"(the prompt, then one per image), got {len(extra)}"
            )
        if gen.prompt_token_count < 1:
            raise Rejected("prompt_token_count must be at least 1")
        if gen.max_new_tokens < 1:
            raise Rejected("max_new_tokens must be at least 1")
        sampling = gen.sampling
        if not sampling.temperature >= 0:
            raise Rejected("sampling.temperature must be >= 0")
        if not 0 < sampling.top_p <= 1:
            raise Rejected("sampling.top_p must be in (0, 1]")
        if sampling.top_k < 0:
            raise Rejected("sampling.top_k must be >= 0 (0 disables it)")
        if any(t < 0 or t > 0xFFFFFFFF for t in gen.stop_token_ids):
            raise Rejected("stop_token_ids must be uint32 values")
        if gen.adapter is not None and gen.adapter not in self.adapters:
            raise Rejected(f"{self.scheduler_name} serves no adapter {gen.adapter!r}", ERR_UNSUPPORTED, "adapter")
        for feature, param in features_used(gen):
            if feature not in self.features:
                raise Rejected(
                    f"{self.scheduler_name} cannot honour {param}"
                    + (f" ({gen.structured.kind})" if param == "structured" else ""),
                    ERR_UNSUPPORTED,
                    param,
                )
        self._validate_ranges(gen)
        self._validate_sampling_token_ids(gen)
        buf = extra[0].buffer
        if len(buf) != 4 * gen.prompt_token_count:
            raise Rejected(
                f"the prompt frame has {len(buf)} bytes, expected 4 * prompt_token_count = {4 * gen.prompt_token_count}"
            )
        prompt = frame_to_ids(buf)
        pixels = self._validate_images(gen, extra[1:])
        vocab_size = self.vocab_size
        if vocab_size is not None:
            highest = max(prompt)
            if highest >= vocab_size:
                hint = f" {self.vocab_hint}" if self.vocab_hint else ""
                raise Rejected(f"prompt token id {highest} is out of range for vocabulary size {vocab_size}{hint}")
        return prompt, bytes(buf), pixels

    def _validate_images(self, gen: Generate, frames: list) -> list[memoryview]:
        """Each image item's pixel frame matches its dtype and shape, or is empty for an image this
        engine holds (``images.by_hash``) or one in a shared-memory file (``images.shm``, opened here:
        a file it cannot read is ``image_missing``); its placeholder lies inside the prompt, after the
        previous image's. Returns each image's pixels: its frame, or its file's mapping (empty: held)."""
        end = 0
        by_hash = FEATURE_IMAGES_BY_HASH in self.features
        shm = FEATURE_IMAGES_SHM in self.features
        pixels: list[memoryview] = []
        for i, (item, frame) in enumerate(zip(gen.images, frames)):
            size = IMAGE_DTYPES.get(item.dtype)
            if size is None:
                raise Rejected(f"images[{i}].dtype must be one of {', '.join(IMAGE_DTYPES)}", param="images")
            expected = size
            for dim in item.shape:
                expected *= dim
            have = len(frame.buffer)
            if any(d < 1 for d in item.shape) or (have and have != expected):
                raise Rejected(
                    f"images[{i}]: the pixel frame has {have} bytes, expected {expected} for {item.dtype} {item.shape}",
                    param="images",
                )
            if have or (by_hash and self.holds_image(item.content_hash)):
                pixels.append(frame.buffer)  # its pixels, or empty for an image held here
            elif shm and item.shm is not None:
                pixels.append(self._map_pixels(i, item.shm, expected))
            elif by_hash:
                raise Rejected(
                    f"images[{i}]: image {item.content_hash} is not held here (any more): send its pixels",
                    ERR_IMAGE_MISSING,
                    param="images",
                )
            else:
                raise Rejected(
                    f"images[{i}]: the pixel frame has 0 bytes, expected {expected} for {item.dtype} {item.shape}",
                    param="images",
                )
            if item.length < 1 or item.offset < end or item.offset + item.length > gen.prompt_token_count:
                raise Rejected(
                    f"images[{i}]: placeholder offset {item.offset} length {item.length} must lie within the "
                    "prompt, after the previous image's",
                    param="images",
                )
            end = item.offset + item.length
        return pixels

    def _map_pixels(self, i: int, name: str, size: int) -> memoryview:
        """images.shm: the item's file mapped; a name outside the protocol's pattern is refused, a file
        that cannot be read here is image_missing (the front end sends the pixels)."""
        try:
            return shared_pixels.open_pixels(name, size)
        except ValueError as exc:
            raise Rejected(f"images[{i}].shm: {exc}", param="images") from None
        except OSError as exc:
            self.log.warning("images[%d]: cannot map shared memory %s: %s", i, name, exc)
            raise Rejected(
                f"images[{i}]: its shared memory {name} cannot be read here ({exc}): send its pixels",
                ERR_IMAGE_MISSING,
                param="images",
            ) from None

    def _validate_ranges(self, gen: Generate) -> None:
        """min_p, repetition_penalty, min_tokens, logprobs, prompt_logprobs, structured, priority and
        cache_salt hold values the protocol allows (their use was checked against ``features`` already)."""
        s = gen.sampling
        if not 0.0 <= s.min_p <= 1.0:
            raise Rejected("sampling.min_p must be in [0, 1]", param="sampling.min_p")
        if not s.repetition_penalty > 0:
            raise Rejected("sampling.repetition_penalty must be > 0", param="sampling.repetition_penalty")
        if s.min_tokens < 0:
            raise Rejected("sampling.min_tokens must be >= 0", param="sampling.min_tokens")
        if gen.logprobs is not None and not 0 <= gen.logprobs <= self.max_logprobs:
            raise Rejected(f"logprobs must be in [0, {self.max_logprobs}]", param="logprobs")
        if gen.prompt_logprobs is not None and not 0 <= gen.prompt_logprobs <= self.max_logprobs:
            raise Rejected(f"prompt_logprobs must be in [0, {self.max_logprobs}]", param="prompt_logprobs")
        if gen.structured is not None:
            kind = gen.structured.kind
            if kind not in STRUCTURED_KINDS:
                raise Rejected(f"structured.kind must be one of {', '.join(STRUCTURED_KINDS)}", param="structured")
            if kind == "choice" and not gen.structured.choices:
                raise Rejected("structured choice needs at least one choice", param="structured")
        if not -(2**63) <= gen.priority < 2**63:
            raise Rejected("priority must be a signed 64-bit integer", param="priority")
        if gen.cache_salt is not None and not gen.cache_salt:
            raise Rejected("cache_salt must not be empty", param="cache_salt")

    def _validate_sampling_token_ids(self, gen: Generate) -> None:
        """The sampling fields that name token IDs (logit_bias, allowed_token_ids, bad_words) name IDs
        in the vocabulary, and logit_bias's biases lie in [-100, 100]."""
        s = gen.sampling
        vocab_size = self.vocab_size
        for token, bias in s.logit_bias.items():
            if token < 0 or (vocab_size is not None and token >= vocab_size) or not -100.0 <= bias <= 100.0:
                raise Rejected(
                    f"sampling.logit_bias has {token}: {bias}; token IDs must be in the vocabulary and "
                    "biases in [-100, 100]",
                    param="sampling.logit_bias",
                )
        if s.allowed_token_ids is not None:
            if not s.allowed_token_ids:
                raise Rejected("sampling.allowed_token_ids must not be empty", param="sampling.allowed_token_ids")
            if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in s.allowed_token_ids):
                raise Rejected(
                    "sampling.allowed_token_ids must be token IDs in the vocabulary", param="sampling.allowed_token_ids"
                )
        for seq in s.bad_words:
            if not seq or any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in seq):
                raise Rejected(
                    "sampling.bad_words must be non-empty sequences of token IDs in the vocabulary",
                    param="sampling.bad_words",
                )

    # ------------------------------------------------------------------ stats

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            self.broadcast_stats()

    def broadcast_stats(self) -> None:
        try:
            payload = encode(self.stats())
            for identity, session in list(self._sessions.items()):
                if not session.rejected:
                    self.send(identity, payload)
        except Exception:
            self.log.exception("sending stats failed")
