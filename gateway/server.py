"""The gateway process: starts and supervises workers and the simulated scheduler, serves HTTP.

``tokenmill serve`` runs this in its own process on a uvloop event loop. The children
(tokenizer workers, and the simulated scheduler unless --scheduler names one) are asked
by the kernel to die with it, so even ``kill -9`` of the gateway leaves no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from array import array

import uvicorn
import zmq.asyncio

from tokenmill.gateway import siblings
from tokenmill.gateway.app import App
from tokenmill.gateway.engine_bridges import EngineBridges
from tokenmill.gateway.generations import Generations
from tokenmill.gateway.http_protocol import protocol_class
from tokenmill.gateway.listener import Acceptor, listen_sockets
from tokenmill.gateway.metrics import Metrics
from tokenmill.gateway.metrics_merge import merge_expositions
from tokenmill.gateway.pool_settings import PoolSettings
from tokenmill.gateway.scheduler_ranks import SchedulerRanks
from tokenmill.gateway.settings import ServeSettings
from tokenmill.gateway.siblings import MetricsExchange, SiblingGateways
from tokenmill.gateway.worker_pool import WorkerPool
from tokenmill.process import systemd_notify
from tokenmill.process.procutil import child_env
from tokenmill.tokenizer_workers.images import shared_memory
from tokenmill.tokenizer_workers.messages import ApiError
from tokenmill.tokenizer_workers.settings import DEFAULT_MODEL_NAME, ConverterSettings, ImageFetchSettings
from tokenmill.transport.security import RemoteWorkerSecurity, private_dir, require_secure, scheduler_client_keys

log = logging.getLogger("tokenmill.gateway")


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (the gateway drains on SIGTERM itself), taking its
    connections from the gateway's own accept loop (gateway/listener.py) instead of listening itself."""

    def __init__(self, config: uvicorn.Config, listeners: list):
        super().__init__(config)
        self.listeners = listeners
        self.acceptor: Acceptor | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=[])  # no listening of uvicorn's own
        config = self.config
        self.acceptor = Acceptor(
            self.listeners,
            lambda: config.http_protocol_class(
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            ),
        )
        self.acceptor.start()

    async def shutdown(self, sockets=None) -> None:
        if self.acceptor is not None:
            self.acceptor.close()
        await super().shutdown(sockets=sockets)


def _parser_setting(value: str, model: str | None) -> str:
    """A parser flag as the workers take it: unset means auto for the embedded model, none otherwise."""
    if not value:
        return "auto" if model is None else ""
    return "" if value == "none" else value


class Gateway:
    def __init__(self, settings: ServeSettings, sibling: dict | None = None):
        self.settings = settings
        self.sibling = sibling  # for gateways 1..N-1 of --gateways N: index, runtime_dir, schedulers
        self.index = sibling["index"] if sibling else 0
        self.siblings: SiblingGateways | None = None
        self.exchange: MetricsExchange | None = None
        self.model_name = settings.served_model_name or (
            os.path.basename(os.path.abspath(settings.model)) if settings.model else DEFAULT_MODEL_NAME
        )
        self.started_at = int(time.time())
        self.draining = False
        self.closing = False
        self.metrics = Metrics(self.model_name)
        self.runtime_dir: str | None = None
        self._own_runtime_dir = False
        self.simulator: asyncio.subprocess.Process | None = None
        self.engine_bridges: EngineBridges | None = None  # with --engine-url
        self.lag_samples = array("f")

    @property
    def max_model_len(self) -> int | None:
        return self.conversion.max_model_len

    @property
    def is_ready(self) -> bool:
        return not self.draining and self.conversion.alive > 0 and self.scheduler.connected

    def pool_settings(self) -> PoolSettings:
        """The workers' pool as the settings ask; gateways 1..N-1 of --gateways N spawn none: the node's
        workers (gateway 0's) join each of them at its own endpoint."""
        s = self.settings
        return PoolSettings(
            size=0 if self.sibling else s.workers,
            max_queued=s.max_queued_conversions,
            max_queued_bytes=s.max_queued_bytes,
            conversion_timeout=s.conversion_timeout,
            memory_limit_mb=s.worker_memory_limit_mb,
            conversion_threads=s.conversion_threads,
            tokenizer_threads=s.tokenizer_threads,
            conversion_nice=s.conversion_nice,
            group_nice=s.worker_group_nice,
            io_rt_priority=s.loop_rt_priority,
            affinity=s.affinity,
            quick_bytes=s.quick_conversion_bytes,
            quick_turn_bytes=s.quick_turn_bytes,
            remote_endpoint=siblings.worker_endpoint(self.runtime_dir, self.index)
            if self.sibling
            else s.remote_workers,
            remote_timeout=s.remote_worker_timeout,
            attach=()
            if self.sibling
            else tuple(siblings.worker_endpoint(self.runtime_dir, k) for k in range(1, s.gateways)),
        )

    def converter_settings(self) -> ConverterSettings:
        s = self.settings
        return ConverterSettings(
            model_dir=s.model,
            chat_template_file=s.chat_template,
            served_model_name=self.model_name,
            max_model_len=s.max_model_len,
            default_chat_template_kwargs=s.default_chat_template_kwargs,
            content_format=s.chat_template_content_format,
            trust_request_chat_template=s.trust_request_chat_template,
            tokenize_cache_bytes=s.tokenize_cache_bytes,
            verify_tokenize_cache=s.verify_tokenize_cache,
            image_cache_bytes=s.image_cache_bytes,
            image_max_pixels=s.image_max_pixels,
            image_shared_memory=s.image_shared_memory,
            image_fetch=ImageFetchSettings(
                enabled=s.image_fetch,
                timeout_s=s.image_fetch_timeout,
                max_bytes=s.image_fetch_max_bytes,
                max_redirects=s.image_fetch_max_redirects,
                allow_networks=[n.strip() for n in s.image_fetch_allow.split(",") if n.strip()],
            ),
            tool_call_parser=_parser_setting(s.tool_call_parser, s.model),
            reasoning_parser=_parser_setting(s.reasoning_parser, s.model),
            max_n=s.max_n,
            generation_config=s.generation_config,
            fingerprint=bool(s.remote_workers) or s.gateways > 1,
        )

    # ---- lifecycle ------------------------------------------------------------------------

    def _make_runtime_dir(self) -> str:
        if self.sibling:
            return self.sibling["runtime_dir"]  # gateway 0's
        if self.settings.runtime_dir:
            return private_dir(self.settings.runtime_dir)
        if os.environ.get("RUNTIME_DIRECTORY"):  # systemd's RuntimeDirectory=
            return private_dir(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
        self._own_runtime_dir = True
        return tempfile.mkdtemp(prefix="tokenmill-")  # mode 0700

    async def start(self) -> None:
        s = self.settings
        scheduler_keys = scheduler_client_keys(s.curve_keys_dir)
        endpoints = s.scheduler_endpoints
        for endpoint in endpoints:
            require_secure(endpoint, "The scheduler", s.insecure_tcp, scheduler_keys is not None)
        self.runtime_dir = self._make_runtime_dir()
        if not self.sibling and s.image_shared_memory:  # image files of workers killed with an earlier gateway
            removed = shared_memory.remove_stale_files()
            if removed:
                log.info("removed %d image file(s) of exited processes from /dev/shm", removed)
        if self.sibling:
            endpoints = self.sibling["schedulers"]
        elif s.engine_urls:
            self.engine_bridges = EngineBridges(s.engine_urls, self.runtime_dir, self._bridge_args())
            endpoints = self.engine_bridges.endpoints
            self.engine_bridges.start()
        elif not endpoints:
            endpoints = [f"ipc://{self.runtime_dir}/scheduler.sock"]
            await self._start_simulator(endpoints[0])
        for index, engine in enumerate(s.engine_urls or endpoints):  # which engine each rank is, on dashboards
            self.metrics.engine_info.labels(self.model_name, str(index), engine).set(1)
        self.generations = Generations(
            self.metrics,
            max_buffered=s.stream_buffer_limit,
            history_cap=s.stream_history_bytes,
            failover_wait=s.stream_failover_wait,
        )
        g = self.generations
        if self.sibling or s.conversion_mode == "pool":
            ctx = zmq.asyncio.Context.instance()
            remote_security = None
            if s.remote_workers and not self.sibling:
                require_secure(s.remote_workers, "The remote workers'", s.insecure_tcp, bool(s.curve_keys_dir))
                if s.curve_keys_dir and s.remote_workers.startswith("tcp://"):
                    remote_security = RemoteWorkerSecurity(
                        ctx,
                        s.curve_keys_dir,
                        lambda reason: self.metrics.remote_worker_refusals.labels(reason=reason).inc(),
                    )
            self.conversion = WorkerPool(
                self.pool_settings(),
                self.converter_settings(),
                g.on_detok,
                g.on_owner_lost,
                metrics=self.metrics,
                ctx=ctx,
                remote_security=remote_security,
            )
        else:  # the baselines' modes convert in this process: only they load the converter here
            from tokenmill.gateway.inprocess import InProcessConversion

            self.conversion = InProcessConversion(
                self.converter_settings(), g.on_detok, threaded=s.conversion_mode == "thread", metrics=self.metrics
            )
        self.scheduler = SchedulerRanks(
            endpoints,
            g.on_outputs,
            g.on_rank_lost,
            g.on_scheduler_error,
            lambda limits: self.conversion.limit_context(limits),
            curve=scheduler_keys,
            policy=s.dp_policy,
        )
        g.attach(self.conversion, self.scheduler)
        self.conversion.on_pixels = g.on_pixels
        self.conversion.on_worker_ready = g.on_worker_ready
        # several gateways in front of several ranks: each turn's rank goes to the conversation's worker,
        # which the other gateways also ask, so a turn finds its history whichever gateway takes it
        self.shares_placements = s.gateways > 1 and len(endpoints) > 1 and s.dp_policy == "affinity"
        await self.conversion.start()
        await self.scheduler.start()
        if s.gateways > 1:
            self.exchange = MetricsExchange(self.runtime_dir, self.index, s.gateways, self.collect_metrics)
            self.exchange.start()
            if not self.sibling:
                self.siblings = SiblingGateways(s, self.runtime_dir, endpoints, self.metrics)
                await self.siblings.start()
                self.siblings.watch_stalls(self.exchange, s.gateway_stall_timeout)
        # Everything started so far lives as long as the gateway: out of the collector's sight, a
        # full collection (a stall of the loop, every stream waits) no longer walks it.
        gc.freeze()
        self._lag_task = asyncio.create_task(self._measure_loop_lag())
        interval = systemd_notify.watchdog_interval()
        self._watchdog_task = asyncio.create_task(systemd_notify.pet_watchdog(interval)) if interval else None

    def _bridge_args(self) -> list[str]:
        """What every engine bridge needs to check its server against what this gateway serves."""
        s = self.settings
        args = [
            "--model",
            s.model or "default",
            "--group-nice",
            str(s.worker_group_nice),
            "--rt-priority",
            str(s.loop_rt_priority),
            "--engine-flavour",
            s.engine_flavour,
            "--engine-scheduling-policy",
            s.engine_scheduling_policy,
        ]
        if s.engine_kv_connector:
            args.append("--engine-kv-connector")
        if s.chat_template:
            args += ["--chat-template", s.chat_template]
        if s.default_chat_template_kwargs:
            args += ["--chat-template-kwargs", json.dumps(s.default_chat_template_kwargs)]
        return args

    async def _start_simulator(self, endpoint: str) -> None:
        s = self.settings
        self.simulator = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tokenmill.engines.simulated",
            "--title=simulated scheduler",
            "--bind",
            endpoint,
            "--prefill-tokens-per-s",
            str(s.sim_prefill_tokens_per_s),
            "--inter-token-latency-ms",
            str(s.sim_inter_token_latency_ms),
            "--max-running",
            str(s.sim_max_running),
            "--mode",
            s.sim_mode,
            "--tokens-per-step",
            str(s.sim_tokens_per_step),
            *(["--max-model-len", str(s.sim_max_model_len)] if s.sim_max_model_len else []),
            "--model",
            s.model or "default",
            *(["--replies", s.sim_replies] if s.sim_replies else []),
            *(["--busy-cores", str(s.sim_busy_cores)] if s.sim_busy_cores else []),
            env=child_env(),
        )

    async def wait_ready(self, timeout: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout
        if not await self.conversion.wait_ready(1, timeout):
            return False
        self.scheduler.check_vocabulary(self.conversion.vocab_size)
        return await self.scheduler.wait_connected(max(0.1, deadline - time.monotonic()))

    async def _measure_loop_lag(self, busy_interval: float = 0.005, idle_interval: float = 0.05) -> None:
        """Sleep a little, over and over; how late each wake-up is, is the loop's lag.

        Every 5 ms while requests are in flight, every 50 ms while none are: on a VM each
        timer wake-up of an idle process cost ~135 µs of CPU, so 5 ms ticks kept an idle
        gateway at 3-4% of a core. A stall shows only where it covers a timer's due time, as
        the part of it after that time: one longer than the interval always shows, as at least
        its length less one interval; a shorter one may be missed. So the 5 ms ticks while busy
        are what catches a few-millisecond stall; slower ticks there (measured: 50 ms would save
        the gateway ~25 ms of CPU per second of waiting on the engine) would miss them.

        Samples also go to a bounded buffer that ``tokenmill bench`` reads through
        /debug/loop-lag, since a histogram cannot tell a maximum.
        """
        observe = self.metrics.loop_lag.observe
        samples = self.lag_samples
        live = self.generations.live
        jobs = getattr(self.conversion, "jobs", {})  # the pool's conversions in flight
        clock = time.perf_counter  # finer than loop.time(), which uvloop rounds to milliseconds
        while True:
            interval = busy_interval if live or jobs else idle_interval
            before = clock()
            await asyncio.sleep(interval)
            lag = max(0.0, clock() - before - interval)
            observe(lag)
            if len(samples) >= 1_000_000:
                del samples[:500_000]
            samples.append(lag)

    def state(self) -> dict:
        """What is in flight, for operators and tests (GET /debug/state)."""
        g = self.generations
        return {
            "gateway": self.index,
            "pid": os.getpid(),
            "gateway_pids": [os.getpid(), *self.siblings.pids()] if self.siblings else None,
            "generations": len(g.live),
            "waiting_for_worker": len(g.waiting),  # requests whose worker died with none other alive
            "scheduler_requests": len(g.by_request),
            "queued_conversions": self.conversion.queued,
            "conversions_in_flight": len(getattr(self.conversion, "jobs", ())),
            "scheduler_connected": self.scheduler.connected,
            "scheduler_ranks": self.scheduler.state(),
            "engine_bridges": self.engine_bridges.state() if self.engine_bridges is not None else [],
            "draining": self.draining,
            "workers": self.conversion.state() if hasattr(self.conversion, "state") else [],
            "parsers": self.conversion.parsers,
        }

    def loop_lag_summary(self, reset: bool = False) -> dict:
        ordered = sorted(self.lag_samples)
        n = len(ordered)
        out = {
            "count": n,
            "p50_ms": 1000 * ordered[n // 2] if n else None,
            "p99_ms": 1000 * ordered[min(n - 1, int(n * 0.99))] if n else None,
            "max_ms": 1000 * ordered[-1] if n else None,
        }
        if reset:
            del self.lag_samples[:]
        return out

    async def node_metrics(self) -> bytes:
        """/metrics: this process's figures, or with --gateways N the node's, merged from all of them."""
        own = self.collect_metrics()
        if self.exchange is None:
            return own
        others = await self.exchange.gather()
        return await asyncio.to_thread(merge_expositions, [own, *others])  # ~10 ms per exposition parsed

    def collect_metrics(self) -> bytes:
        m = self.metrics
        m.gateway_processes.set(1)
        m.workers_alive.set(self.conversion.alive)
        m.workers_busy.set(self.conversion.busy)
        m.num_requests_running.set(len(self.generations))
        m.num_requests_waiting.set(self.conversion.queued)
        m.scheduler_connected.set(1 if self.scheduler.connected else 0)
        m.draining.set(1 if self.draining else 0)
        m.queued_bytes.set(getattr(self.conversion, "queued_bytes", 0))
        stats = self.scheduler.stats
        if stats is not None:
            m.scheduler_running.set(stats.num_running)
            m.scheduler_waiting.set(stats.num_waiting)
        m.observe_ranks(self.scheduler.ranks)
        return m.render()

    async def drain(self) -> None:
        """Stop taking requests, let running ones finish (up to shutdown_timeout), abort the rest."""
        self.draining = True
        deadline = time.monotonic() + self.settings.shutdown_timeout
        while (len(self.generations) or self.conversion.busy or self.conversion.queued) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.closing = True  # from here on nothing new starts, not even a conversion finishing now
        shutdown = ApiError(
            503, "The server is shutting down; the request was aborted.", "ServiceUnavailableError", None, "shutdown"
        )
        aborted = self.conversion.busy or self.conversion.queued or len(self.generations)
        self.conversion.fail_pending(shutdown)
        for gen in list(self.generations.live):
            self.generations.fail(gen, shutdown, reason="shutdown")
        if aborted:
            await asyncio.sleep(0.05)  # let handlers write those errors

    async def close(self) -> None:
        if self.siblings is not None:
            self.siblings.terminate()
            await self.siblings.wait(self.settings.shutdown_timeout + 10)
        if self.exchange is not None:
            self.exchange.close()
        self._lag_task.cancel()
        if self._watchdog_task:
            self._watchdog_task.cancel()
        await self.scheduler.close()
        simulator = self.simulator is not None and self.simulator.returncode is None
        if simulator:
            self.simulator.terminate()  # it ends while the workers do
        await self.conversion.close()
        if self.engine_bridges is not None:
            await self.engine_bridges.close()
        if simulator:
            try:
                await asyncio.wait_for(self.simulator.wait(), 5)
            except asyncio.TimeoutError:
                self.simulator.kill()
                await self.simulator.wait()
        if self._own_runtime_dir and self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    async def serve(self, on_ready=None) -> int:
        s = self.settings
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        try:
            config = uvicorn.Config(
                App(self),
                host=s.host,
                port=s.port,
                loop="none",
                lifespan="off",
                http=protocol_class(
                    s.header_timeout,
                    lambda: self.metrics.closed_connections.labels(reason="header_timeout").inc(),
                    s.send_buffer_bytes,
                ),
                log_level=s.log_level,
                access_log=False,
                timeout_keep_alive=s.timeout_keep_alive,
                timeout_graceful_shutdown=5,  # a backstop: drain() has already answered every request
            )
            ready_task = asyncio.create_task(self.wait_ready())
            stop_task = asyncio.create_task(stop.wait())
            if self.sibling:
                # gateways 1..N-1 share the port with a gateway that already serves: binding before this
                # one's scheduler is connected would have the kernel hand it requests it can only refuse
                await asyncio.wait({ready_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
                if not ready_task.done() or not ready_task.result():
                    if ready_task.done():
                        log.error("gateway %d did not become ready; not listening", self.index)
                        return 1
                    return 0
            try:  # with --gateways N every gateway binds the port (SO_REUSEPORT); the kernel spreads connections
                listeners = listen_sockets(s.host, s.port, reuseport=s.gateways > 1)
            except OSError as exc:
                log.error("cannot listen on %s:%d: %s", s.host, s.port, exc.strerror or exc)
                return 1
            server = _Server(config, listeners)
            server_task = asyncio.create_task(server.serve())
            await asyncio.wait({ready_task, stop_task, server_task}, return_when=asyncio.FIRST_COMPLETED)
            if server_task.done():
                server_task.result()  # a bind error surfaces here
                return 1
            if ready_task.done() and ready_task.result():
                systemd_notify.notify(
                    f"READY=1\nSTATUS=serving {self.model_name} on {s.host}:{s.port}\nMAINPID={os.getpid()}"
                )
                if on_ready:
                    on_ready(self)
            elif ready_task.done():
                log.error(
                    "tokenmill did not become ready (workers alive: %d, scheduler connected: %s)",
                    self.conversion.alive,
                    self.scheduler.connected,
                )
            await stop_task
            if self.siblings is not None:
                self.siblings.terminate()  # systemd signals gateway 0 only; the others drain too
            systemd_notify.notify("STOPPING=1\nSTATUS=draining in-flight requests")
            log.info("stopping: draining in-flight requests (up to %gs)", s.shutdown_timeout)
            await self.drain()
            server.should_exit = True
            await server_task  # (uvicorn's shutdown also gives the aborts drain() sent time to reach the engine)
            return 0
        finally:
            await self.close()


def run(settings: ServeSettings, on_ready=None, sibling: dict | None = None) -> int:
    import uvloop

    from tokenmill.process.procutil import (
        keep_freed_memory,
        realtime_zmq_threads,
        request_latency_slice,
        request_realtime,
        set_process_name,
    )

    name = f"gateway {sibling['index']}" if sibling else "gateway"
    set_process_name(f"tm-gateway-{sibling['index']}" if sibling else "tm-gateway")
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
    keep_freed_memory()  # request bodies of megabytes reuse heap pages instead of faulting in fresh ones
    # this thread and ZeroMQ's (which carry the loop's frames to and from the engine) only: the workers,
    # the scheduler and the loop's other helper threads keep the default
    log = logging.getLogger(__name__)
    if request_realtime(settings.loop_rt_priority):
        realtime_zmq_threads(settings.loop_rt_priority)
        log.info("the event loop runs real-time (SCHED_FIFO priority %d)", settings.loop_rt_priority)
    elif settings.loop_slice_us and not request_latency_slice(settings.loop_slice_us):
        log.info("this kernel keeps its default time slice for the event loop")
    return uvloop.run(Gateway(settings, sibling).serve(on_ready))


def sibling_main() -> int:
    """Gateway 1..N-1 of --gateways N, started by gateway 0 (gateway/siblings.py)."""
    import json

    from tokenmill.process.procutil import die_with_supervisor

    die_with_supervisor()
    sibling = json.loads(os.environ[siblings.SIBLING_ENV])
    return run(ServeSettings(**sibling.pop("settings")), sibling=sibling)


if __name__ == "__main__":
    sys.exit(sibling_main())
