"""The gateway's side of the tokenizer worker pool: processes, dispatch, and their ZeroMQ socket.

Dispatch is pull-based: each worker converts as many requests at once as it has conversion
threads (two by default; WorkerReady says how many) and the gateway hands the next queued
request to whichever worker has a thread free, so a 250k-token conversion never holds up
short requests while another thread is idle. Every idle worker gets a job before any worker
gets a second one: two conversions in one process share its GIL, in two processes nothing.
Cheap conversions (quick jobs) skip the queue: small bodies go at once to their conversation's
worker, or the least busy when that one has more in flight, and a next turn that adds little to
a conversation goes to the worker that converted the last one (its cache holds the rest); the
worker's IO thread converts them beside whatever its conversion threads are doing (a hand-off
would cost more than they do). A turn of a conversation whose cache another worker holds waits
for that worker at most as long as converting it afresh would take (a short request: no time
at all). Detokenization goes to the worker that converted the request (it holds that
request's decoder state) and is answered between conversions, since a worker's IO thread runs
while its conversion threads encode.

The pool owns the worker processes: a worker that dies (crash, kill -9, OOM, or killed
here for overrunning the conversion deadline) is replaced at once, and its in-flight
conversion is dispatched once more or failed.

Workers on other hosts (``tokenmill worker --connect``, on the --remote-workers socket)
join and leave at any time. The pool cannot watch their processes, so a remote worker
that falls silent for ``remote_timeout`` seconds is counted lost exactly as a local one
that died: its conversion is dispatched again, and its streams end with an error.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
import os
import socket
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from tokenizer_workers import messages as m
from tokenizer_workers.converter import ConverterSettings
from tokenizer_workers.worker import SETTINGS_ENV
from tokenmill.transport.loop_socket import LoopSocket
from tokenmill.transport.pipe_link import LinkDown, PipeLink
from tokenmill.process.procutil import child_env

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


@dataclass(eq=False)
class _Job:
    job_id: int
    kind: str
    request_id: str
    body: bytes
    future: asyncio.Future
    enqueued: float
    attempts: int = 0
    worker: int | None = None
    timer: asyncio.TimerHandle | None = None
    timed_out: bool = False
    affinity: int | None = None  # hash of the conversation's beginning
    lane: deque | None = None  # the queue it waits in
    quick: bool = False  # cheap enough for the worker's IO thread: sent without waiting for a free worker
    home: int | None = None  # the worker for a quick job: its conversation's (a quick turn: that one or none)


@dataclass(eq=False)
class _Worker:
    index: int
    identity: bytes
    link: PipeLink | LoopSocket | None = None  # a spawned worker's socket pair, or the remote workers' socket
    host: str = ""  # a remote worker's host ("" for the gateway's own)
    pid: int = 0
    last_seen: float = 0.0
    retired: bool = False  # a lost remote worker's slot, free for the next one to join
    elsewhere: bool = False  # converting a job of another gateway of the node (--gateways N)
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    slots: int = 1  # conversion threads (WorkerReady): non-quick jobs it takes at once
    running: dict = field(default_factory=dict)  # job id -> non-quick job its conversion threads hold
    started: float = 0.0
    restarts: int = 0
    owned: set = field(default_factory=set)  # scheduler request ids whose detok state it holds
    lane: deque = field(default_factory=deque)  # jobs waiting for this worker's segment cache
    quick: dict = field(default_factory=dict)  # job id -> quick job sent to it and not answered yet

    def send(self, frames: list) -> None:
        """One message to this worker; raises zmq.ZMQError or LinkDown when it cannot take it."""
        if isinstance(self.link, LoopSocket):  # a joined worker, on the shared ROUTER socket
            self.link.send([self.identity, *frames])
        else:
            self.link.send(frames)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class WorkerPool:
    def __init__(
        self,
        size: int,
        settings: ConverterSettings,
        on_detok: Callable[[m.DetokOut], None],
        on_owner_lost: Callable[[int, set], None],
        *,
        max_queued: int = 1024,
        max_queued_bytes: int = 1 << 30,
        conversion_timeout: float = 60.0,
        memory_limit_mb: int = 0,
        conversion_threads: int = 2,
        conversion_nice: int = 0,
        affinity: bool = True,
        quick_bytes: int = 8192,
        quick_depth: int = 16,
        quick_turn_bytes: int = 65536,
        metrics=None,
        ctx: zmq.asyncio.Context | None = None,
        remote_endpoint: str | None = None,
        remote_security=None,
        remote_timeout: float = 5.0,
        attach: tuple[str, ...] = (),
    ):
        self.size = size
        self.settings = settings
        self.on_detok = on_detok
        self.on_owner_lost = on_owner_lost
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.conversion_timeout = conversion_timeout
        self.memory_limit_mb = memory_limit_mb
        self.conversion_threads = conversion_threads  # of each worker this gateway spawns
        self.conversion_nice = conversion_nice
        self.affinity = affinity
        self.quick_bytes = quick_bytes  # bodies up to this size convert on a worker's IO thread (0: never)
        self.quick_depth = quick_depth  # quick jobs in flight per worker, at most
        self.quick_turn_bytes = quick_turn_bytes  # a conversation's turn at home up to this size is quick too
        self.remote_endpoint = remote_endpoint  # where workers on other hosts join (None: nowhere)
        self.remote_security = remote_security  # transport_security.RemoteWorkerSecurity
        self.remote_timeout = remote_timeout
        self.attach = attach  # the node's other gateways (--gateways N), which each worker joins too
        self.fingerprint = ""  # the first worker's: every remote worker must convert the same way
        # conversation key -> (worker that converted it last, that body's size); insertion-ordered, bounded
        self.homes: dict[int, tuple[int, int]] = {}
        self.cold_s_per_byte = 1e-6  # conversion time per body byte with nothing cached (running average)
        self._steal_timer: asyncio.TimerHandle | None = None
        self.metrics = metrics
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.workers = [_Worker(i, f"w{i}".encode()) for i in range(size)]
        self.by_identity = {w.identity: w for w in self.workers}
        self._ring()
        self.queue: deque[_Job] = deque()
        self.quick_queue: deque[_Job] = deque()  # quick jobs waiting for a worker with room
        self.queued_bytes = 0
        self.jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self.model_max_model_len: int | None = None  # as the workers loaded it
        self.engine_max_model_len: int | None = None  # as the scheduler's Welcome said
        self.limits: m.Limits | None = None  # the scheduler's Welcome, as the workers need it
        self.vocab_size = 0  # the tokenizer's (WorkerReady)
        self.parsers = {"tool_call_parser": None, "reasoning_parser": None}  # as the workers resolved them
        self._ready_changed = asyncio.Event()
        self.remote_sock: LoopSocket | None = None
        self._reaper: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        if self.remote_endpoint:  # remote workers outlive a gateway restart: they join the next one
            remote = zmq.Socket(self.ctx, zmq.ROUTER)
            remote.setsockopt(zmq.LINGER, 0)
            remote.setsockopt(zmq.ROUTER_MANDATORY, 1)
            remote.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker reconnecting after a network blip
            remote.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # drop TCP paths that died without a FIN
            remote.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
            if self.remote_security:
                self.remote_security.secure_server(remote)
            remote.bind(self.remote_endpoint)
            self.remote_sock = LoopSocket(remote, lambda frames: self._on_message(
                self.remote_sock, frames[0].bytes, [frame.buffer for frame in frames[1:]]))
            self.remote_sock.start()
            self._reaper = asyncio.create_task(self._reap_silent())
            log.info("remote tokenizer workers may join at %s", self.remote_endpoint)
        for worker in self.workers:
            await self._start_process(worker)

    def _ring(self) -> None:
        """The consistent-hash ring: 64 points per worker, so a worker's share moves little when the
        pool changes. Local workers stay on it while restarting; remote ones while they are joined."""
        members = [w.index for w in self.workers if not w.host or (w.ready and not w.retired)]
        self.ring = sorted((zlib.crc32(f"{i}:{v}".encode()), i) for i in members for v in range(64))

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
        return sum(w.ready for w in self.workers)

    @property
    def queued(self) -> int:
        return len(self.queue) + len(self.quick_queue) + sum(len(w.lane) for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(bool(w.running) or bool(w.quick) for w in self.workers)

    async def close(self) -> None:
        self._closing = True
        if self._steal_timer is not None:
            self._steal_timer.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
        for worker in self.workers:
            if worker.process and worker.process.returncode is None:
                worker.process.terminate()
        for worker in self.workers:
            if worker.process:
                try:
                    await asyncio.wait_for(worker.process.wait(), 5)
                except asyncio.TimeoutError:
                    worker.process.kill()
                    await worker.process.wait()
        for job in list(self.jobs.values()):
            self._fail(job, m.ApiError(503, "The server is shutting down.", "ServiceUnavailableError", None, "shutdown"))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers:
            if isinstance(worker.link, PipeLink):
                worker.link.close()
        if self.remote_sock is not None:
            self.remote_sock.close()
        if self.remote_security:
            self.remote_security.stop()

    def _spawn_task(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_process(self, worker: _Worker) -> None:
        env = child_env()
        env[SETTINGS_ENV] = msgspec.json.encode(self.settings).decode()
        worker.ready = False
        worker.started = time.monotonic()
        if isinstance(worker.link, PipeLink):
            worker.link.close()  # its last process's link: what is still in it is for a process that is gone
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):  # a long prompt's body (MBs) in one write, not one per 208 KiB of default buffer
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        with theirs:
            worker.link = await PipeLink.open(ours, lambda link, frames: self._on_message(link, worker.identity, frames))
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tokenizer_workers.worker", f"--title=tokenizer worker {worker.index}",
                "--link-fd", str(theirs.fileno()), "--index", str(worker.index),
                "--memory-limit-mb", str(self.memory_limit_mb), "--conversion-threads", str(self.conversion_threads),
                "--conversion-nice", str(self.conversion_nice),
                *(arg for endpoint in self.attach for arg in ("--attach", endpoint)), env=env, pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        self._spawn_task(self._watch_process(worker, worker.process))

    async def _watch_process(self, worker: _Worker, process) -> None:
        code = await process.wait()
        if self._closing or worker.process is not process:
            return
        log.warning("tokenizer worker %d (pid %d) exited with %s; starting a replacement", worker.index, process.pid, code)
        self._on_worker_death(worker)
        if self.metrics:
            self.metrics.worker_restarts.inc()
        # a worker that dies right after starting is crash-looping: back off a little
        if time.monotonic() - worker.started < 2.0:
            await asyncio.sleep(min(5.0, 0.5 * (worker.restarts + 1)))
        worker.restarts += 1
        if not self._closing:
            await self._start_process(worker)

    def _on_worker_death(self, worker: _Worker) -> None:
        worker.ready = worker.elsewhere = False
        self._ready_changed.set()
        lost = [*worker.quick.values(), *worker.running.values()]
        worker.running, worker.quick = {}, {}
        for job in lost:
            if job.timer:
                job.timer.cancel()
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
            elif job.attempts < 2 and not job.future.done():
                log.warning("re-dispatching request %s after its worker died", job.request_id)
                job.worker = None
                self._enqueue(job, front=True)
            else:
                self._fail(
                    job,
                    m.ApiError(503, "The tokenizer worker converting this request died twice.", "ServiceUnavailableError", None, "worker_died"),
                )
        if worker.owned:
            owned, worker.owned = worker.owned, set()
            self.on_owner_lost(worker.index, owned)
        self.homes = {key: home for key, home in self.homes.items() if home[0] != worker.index}  # its cache is gone
        if worker.host:
            self._ring()
        while worker.lane:  # whoever is free takes what waited for this worker
            job = worker.lane.popleft()
            job.lane = self.queue
            self.queue.append(job)
        self._dispatch()

    # ---- conversion -------------------------------------------------------------------

    def check_capacity(self, nbytes: int) -> None:
        """Raise a 429 when a body of this size would overflow the conversion queue."""
        queued = self.queued
        if queued >= self.max_queued or self.queued_bytes + nbytes > self.max_queued_bytes:
            reason = "queue_full" if queued >= self.max_queued else "queue_bytes"
            if self.metrics:
                self.metrics.rejections.labels(reason=reason).inc()
            raise ConversionRejected(
                m.ApiError(429, "The server is overloaded: too many requests are waiting for conversion. Retry later.",
                           "RateLimitError", None, "overloaded"),
                retry_after=1,
            )

    def convert(self, kind: str, request_id: str, body: bytes, affinity: int | None = None) -> asyncio.Future:
        """A future of the conversion (ConvertResult, or ConversionRejected). A plain future, not a
        coroutine: the worker's answer resolves it directly, one loop iteration sooner than a task
        would wake its caller. Cancelling it gives the job up (dropped if still queued)."""
        future = asyncio.get_running_loop().create_future()
        try:
            self.check_capacity(len(body))
        except ConversionRejected as exc:
            future.set_exception(exc)
            return future
        job = _Job(next(self._ids), kind, request_id, body, future, time.monotonic())
        job.affinity = affinity
        # a template sent with the request could loop until the conversion timeout: never on the IO thread
        if not (self.settings.trust_request_chat_template and b'"chat_template"' in body):
            job.quick = 0 < len(body) <= self.quick_bytes
            keyed = self.affinity and affinity is not None
            home = self.homes.get(affinity) if keyed else None
            if job.quick and keyed:
                # its earlier turns' worker, or the hash ring's choice for a new conversation
                job.home = home[0] if home is not None else self._ring_index(affinity)
            elif (home is not None and len(body) <= self.quick_turn_bytes
                  and 0 <= len(body) - home[1] <= self.quick_bytes):
                # the next turn of a conversation its worker holds: little new text to encode, so
                # cheaper than the hand-offs to a conversion thread and back
                job.quick, job.home = True, home[0]
        self.jobs[job.job_id] = job
        future.add_done_callback(lambda f: self._forget(job) if f.cancelled() else None)
        self._enqueue(job)
        self._dispatch()
        return future

    def _forget(self, job: _Job) -> None:
        """The caller went away: drop a queued job; a running one's result will be released."""
        if job.worker is None and job.lane is not None and job in job.lane:
            job.lane.remove(job)
            self.queued_bytes -= len(job.body)
            self.jobs.pop(job.job_id, None)

    # ---- dispatch: affinity (new conversations within a load bound), rent or buy, no idle worker ----

    def _enqueue(self, job: _Job, front: bool = False) -> None:
        self.queued_bytes += len(job.body)
        owner = None if front or job.quick else self._owner(job)
        job.lane = self.quick_queue if job.quick else owner.lane if owner is not None else self.queue
        if front:
            job.lane.appendleft(job)
        else:
            job.lane.append(job)

    def _owner(self, job: _Job) -> _Worker | None:
        """The worker holding this conversation's segments (others take the job from its lane only
        once waiting has cost as much as converting afresh: _ripe); for a conversation no worker
        holds, the hash ring's worker unless it already has more than its share."""
        if not self.affinity or job.affinity is None:
            return None
        home = self.homes.get(job.affinity)
        index = home[0] if home is not None else self._ring_index(job.affinity)
        if index is None or not self.workers[index].ready:
            return None
        worker = self.workers[index]
        if home is not None:
            return worker
        alive = [w for w in self.workers if w.ready]
        total = sum(self._load(w) for w in alive) + len(self.queue) + 1
        bound = max(1, math.ceil(1.25 * total / len(alive)))
        return worker if self._load(worker) < bound else None

    def _ring_index(self, key: int) -> int | None:
        """The worker the consistent-hash ring gives a conversation no worker holds yet."""
        return self.ring[bisect.bisect(self.ring, (key,)) % len(self.ring)][1] if self.ring else None

    @staticmethod
    def _load(worker: _Worker) -> int:
        """Non-quick jobs a worker holds or has waiting for it (a shared worker busy elsewhere counts one)."""
        return max(len(worker.running), worker.elsewhere) + len(worker.lane)

    def _set_home(self, key: int, index: int, nbytes: int) -> None:
        """A conversation converted by a worker stays with it: that worker now holds its segments,
        so load moves once instead of missing the cache on every turn."""
        self.homes.pop(key, None)
        self.homes[key] = (index, nbytes)
        if len(self.homes) > 65536:
            del self.homes[next(iter(self.homes))]

    def _ripe(self, job: _Job) -> float:
        """When another worker may take a job waiting for its conversation's worker (rent or buy).

        Converting it elsewhere tokenizes its whole history again; waiting costs time. So an idle
        worker waits for the owner at most as long as converting the job cold would take: a short
        request is taken at once (a long conversion never holds it up), and a long conversation
        whose owner frees up within that time keeps its cache. Neither choice costs more than
        twice the better one. A conversation no worker has converted yet is taken at once.
        """
        if job.affinity is None or job.affinity not in self.homes:
            return job.enqueued
        return job.enqueued + self.cold_s_per_byte * len(job.body)

    def _take(self, worker: _Worker, steal: bool = True) -> _Job | None:
        """Its own lane first, then the shared queue, then (when steal) the ripe jobs of other lanes,
        longest lane first."""
        for lane in (worker.lane, self.queue):
            while lane:
                job = lane.popleft()
                self.queued_bytes -= len(job.body)
                if not job.future.done():
                    job.lane = None
                    return job
                self.jobs.pop(job.job_id, None)
        if not steal:
            return None
        now, wake = time.monotonic(), None
        for lane in sorted((w.lane for w in self.workers if w is not worker and w.lane), key=len, reverse=True):
            for job in list(lane):
                if job.future.done():
                    lane.remove(job)
                    self.queued_bytes -= len(job.body)
                    self.jobs.pop(job.job_id, None)
                    continue
                ripe = self._ripe(job)
                if ripe <= now:
                    lane.remove(job)
                    self.queued_bytes -= len(job.body)
                    job.lane = None
                    return job
                wake = ripe if wake is None else min(wake, ripe)
        if wake is not None:
            self._dispatch_later(wake - now)
        return None

    def _dispatch_later(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        if self._steal_timer is not None:
            if self._steal_timer.when() <= when:
                return
            self._steal_timer.cancel()
        self._steal_timer = loop.call_at(when, self._on_steal_timer)

    def _on_steal_timer(self) -> None:
        self._steal_timer = None
        self._dispatch()

    def _dispatch(self) -> None:
        if self.quick_queue:
            self._dispatch_quick()
        # One job for every idle worker before a second for any: a job beside another on the same
        # worker shares that process's GIL and its cache lock, one on an idle worker shares nothing.
        # At each level every worker takes from its own lane before any takes from another's.
        for level in range(max((w.slots for w in self.workers), default=1)):
            for steal in (False, True):
                for worker in self.workers:
                    if worker.ready and not worker.elsewhere and len(worker.running) <= level < worker.slots:
                        job = self._take(worker, steal)
                        if job is not None:
                            self._send_job(worker, job)

    def _dispatch_quick(self) -> None:
        """Quick jobs go at once, up to quick_depth in flight per worker (its IO thread converts
        them even while its conversion threads are busy). A small body goes to its conversation's
        worker unless that one has more in flight than the least busy (many conversations can
        share a key: then they spread), else to the least busy. A quick turn (over quick_bytes)
        goes to its conversation's worker, or, when that one is gone or full, to a conversion
        thread like any other turn (elsewhere it would be encoded afresh on an IO thread)."""
        ready = [w for w in self.workers if w.ready]
        while self.quick_queue and ready:
            job = self.quick_queue[0]
            least = min(ready, key=lambda w: (len(w.quick), len(w.running)))
            home = self.workers[job.home] if job.home is not None else None
            if home is not None and home.ready and len(home.quick) < self.quick_depth and (
                    len(job.body) > self.quick_bytes or len(home.quick) <= len(least.quick)):
                worker = home
            elif len(job.body) > self.quick_bytes:
                self.quick_queue.popleft()
                self.queued_bytes -= len(job.body)
                job.quick, job.home = False, None
                self._enqueue(job)
                continue
            else:
                worker = least
                if len(worker.quick) >= self.quick_depth:
                    return
            self.quick_queue.popleft()
            self.queued_bytes -= len(job.body)
            if job.future.done():
                self.jobs.pop(job.job_id, None)
                continue
            job.lane = None
            self._send_job(worker, job)
            ready = [w for w in ready if w.ready]

    def _send_job(self, worker: _Worker, job: _Job) -> None:
        header = m.encoder.encode(m.ConvertJob(job.job_id, job.kind, job.request_id, job.quick))
        try:
            worker.send([header, job.body])
        except (zmq.ZMQError, LinkDown):
            worker.ready = False  # its death is being reported; try another worker
            self._enqueue(job, front=True)
            return
        job.attempts += 1
        job.worker = worker.index
        if job.quick:
            worker.quick[job.job_id] = job
        else:
            worker.running[job.job_id] = job
        if job.affinity is not None:  # quick or not, its segments go into that worker's one cache
            self._set_home(job.affinity, worker.index, len(job.body))
        if self.metrics:
            self.metrics.queue_wait.observe(time.monotonic() - job.enqueued)
            self.metrics.conversions[job.quick].inc()
        if self.conversion_timeout > 0:
            job.timer = asyncio.get_running_loop().call_later(self.conversion_timeout, self._overrun, worker, job)

    def _overrun(self, worker: _Worker, job: _Job) -> None:
        running = worker.running.get(job.job_id) is job or worker.quick.get(job.job_id) is job
        if running and worker.host and not worker.retired:  # not ours to kill: stop it, and count it lost
            log.error("request %s overran the conversion timeout on remote worker %d (%s); dropping the worker",
                      job.request_id, worker.index, worker.host)
            job.timed_out = True
            if self.metrics:
                self.metrics.conversion_timeouts.inc()
            self._send(worker, [m.encoder.encode(m.Shutdown("a conversion overran the conversion timeout"))])
            self._lose(worker, "it overran the conversion timeout")
        elif running and worker.process and worker.process.returncode is None:
            log.error("request %s overran the conversion timeout; killing tokenizer worker %d", job.request_id, worker.index)
            job.timed_out = True
            if self.metrics:
                self.metrics.conversion_timeouts.inc()
            worker.process.kill()

    def fail_pending(self, error: m.ApiError) -> None:
        """Answer every conversion still queued or running with this error (shutdown)."""
        for job in list(self.jobs.values()):
            self._fail(job, error)

    def _fail(self, job: _Job, error: m.ApiError) -> None:
        self.jobs.pop(job.job_id, None)
        if not job.future.done():
            job.future.set_exception(ConversionRejected(error))

    # ---- detokenization -----------------------------------------------------------------

    def detokenize(self, owner: int, items: list[m.DetokItem]) -> None:
        worker = self.workers[owner]
        for item in items:
            if item.finished:
                worker.owned.discard(item.request_id)
        self._send(worker, [m.encoder.encode(m.DetokBatch(items))])  # a dead worker's requests fail on its death

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
            if worker.ready:
                self._send_limits(worker)

    def _send_limits(self, worker: _Worker) -> None:
        self._send(worker, [m.encoder.encode(self.limits)])  # a dead worker's replacement gets them when ready

    @staticmethod
    def _send(worker: _Worker, frames: list) -> bool:
        try:
            worker.send(frames)
            return True
        except (zmq.ZMQError, LinkDown):
            return False

    def placed(self, owner: int, conversation: int, rank: int) -> None:
        """Tell the worker that converted this turn where it went (shared with the node's other gateways)."""
        self._send(self.workers[owner], [m.encoder.encode(m.Placed(conversation, rank))])

    def release(self, owner: int, request_ids: list[str]) -> None:
        worker = self.workers[owner]
        worker.owned.difference_update(request_ids)
        self._send(worker, [m.encoder.encode(m.Release(request_ids))])

    # ---- receive loop -----------------------------------------------------------------

    def _on_message(self, link: PipeLink | LoopSocket, identity: bytes, frames: list) -> None:
        """One message from a worker: a header (msgpack) and, with a conversion, the frames to forward."""
        try:
            msg = m.from_worker.decode(frames[0])
        except (IndexError, msgspec.DecodeError):
            log.error("undecodable message from worker %r", identity)
            return
        worker = self.by_identity.get(identity)
        if worker is None or worker.link is not link or worker.retired:
            if link is self.remote_sock:
                self._on_stranger(identity, msg)
            return
        if worker.host:
            worker.last_seen = time.monotonic()
            if isinstance(msg, m.Heartbeat):
                return
            if isinstance(msg, m.WorkerHello):
                if not worker.ready and worker.pid == msg.pid:  # a hello repeated before our answer reached it
                    self._send_settings(worker)
                    return
                self._lose(worker, "it said hello again")  # it restarted under the same identity: a new session
                self._on_stranger(identity, msg)
                return
        index = worker.index
        if isinstance(msg, m.WorkerBusy):
            worker.elsewhere = msg.busy
            if not msg.busy:
                self._dispatch()
            return
        if isinstance(msg, m.DetokOut):
            if self.metrics:
                self.metrics.detokenize_seconds.observe(msg.detok_s)
            self.on_detok(msg)
        elif isinstance(msg, m.ConvertDone):
            self._on_done(worker, msg, frames[1:])
        elif isinstance(msg, m.WorkerReady):
            if not self._admit_ready(worker, msg):
                return
            self.model_max_model_len = msg.max_model_len
            self.vocab_size = msg.vocab_size
            if self.limits is not None:
                self._send_limits(worker)
            self.parsers = {"tool_call_parser": msg.tool_call_parser or None,
                            "reasoning_parser": msg.reasoning_parser or None}  # fmt: skip
            if self.metrics:
                self.metrics.tokenize_cache_enabled.set(1 if msg.tokenize_cache else 0)
                if msg.tool_call_parser:  # exported at 0 from the start, so dashboards and alerts see it
                    self.metrics.tool_parse_failures.labels(parser=msg.tool_call_parser)
            if not msg.tokenize_cache:
                log.info("tokenization cache off in worker %d: %s", index, msg.tokenize_cache_reason)
            worker.slots = max(1, msg.conversion_threads)
            worker.ready = True
            self._ready_changed.set()
            if worker.host:
                self._ring()
            log.info("tokenizer worker %d%s ready (pid %d; tool-call parser %s, reasoning parser %s)", index,
                     f" on {worker.host}" if worker.host else "", msg.pid,
                     msg.tool_call_parser or "none", msg.reasoning_parser or "none")
            self._dispatch()

    # ---- remote workers ---------------------------------------------------------------

    def _on_stranger(self, identity: bytes, msg) -> None:
        """A message on the remote socket from a worker not in the pool: a hello joins it; anything
        else comes from a session this gateway does not know (it restarted, or counted the worker
        lost), so the worker is told to join again."""
        if not isinstance(msg, m.WorkerHello):
            try:
                self.remote_sock.send([identity, m.encoder.encode(m.Rejoin())])
            except zmq.ZMQError:
                pass
            return
        worker = self._free_slot(msg.index)
        self.by_identity.pop(worker.identity, None)
        worker.identity, worker.link, worker.host, worker.pid = identity, self.remote_sock, msg.host, msg.pid
        worker.retired, worker.ready, worker.last_seen = False, False, time.monotonic()
        worker.running, worker.quick, worker.owned = {}, {}, set()
        self.by_identity[identity] = worker
        log.info("%s on %s (pid %d) joins as worker %d", self._kind, msg.host, msg.pid, worker.index)
        self._send_settings(worker)

    @property
    def _kind(self) -> str:
        return "tokenizer worker" if self.remote_endpoint.startswith("ipc://") else "remote tokenizer worker"

    def _send_settings(self, worker: _Worker) -> None:
        self._send(worker, [m.encoder.encode(m.WorkerSettings(worker.index, msgspec.json.encode(self.settings)))])

    def _free_slot(self, wanted: int) -> _Worker:
        """A place in the pool for a joining worker: the index it asks for when that is free (a worker of
        this node has the same index in every gateway, so the hash ring sends a conversation to the same
        worker whichever gateway takes it), else a lost worker's place, else a new one."""
        while wanted >= len(self.workers):
            self.workers.append(_Worker(len(self.workers), b"", host="-", retired=True))
        if wanted >= 0 and self.workers[wanted].retired and not self.workers[wanted].owned:
            return self.workers[wanted]
        free = next((w for w in self.workers if w.retired and not w.owned and w.index >= self.size), None)
        if free is None:
            free = _Worker(len(self.workers), b"", host="-", retired=True)
            self.workers.append(free)
        return free

    def _admit_ready(self, worker: _Worker, msg: m.WorkerReady) -> bool:
        """The first worker's fingerprint is the pool's; a remote worker with another is refused."""
        if not self.fingerprint or not worker.host:
            self.fingerprint = self.fingerprint or msg.fingerprint
            return True
        if msg.fingerprint == self.fingerprint:
            return True
        log.error("refused remote tokenizer worker %d on %s (pid %d): its tokenizer, templates or context length "
                  "differ from this gateway's (fingerprint %s, expected %s); give it the same model (--model)",
                  worker.index, worker.host, msg.pid, msg.fingerprint, self.fingerprint)
        if self.metrics:
            self.metrics.remote_worker_refusals.labels(reason="fingerprint").inc()
        self._send(worker, [m.encoder.encode(m.Shutdown(
            "its tokenizer, chat templates or context length differ from the gateway's; load the same model"))])
        self._lose(worker, None)
        return False

    def _lose(self, worker: _Worker, why: str | None) -> None:
        """A remote worker leaves the pool: its work goes as a dead local worker's does."""
        if why:
            log.warning("%s %d on %s (pid %d) is lost: %s", self._kind, worker.index, worker.host, worker.pid, why)
        worker.retired = True
        self.by_identity.pop(worker.identity, None)
        self._on_worker_death(worker)

    async def _reap_silent(self) -> None:
        while True:
            await asyncio.sleep(min(0.25 if self.remote_endpoint.startswith("ipc://") else 1.0, self.remote_timeout / 4))
            now = time.monotonic()
            same_host = self.remote_endpoint.startswith("ipc://")
            for worker in self.workers:
                if not worker.host or worker.retired:
                    continue
                if now - worker.last_seen > self.remote_timeout:
                    self._lose(worker, f"silent for {now - worker.last_seen:.1f} s")
                elif same_host and not _pid_alive(worker.pid):  # on this host, a death need not wait for silence
                    self._lose(worker, f"process {worker.pid} exited")

    def _on_done(self, worker: _Worker, done: m.ConvertDone, frames) -> None:
        job = self.jobs.get(done.job_id)
        if job is not None and job.worker not in (None, worker.index):
            job = None  # a remote worker's answer to a job that has moved on to another worker since
        else:
            self.jobs.pop(done.job_id, None)
        cache = done.cache
        if job is not None and cache is not None and cache.cached_tokens == 0 and len(job.body) >= 16384:
            rate = (done.render_s + done.tokenize_s) / len(job.body)  # a cold conversion: what a move costs
            self.cold_s_per_byte += 0.2 * (rate - self.cold_s_per_byte)
        if (running := worker.running.pop(done.job_id, None)) is not None:
            if running.timer:
                running.timer.cancel()
        elif (quick := worker.quick.pop(done.job_id, None)) is not None and quick.timer:
            quick.timer.cancel()
        self._dispatch()
        if self.metrics:
            self.metrics.observe_conversion(done, worker.index)
        ids = [c.request_id for c in done.choices]
        if job is None or job.future.done():
            if ids:  # nobody waits for it any more: free the decoder state it opened
                self.release(worker.index, ids)
            return
        worker.owned.update(ids)
        job.future.set_result(ConvertResult(done, frames, worker.index))

    def state(self) -> list[dict]:
        return [
            {"index": w.index, "pid": w.process.pid if w.process else w.pid or None, "alive": w.ready,
             "host": w.host or None, "busy": bool(w.running) or bool(w.quick), "converting": len(w.running),
             "quick_jobs": len(w.quick), "streams": len(w.owned)}
            for w in self.workers if not w.retired
        ]  # fmt: skip
