"""The tokenizer worker pool as the gateway uses it: conversions in, results and detokenized text out.

It composes three parts and routes the workers' messages between them:
- dispatch.py, the policy: which worker converts which request, and when (pull-based, one job per
  idle worker before a second for any, quick jobs on the workers' IO threads, conversation
  affinity within a load bound, rent or buy);
- worker_supervision.py, the workers this gateway spawns: a worker that dies (crash, kill -9, OOM,
  or killed here for overrunning the conversion deadline) is replaced at once, and its in-flight
  conversion is dispatched once more or failed;
- remote_workers.py, the workers that join over ZeroMQ (other hosts, or the node's shared workers):
  one that falls silent is counted lost exactly as a local one that died.

Detokenization goes to the worker that converted the request (it holds that request's decoder
state) and is answered between conversions, since a worker's IO thread runs while its conversion
threads encode.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import zmq.asyncio

from tokenmill.gateway.dispatch import Dispatcher, Job
from tokenmill.gateway.pool_settings import PoolSettings
from tokenmill.gateway.remote_workers import RemoteWorkers
from tokenmill.gateway.request_body import RequestBody
from tokenmill.gateway.worker_supervision import LocalWorkers, Worker
from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.settings import ConverterSettings

log = logging.getLogger("tokenmill.pool")


class ConversionRejected(Exception):
    """Raised to the HTTP layer with an OpenAI-style error to return."""

    def __init__(self, error: m.ApiError, retry_after: int | None = None):
        super().__init__(error.message)
        self.error = error
        self.retry_after = retry_after


@dataclass
class ConvertResult:
    done: m.ConvertDone
    frames: list  # buffers: per choice, Generate header then prompt tokens
    owner: int  # the worker holding the detokenizer state
    owner_deaths: int = 0  # the owner's deaths when it answered: more by the time streams start, and it holds none
    affinity: int | None = None  # the conversation's key (dispatch.py): repointed when its stream moves


@dataclass(eq=False)
class _Conversion(Job):
    timer: asyncio.TimerHandle | None = None  # the conversion deadline of its current attempt


class WorkerPool:
    def __init__(
        self,
        pool: PoolSettings,
        settings: ConverterSettings,
        on_detok: Callable[[m.DetokOut], None],
        on_owner_lost: Callable[[int, set], None],
        *,
        metrics=None,
        ctx: zmq.asyncio.Context | None = None,
        remote_security=None,
    ):
        size = pool.size
        self.size = size
        self.settings = settings
        self.on_detok = on_detok
        self.on_owner_lost = on_owner_lost
        self.on_pixels: Callable[[str, list | None], None] = lambda request_id, frames: None  # Generations'
        # a worker became ready (Generations': the streams waiting for one move to it)
        self.on_worker_ready: Callable[[int], None] = lambda index: None
        self.max_queued = pool.max_queued
        self.max_queued_bytes = pool.max_queued_bytes
        self.conversion_timeout = pool.conversion_timeout
        self.metrics = metrics
        self.workers = [Worker(i, f"w{i}".encode()) for i in range(size)]
        self.by_identity = {w.identity: w for w in self.workers}
        self.policy = Dispatcher(
            size,
            self._deliver,
            self._dispatch_later,
            affinity=pool.affinity,
            quick_bytes=pool.quick_bytes,
            quick_depth=pool.quick_depth,
            quick_turn_bytes=pool.quick_turn_bytes,
        )
        self.local = LocalWorkers(
            settings,
            self._on_message,
            lambda worker: self.policy.worker_starting(worker.index),
            self._on_worker_death,
            pool,
            metrics=metrics,
        )
        self.remote = RemoteWorkers(
            pool.remote_endpoint,
            settings,
            self.workers,
            self.by_identity,
            self._add_place,
            lambda index: self.policy.workers[index].ready,
            self._on_message,
            self._on_worker_death,
            size=size,
            security=remote_security,
            timeout=pool.remote_timeout,
            ctx=ctx,
            metrics=metrics,
        )
        self._steal_timer: asyncio.TimerHandle | None = None
        self._ids = itertools.count(1)
        self.model_max_model_len: int | None = None  # as the workers loaded it
        self.engine_max_model_len: int | None = None  # as the scheduler's Welcome said
        self.limits: m.Limits | None = None  # the scheduler's Welcome, as the workers need it
        self.vocab_size = 0  # the tokenizer's (WorkerReady)
        self.parsers = {"tool_call_parser": None, "reasoning_parser": None}  # as the workers resolved them
        self._ready_changed = asyncio.Event()
        self.deaths: dict[int, int] = {}  # worker index -> deaths and losses so far

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self.remote.start()
        for worker in self.workers:
            await self.local.start(worker)

    def _add_place(self) -> Worker:
        """A new place for a joining worker (retired until one takes it)."""
        worker = Worker(self.policy.add_worker(), b"", host="-", retired=True)
        self.workers.append(worker)
        return worker

    async def wait_ready(self, count: int | None = None, timeout: float = 120.0) -> bool:
        count = self.size if count is None else count
        deadline = time.monotonic() + timeout
        while self.alive < count:
            self._ready_changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._ready_changed.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    @property
    def alive(self) -> int:
        return self.policy.alive

    @property
    def queued(self) -> int:
        return self.policy.queued

    @property
    def jobs(self) -> dict:
        """The conversions in flight (queued or converting), by job id: /debug/state counts them."""
        return self.policy.jobs

    @property
    def busy(self) -> int:
        return self.policy.busy

    async def close(self) -> None:
        self.local.closing = True
        if self._steal_timer is not None:
            self._steal_timer.cancel()
        self.remote.stop()
        await self.local.stop()
        for job in list(self.policy.jobs.values()):
            self._fail(
                job, m.ApiError(503, "The server is shutting down.", "ServiceUnavailableError", None, "shutdown")
            )
        await self.local.close()
        self.remote.close()

    def _on_worker_death(self, worker: Worker) -> None:
        """A local worker died or a remote one was lost: its conversions go again (once) or fail, and
        the streams it was detokenizing end."""
        self.deaths[worker.index] = self.deaths.get(worker.index, 0) + 1
        state = self.policy.workers[worker.index]
        for job in [*state.quick.values(), *state.running.values()]:
            if job.timer:
                job.timer.cancel()
        self._ready_changed.set()
        for job in self.policy.worker_lost(worker.index):
            if job.timed_out:
                self._fail(
                    job,
                    m.ApiError(
                        400,
                        f"Converting this request took longer than the conversion timeout "
                        f"({self.conversion_timeout:g} s); it was stopped.",
                        "BadRequestError",
                        None,
                        "conversion_timeout",
                    ),
                )
            else:
                self._fail(
                    job,
                    m.ApiError(
                        503,
                        "The tokenizer worker converting this request died twice.",
                        "ServiceUnavailableError",
                        None,
                        "worker_died",
                    ),
                )
        owned, worker.owned = worker.owned, set()
        self.on_owner_lost(worker.index, owned)  # also the streams whose last tokens it had not answered

    # ---- conversion -------------------------------------------------------------------

    def check_capacity(self, nbytes: int) -> None:
        """Raise a 429 when a body of this size would overflow the conversion queue."""
        queued = self.queued
        if queued >= self.max_queued or self.policy.queued_bytes + nbytes > self.max_queued_bytes:
            reason = "queue_full" if queued >= self.max_queued else "queue_bytes"
            if self.metrics:
                self.metrics.rejections.labels(reason=reason).inc()
            raise ConversionRejected(
                m.ApiError(
                    429,
                    "The server is overloaded: too many requests are waiting for conversion. Retry later.",
                    "RateLimitError",
                    None,
                    "overloaded",
                ),
                retry_after=1,
            )

    def convert(self, kind: str, request_id: str, body: RequestBody, affinity: int | None = None) -> asyncio.Future:
        """A future of the conversion (ConvertResult, or ConversionRejected). A plain future, not a
        coroutine: the worker's answer resolves it directly, one loop iteration sooner than a task
        would wake its caller. Cancelling it gives the job up (dropped if still queued)."""
        future = asyncio.get_running_loop().create_future()
        try:
            self.check_capacity(len(body))
        except ConversionRejected as exc:
            future.set_exception(exc)
            return future
        job = _Conversion(next(self._ids), kind, request_id, body, time.monotonic(), affinity, future)
        future.add_done_callback(lambda f: self.policy.withdraw(job) if f.cancelled() else None)
        # a template sent with the request could loop until the conversion timeout: never on the IO thread
        self.policy.submit(job, quick_ok=not (self.settings.trust_request_chat_template and b'"chat_template"' in body))
        return future

    def _deliver(self, index: int, job: _Conversion) -> bool:
        """The policy's hand-out: send the job to the worker, and start its conversion deadline."""
        worker = self.workers[index]
        header = m.encoder.encode(m.ConvertJob(job.job_id, job.kind, job.request_id, job.quick))
        if not worker.try_send([header, job.body.pieces]):  # the body as it arrived: one frame, never joined
            return False
        if self.metrics:
            self.metrics.queue_wait.observe(time.monotonic() - job.enqueued)
            self.metrics.conversions[job.quick].inc()
        if self.conversion_timeout > 0:
            job.timer = asyncio.get_running_loop().call_later(self.conversion_timeout, self._overrun, worker, job)
        return True

    def _dispatch_later(self, delay: float) -> None:
        """The policy asks to run again in ``delay`` seconds (the earliest such request wins)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        if self._steal_timer is not None:
            if self._steal_timer.when() <= when:
                return
            self._steal_timer.cancel()
        self._steal_timer = loop.call_at(when, self._on_steal_timer)

    def _on_steal_timer(self) -> None:
        self._steal_timer = None
        self.policy.dispatch()

    def _overrun(self, worker: Worker, job: _Conversion) -> None:
        running = self.policy.converting(worker.index, job)
        if running and worker.host and not worker.retired:  # not ours to kill: stop it, and count it lost
            log.error(
                "request %s overran the conversion timeout on remote worker %d (%s); dropping the worker",
                job.request_id,
                worker.index,
                worker.host,
            )
            job.timed_out = True
            if self.metrics:
                self.metrics.conversion_timeouts.inc()
            worker.try_send([m.encoder.encode(m.Shutdown("a conversion overran the conversion timeout"))])
            self.remote.lose(worker, "it overran the conversion timeout")
        elif running and worker.process and worker.process.returncode is None:
            log.error(
                "request %s overran the conversion timeout; killing tokenizer worker %d", job.request_id, worker.index
            )
            job.timed_out = True
            if self.metrics:
                self.metrics.conversion_timeouts.inc()
            worker.process.kill()

    def fail_pending(self, error: m.ApiError) -> None:
        """Answer every conversion still queued or running with this error (shutdown)."""
        for job in list(self.policy.jobs.values()):
            self._fail(job, error)

    def _fail(self, job: _Conversion, error: m.ApiError) -> None:
        self.policy.drop(job)
        if not job.future.done():
            job.future.set_exception(ConversionRejected(error))

    # ---- detokenization and the workers' other messages ---------------------------------

    def detokenize(self, owner: int, items: list[m.DetokItem]) -> None:
        worker = self.workers[owner]
        for item in items:
            if item.finished:
                worker.owned.discard(item.request_id)
        worker.try_send([m.encoder.encode(m.DetokBatch(items))])  # a dead worker's requests fail on its death

    def ended(self, owner: int, request_id: str) -> None:
        """The owner sent a stream's last text: it holds no state for it any more."""
        self.workers[owner].owned.discard(request_id)

    def died_since(self, owner: int, deaths: int) -> bool:
        """The worker that converted a request died (or was lost) after answering: it holds no state for it."""
        return self.deaths.get(owner, 0) != deaths

    def stream_owner(self, exclude: int) -> int | None:
        """The live worker that takes over a dead one's streams: the one detokenizing fewest (None: none alive)."""
        live = [
            w for w, s in zip(self.workers, self.policy.workers) if s.ready and not w.retired and w.index != exclude
        ]
        return min(live, key=lambda w: len(w.owned)).index if live else None

    def rehome(self, owner: int, affinity: int | None) -> None:
        """A conversation's stream moved to ``owner``: its next turn goes there too (the dead worker's
        cache is gone, and this one now holds its decoder)."""
        if affinity is not None:
            self.policy.rehome(affinity, owner)

    def resume(self, owner: int, streams: list[m.ResumeStream]) -> None:
        """Send streams of a dead worker to ``owner``, which rebuilds them (a failure comes back as a
        delta with an error; a worker dying meanwhile moves them again, through on_owner_lost)."""
        worker = self.workers[owner]
        worker.owned.update(s.request_id for s in streams)
        worker.try_send([m.encoder.encode(m.Resume(streams))])

    @property
    def max_model_len(self) -> int | None:
        limits = [n for n in (self.model_max_model_len, self.engine_max_model_len) if n]
        return min(limits) if limits else None

    def limit_context(self, limits: m.Limits) -> None:
        """The scheduler said hello with its context length and features: every worker checks requests
        against them."""
        self.limits = limits
        self.engine_max_model_len = limits.max_model_len
        for worker in self.workers:
            if self.policy.workers[worker.index].ready:
                self._send_limits(worker)

    def _send_limits(self, worker: Worker) -> None:
        worker.try_send([m.encoder.encode(self.limits)])  # a dead worker's replacement gets them when ready

    def placed(self, owner: int, conversation: int, rank: int) -> None:
        """Tell the worker that converted this turn where it went (shared with the node's other gateways)."""
        self.workers[owner].try_send([m.encoder.encode(m.Placed(conversation, rank))])

    def want_pixels(self, owner: int, request_id: str, content_hashes: list[str]) -> None:
        """The engine lost images a request sent by hash: their pixels from the worker that converted it
        (answered through ``on_pixels``; a worker that is gone answers None at once)."""
        if not self.workers[owner].try_send([m.encoder.encode(m.PixelsWanted(request_id, content_hashes))]):
            self.on_pixels(request_id, None)

    def release(self, owner: int, request_ids: list[str]) -> None:
        worker = self.workers[owner]
        worker.owned.difference_update(request_ids)
        worker.try_send([m.encoder.encode(m.Release(request_ids))])

    # ---- receive loop -----------------------------------------------------------------

    def _on_message(self, link, identity: bytes, frames: list) -> None:
        """One message from a worker: a header (msgpack) and, with a conversion, the frames to forward."""
        try:
            msg = m.from_worker.decode(frames[0])
        except (IndexError, msgspec.DecodeError):
            log.error("undecodable message from worker %r", identity)
            return
        worker = self.by_identity.get(identity)
        if worker is None or worker.link is not link or worker.retired:
            if link is self.remote.sock:
                self.remote.on_stranger(identity, msg)
            return
        if worker.host and self.remote.heard(worker, msg):
            return
        index = worker.index
        if isinstance(msg, m.WorkerBusy):
            self.policy.worker_busy_elsewhere(index, msg.busy)
            return
        if isinstance(msg, m.DetokOut):
            if not self.policy.workers[index].ready:
                return  # read after its death was handled: its streams moved, and their new owner answers them
            if self.metrics:
                self.metrics.detokenize_seconds.observe(msg.detok_s)
            self.on_detok(msg)
        elif isinstance(msg, m.ConvertDone):
            self._on_done(worker, msg, frames[1:])
        elif isinstance(msg, m.Pixels):
            self.on_pixels(msg.request_id, frames[1:] if msg.found else None)
        elif isinstance(msg, m.WorkerReady):
            if not self.remote.admit_ready(worker, msg):
                return
            self.model_max_model_len = msg.max_model_len
            self.vocab_size = msg.vocab_size
            if self.limits is not None:
                self._send_limits(worker)
            self.parsers = {
                "tool_call_parser": msg.tool_call_parser or None,
                "reasoning_parser": msg.reasoning_parser or None,
            }
            if self.metrics:
                self.metrics.tokenize_cache_enabled.set(1 if msg.tokenize_cache else 0)
                if msg.tool_call_parser:  # exported at 0 from the start, so dashboards and alerts see it
                    self.metrics.tool_parse_failures.labels(parser=msg.tool_call_parser)
            if not msg.tokenize_cache:
                log.info("tokenization cache off in worker %d: %s", index, msg.tokenize_cache_reason)
            self._ready_changed.set()
            log.info(
                "tokenizer worker %d%s ready (pid %d; tool-call parser %s, reasoning parser %s)",
                index,
                f" on {worker.host}" if worker.host else "",
                msg.pid,
                msg.tool_call_parser or "none",
                msg.reasoning_parser or "none",
            )
            self.policy.worker_ready(index, msg.conversion_threads)
            self.on_worker_ready(index)

    def _on_done(self, worker: Worker, done: m.ConvertDone, frames) -> None:
        state = self.policy.workers[worker.index]
        sent = state.running.get(done.job_id)
        if sent is None:
            sent = state.quick.get(done.job_id)
        if sent is not None and sent.timer:
            sent.timer.cancel()
        job = self.policy.finished(worker.index, done)
        if self.metrics:
            self.metrics.observe_conversion(done, worker.index)
        ids = [c.request_id for c in done.choices]
        if job is None or job.future.done():
            if ids:  # nobody waits for it any more: free the decoder state it opened
                self.release(worker.index, ids)
            return
        worker.owned.update(ids)
        job.future.set_result(ConvertResult(done, frames, worker.index, self.deaths.get(worker.index, 0), job.affinity))

    def state(self) -> list[dict]:
        return [
            {
                "index": w.index,
                "pid": w.process.pid if w.process else w.pid or None,
                "alive": s.ready,
                "host": w.host or None,
                "busy": bool(s.running) or bool(s.quick),
                "converting": len(s.running),
                "quick_jobs": len(s.quick),
                "streams": len(w.owned),
            }
            for w, s in zip(self.workers, self.policy.workers)
            if not w.retired
        ]
