"""Admission of tokenizer workers that join over ZeroMQ: the ROUTER socket, CURVE, join, heartbeat, loss.

Workers on other hosts (``tokenmill worker --connect``, on the --remote-workers socket), and the
node's shared workers joining a sibling gateway (--gateways N, on an ipc:// socket), join and leave
at any time. The pool cannot watch their processes, so a remote worker that falls silent for
``timeout`` seconds (on this host: whose process is gone) is counted lost exactly as a local one
that died: its conversion is dispatched again, and its streams end with an error. A worker whose
tokenizer, templates or context length differ from the pool's first worker (the fingerprint in
WorkerReady) is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from tokenmill.gateway.worker_supervision import Worker
from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.settings import ConverterSettings
from tokenmill.transport.loop_socket import LoopSocket

log = logging.getLogger("tokenmill.pool")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class RemoteWorkers:
    """Lets workers join the pool's list of workers at ``endpoint`` (None: nowhere), and counts them lost.

    It shares the pool's ``workers`` list and ``by_identity`` map; ``add_place()`` appends a new, retired
    place to the pool (and its policy) and returns it; ``is_ready(index)`` says whether a worker takes
    jobs; ``on_message(link, identity, frames)`` gets what arrives on the socket; ``on_lost(worker)``
    settles a lost worker's work as a dead local worker's.
    """

    def __init__(
        self,
        endpoint: str | None,
        settings: ConverterSettings,
        workers: list[Worker],
        by_identity: dict[bytes, Worker],
        add_place: Callable[[], Worker],
        is_ready: Callable[[int], bool],
        on_message: Callable[[LoopSocket, bytes, list], None],
        on_lost: Callable[[Worker], None],
        *,
        size: int = 0,
        security=None,
        timeout: float = 5.0,
        ctx: zmq.asyncio.Context | None = None,
        metrics=None,
    ):
        self.endpoint = endpoint  # where workers on other hosts join (None: nowhere)
        self.settings = settings
        self.workers = workers
        self.by_identity = by_identity
        self.add_place = add_place
        self.is_ready = is_ready
        self.on_message = on_message
        self.on_lost = on_lost
        self.size = size  # the pool's own workers: places below this are never a joining worker's
        self.security = security  # transport_security.RemoteWorkerSecurity
        self.timeout = timeout
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.metrics = metrics
        self.fingerprint = ""  # the first worker's: every remote worker must convert the same way
        self.sock: LoopSocket | None = None
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        if not self.endpoint:
            return
        # remote workers outlive a gateway restart: they join the next one
        remote = zmq.Socket(self.ctx, zmq.ROUTER)
        remote.setsockopt(zmq.LINGER, 0)
        remote.setsockopt(zmq.ROUTER_MANDATORY, 1)
        remote.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker reconnecting after a network blip
        remote.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # drop TCP paths that died without a FIN
        remote.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if self.security:
            self.security.secure_server(remote)
        remote.bind(self.endpoint)
        self.sock = LoopSocket(
            remote, lambda frames: self.on_message(self.sock, frames[0].bytes, [frame.buffer for frame in frames[1:]])
        )
        self.sock.start()
        self._reaper = asyncio.create_task(self._reap_silent())
        log.info("remote tokenizer workers may join at %s", self.endpoint)

    def stop(self) -> None:
        """Stop counting silent workers lost (the pool is closing)."""
        if self._reaper is not None:
            self._reaper.cancel()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.security:
            self.security.stop()

    @property
    def _kind(self) -> str:
        return "tokenizer worker" if self.endpoint.startswith("ipc://") else "remote tokenizer worker"

    def on_stranger(self, identity: bytes, msg) -> None:
        """A message on the remote socket from a worker not in the pool: a hello joins it; anything
        else comes from a session this gateway does not know (it restarted, or counted the worker
        lost), so the worker is told to join again."""
        if not isinstance(msg, m.WorkerHello):
            try:
                self.sock.send([identity, m.encoder.encode(m.Rejoin())])
            except zmq.ZMQError:
                pass
            return
        worker = self._free_place(msg.index)
        self.by_identity.pop(worker.identity, None)
        worker.identity, worker.link, worker.host, worker.pid = identity, self.sock, msg.host, msg.pid
        worker.retired, worker.last_seen = False, time.monotonic()
        worker.owned = set()  # (its place in the policy is empty: a lost worker's jobs went elsewhere)
        self.by_identity[identity] = worker
        log.info("%s on %s (pid %d) joins as worker %d", self._kind, msg.host, msg.pid, worker.index)
        self._send_settings(worker)

    def heard(self, worker: Worker, msg) -> bool:
        """A message from a joined worker: it is alive. True when this settled the message (a
        heartbeat, or a hello: repeated, or from a worker that restarted under the same identity)."""
        worker.last_seen = time.monotonic()
        if isinstance(msg, m.Heartbeat):
            return True
        if isinstance(msg, m.WorkerHello):
            if (
                not self.is_ready(worker.index) and worker.pid == msg.pid
            ):  # a hello repeated before our answer reached it
                self._send_settings(worker)
                return True
            self.lose(worker, "it said hello again")  # it restarted under the same identity: a new session
            self.on_stranger(worker.identity, msg)
            return True
        return False

    def _send_settings(self, worker: Worker) -> None:
        worker.try_send([m.encoder.encode(m.WorkerSettings(worker.index, msgspec.json.encode(self.settings)))])

    def _free_place(self, wanted: int) -> Worker:
        """A place in the pool for a joining worker: the index it asks for when that is free (a worker of
        this node has the same index in every gateway, so the hash ring sends a conversation to the same
        worker whichever gateway takes it), else a lost worker's place, else a new one."""
        while wanted >= len(self.workers):
            self.add_place()
        if wanted >= 0 and self.workers[wanted].retired and not self.workers[wanted].owned:
            return self.workers[wanted]
        free = next((w for w in self.workers if w.retired and not w.owned and w.index >= self.size), None)
        if free is None:
            free = self.add_place()
        return free

    def admit_ready(self, worker: Worker, msg: m.WorkerReady) -> bool:
        """The first worker's fingerprint is the pool's; a remote worker with another is refused."""
        if not self.fingerprint or not worker.host:
            self.fingerprint = self.fingerprint or msg.fingerprint
            return True
        if msg.fingerprint == self.fingerprint:
            return True
        log.error(
            "refused remote tokenizer worker %d on %s (pid %d): its tokenizer, templates or context length "
            "differ from this gateway's (fingerprint %s, expected %s); give it the same model (--model)",
            worker.index,
            worker.host,
            msg.pid,
            msg.fingerprint,
            self.fingerprint,
        )
        if self.metrics:
            self.metrics.remote_worker_refusals.labels(reason="fingerprint").inc()
        worker.try_send(
            [
                m.encoder.encode(
                    m.Shutdown(
                        "its tokenizer, chat templates or context length differ from the gateway's; load the same model"
                    )
                )
            ]
        )
        self.lose(worker, None)
        return False

    def lose(self, worker: Worker, why: str | None) -> None:
        """A remote worker leaves the pool: its work goes as a dead local worker's does."""
        if why:
            log.warning("%s %d on %s (pid %d) is lost: %s", self._kind, worker.index, worker.host, worker.pid, why)
        worker.retired = True
        self.by_identity.pop(worker.identity, None)
        self.on_lost(worker)

    async def _reap_silent(self) -> None:
        while True:
            await asyncio.sleep(min(0.25 if self.endpoint.startswith("ipc://") else 1.0, self.timeout / 4))
            now = time.monotonic()
            same_host = self.endpoint.startswith("ipc://")
            for worker in self.workers:
                if not worker.host or worker.retired:
                    continue
                if now - worker.last_seen > self.timeout:
                    self.lose(worker, f"silent for {now - worker.last_seen:.1f} s")
                elif same_host and not _pid_alive(worker.pid):  # on this host, a death need not wait for silence
                    self.lose(worker, f"process {worker.pid} exited")
