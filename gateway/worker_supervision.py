"""Tokenizer worker processes this gateway spawns: their links, their deaths and their replacements.

Each local worker is a ``tokenmill.tokenizer_workers.worker`` process on one end of a Unix socket pair (a
PipeLink). A worker that dies (crash, kill -9, OOM, or killed for overrunning the conversion
deadline) is replaced at once, after a short back-off when it keeps dying right after starting.
``Worker`` is the pool's record of one worker, local or remote (remote_workers.py fills it in).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq

from tokenmill.gateway.pool_settings import PoolSettings
from tokenmill.process.procutil import ONE_BLAS_THREAD, child_env
from tokenmill.tokenizer_workers.images import shared_memory
from tokenmill.tokenizer_workers.settings import SETTINGS_ENV, ConverterSettings
from tokenmill.transport.loop_socket import LoopSocket
from tokenmill.transport.pipe_link import LinkDown, PipeLink

log = logging.getLogger("tokenmill.pool")


@dataclass(eq=False)
class Worker:
    """One place in the pool: its link and process (local) or host and session (remote). What it
    converts is the dispatch policy's (dispatch.WorkerState, same index)."""

    index: int
    identity: bytes
    link: PipeLink | LoopSocket | None = None  # a spawned worker's socket pair, or the remote workers' socket
    host: str = ""  # a remote worker's host ("" for the gateway's own)
    pid: int = 0
    last_seen: float = 0.0
    retired: bool = False  # a lost remote worker's slot, free for the next one to join
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    quick_deaths: int = 0  # deaths in a row right after starting (the restart back-off grows with them)
    owned: set = field(default_factory=set)  # scheduler request ids whose detok state it holds

    def send(self, frames: list) -> None:
        """One message to this worker; raises zmq.ZMQError or LinkDown when it cannot take it."""
        if isinstance(self.link, LoopSocket):  # a joined worker, on the shared ROUTER socket: whole frames
            self.link.send([self.identity, *(b"".join(f) if type(f) is list else f for f in frames)])
        else:
            self.link.send(frames)

    def try_send(self, frames: list) -> bool:
        """send(), False instead of an error (a dead worker's messages are settled by its death)."""
        try:
            self.send(frames)
            return True
        except (zmq.ZMQError, LinkDown):
            return False


class LocalWorkers:
    """Spawns the gateway's own workers, watches them and replaces those that die.

    ``on_message(link, identity, frames)`` gets what a worker sends, ``on_spawn(worker)`` is called
    as each process (re)starts (it converts nothing until it says WorkerReady), ``on_exit(worker)``
    when one has died, before its replacement starts.
    """

    def __init__(
        self,
        settings: ConverterSettings,
        on_message: Callable[[PipeLink, bytes, list], None],
        on_spawn: Callable[[Worker], None],
        on_exit: Callable[[Worker], None],
        pool: PoolSettings,
        *,
        metrics=None,
    ):
        self.settings = settings
        self.on_message = on_message
        self.on_spawn = on_spawn
        self.on_exit = on_exit
        self.pool = pool  # each spawned worker's limits, threads, niceness and the gateways it joins
        self.metrics = metrics
        self.workers: list[Worker] = []  # those spawned here
        self.closing = False
        self._tasks: set[asyncio.Task] = set()

    async def start(self, worker: Worker) -> None:
        """Start (or restart) this worker's process on a new socket pair."""
        if worker not in self.workers:
            self.workers.append(worker)
        env = child_env() | ONE_BLAS_THREAD
        if self.pool.tokenizer_threads:  # read once, when the worker's first encode starts the pool
            env["RAYON_NUM_THREADS"] = str(self.pool.tokenizer_threads)
        env[SETTINGS_ENV] = msgspec.json.encode(self.settings).decode()
        self.on_spawn(worker)
        worker.started = time.monotonic()
        if isinstance(worker.link, PipeLink):
            worker.link.close()  # its last process's link: what is still in it is for a process that is gone
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # room for a few of PipeLink's 256 KiB slices of a long body before the loop waits for the worker
        # (a send buffer does not bound one write: the kernel copies on while the worker reads)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        with theirs:
            worker.link = await PipeLink.open(ours, lambda link, frames: self.on_message(link, worker.identity, frames))
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tokenmill.tokenizer_workers.worker",
                f"--title=tokenizer worker {worker.index}",
                "--link-fd",
                str(theirs.fileno()),
                "--index",
                str(worker.index),
                "--memory-limit-mb",
                str(self.pool.memory_limit_mb),
                "--conversion-threads",
                str(self.pool.conversion_threads),
                "--conversion-nice",
                str(self.pool.conversion_nice),
                "--group-nice",
                str(self.pool.group_nice),
                "--io-rt-priority",
                str(self.pool.io_rt_priority),
                *(arg for endpoint in self.pool.attach for arg in ("--attach", endpoint)),
                env=env,
                pass_fds=(theirs.fileno(),),
                # a session of its own, so a scheduling group of its own (Linux autogroups): the CPU it
                # spends converting is not charged to the gateway's group, whose loop then gets a core
                # the moment a request arrives (it dies with the gateway all the same: die_with_supervisor)
                start_new_session=True,
            )
        task = asyncio.create_task(self._watch(worker, worker.process))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, worker: Worker, process) -> None:
        code = await process.wait()
        shared_memory.remove_stale_files()  # its images in /dev/shm, if it could not remove them
        if self.closing or worker.process is not process:
            return
        log.warning(
            "tokenizer worker %d (pid %d) exited with %s; starting a replacement", worker.index, process.pid, code
        )
        # nothing more of what the dead process wrote is read: what it sent after the last message read
        # now (a WorkerReady, a conversion, text) would arrive after its death was handled, as if from a
        # live worker (the conversion goes again, its text comes from the worker its streams move to)
        if isinstance(worker.link, PipeLink):
            worker.link.close()
        self.on_exit(worker)
        if self.metrics:
            self.metrics.worker_restarts.inc()
        # a worker that dies right after starting is crash-looping: back off a little, longer with each such
        # death in a row (one that lived a while starts the count again: its replacement starts at once)
        if time.monotonic() - worker.started < 2.0:
            worker.quick_deaths += 1
            await asyncio.sleep(min(5.0, 0.5 * worker.quick_deaths))
        else:
            worker.quick_deaths = 0
        if not self.closing:
            await self.start(worker)

    async def stop(self) -> None:
        """No more replacements; terminate the workers and wait for them (5 s, then kill)."""
        self.closing = True
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
        shared_memory.remove_stale_files()  # the images of any that could not remove their own

    async def close(self) -> None:
        """After stop(): end the watchers and close the links."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers:
            if isinstance(worker.link, PipeLink):
                worker.link.close()
