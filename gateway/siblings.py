"""Several gateway processes on one port (``--gateways N``): how they start and find each other.

The process ``tokenmill serve`` starts (the one systemd watches) is gateway 0. It starts the
simulated scheduler if there is one, the tokenizer workers, and gateways 1..N-1, restarting
any that dies; they die with it. Every gateway listens on the same host and port with
SO_REUSEPORT, so the kernel spreads new connections over them, runs its own uvloop, and has
its own session with every scheduler rank. They share one worker pool: each worker is a local
worker of gateway 0 and joins every other gateway (``--attach``) at the same index, so a
conversation hashes to the same worker whichever gateway takes its connection.

Each gateway answers /health and /ready for itself. /metrics on any of them shows the node's
totals: it asks the others for their own exposition over ipc:// and merges them
(gateway/metrics_merge.py), so nothing is counted twice.

systemd's watchdog hears gateway 0 only, so gateway 0 watches the others the same way: it pings
each over the same ipc:// link every second, and one whose loop has not answered for
``--gateway-stall-timeout`` seconds is killed and replaced (its connections drop; the kernel
sends new ones to the gateways still listening).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from dataclasses import asdict
from typing import Callable

import zmq

from tokenmill.process.procutil import child_env
from tokenmill.transport.loop_socket import LoopSocket

log = logging.getLogger("tokenmill.gateway")
SIBLING_ENV = "TOKENMILL_GATEWAY_SIBLING"


def worker_endpoint(runtime_dir: str, index: int) -> str:
    """Where gateway ``index`` (1..N-1) lets the node's workers join it."""
    return f"ipc://{runtime_dir}/gateway-{index}-workers.sock"


def metrics_endpoint(runtime_dir: str, index: int) -> str:
    return f"ipc://{runtime_dir}/gateway-{index}-metrics.sock"


class SiblingGateways:
    """In gateway 0: starts gateways 1..N-1 and restarts one that exits."""

    def __init__(self, settings, runtime_dir: str, schedulers: list[str], metrics):
        self.settings = settings
        self.metrics = metrics
        self.runtime_dir = runtime_dir
        self.schedulers = schedulers
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.heard: dict[int, float] = {}  # index -> when its loop last answered a ping (or it started)
        self._killed: set[int] = set()  # killed by the stall watch: their exit is not a crash
        self._closing = False
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for index in range(1, self.settings.gateways):
            await self._spawn(index)

    async def _spawn(self, index: int) -> None:
        env = child_env()
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):  # systemd hears gateway 0 only
            env.pop(name, None)
        env[SIBLING_ENV] = json.dumps(
            {
                "index": index,
                "runtime_dir": self.runtime_dir,
                "schedulers": self.schedulers,
                "settings": asdict(self.settings),
            }
        )
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", "tokenmill.gateway.server", env=env)
        self.processes[index] = process
        self.heard[index] = time.monotonic() + 30.0  # until it first answers: start-up is not a stall
        self._tasks.append(asyncio.create_task(self._watch(index, process, time.monotonic())))

    async def _watch(self, index: int, process, started: float) -> None:
        code = await process.wait()
        if self._closing:
            return
        log.warning("gateway %d (pid %d) exited with %s; starting a replacement", index, process.pid, code)
        stalled = index in self._killed
        self._killed.discard(index)
        self.metrics.gateway_restarts.labels(reason="stalled" if stalled else "exited").inc()
        if time.monotonic() - started < 2.0:  # crash-looping: back off a little
            await asyncio.sleep(2.0)
        if not self._closing:
            await self._spawn(index)

    def watch_stalls(self, exchange: "MetricsExchange", timeout: float) -> None:
        """Kill (and so replace) a gateway whose event loop stops answering pings for ``timeout`` seconds."""
        if timeout > 0:
            self._tasks.append(asyncio.create_task(self._watch_stalls(exchange, timeout)))

    async def _watch_stalls(self, exchange: "MetricsExchange", timeout: float) -> None:
        interval = min(1.0, timeout / 4)
        while not self._closing:
            await asyncio.sleep(interval)
            answered = await exchange.ping(list(self.processes), interval)
            now = time.monotonic()
            for index, process in list(self.processes.items()):
                if index in answered:
                    self.heard[index] = now
                elif now - self.heard[index] > timeout and process.returncode is None and not self._closing:
                    log.error(
                        "gateway %d (pid %d) has not answered for %.0f s: its event loop is stalled; killing it",
                        index,
                        process.pid,
                        now - self.heard[index],
                    )
                    self._killed.add(index)
                    self.heard[index] = now + 30.0
                    process.kill()  # _watch starts the replacement

    def terminate(self) -> None:
        """SIGTERM: each gateway drains its own requests, as this one does."""
        self._closing = True
        for process in self.processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float) -> None:
        self._closing = True
        for process in self.processes.values():
            try:
                await asyncio.wait_for(process.wait(), timeout)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
        for task in self._tasks:
            task.cancel()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.returncode is None]


class MetricsExchange:
    """Each gateway answers the others' requests for its own exposition, and gathers theirs."""

    def __init__(self, runtime_dir: str, index: int, count: int, render: Callable[[], bytes], timeout: float = 1.0):
        self.runtime_dir, self.index, self.count = runtime_dir, index, count
        self.render = render
        self.timeout = timeout
        self.server: LoopSocket | None = None
        self.peers: dict[int, LoopSocket] = {}
        self.waiting: dict[bytes, asyncio.Future] = {}
        self._nonce = 0

    def start(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(metrics_endpoint(self.runtime_dir, self.index))
        self.server = LoopSocket(sock, self._answer)
        self.server.start()
        for other in range(self.count):
            if other == self.index:
                continue
            peer = ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.setsockopt(zmq.SNDHWM, 16)
            peer.connect(metrics_endpoint(self.runtime_dir, other))
            self.peers[other] = LoopSocket(peer, self._reply)
            self.peers[other].start()

    def _answer(self, frames) -> None:
        """[nonce] asks for this gateway's exposition; [nonce, b"ping"] only whether its loop runs."""
        try:
            body = b"" if len(frames) > 2 else self.render()
            self.server.send([frames[0].bytes, frames[1].bytes, body])
        except zmq.ZMQError:
            pass  # the asker is gone

    def _reply(self, frames) -> None:
        future = self.waiting.pop(frames[0].bytes, None)
        if future is not None and not future.done():
            future.set_result(frames[1].bytes)

    async def gather(self) -> list[bytes]:
        """The other gateways' expositions; one that does not answer within the timeout is left out
        (tokenmill_gateway_processes then shows fewer than --gateways)."""
        answers = await self._ask(list(self.peers), [], self.timeout)
        return list(answers.values())

    async def ping(self, indices: list[int], timeout: float) -> set[int]:
        """Which of these gateways' loops answered within the timeout."""
        return set(await self._ask(indices, [b"ping"], timeout))

    async def _ask(self, indices: list[int], request: list[bytes], timeout: float) -> dict[int, bytes]:
        loop = asyncio.get_running_loop()
        asked = []
        for index in indices:
            peer = self.peers.get(index)
            if peer is None:
                continue
            self._nonce += 1
            nonce = self._nonce.to_bytes(8, "little")
            future = loop.create_future()
            self.waiting[nonce] = future
            try:
                peer.send([nonce, *request])
                asked.append((index, nonce, future))
            except zmq.ZMQError:  # its queue is full: it has not been reading
                self.waiting.pop(nonce, None)
        if not asked:
            return {}
        await asyncio.wait([f for _, _, f in asked], timeout=timeout)
        for _, nonce, _ in asked:
            self.waiting.pop(nonce, None)
        return {index: f.result() for index, _, f in asked if f.done() and not f.cancelled()}

    def close(self) -> None:
        for sock in (self.server, *self.peers.values()):
            if sock is not None:
                sock.close()
