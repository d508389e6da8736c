"""The settings a gateway runs with (``ServeSettings``), checked as a whole.

Where each value comes from (flags, TOKENMILL_* variables, a TOML file) is the command line's
business: tokenmill/settings.py, one layer up, builds a ServeSettings from them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _default_workers() -> int:
    return max(1, (os.cpu_count() or 2) - 1)


def _default_tokenizer_threads() -> int:
    """The tokenizers pool each local worker encodes a long prompt's pieces on: as the environment's
    RAYON_NUM_THREADS says, else the CPUs this process may use minus one, which stays the engine's.
    Beside an engine that keeps the cores busy, a pool of every core took the engine's share on each
    of them, and its streams' tokens waited (docs/design/cpu-sharing.md)."""
    configured = os.environ.get("RAYON_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(1, cpus - 1)


@dataclass
class ServeSettings:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    gateways: int = 1
    gateway_stall_timeout: float = 30.0
    loop_slice_us: int = 100  # the CPU time slice each gateway's event-loop thread asks the kernel for (0: default)
    loop_rt_priority: int = 1  # SCHED_FIFO for each event-loop thread where permitted (0: never); else the slice
    workers: int = 0  # 0: CPU count minus one, at least one
    conversion_threads: int = 2  # per worker
    tokenizer_threads: int = 0  # the tokenizers library's pool in each local worker (0: CPUs allowed minus one)
    conversion_nice: int = 0  # added to the worker's niceness for its conversion threads
    worker_group_nice: int = -6  # each worker's scheduling group (autogroup) where permitted (0: leave)
    scheduler: str | None = None
    engine_url: str | None = None  # engine servers over HTTP, comma-separated (one bridge process each)
    engine_flavour: str = "auto"  # their API: vllm, sglang, or auto (each bridge asks its server)
    engine_scheduling_policy: str = "fcfs"  # the vLLM servers' --scheduling-policy (their API does not say)
    engine_kv_connector: bool = False  # the vLLM servers run a KV connector (their --kv-transfer-config)
    chat_template: str | None = None
    max_model_len: int | None = None
    served_model_name: str | None = None
    default_chat_template_kwargs: dict = None
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False
    runtime_dir: str | None = None
    remote_workers: str | None = None
    remote_worker_timeout: float = 5.0
    api_key: str | None = None
    max_body_bytes: int = 64 << 20
    max_queued_conversions: int = 1024
    max_queued_bytes: int = 512 << 20
    conversion_timeout: float = 60.0
    worker_memory_limit_mb: int = 8192
    shutdown_timeout: float = 30.0
    timeout_keep_alive: int = 5
    max_header_bytes: int = 64 << 10
    body_timeout: float = 30.0
    messages_ping_interval: float = 1.0  # /v1/messages streams: a ping this often while the prompt converts
    header_timeout: float = 10.0
    stream_buffer_limit: int = 1 << 20
    stream_history_bytes: int = 4 << 20  # per choice, to move a stream off a dead worker (0: no failover)
    stream_failover_wait: float = 30.0  # seconds a stream whose worker died with none alive waits for one
    send_buffer_bytes: int = 0
    insecure_tcp: bool = False
    curve_keys_dir: str | None = None
    tokenize_cache_bytes: int = 256 << 20
    verify_tokenize_cache: bool = False
    image_cache_bytes: int = 256 << 20
    image_max_pixels: int = 50_000_000
    image_shared_memory: bool = True
    image_fetch: bool = False
    image_fetch_timeout: float = 10.0
    image_fetch_max_bytes: int = 20 << 20
    image_fetch_max_redirects: int = 3
    image_fetch_allow: str = ""
    affinity: bool = True
    quick_conversion_bytes: int = 8192
    quick_turn_bytes: int = 65536
    max_n: int = 128
    generation_config: str = "auto"  # the model's generation_config.json sampling defaults, or "vllm": none
    dp_policy: str = "affinity"
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    conversion_mode: str = "pool"
    sim_prefill_tokens_per_s: float = 200000.0
    sim_inter_token_latency_ms: float = 20.0
    sim_max_running: int = 256
    sim_tokens_per_step: int = 1
    sim_max_model_len: int = 0
    sim_mode: str = "random"
    sim_replies: str | None = None
    sim_busy_cores: int = 0
    log_level: str = "info"

    def __post_init__(self):
        if self.default_chat_template_kwargs is None:
            self.default_chat_template_kwargs = {}
        if not self.workers and not self.remote_workers:
            self.workers = _default_workers()
        if self.gateways < 1:
            raise SystemExit("gateways: at least 1")
        if self.conversion_threads < 1:
            raise SystemExit("conversion_threads: at least 1")
        if self.tokenizer_threads < 0:
            raise SystemExit("tokenizer_threads: 0 (CPUs allowed minus one) or more")
        if not self.tokenizer_threads:
            self.tokenizer_threads = _default_tokenizer_threads()
        if not 0 <= self.conversion_nice <= 19:
            raise SystemExit("conversion_nice: 0 to 19")
        if not -20 <= self.worker_group_nice <= 19:
            raise SystemExit("worker_group_nice: -20 to 19")
        if not 0 <= self.loop_rt_priority <= 99:
            raise SystemExit("loop_rt_priority: 0 (never real-time) or a SCHED_FIFO priority 1 to 99")
        if self.loop_slice_us and not 100 <= self.loop_slice_us <= 100_000:
            raise SystemExit("loop_slice_us: 0 (the kernel's default) or 100 to 100000")
        if self.stream_history_bytes < 0:
            raise SystemExit("stream_history_bytes: 0 or more")
        if self.stream_failover_wait < 0:
            raise SystemExit("stream_failover_wait: 0 or more")
        if self.sim_busy_cores < 0:
            raise SystemExit("sim_busy_cores: 0 or more")
        if self.gateways > 1 and (self.remote_workers or self.conversion_mode != "pool"):
            raise SystemExit(
                "--gateways above 1 takes the node's own worker pool only: not with --remote-workers "
                "(remote workers join one gateway) nor with --conversion-mode inline/thread"
            )
        if self.engine_url and self.scheduler:
            raise SystemExit("engine_url and scheduler: name the engines one way (each --engine-url is a rank)")
        urls = self.engine_urls
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise SystemExit(f"engine_url: {url!r} is not an http:// or https:// URL")
        repeated = sorted({u for u in urls if urls.count(u) > 1})
        if repeated:
            raise SystemExit(f"engine_url: {', '.join(repeated)} listed more than once")
        endpoints = self.scheduler_endpoints
        duplicates = sorted({e for e in endpoints if endpoints.count(e) > 1})
        if duplicates:
            raise SystemExit(
                f"scheduler: {', '.join(duplicates)} listed more than once; each data-parallel rank is one endpoint"
            )

    @property
    def engine_urls(self) -> list[str]:
        """The engine servers reached over HTTP, one data-parallel rank each ([] : none)."""
        return [u.strip().rstrip("/") for u in (self.engine_url or "").split(",") if u.strip()]

    @property
    def scheduler_endpoints(self) -> list[str]:
        """The scheduler endpoints, one per data-parallel rank ([] : start the simulated scheduler)."""
        return [e.strip() for e in (self.scheduler or "").split(",") if e.strip()]
