"""Prometheus metrics, all exported by the gateway.

Workers do not run prometheus-client themselves: they already answer every conversion
and detokenization with a small message, so they put their timings in it and the gateway
observes them. That keeps one registry in one process (no multiprocess directory to clean
after a worker is killed) and the figures survive worker restarts.

Names follow vLLM's where the meaning is the same (``vllm:time_to_first_token_seconds``
becomes ``tokenmill_time_to_first_token_seconds``), all with a ``model_name`` label.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily

from tokenmill.tokenizer_workers.messages import ConvertDone

_LATENCY = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LAG = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# How each gauge merges when N gateway processes (``serve --gateways N``) answer one scrape as the node
# (gateway/metrics_merge.py). Counters and histograms are always summed. Every gauge must be listed here:
# tests/unit/test_metrics_merge.py fails on one that is not, so a new gauge cannot silently double count.
#   "sum": the process's own state; the node's figure is the total over gateways.
#   "max": a node-wide fact every gateway observes the same (up to staleness); summing would count it N times.
#   "min": a per-gateway link that the node needs on every gateway; 0 if any gateway lost it, so alerts fire.
GAUGE_MERGE: dict[str, str] = {
    # this gateway's own requests, queues and shutdown state: the node's is the total
    "tokenmill_gateway_processes": "sum",  # each process sets 1: the sum is how many gateways answered
    "tokenmill_num_requests_running": "sum",
    "tokenmill_num_requests_waiting": "sum",  # each gateway queues its own conversions
    "tokenmill_queued_request_bytes": "sum",
    "tokenmill_stream_history_bytes": "sum",  # each gateway keeps its own streams' token history
    "tokenmill_draining": "sum",  # how many gateways are draining
    "tokenmill_rank_requests_in_flight": "sum",  # "requests this gateway has on the rank"
    "tokenmill_workers_busy": "sum",  # each counts the workers busy with its own jobs; a worker converting one gateway's jobs is not given the others' (WorkerBusy)
    # the tokenizer workers, shared by the node's gateways: each gateway counts the workers linked to it and
    # keeps their reports, so these are per-gateway figures in truth, of the same workers. (Were each gateway
    # to run a pool of its own, workers_alive and tokenize_cache_bytes would have to be "sum".)
    "tokenmill_workers_alive": "max",
    "tokenmill_tokenize_cache_bytes": "max",  # by worker: each gateway has that worker's last report, some older
    "tokenmill_tokenize_cache_enabled": "max",  # the model's self-test, the same for every worker of the model
    # what the one scheduler and its ranks report: each gateway's client gets the same stats, about a second old
    "tokenmill_scheduler_num_requests_running": "max",
    "tokenmill_scheduler_num_requests_waiting": "max",
    "tokenmill_rank_num_requests_running": "max",
    "tokenmill_rank_num_requests_waiting": "max",
    # each gateway's own link to the scheduler and its ranks: a gateway without one fails its requests,
    # which "max" would hide behind the others' 1
    "tokenmill_scheduler_connected": "min",
    "tokenmill_rank_connected": "min",
    # configuration: which engine server (--engine-url) each rank is, the same on every gateway
    "tokenmill_engine_info": "max",
}


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name

        def c(name, doc, extra=()):
            m = Counter(name, doc, label + list(extra), registry=r)
            return m if extra else m.labels(model_name)

        def h(name, doc, buckets):
            hist = _FastHistogram(name, doc, buckets, model_name)
            r.register(hist)
            return hist

        def g(name, doc):
            return Gauge(name, doc, label, registry=r).labels(model_name)

        self._requests = Counter(
            "tokenmill_requests",
            "HTTP requests answered, by endpoint and status code.",
            label + ["endpoint", "status"],
            registry=r,
        )
        self._success = Counter(
            "tokenmill_request_success",
            "Generations that finished, by finish reason.",
            label + ["finished_reason"],
            registry=r,
        )
        self._children: dict = {}  # (family, label values) -> child, for the families a request touches
        self.time_to_first_token = h(
            "tokenmill_time_to_first_token_seconds",
            "Time from request arrival (including conversion) to the first generated token.",
            _LATENCY,
        )
        self.e2e_latency = h(
            "tokenmill_e2e_request_latency_seconds", "Time from request arrival to its last byte.", _LATENCY
        )
        self.inter_token_latency = h(
            "tokenmill_inter_token_latency_seconds", "Time between consecutive scheduler outputs of a request.", _FAST
        )
        self.prompt_tokens = c("tokenmill_prompt_tokens", "Prompt tokens sent to the scheduler.")
        self.generation_tokens = c("tokenmill_generation_tokens", "Tokens generated by the scheduler.")
        self.num_requests_running = g(
            "tokenmill_num_requests_running", "Requests generating (sent to the scheduler, not finished)."
        )
        self.num_requests_waiting = g("tokenmill_num_requests_waiting", "Requests waiting for a tokenizer worker.")
        self.scheduler_running = g(
            "tokenmill_scheduler_num_requests_running", "Running requests as the scheduler reports them."
        )
        self.scheduler_waiting = g(
            "tokenmill_scheduler_num_requests_waiting", "Waiting requests as the scheduler reports them."
        )
        self.queue_wait = h(
            "tokenmill_queue_wait_seconds", "Time a request waited in the gateway before a worker took it.", _FAST
        )
        self.worker_queue_wait = h(
            "tokenmill_worker_queue_wait_seconds",
            "Time between a worker receiving a request and starting on it.",
            _FAST,
        )
        self.render_seconds = h(
            "tokenmill_render_seconds", "Chat template rendering time per request (in a worker).", _FAST
        )
        self.tokenize_seconds = h("tokenmill_tokenize_seconds", "Tokenization time per request (in a worker).", _FAST)
        self.detokenize_seconds = h(
            "tokenmill_detokenize_seconds", "Detokenization time per output batch (in a worker).", _FAST
        )
        self.loop_lag = h("tokenmill_event_loop_lag_seconds", "How late the gateway's event loop ran a timer.", _LAG)
        self.workers_alive = g("tokenmill_workers_alive", "Tokenizer worker processes connected and ready.")
        self.workers_busy = g("tokenmill_workers_busy", "Tokenizer workers converting a request right now.")
        self.worker_restarts = c("tokenmill_worker_restarts", "Tokenizer worker processes replaced after dying.")
        self.conversion_timeouts = c(
            "tokenmill_conversion_timeouts", "Conversions stopped for overrunning the deadline."
        )
        self.aborts = Counter(
            "tokenmill_aborts", "Generations stopped early, by reason.", label + ["reason"], registry=r
        )
        self.rejections = Counter(
            "tokenmill_rejections", "Requests refused before conversion, by reason.", label + ["reason"], registry=r
        )
        self.scheduler_connected = g("tokenmill_scheduler_connected", "1 while the GPU scheduler is connected.")
        self.tokenize_cpu_seconds = c(
            "tokenmill_tokenize_cpu_seconds", "CPU seconds workers spent tokenizing chat prompts."
        )
        self.cache_hits = c(
            "tokenmill_tokenize_cache_hits", "Prompt pieces whose token IDs came from a worker's cache."
        )
        self.prefix_reuses = c(
            "tokenmill_tokenize_prefix_reuses",
            "Prompts that began with the token IDs of an earlier prompt in the same worker.",
        )
        self.cache_misses = c("tokenmill_tokenize_cache_misses", "Cacheable prompt pieces that had to be tokenized.")
        self.cache_tokens = c("tokenmill_prompt_tokens_from_cache", "Prompt tokens served from the tokenization cache.")
        self.fresh_tokens = c("tokenmill_prompt_tokens_tokenized", "Prompt tokens tokenized afresh.")
        self.cache_mismatches = c(
            "tokenmill_tokenize_cache_mismatches",
            "Cached tokenizations that differed from whole encoding (--verify-tokenize-cache).",
        )
        self.cache_evictions = c("tokenmill_tokenize_cache_evictions", "Pieces evicted from workers' caches.")
        self.cache_bytes = Gauge(
            "tokenmill_tokenize_cache_bytes",
            "Bytes held by each worker's tokenization cache.",
            label + ["worker"],
            registry=r,
        )
        self.tokenize_cache_enabled = g(
            "tokenmill_tokenize_cache_enabled",
            "1 when the model passed the segment-separability self-test and the cache is on.",
        )
        self.images_sent_pixels = c("tokenmill_images_sent_pixels", "Images sent to the engine with their pixels.")
        self.images_sent_by_hash = c(
            "tokenmill_images_sent_by_hash",
            "Images sent to the engine as their content hash alone: it held them (protocol 1.2 images.by_hash).",
        )
        self.images_sent_shm = c(
            "tokenmill_images_sent_shared_memory",
            "Images sent to the engine as a shared-memory file it maps: on this host, first sent "
            "(protocol 1.2 images.shm).",
        )
        self.image_pixels_resent = c(
            "tokenmill_image_pixels_resent",
            "Requests whose images the engine no longer held when sent by hash, or could not map: sent again "
            "with their pixels.",
        )
        self.draining = g("tokenmill_draining", "1 while the server drains for shutdown (readiness fails).")
        self.queued_bytes = g("tokenmill_queued_request_bytes", "Request body bytes waiting for a tokenizer worker.")
        self.stream_errors = Counter(
            "tokenmill_stream_errors",
            "Streams that ended with an error event after a 200, by code.",
            label + ["code"],
            registry=r,
        )
        self.stream_errors = _Bound(self.stream_errors, model_name)
        self.coalesced_deltas = c(
            "tokenmill_stream_coalesced_deltas",
            "Text deltas merged into an earlier SSE event because the client read slower than tokens arrived.",
        )
        self.closed_connections = Counter(
            "tokenmill_closed_connections",
            "Connections the gateway closed itself, by reason (header_timeout, slow_client).",
            label + ["reason"],
            registry=r,
        )
        self.closed_connections = _Bound(self.closed_connections, model_name)
        for reason in ("header_timeout", "slow_client"):  # exported at 0 from the start, for dashboards and alerts
            self.closed_connections.labels(reason=reason)

        def by_reason(name, doc, reasons):
            """A counter by reason, each reason exported at 0 from the start (for dashboards and alerts)."""
            counter = _Bound(c(name, doc, ["reason"]), model_name)
            for reason in reasons:
                counter.labels(reason=reason)
            return counter

        self.remote_worker_refusals = by_reason(
            "tokenmill_remote_worker_refusals",
            "Remote tokenizer workers refused: unknown CURVE key, or a tokenizer/template different from the gateway's.",
            ("curve_key", "fingerprint"),
        )
        self.stream_failovers = by_reason(
            "tokenmill_stream_failovers",
            "Requests whose tokenizer worker died or was lost mid-stream: resumed (their streams moved to a live "
            "worker), waiting (no other worker was alive: they wait up to --stream-failover-wait for one to be "
            "ready, then count as resumed or no_worker), or failed with worker_died because not_resumable (over "
            "--stream-history-bytes), too_many (moved too often), no_worker (none ready in time) or rebuild_failed "
            "(the new worker could not rebuild them); rank_resumed: requests whose scheduler rank (engine replica) "
            "was lost, started again on another rank.",
            ("resumed", "waiting", "not_resumable", "too_many", "no_worker", "rebuild_failed", "rank_resumed"),
        )
        self.stream_history_bytes = g(
            "tokenmill_stream_history_bytes",
            "Bytes of token history the gateway keeps so that live streams can move to another worker.",
        )
        conversions = _Bound(
            c(
                "tokenmill_conversions",
                "Conversions sent to tokenizer workers, by path: io_thread "
                "(small bodies, and cheap next turns of a conversation the worker holds) or "
                "conversion_thread.",
                ["path"],
            ),
            model_name,
        )
        self.conversions = {
            quick: conversions.labels(path="io_thread" if quick else "conversion_thread") for quick in (True, False)
        }  # by job.quick; both exported from the start
        self.gateway_processes = g(
            "tokenmill_gateway_processes",
            "Gateway processes whose metrics this scrape shows (each sets 1; summed when merged).",
        )
        self.gateway_processes.set(1)
        self.gateway_restarts = by_reason(
            "tokenmill_gateway_restarts",
            "Gateway processes (1..N-1 of --gateways N) replaced by gateway 0: exited, or killed for a stalled loop.",
            ("exited", "stalled"),
        )
        self.tool_parse_failures = _Bound(
            Counter(
                "tokenmill_tool_call_parse_failures",
                "Tool calls the parser could not read (returned as content), by format.",
                label + ["parser"],
                registry=r,
            ),
            model_name,
        )
        # per scheduler rank (data-parallel engines, gateway/scheduler_ranks.py), set at each scrape
        rank = label + ["rank"]
        self.rank_connected = Gauge(
            "tokenmill_rank_connected", "1 while the scheduler rank is connected and accepted.", rank, registry=r
        )
        self.rank_in_flight = Gauge(
            "tokenmill_rank_requests_in_flight", "Scheduler requests this gateway has on the rank.", rank, registry=r
        )
        self.rank_running = Gauge(
            "tokenmill_rank_num_requests_running", "Running requests as the rank reports them.", rank, registry=r
        )
        self.rank_waiting = Gauge(
            "tokenmill_rank_num_requests_waiting", "Waiting requests as the rank reports them.", rank, registry=r
        )
        self.rank_time_to_first_token = _RankHistograms(
            "tokenmill_rank_time_to_first_token_seconds",
            "Time from a request's arrival (including conversion) to its first token, by the rank that generated it.",
            _LATENCY,
            model_name,
        )
        r.register(self.rank_time_to_first_token)
        self.engine_info = Gauge(
            "tokenmill_engine_info",
            "1 for each engine rank: the engine server's URL (--engine-url) or the scheduler endpoint it is reached at.",
            rank + ["url"],
            registry=r,
        )
        self._rank_counts = {
            name: Counter(name, doc, rank, registry=r)
            for name, doc in (
                ("tokenmill_rank_errors", "Requests on the rank that ended in an error or were lost with it."),
                ("tokenmill_rank_requests", "Scheduler requests sent to the rank."),
                ("tokenmill_rank_prompt_tokens", "Prompt tokens of the rank's finished requests."),
                ("tokenmill_rank_cached_prompt_tokens", "Of those, tokens the engine served from its prefix cache."),
            )
        }
        self._rank_seen: dict[tuple[str, int], float] = {}
        # bind the labelled families to this model, keeping .labels(reason=...) call sites short
        self.aborts = _Bound(self.aborts, model_name)
        self.rejections = _Bound(self.rejections, model_name)

    def observe_ranks(self, ranks) -> None:
        """The scheduler ranks' state and counters (kept on the ranks, so the loop pays nothing per request)."""
        for r in ranks:
            labels = (self.model_name, str(r.index))
            self.rank_connected.labels(*labels).set(1 if r.ready else 0)
            self.rank_in_flight.labels(*labels).set(r.in_flight)
            stats = r.client.stats
            if stats is not None:
                self.rank_running.labels(*labels).set(stats.num_running)
                self.rank_waiting.labels(*labels).set(stats.num_waiting)
            for name, value in (
                ("tokenmill_rank_errors", r.errors),
                ("tokenmill_rank_requests", r.requests),
                ("tokenmill_rank_prompt_tokens", r.prompt_tokens),
                ("tokenmill_rank_cached_prompt_tokens", r.cached_tokens),
            ):
                seen = self._rank_seen.get((name, r.index), 0)
                if value > seen:
                    self._rank_counts[name].labels(*labels).inc(value - seen)
                    self._rank_seen[name, r.index] = value
                else:
                    self._rank_counts[name].labels(*labels)  # exported at 0 from the start

    def _child(self, family, *values):
        """family.labels(model_name, *values), remembered: prometheus-client's labels() costs ~2 µs a
        call. The values are bounded (routes, with app.py labelling unknown paths alike; statuses;
        finish reasons; worker indexes)."""
        key = (family, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(self.model_name, *values)
        return child

    def request(self, endpoint: str, status: int) -> None:
        self._child(self._requests, endpoint, str(status)).inc()

    def finished(self, reason: str) -> None:
        self._child(self._success, reason).inc()

    def observe_conversion(self, done: ConvertDone, worker: int = 0) -> None:
        timing = done.timing
        if done.error is not None or timing is None:
            return
        self.worker_queue_wait.observe(timing.queue_s)
        if timing.render_s:
            self.render_seconds.observe(timing.render_s)
        self.tokenize_seconds.observe(timing.tokenize_s)
        self.tokenize_cpu_seconds.inc(timing.tokenize_cpu_s)
        cache = timing.cache
        if cache is not None:
            self.cache_hits.inc(cache.hits)
            self.cache_misses.inc(cache.misses)
            self.prefix_reuses.inc(cache.prefix_hits)
            self.cache_tokens.inc(cache.cached_tokens)
            self.fresh_tokens.inc(cache.fresh_tokens)
            self.cache_mismatches.inc(cache.mismatches)
            self.cache_evictions.inc(cache.evictions)
            self._child(self.cache_bytes, str(worker)).set(cache.bytes_used)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Bound:
    """A labelled metric family with model_name already filled in."""

    def __init__(self, family, model_name: str):
        self.family = family
        self.model_name = model_name

    def labels(self, **labels):
        return self.family.labels(model_name=self.model_name, **labels)


class _FastHistogram:
    """A histogram for the event loop: a bisect and two additions per observation.

    prometheus-client's Histogram takes a lock and checks its state on every observe (1.3 µs
    against 0.3 here); at tens of thousands of outputs a second that was a tenth of the gateway's
    loop, and a request observes seven. Every histogram here is only ever touched from the event
    loop, and exports the same series (``_bucket``, ``_count``, ``_sum``).
    """

    def __init__(self, name: str, documentation: str, buckets, model_name: str):
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf only
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric([self.model_name], buckets, self.sum)
        yield family


class _RankHistograms:
    """One _FastHistogram per scheduler rank, exported as one family with a ``rank`` label."""

    def __init__(self, name: str, documentation: str, buckets, model_name: str):
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.buckets = buckets
        self.by_rank: dict[int, _FastHistogram] = {}

    def observe(self, rank: int, value: float) -> None:
        hist = self.by_rank.get(rank)
        if hist is None:
            hist = self.by_rank[rank] = _FastHistogram(self.name, self.documentation, self.buckets, self.model_name)
        hist.observe(value)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name", "rank"])
        for rank, hist in sorted(self.by_rank.items()):
            cumulative, buckets = 0, []
            for bound, count in zip([*hist.bounds, float("inf")], hist.counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([self.model_name, str(rank)], buckets, hist.sum)
        yield family
