"""Engines reached over HTTP (``--engine-url``): one ``tokenmill engine --backend http`` process per URL.

Each engine server (an unmodified ``vllm serve --enable-scale-out``, or SGLang's server) gets a
bridge process of its own on this host that speaks the scheduler protocol on an ipc:// socket in the
runtime directory and the engine's token-in/token-out HTTP API on the other side. The gateway sees
each one as a data-parallel rank, so the ranks' conversation affinity, load counts and lost-rank
handling serve the replicas as they serve ranks. The bridges, not the gateway, build and parse the
engines' JSON: a long prompt's IDs are written into a request body off the event loop that serves
clients.

A bridge exits when its engine stops answering (its requests end with an error first) and is
started again here, with a growing pause; a new one waits for its engine and says welcome when the
engine serves again. A bridge that exits with status 2 refused its engine (another model, a
different tokenization, no token-in API): its message is in the log, and it is retried only every
``REFUSED_RETRY_S``, so that a replica fixed by its operator comes back without a restart here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from tokenmill.process.procutil import child_env

log = logging.getLogger("tokenmill.engine_bridges")

RESTART_PAUSES_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # after the 1st, 2nd, ... exit in a row
REFUSED_RETRY_S = 30.0
STABLE_S = 30.0  # a bridge that ran this long starts its next pause series from the beginning


class EngineBridges:
    """Starts, restarts and stops the bridge processes of ``urls``; ``endpoints`` are their sockets."""

    def __init__(self, urls: list[str], runtime_dir: str, args: list[str]) -> None:
        self.urls = urls
        self.endpoints = [f"ipc://{runtime_dir}/engine-{i}.sock" for i in range(len(urls))]
        self.args = args  # for every bridge: the model, its flavour, timeouts
        self.processes: list[asyncio.subprocess.Process | None] = [None] * len(urls)
        self.exits: list[tuple[int, str]] = []  # (replica, how) of every exit, for state and tests
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._supervise(i), name=f"engine-bridge-{i}") for i in range(len(self.urls))
        ]

    def command(self, index: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "tokenmill.engines.bridge",
            "--backend",
            "http",
            "--engine-url",
            self.urls[index],
            "--bind",
            self.endpoints[index],
            *self.args,
        ]

    async def _supervise(self, index: int) -> None:
        failures = 0
        loop = asyncio.get_running_loop()
        while not self._closing:
            started = loop.time()
            # a session of its own, so a scheduling group of its own (Linux autogroups), niced as the workers'
            # (--group-nice): in the gateway's group, beside workers converting long prompts at a heavier
            # weight, it was starved for seconds, its streams stalled and its link's heartbeats timed out
            proc = await asyncio.create_subprocess_exec(*self.command(index), env=child_env(), start_new_session=True)
            self.processes[index] = proc
            status = await proc.wait()
            if self._closing:
                return
            ran = loop.time() - started
            failures = 1 if ran >= STABLE_S else failures + 1
            how = f"exit status {status}" if status >= 0 else f"signal {-status}"
            self.exits.append((index, how))
            if status == 2:
                pause = REFUSED_RETRY_S
                log.error(
                    "the bridge to %s refused its engine (%s); trying again in %.0f s", self.urls[index], how, pause
                )
            else:
                pause = RESTART_PAUSES_S[min(failures, len(RESTART_PAUSES_S)) - 1]
                log.warning("the bridge to %s ended (%s); starting it again in %.1f s", self.urls[index], how, pause)
            await asyncio.sleep(pause)

    def state(self) -> list[dict]:
        """Each bridge's URL, process (None while it waits to start again) and past exits (GET /debug/state)."""
        return [
            {
                "url": url,
                "pid": p.pid if p is not None and p.returncode is None else None,
                "exits": [how for i, how in self.exits if i == index],
            }
            for index, (url, p) in enumerate(zip(self.urls, self.processes, strict=True))
        ]

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        live = [p for p in self.processes if p is not None and p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in live:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
