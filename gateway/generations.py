"""The table of requests being generated, and the routing of their outputs.

Scheduler outputs (raw token frames) go to the worker that holds each request's
decoder; the text that comes back goes to the HTTP response waiting for it. The
gateway never looks inside a token frame.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import msgspec

from tokenmill.gateway import stream_events as ev
from tokenmill.gateway.scheduler_ranks import SchedulerRanks
from tokenmill.scheduler_client import protocol
from tokenmill.scheduler_client.client import SchedulerUnavailable
from tokenmill.tokenizer_workers.messages import ApiError, DetokItem, DetokOut, ResumeStream

log = logging.getLogger("tokenmill.generations")

# Generation.owner of a request whose worker died with no other alive: no worker holds its streams while
# it waits (Generations.waiting) for one to be ready
NO_OWNER = -1


@dataclass(eq=False)
class Choice:
    index: int
    request_id: str
    prompt_tokens: int
    counts_prompt: bool = True  # usage counts each prompt once, however many choices share it
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None  # as the scheduler or a stop string decided
    tool_calls: int = 0  # calls parsed out of its output
    calls_finish: str = "tool_calls"  # the finish_reason of a choice with calls ("stop" for a named tool_choice)
    error: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token ID that ended it
    done: bool = False  # its final text has arrived
    scheduler_done: bool = False
    prompt_logprobs: bytes | None = None  # vLLM's prompt_logprobs as JSON (the worker's), when asked and sent
    kv_transfer_params: dict | None = None  # what the engine's final output returned (protocol 1.2)
    # failover: the worker's spec of its decoder (opaque bytes), the token frames the owner
    # answered (concatenated, never parsed here), tokens per answered batch, and the items it has not
    # answered yet; history None: not resumable (no spec, resumption off, or over the cap)
    resume: bytes | None = None
    history: bytearray | None = None
    chunks: array | None = None
    inflight: deque | None = None
    # images sent by hash alone (protocol 1.2 images.by_hash): the frames as sent, kept until the engine's
    # first output, to send again with the pixels if it answers image_missing (once)
    sent: tuple | None = None
    pixels_asked: bool = False
    # rank failover (several ranks): the Generate header and prompt frame as sent, kept until the choice is
    # done, to start it again on another rank from the prompt and the tokens already generated; and how many
    # tokens it had when it last moved (the new rank counts its completion tokens from there)
    engine_frames: tuple[bytes, bytes] | None = None
    token_offset: int = 0


@dataclass(eq=False)
class Generation:
    """One HTTP request's generation; the handler reads ``events`` (gateway/stream_events.py)."""

    id: str
    owner: int
    choices: list[Choice]
    arrival: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    last_token_at: float | None = None
    buffered: int = 0  # characters of text in events the handler has not taken yet
    drop_connection: Callable[[], None] | None = None  # closes the client's connection (a client that stopped reading)
    rank: int = 0  # the scheduler rank generating it (gateway/scheduler_ranks.py)
    fields: dict[str, str] = field(default_factory=dict)  # Generate fields -> request fields (ConvertDone.fields)
    owner_deaths: int = 0  # the owner's deaths (WorkerPool.deaths) when it converted this request
    failovers: int = 0  # times its streams moved to another worker
    affinity: int | None = None  # its conversation's key for the workers' dispatch (moves with its streams)
    image_hashes: list[str] = field(default_factory=list)  # ConvertDone.images_by_hash

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices)


class StreamHolders(Protocol):
    """What the table asks of whoever holds its streams' decoders: the worker pool, or for the baselines'
    modes an in-process converter (which never loses a worker)."""

    def detokenize(self, owner: int, items: list[DetokItem]) -> None: ...
    def ended(self, owner: int, request_id: str) -> None: ...
    def release(self, owner: int, request_ids: list[str]) -> None: ...
    def want_pixels(self, owner: int, request_id: str, content_hashes: list[str]) -> None: ...
    def died_since(self, owner: int, deaths: int) -> bool: ...
    def stream_owner(self, exclude: int) -> int | None: ...
    def rehome(self, owner: int, affinity: int | None) -> None: ...
    def resume(self, owner: int, streams: list[ResumeStream]) -> None: ...


class Generations:
    """Every live generation by request id. Made before the stream holders and the scheduler ranks, which
    report to it (on_detok, on_outputs, ...); ``attach`` hands it both once they exist."""

    MAX_FAILOVERS = 3  # a request whose streams moved this often fails rather than move again

    conversion: StreamHolders
    scheduler: SchedulerRanks

    def __init__(self, metrics=None, max_buffered: int = 0, history_cap: int = 0, failover_wait: float = 0.0):
        self.metrics = metrics
        self.max_buffered = max_buffered  # text a client may leave unread before its request is aborted (0: no limit)
        # bytes of token history one choice may hold to be resumable on another worker (0: no failover)
        self.history_cap = history_cap
        # seconds a request whose worker died with no other alive waits for one to be ready (0: it fails at once)
        self.failover_wait = failover_wait
        self.history_bytes = 0  # held now, all choices together (tokenmill_stream_history_bytes)
        self.by_request: dict[str, tuple[Generation, Choice]] = {}
        self.live: set[Generation] = set()
        # the requests waiting for a worker (owner NO_OWNER), in the order they began to, each with the timer
        # that fails it when the wait is over; the scheduler's tokens for them meanwhile join their history
        self.waiting: dict[Generation, asyncio.TimerHandle] = {}
        if metrics is not None:
            metrics.stream_history_bytes.set_function(lambda: self.history_bytes)

    def attach(self, conversion: StreamHolders, scheduler: SchedulerRanks) -> None:
        self.conversion = conversion
        self.scheduler = scheduler

    def __len__(self) -> int:
        return len(self.live)

    def add(self, gen: Generation) -> None:
        if gen in self.live:
            return
        self.live.add(gen)
        for choice in gen.choices:
            self.by_request[choice.request_id] = (gen, choice)
            if self.history_cap and choice.resume is not None:
                choice.history, choice.chunks, choice.inflight = bytearray(), array("I"), deque()
        if self.conversion.died_since(gen.owner, gen.owner_deaths):
            moving: dict[int, list[ResumeStream]] = defaultdict(list)
            self._move(gen, gen.owner, moving)  # it died between converting and now: move (or fail) at once
            for new_owner, streams in moving.items():
                self.conversion.resume(new_owner, streams)

    def _drop(self, gen: Generation) -> None:
        self.live.discard(gen)
        for choice in gen.choices:
            self.by_request.pop(choice.request_id, None)
            self._forget_history(choice)

    def _forget_history(self, choice: Choice) -> None:
        if choice.history is not None:
            self.history_bytes -= len(choice.history) + 4 * len(choice.chunks)
            choice.history = choice.chunks = choice.inflight = None

    def _answered(self, choice: Choice) -> None:
        """The owner answered the oldest item it had: its tokens join the history."""
        if not choice.inflight:
            return
        frame = choice.inflight.popleft().token_ids
        if len(choice.history) + len(frame) + 4 * len(choice.chunks) + 4 > self.history_cap:
            self._forget_history(choice)  # too long to keep: this stream is no longer resumable
            return
        choice.history += frame
        choice.chunks.append(len(frame) // 4)
        self.history_bytes += len(frame) + 4

    # ---- from the scheduler -----------------------------------------------------------

    def on_outputs(self, outputs: list[protocol.RequestOutput]) -> None:
        per_owner: dict[int, list[DetokItem]] = defaultdict(list)
        now = time.monotonic()
        metrics = self.metrics
        tokens = 0
        for out in outputs:
            entry = self.by_request.get(out.request_id)
            if entry is None:
                continue  # finished by a stop string, aborted, or from before a restart
            gen, choice = entry
            if choice.scheduler_done:
                continue
            if out.token_ids:
                if gen.first_token_at is None:
                    gen.first_token_at = now
                    if metrics:
                        metrics.time_to_first_token.observe(now - gen.arrival)
                        metrics.rank_time_to_first_token.observe(gen.rank, now - gen.arrival)
                elif metrics:
                    metrics.inter_token_latency.observe(now - gen.last_token_at)
                gen.last_token_at = now
                tokens += len(out.token_ids) // 4
            choice.sent = None  # the engine has the request: nothing to send again
            if out.completion_tokens:
                choice.completion_tokens = out.completion_tokens + choice.token_offset
            choice.cached_tokens = out.cached_tokens
            if out.finish_reason is not None:
                if out.finish_reason == "error":
                    self.scheduler.ranks[gen.rank].errors += 1
                choice.scheduler_done = True
                choice.finish_reason = out.finish_reason
                choice.error = out.error
                choice.kv_transfer_params = out.kv_transfer_params
                self.scheduler.finished(
                    gen.rank, choice.prompt_tokens if choice.counts_prompt else 0, out.cached_tokens
                )
            item = DetokItem(
                out.request_id,
                out.token_ids,
                out.finish_reason is not None,
                out.logprobs,
                out.top_ids,
                out.top_logprobs,
                out.prompt_logprobs,
            )
            if choice.inflight is not None:
                choice.inflight.append(item)
            if gen.owner != NO_OWNER:  # (one waiting for a worker has them in its history: inflight)
                per_owner[gen.owner].append(item)
        if tokens and metrics:
            metrics.generation_tokens.inc(tokens)
        for owner, items in per_owner.items():
            self.conversion.detokenize(owner, items)

    def on_scheduler_error(self, error: protocol.Error) -> None:
        entry = self.by_request.get(error.request_id or "")
        if entry is None:
            return
        gen, choice = entry
        if error.code == protocol.ERR_IMAGE_MISSING and choice.sent is not None and gen.owner == NO_OWNER:
            self.on_pixels(choice.request_id, None)  # the worker that had its pixels is dead
            return
        if error.code == protocol.ERR_IMAGE_MISSING and choice.sent is not None and not choice.pixels_asked:
            choice.pixels_asked = True  # the engine evicted an image sent by hash: the pixels, then again
            if self.metrics:
                self.metrics.image_pixels_resent.inc()
            self.conversion.want_pixels(gen.owner, choice.request_id, gen.image_hashes)
            return
        self.fail(
            gen,
            ApiError(
                400,
                f"The scheduler rejected the request: {error.message}",
                "BadRequestError",
                _request_field(error.param, gen.fields),
                error.code,
            ),
        )

    def on_pixels(self, request_id: str, frames: list | None) -> None:
        """The pixels of a request's images (PixelsWanted), to send its Generate again with; None: the
        worker no longer has them, and the request fails to be retried (its images are sent again then)."""
        entry = self.by_request.get(request_id)
        if entry is None:
            return  # ended meanwhile (client gone)
        gen, choice = entry
        sent, choice.sent = choice.sent, None
        if frames is not None and sent is not None:
            try:
                self.scheduler.resend(gen.rank, sent[0], sent[1], *frames)
                return
            except SchedulerUnavailable:
                pass
        self.fail(
            gen,
            ApiError(
                503,
                "The engine no longer holds an image of this request and its pixels are gone too; retry the request.",
                "ServiceUnavailableError",
                None,
                "image_missing",
            ),
            abort=False,
        )

    def on_rank_lost(self, rank: int, why: str) -> None:
        """A scheduler rank went away (it will not know its requests when it is back). Each request on it
        moves to a live rank where it can go on exactly (resumable_on_rank): one not started yet is sent
        again as it was, one that is streaming goes on from its prompt and the tokens it already has, so its
        client sees one unbroken stream; the others fail with a 503."""
        for gen in [g for g in self.live if g.rank == rank]:
            try:
                if self._move_rank(gen, rank):
                    continue
            except Exception:  # a request is never left waiting: it fails below
                log.exception("moving request %s off scheduler rank %d failed", gen.id, rank)
            self.scheduler.ranks[rank].errors += 1
            self.fail(
                gen,
                ApiError(
                    503,
                    f"The GPU scheduler became unavailable ({why}); retry the request.",
                    "ServiceUnavailableError",
                    None,
                    "scheduler_unavailable",
                ),
                abort=False,
                reason="scheduler_lost",
            )

    def _move_rank(self, gen: Generation, lost: int) -> bool:
        """Start a lost rank's request again on another rank, if every unfinished choice of it can go on
        exactly there; False if not (or no rank is left)."""
        moving = [c for c in gen.choices if not c.done and not c.scheduler_done]
        if not moving or gen.failovers >= self.MAX_FAILOVERS:
            return False
        restarts = []
        for choice in moving:
            restart = self._restart(choice)
            if restart is None:
                return False
            restarts.append(restart)
        try:
            rank = self.scheduler.pick(None)
        except SchedulerUnavailable:
            return False
        if rank.index == lost:
            return False
        gen.failovers += 1
        gen.rank = rank.index
        self._count_failover("rank_resumed")
        for choice, (header, prompt, emitted) in zip(moving, restarts, strict=True):
            choice.token_offset += emitted
            choice.engine_frames = (header, prompt)
            self.scheduler.generate(rank, header, prompt)
        return True

    def _restart(self, choice: Choice) -> tuple[bytes, bytes, int] | None:
        """(Generate header, prompt frame, tokens carried over) to start a choice again elsewhere: the prompt
        followed by every token the lost rank sent for it, with that many fewer to generate. Only where
        the continuation is what the lost rank would have generated: nothing generated yet (any sampling),
        or greedy with nothing that depends on which tokens were output rather than prompt (presence and
        frequency penalties, a grammar's state, min_tokens counted) and no images or prompt logprobs."""
        if choice.engine_frames is None:
            return None
        header, prompt = choice.engine_frames
        emitted = b""
        if choice.history is not None:
            emitted = bytes(choice.history) + b"".join(item.token_ids for item in choice.inflight)
        elif choice.completion_tokens > choice.token_offset:
            return None  # tokens were generated but are not kept: cannot go on from them
        count = len(emitted) // 4
        if count == 0:
            return header, prompt, 0
        gen = protocol.decode_to_scheduler(header)
        s = gen.sampling
        if not (
            isinstance(gen, protocol.Generate)
            and s.temperature == 0
            and s.presence_penalty == 0
            and s.frequency_penalty == 0
            and not s.min_tokens
            and gen.structured is None
            and gen.prompt_logprobs is None
            and not gen.images
            and gen.max_new_tokens > count
        ):
            return None
        moved = msgspec.structs.replace(
            gen, prompt_token_count=gen.prompt_token_count + count, max_new_tokens=gen.max_new_tokens - count
        )
        return protocol.encode(moved), b"".join((prompt, emitted)), count

    # ---- from the workers -------------------------------------------------------------

    def on_detok(self, out: DetokOut) -> None:
        if out.parse_failures and self.metrics:
            for parser, count in out.parse_failures.items():
                self.metrics.tool_parse_failures.labels(parser=parser).inc(count)
        for delta in out.items:
            entry = self.by_request.get(delta.request_id)
            if entry is None:
                continue
            gen, choice = entry
            if gen.owner == NO_OWNER:
                continue  # from a worker that no longer holds it: what it answered goes to the next one again
            if delta.error:
                self._resume_failed(gen, delta.error)
                continue
            if choice.inflight is not None:
                self._answered(choice)
            tokens = delta.tokens
            pieces = delta.pieces
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            if delta.token_ids is not None:  # a chunk for every delta that took tokens, with their IDs
                kind, text = "text", delta.text
                if pieces:  # parsed: the first content or reasoning piece rides with the IDs, as vLLM's delta
                    first = pieces[0]
                    if first.kind == "content" or first.kind == "reasoning":
                        kind, text, pieces = (
                            ("text" if first.kind == "content" else "reasoning"),
                            first.text,
                            pieces[1:],
                        )
                    else:
                        kind = None  # a call goes in chunks of its own: the IDs come in an empty delta before it
                if delta.token_ids or text or delta.logprobs:
                    gen.buffered += len(text)
                    gen.events.put_nowait(
                        ev.Ids(choice.index, kind, text, delta.token_ids, delta.logprobs or None, tokens)
                    )
            elif delta.logprobs:  # the delta's text goes with them (with parsers, its pieces follow)
                gen.buffered += len(delta.text)
                gen.events.put_nowait(ev.Logprobs(choice.index, delta.text, delta.logprobs, tokens))
            elif delta.text:
                gen.buffered += len(delta.text)
                gen.events.put_nowait(ev.Text(choice.index, delta.text, tokens))
            for piece in pieces:
                gen.buffered += len(piece.text)
                if piece.kind == "call":
                    choice.tool_calls += 1
                    gen.events.put_nowait(ev.Call(choice.index, piece, tokens))
                elif piece.kind == "reasoning":
                    gen.events.put_nowait(ev.Reasoning(choice.index, piece.text, tokens))
                else:  # "content" and "text" pieces are the same thing
                    gen.events.put_nowait(ev.Text(choice.index, piece.text, tokens))
            if self.max_buffered and gen.buffered > self.max_buffered:
                self._too_slow(gen)
                continue
            if delta.stopped:  # a stop string matched: "stop", even if the scheduler hit its limit meanwhile
                choice.finish_reason = protocol.FINISH_STOP
                # usage counts the tokens up to the one that completed the stop string, as vLLM does, not
                # those the scheduler generated before the abort reached it
                choice.completion_tokens = tokens or choice.completion_tokens
                if not choice.scheduler_done:
                    self.scheduler.abort(gen.rank, [choice.request_id])
            if delta.final:
                choice.done = True
                self.by_request.pop(choice.request_id, None)
                self._forget_history(choice)
                # its worker holds nothing more for it (a stop string ended it before the scheduler's
                # last output, or it moved with its last tokens: neither went out as a finished item)
                self.conversion.ended(gen.owner, choice.request_id)
                if choice.finish_reason == protocol.FINISH_ERROR:
                    self.fail(
                        gen,
                        ApiError(
                            500,
                            f"The scheduler failed the request: {choice.error or 'unknown error'}",
                            "InternalServerError",
                            None,
                            "scheduler_error",
                        ),
                    )
                    continue
                reason = _openai_finish(choice)
                gen.events.put_nowait(
                    ev.Finish(
                        choice.index,
                        reason,
                        tokens or choice.completion_tokens,
                        delta.stop_reason if reason == "stop" else None,
                    )
                )
                if gen.finished:
                    self.live.discard(gen)

    def _too_slow(self, gen: Generation) -> None:
        """The client stopped reading (or reads slower than the model writes): stop generating for it
        and close its connection, rather than hold ever more text for it."""
        self.fail(
            gen,
            ApiError(
                408,
                f"The client read the stream too slowly: more than {self.max_buffered} characters "
                "waited to be sent, so the request was aborted.",
                "RequestTimeoutError",
                None,
                "slow_client",
            ),
            reason="slow_client",
        )
        if gen.drop_connection is not None:
            if self.metrics:
                self.metrics.closed_connections.labels(reason="slow_client").inc()
            gen.drop_connection()

    def on_owner_lost(self, owner: int, request_ids: set) -> None:
        """The worker detokenizing these requests died or was lost: each request's streams move to a
        live worker, which rebuilds their state from what is kept here and goes on. With no other
        worker alive, the request waits for one to be ready (on_worker_ready), at most
        ``failover_wait`` seconds; a request that cannot move fails with a 503 worker_died."""
        moving: dict[int, list[ResumeStream]] = defaultdict(list)
        # the pool forgets a request once its last tokens are sent to the worker; the worker may die
        # before answering them, so every live generation this worker holds counts
        lost = {entry[0] for entry in map(self.by_request.get, request_ids) if entry is not None}
        lost.update(g for g in self.live if g.owner == owner)
        for gen in lost:
            if gen.owner != owner:
                continue  # (ended, or moved on since: a worker that holds it now answers it)
            waiting_pixels = next((c for c in gen.choices if c.pixels_asked and c.sent is not None), None)
            if waiting_pixels is not None:  # the pixels it asked this worker for will never come
                self.on_pixels(waiting_pixels.request_id, None)
                continue
            self._move(gen, owner, moving)
        for new_owner, streams in moving.items():
            self.conversion.resume(new_owner, streams)

    def on_worker_ready(self, index: int) -> None:
        """A worker is ready (a dead one's replacement, or one that joined): the requests waiting for one
        move to the live worker holding fewest streams, which rebuilds their streams and goes on with
        the tokens the scheduler sent meanwhile."""
        if not self.waiting:
            return
        new_owner = self.conversion.stream_owner(exclude=NO_OWNER)
        if new_owner is None:
            return  # (gone again already: they wait on)
        moving: dict[int, list[ResumeStream]] = defaultdict(list)
        for gen in list(self.waiting):
            self.waiting.pop(gen).cancel()
            self._hand_over(gen, new_owner, moving)
        for owner, streams in moving.items():
            self.conversion.resume(owner, streams)

    def _move(self, gen: Generation, owner: int, moving: dict) -> None:
        """One request's streams to a live worker (added to ``moving``), to the requests waiting for
        one, or its 503 saying why not."""
        if not any(not c.done for c in gen.choices):
            return
        why = new_owner = None
        if any(c.history is None for c in gen.choices if not c.done):
            why = "not_resumable"
        elif gen.failovers >= self.MAX_FAILOVERS:
            why = "too_many"
        else:
            new_owner = self.conversion.stream_owner(exclude=owner)
            if new_owner is None:
                if self.failover_wait > 0:
                    self._wait(gen)
                    return
                why = "no_worker"
        if why is not None:
            self._count_failover(why)
            self.fail(gen, _worker_died(why), abort=True, reason="worker_died")
            return
        self._hand_over(gen, new_owner, moving)

    def _hand_over(self, gen: Generation, new_owner: int, moving: dict) -> None:
        """Give a request's running streams to ``new_owner``: their ResumeStreams join ``moving``."""
        gen.failovers += 1
        gen.owner = new_owner
        self._count_failover("resumed")
        self.conversion.rehome(new_owner, gen.affinity)
        for c in gen.choices:
            if not c.done:
                moving[new_owner].append(
                    ResumeStream(c.request_id, c.resume, bytes(c.history), c.chunks.tobytes(), list(c.inflight))
                )

    def _wait(self, gen: Generation) -> None:
        """No worker is alive to take the request's streams: no worker holds them until one is ready."""
        gen.owner = NO_OWNER
        self.waiting[gen] = asyncio.get_running_loop().call_later(self.failover_wait, self._waited, gen)
        self._count_failover("waiting")

    def _waited(self, gen: Generation) -> None:
        """A request waited ``failover_wait`` seconds and no worker became ready: it fails."""
        if gen not in self.waiting:
            return
        self._count_failover("no_worker")
        self.fail(gen, _worker_died("no_worker", self.failover_wait), abort=True, reason="worker_died")

    def _resume_failed(self, gen: Generation, why: str) -> None:
        self._count_failover("rebuild_failed")
        self.fail(
            gen,
            ApiError(
                503,
                f"The tokenizer worker streaming this request could not go on with it ({why}); retry the request.",
                "ServiceUnavailableError",
                None,
                "worker_died",
            ),
            reason="worker_died",
        )

    def _count_failover(self, reason: str) -> None:
        if self.metrics:
            self.metrics.stream_failovers.labels(reason=reason).inc()

    # ---- from the HTTP side ---------------------------------------------------------------

    def fail(self, gen: Generation, error: ApiError, abort: bool = True, reason: str = "error") -> None:
        if gen not in self.live:
            return
        self.cancel(gen, abort=abort, reason=reason)
        gen.events.put_nowait(ev.Failed(error))

    def cancel(self, gen: Generation, abort: bool = True, reason: str = "client_disconnect") -> None:
        """Stop a generation and free its state everywhere (client gone, error, shutdown)."""
        if gen not in self.live:
            return
        timer = self.waiting.pop(gen, None)
        if timer is not None:
            timer.cancel()
        running = [c.request_id for c in gen.choices if not c.done]
        unfinished = [c.request_id for c in gen.choices if not c.done and not c.scheduler_done]
        if abort and unfinished:
            self.scheduler.abort(gen.rank, unfinished)
        for _ in unfinished:  # the gateway stops waiting for them: they no longer count as its load
            self.scheduler.finished(gen.rank)
        if running:
            if gen.owner != NO_OWNER:
                self.conversion.release(gen.owner, running)
            if self.metrics:
                self.metrics.aborts.labels(reason=reason).inc()
        self._drop(gen)


_WHY = {
    "not_resumable": "its stream could not be kept resumable (token history over --stream-history-bytes, "
    "or resumption off)",
    "too_many": f"its streams had moved {Generations.MAX_FAILOVERS} times already",
    "no_worker": "no other tokenizer worker was alive to take its streams over",
}


def _worker_died(why: str, waited: float = 0.0) -> ApiError:
    reason = _WHY[why]
    if waited:
        reason = f"no tokenizer worker became ready to take them over within --stream-failover-wait ({waited:g} s)"
    return ApiError(
        503,
        f"The tokenizer worker streaming this request died, and {reason}; retry the request.",
        "ServiceUnavailableError",
        None,
        "worker_died",
    )


def _request_field(param: str | None, fields: dict[str, str]) -> str | None:
    """The request field behind a Generate field a scheduler refused ("sampling.min_p" -> "min_p");
    "structured" (and its whitespace_pattern) become the field the worker found it in (``fields``:
    response_format, structured_outputs.<key>, guided_*, tool_choice), else stay as they are."""
    if not param:
        return None
    if param in fields:
        return fields[param]
    return "max_tokens" if param == "max_new_tokens" else param.removeprefix("sampling.")


def _openai_finish(choice: Choice) -> str:
    # OpenAI knows stop, length and tool_calls; an abort ends the text like a stop would. As vLLM
    # does, "tool_calls" needs calls and a model that stopped by itself: a length cut stays "length".
    if choice.finish_reason == protocol.FINISH_LENGTH:
        return "length"
    return choice.calls_finish if choice.tool_calls else "stop"
