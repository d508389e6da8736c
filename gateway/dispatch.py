"""The tokenizer workers' dispatch policy: which worker converts which request, and when.

No sockets, processes or event loop here: the pool (worker_pool.py) tells a Dispatcher what
happens (a job submitted, a worker ready, a conversion finished, a worker lost) and the
Dispatcher hands jobs out through the ``deliver`` function it was given, and asks through ``wake``
to be run again later. The same calls drive it in tests (tests/unit/test_dispatch_policy.py).

Dispatch is pull-based: each worker converts as many requests at once as it has conversion
threads (two by default; WorkerReady says how many) and the next queued request goes to whichever
worker has a thread free, so a 250k-token conversion never holds up short requests while another
thread is idle. Every idle worker gets a job before any worker gets a second one: two conversions
in one process share its GIL, in two processes nothing.

Cheap conversions (quick jobs) skip the queue: small bodies go at once to their conversation's
worker, or the least busy when that one has more in flight, and a next turn that adds little to a
conversation goes to the worker that converted the last one (its cache holds the rest); the
worker's IO thread converts them beside whatever its conversion threads are doing (a hand-off
would cost more than they do).

A turn of a conversation whose cache a worker holds waits for that worker at most as long as
converting it afresh would take (rent or buy; a short request: no time at all). A conversation no
worker holds goes to the worker the consistent-hash ring gives it, unless that worker already has
more than 1.25 times its share of the load. docs/design/components.md has the measurements.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
import zlib
from collections import deque
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("tokenmill.pool")


@dataclass(eq=False)
class Job:
    """One conversion: what the caller submits, and where the policy keeps it."""

    job_id: int
    kind: str
    request_id: str
    body: Sized  # the request's body (a RequestBody); the policy reads only its length
    enqueued: float  # when it was submitted, on the Dispatcher's clock
    affinity: int | None = None  # hash of the conversation's beginning
    future: Any = None  # the caller's answer (anything with done()): a waiting job whose future is done is dropped
    timed_out: bool = False  # it overran the conversion deadline: never dispatched again
    # set by the policy
    attempts: int = 0  # times delivered to a worker
    worker: int | None = None  # the worker converting it
    lane: deque | None = None  # the queue it waits in
    quick: bool = False  # cheap enough for the worker's IO thread: sent without waiting for a free worker
    home: int | None = None  # the worker for a quick job: its conversation's (a quick turn: that one or none)


@dataclass(eq=False)
class WorkerState:
    """What the policy knows of one worker. Read it; change it only through the Dispatcher's methods."""

    index: int
    remote: bool = False  # joined from elsewhere: on the hash ring only while ready
    ready: bool = False
    elsewhere: bool = False  # converting a job of another gateway of the node (--gateways N)
    slots: int = 1  # conversion threads (WorkerReady): non-quick jobs it takes at once
    running: dict = field(default_factory=dict)  # job id -> non-quick job its conversion threads hold
    quick: dict = field(default_factory=dict)  # job id -> quick job sent to it and not answered yet
    lane: deque = field(default_factory=deque)  # jobs waiting for this worker's segment cache


class Dispatcher:
    """The dispatch policy of a pool of ``size`` local workers (remote ones are added as they join).

    ``deliver(worker_index, job) -> bool`` sends a job to a worker (False: its link refused it; the
    worker is then taken for not ready until it says so again, and the job goes to another).
    ``wake(delay)`` asks for dispatch() to be called again in ``delay`` seconds (a job waiting for a
    busy worker's cache may then go elsewhere). ``clock`` is the clock of ``Job.enqueued``.
    """

    def __init__(
        self,
        size: int,
        deliver: Callable[[int, Job], bool],
        wake: Callable[[float], None] = lambda delay: None,
        *,
        affinity: bool = True,
        quick_bytes: int = 8192,
        quick_depth: int = 16,
        quick_turn_bytes: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.deliver = deliver
        self.wake = wake
        self.clock = clock
        self.affinity = affinity
        self.quick_bytes = quick_bytes  # bodies up to this size convert on a worker's IO thread (0: never)
        self.quick_depth = quick_depth  # quick jobs in flight per worker, at most
        self.quick_turn_bytes = quick_turn_bytes  # a conversation's turn at home up to this size is quick too
        self.workers = [WorkerState(i) for i in range(size)]
        self.jobs: dict[int, Job] = {}  # submitted and not answered
        self.queue: deque[Job] = deque()  # jobs any worker may take
        self.quick_queue: deque[Job] = deque()  # quick jobs waiting for a worker with room
        self.queued_bytes = 0
        # conversation key -> (worker that converted it last, that body's size); insertion-ordered, bounded
        self.homes: dict[int, tuple[int, int]] = {}
        self.cold_s_per_byte = 1e-6  # conversion time per body byte with nothing cached (running average)
        self._ring()

    # ---- what the pool tells it ---------------------------------------------------------

    def add_worker(self) -> int:
        """A place for a worker joining from elsewhere (not ready, off the ring until it is)."""
        self.workers.append(WorkerState(len(self.workers), remote=True))
        return len(self.workers) - 1

    def submit(self, job: Job, quick_ok: bool = True) -> None:
        """A new conversion; ``quick_ok=False`` keeps it off the workers' IO threads whatever its size."""
        if quick_ok:
            body = job.body
            job.quick = 0 < len(body) <= self.quick_bytes
            keyed = self.affinity and job.affinity is not None
            home = self.homes.get(job.affinity) if keyed else None
            if job.quick and keyed:
                # its earlier turns' worker, or the hash ring's choice for a new conversation
                job.home = home[0] if home is not None else self.ring_worker(job.affinity)
            elif (
                home is not None and len(body) <= self.quick_turn_bytes and 0 <= len(body) - home[1] <= self.quick_bytes
            ):
                # the next turn of a conversation its worker holds: little new text to encode, so
                # cheaper than the hand-offs to a conversion thread and back
                job.quick, job.home = True, home[0]
        self.jobs[job.job_id] = job
        self._enqueue(job)
        self.dispatch()

    def withdraw(self, job: Job) -> None:
        """The caller went away: drop a job still waiting (one being converted is answered, then released)."""
        if job.worker is None and job.lane is not None and job in job.lane:
            job.lane.remove(job)
            self.queued_bytes -= len(job.body)
            self.jobs.pop(job.job_id, None)

    def drop(self, job: Job) -> None:
        """The caller was answered otherwise (an error): forget the job; if it still waits, it is skipped."""
        self.jobs.pop(job.job_id, None)

    def worker_ready(self, index: int, slots: int) -> None:
        """A worker takes jobs, ``slots`` at once on its conversion threads."""
        worker = self.workers[index]
        worker.slots = max(1, slots)
        worker.ready = True
        if worker.remote:
            self._ring()
        self.dispatch()

    def worker_starting(self, index: int) -> None:
        """A worker's process is (re)starting: no jobs until it is ready."""
        self.workers[index].ready = False

    def worker_busy_elsewhere(self, index: int, busy: bool) -> None:
        """A worker shared by the node's gateways converts (or stopped converting) another gateway's job."""
        self.workers[index].elsewhere = busy
        if not busy:
            self.dispatch()

    def finished(self, index: int, done) -> Job | None:
        """A worker answered a job (a ConvertDone): the job whose caller waits for this answer, or None
        when there is none (a remote worker's answer to a job that has moved on since)."""
        job = self.jobs.get(done.job_id)
        if job is not None and job.worker not in (None, index):
            job = None  # a remote worker's answer to a job that has moved on to another worker since
        else:
            self.jobs.pop(done.job_id, None)
        timing = done.timing
        cache = timing.cache if timing is not None else None
        if job is not None and cache is not None and cache.cached_tokens == 0 and len(job.body) >= 16384:
            rate = (timing.render_s + timing.tokenize_s) / len(job.body)  # a cold conversion: what a move costs
            self.cold_s_per_byte += 0.2 * (rate - self.cold_s_per_byte)
        worker = self.workers[index]
        if worker.running.pop(done.job_id, None) is None:
            worker.quick.pop(done.job_id, None)
        self.dispatch()
        return job

    def rehome(self, key: int, index: int) -> None:
        """A conversation's stream moved to this worker (its own died): its next turn goes here. The
        worker has none of its segments cached yet (size 0): a long next turn is not a quick one."""
        if self.affinity:
            self._set_home(key, index, 0)

    def worker_lost(self, index: int) -> list[Job]:
        """A worker died or left: what it was converting is dispatched once more, what waited for it
        goes to whoever is free, and its conversations lose their home (its cache is gone). Returns the
        jobs it was converting that are not dispatched again (timed out, tried twice, or abandoned)."""
        worker = self.workers[index]
        worker.ready = worker.elsewhere = False
        lost = [*worker.quick.values(), *worker.running.values()]
        worker.running, worker.quick = {}, {}
        failed = []
        for job in lost:
            if not job.timed_out and job.attempts < 2 and not _abandoned(job):
                log.warning("re-dispatching request %s after its worker died", job.request_id)
                job.worker = None
                self._enqueue(job, front=True)
            else:
                failed.append(job)
        self.homes = {key: home for key, home in self.homes.items() if home[0] != index}  # its cache is gone
        if worker.remote:
            self._ring()
        while worker.lane:  # whoever is free takes what waited for this worker
            job = worker.lane.popleft()
            job.lane = self.queue
            self.queue.append(job)
        self.dispatch()
        return failed

    # ---- what it says -------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self.queue) + len(self.quick_queue) + sum(len(w.lane) for w in self.workers)

    @property
    def busy(self) -> int:
        """Workers converting at least one job."""
        return sum(bool(w.running) or bool(w.quick) for w in self.workers)

    @property
    def alive(self) -> int:
        """Workers taking jobs."""
        return sum(w.ready for w in self.workers)

    def converting(self, index: int, job: Job) -> bool:
        """Whether this worker converts this job now."""
        worker = self.workers[index]
        return worker.running.get(job.job_id) is job or worker.quick.get(job.job_id) is job

    def ring_worker(self, key: int) -> int | None:
        """The worker the consistent-hash ring gives a conversation no worker holds yet."""
        return self.ring[bisect.bisect(self.ring, (key,)) % len(self.ring)][1] if self.ring else None

    # ---- dispatch: affinity (new conversations within a load bound), rent or buy, no idle worker ----

    def _ring(self) -> None:
        """The consistent-hash ring: 64 points per worker, so a worker's share moves little when the
        pool changes. Local workers stay on it while restarting; remote ones while they are joined."""
        members = [w.index for w in self.workers if not w.remote or w.ready]
        self.ring = sorted((zlib.crc32(f"{i}:{v}".encode()), i) for i in members for v in range(64))

    def _enqueue(self, job: Job, front: bool = False) -> None:
        self.queued_bytes += len(job.body)
        owner = None if front or job.quick else self._owner(job)
        job.lane = self.quick_queue if job.quick else owner.lane if owner is not None else self.queue
        if front:
            job.lane.appendleft(job)
        else:
            job.lane.append(job)

    def _owner(self, job: Job) -> WorkerState | None:
        """The worker holding this conversation's segments (others take the job from its lane only
        once waiting has cost as much as converting afresh: _ripe); for a conversation no worker
        holds, the hash ring's worker unless it already has more than its share."""
        if not self.affinity or job.affinity is None:
            return None
        home = self.homes.get(job.affinity)
        index = home[0] if home is not None else self.ring_worker(job.affinity)
        if index is None or not self.workers[index].ready:
            return None
        worker = self.workers[index]
        if home is not None:
            return worker
        alive = [w for w in self.workers if w.ready]
        total = sum(self._load(w) for w in alive) + len(self.queue) + 1
        bound = max(1, math.ceil(1.25 * total / len(alive)))
        return worker if self._load(worker) < bound else None

    @staticmethod
    def _load(worker: WorkerState) -> int:
        """Non-quick jobs a worker holds or has waiting for it (a shared worker busy elsewhere counts one)."""
        return max(len(worker.running), worker.elsewhere) + len(worker.lane)

    def _set_home(self, key: int, index: int, nbytes: int) -> None:
        """A conversation converted by a worker stays with it: that worker now holds its segments,
        so load moves once instead of missing the cache on every turn."""
        self.homes.pop(key, None)
        self.homes[key] = (index, nbytes)
        if len(self.homes) > 65536:
            del self.homes[next(iter(self.homes))]

    def _ripe(self, job: Job) -> float:
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

    def _take(self, worker: WorkerState, steal: bool = True) -> Job | None:
        """Its own lane first, then the shared queue, then (when steal) the ripe jobs of other lanes,
        longest lane first."""
        for lane in (worker.lane, self.queue):
            while lane:
                job = lane.popleft()
                self.queued_bytes -= len(job.body)
                if not _abandoned(job):
                    job.lane = None
                    return job
                self.jobs.pop(job.job_id, None)
        if not steal:
            return None
        now, wake = self.clock(), None
        for lane in sorted((w.lane for w in self.workers if w is not worker and w.lane), key=len, reverse=True):
            for job in list(lane):
                if _abandoned(job):
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
            self.wake(wake - now)
        return None

    def dispatch(self) -> None:
        """Hand out whatever the workers can take now."""
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
                            self._send(worker, job)

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
            if (
                home is not None
                and home.ready
                and len(home.quick) < self.quick_depth
                and (len(job.body) > self.quick_bytes or len(home.quick) <= len(least.quick))
            ):
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
            if _abandoned(job):
                self.jobs.pop(job.job_id, None)
                continue
            job.lane = None
            self._send(worker, job)
            ready = [w for w in ready if w.ready]

    def _send(self, worker: WorkerState, job: Job) -> None:
        if not self.deliver(worker.index, job):
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


def _abandoned(job: Job) -> bool:
    return job.future is not None and job.future.done()
