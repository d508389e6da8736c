"""The merge of N gateways' /metrics into the node's (gateway/metrics_merge.py), on real Metrics objects.

Each gateway process is a real ``Metrics`` driven through the methods the gateway calls; the merge of
their renders must read as one process that saw everything: counters and histogram buckets summed,
gauges by their declared mode, and no gauge left without one.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.gateway.metrics import GAUGE_MERGE, Metrics
from tokenmill.gateway.metrics_merge import merge_expositions, merge_families
from tokenmill.tokenizer_workers.messages import CacheReport, ConvertDone, Timing

Series = tuple[str, tuple[tuple[str, str], ...]]


def _rank(index: int, ready: bool, in_flight: int, running: int, waiting: int, requests: int):
    """What Metrics.observe_ranks reads off a gateway/scheduler_ranks.py rank."""
    stats = SimpleNamespace(num_running=running, num_waiting=waiting)
    return SimpleNamespace(
        index=index,
        ready=ready,
        in_flight=in_flight,
        client=SimpleNamespace(stats=stats),
        requests=requests,
        prompt_tokens=10 * requests,
        cached_tokens=requests,
        errors=requests // 2,
    )


def _gateways() -> list[Metrics]:
    """Three gateway processes of one node, each with its own traffic, and the node-wide facts they share."""
    a, b, c = Metrics("m"), Metrics("m"), Metrics("m")
    for m, n in ((a, 3), (b, 1), (c, 0)):
        for _ in range(n):
            m.request("/v1/chat/completions", 200)
            m.finished("stop")
    b.request("/v1/completions", 400)  # a label set only one gateway has
    c.rejections.labels(reason="queue_full").inc(2)
    a.remote_worker_refusals.labels(reason="curve_key").inc()
    for m, gaps in ((a, [0.0002, 0.003, 0.003]), (b, [0.003, 7.0]), (c, [])):
        for gap in gaps:
            m.inter_token_latency.observe(gap)  # the custom _FastHistogram
    a.e2e_latency.observe(0.3)
    b.e2e_latency.observe(30.0)
    a.observe_conversion(
        ConvertDone(
            1,
            timing=Timing(
                render_s=0.001,
                tokenize_s=0.002,
                tokenize_cpu_s=0.5,
                queue_s=0.0001,
                cache=CacheReport(2, 1, 40, 10, 0, 3, 1000),
            ),
        ),
        worker=0,
    )
    b.observe_conversion(
        ConvertDone(
            2, timing=Timing(tokenize_s=0.004, tokenize_cpu_s=0.25, cache=CacheReport(1, 0, 20, 0, 0, 5, 1500))
        ),
        worker=0,
    )
    b.observe_conversion(
        ConvertDone(3, timing=Timing(tokenize_s=0.01, cache=CacheReport(0, 1, 0, 7, 0, 0, 700))), worker=1
    )
    for m, running, waiting, queued, busy, connected in ((a, 5, 1, 100, 2, 1), (b, 2, 0, 0, 1, 0), (c, 0, 3, 50, 0, 1)):
        m.num_requests_running.set(running)  # per process
        m.num_requests_waiting.set(waiting)
        m.queued_bytes.set(queued)
        m.workers_busy.set(busy)
        m.scheduler_connected.set(connected)  # gateway b lost the scheduler
        m.workers_alive.set(4)  # the shared pool: every gateway sees the same
        m.tokenize_cache_enabled.set(1)
        m.scheduler_running.set(7)
        m.scheduler_waiting.set(2)
    c.draining.set(1)
    a.observe_ranks([_rank(0, True, 3, 6, 1, 10), _rank(1, True, 2, 1, 0, 4)])
    b.observe_ranks([_rank(0, True, 1, 6, 1, 5), _rank(1, False, 0, 1, 0, 2)])
    c.observe_ranks([_rank(0, True, 0, 6, 1, 1), _rank(1, True, 1, 1, 0, 0)])
    return [a, b, c]


def _samples(text: bytes) -> tuple[dict[Series, float], dict[str, str]]:
    """Every sample of an exposition by (name, labels), and each family's type (it must parse)."""
    values: dict[Series, float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text.decode()):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in values, f"duplicate series {key}"
            values[key] = s.value
    return values, types


def _value(values: dict[Series, float], name: str, **labels: str) -> float:
    return values[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


def test_every_gauge_has_a_merge_mode():
    """A gauge without a mode would be summed or dropped by guess; declaring one is part of adding it."""
    gauges = {f.name for f in Metrics("m").registry.collect() if f.type == "gauge"}
    assert gauges - GAUGE_MERGE.keys() == set(), "declare these in gateway/metrics.py GAUGE_MERGE"
    assert GAUGE_MERGE.keys() - gauges == set(), "GAUGE_MERGE names gauges Metrics no longer has"
    assert set(GAUGE_MERGE.values()) <= {"sum", "max", "min"}


def test_merge_is_the_node_total():
    gateways = _gateways()
    renders = [m.render() for m in gateways]
    merged = merge_expositions(renders)
    got, types = _samples(merged)
    parts = [_samples(r) for r in renders]

    # the oracle: each process's own exposition, parsed, combined by family type / declared mode
    expected: dict[Series, list[float]] = defaultdict(list)
    kind: dict[Series, str] = {}
    for values, ptypes in parts:
        for key, v in values.items():
            name = key[0]
            family = next(
                f
                for f in (name, *(name.removesuffix(x) for x in ("_total", "_bucket", "_sum", "_count")))
                if f in ptypes
            )
            if name.endswith("_created"):
                kind[key] = "min"
            elif ptypes[family] in ("counter", "histogram"):
                kind[key] = "sum"
            else:
                kind[key] = GAUGE_MERGE[family]
            expected[key].append(v)
    assert got.keys() == expected.keys()
    combine = {"sum": sum, "max": max, "min": min}
    for key, vs in expected.items():
        assert got[key] == pytest.approx(combine[kind[key]](vs)), key
    assert types == {name: t for _, ptypes in parts for name, t in ptypes.items()}  # every family, same type

    # and by hand, the figures a dashboard reads
    assert _value(got, "tokenmill_requests_total", endpoint="/v1/chat/completions", status="200") == 4
    assert _value(got, "tokenmill_requests_total", endpoint="/v1/completions", status="400") == 1
    assert _value(got, "tokenmill_request_success_total", finished_reason="stop") == 4
    assert _value(got, "tokenmill_rejections_total", reason="queue_full") == 2
    assert _value(got, "tokenmill_remote_worker_refusals_total", reason="curve_key") == 1
    assert _value(got, "tokenmill_remote_worker_refusals_total", reason="fingerprint") == 0
    itl = "tokenmill_inter_token_latency_seconds"
    assert _value(got, f"{itl}_bucket", le="0.00025") == 1
    assert _value(got, f"{itl}_bucket", le="0.005") == 4
    assert _value(got, f"{itl}_bucket", le="10.0") == 5
    assert _value(got, f"{itl}_bucket", le="+Inf") == _value(got, f"{itl}_count") == 5
    assert _value(got, f"{itl}_sum") == pytest.approx(0.0002 + 0.003 * 3 + 7.0)
    assert _value(got, "tokenmill_e2e_request_latency_seconds_bucket", le="+Inf") == 2
    assert _value(got, "tokenmill_e2e_request_latency_seconds_bucket", le="80.0") == 2
    assert _value(got, "tokenmill_e2e_request_latency_seconds_bucket", le="20.0") == 1
    assert _value(got, "tokenmill_tokenize_cpu_seconds_total") == pytest.approx(0.75)
    assert _value(got, "tokenmill_tokenize_cache_evictions_total") == 3 + 5
    assert _value(got, "tokenmill_rank_requests_total", rank="0") == 16
    created = [_value(values, "tokenmill_prompt_tokens_created") for values, _ in parts]
    assert _value(got, "tokenmill_prompt_tokens_created") == min(created)
    # gauges: "sum" for each process's own state
    assert _value(got, "tokenmill_gateway_processes") == 3
    assert _value(got, "tokenmill_num_requests_running") == 7
    assert _value(got, "tokenmill_num_requests_waiting") == 4
    assert _value(got, "tokenmill_queued_request_bytes") == 150
    assert _value(got, "tokenmill_workers_busy") == 3
    assert _value(got, "tokenmill_draining") == 1
    assert _value(got, "tokenmill_rank_requests_in_flight", rank="0") == 4
    # "max" for what every gateway observes the same
    assert _value(got, "tokenmill_workers_alive") == 4
    assert _value(got, "tokenmill_tokenize_cache_enabled") == 1
    assert _value(got, "tokenmill_scheduler_num_requests_running") == 7
    assert _value(got, "tokenmill_rank_num_requests_running", rank="0") == 6
    assert _value(got, "tokenmill_tokenize_cache_bytes", worker="0") == 1500
    assert _value(got, "tokenmill_tokenize_cache_bytes", worker="1") == 700
    # "min" for each gateway's own link to the scheduler: one gateway without it is the node's problem
    assert _value(got, "tokenmill_scheduler_connected") == 0
    assert _value(got, "tokenmill_rank_connected", rank="0") == 1
    assert _value(got, "tokenmill_rank_connected", rank="1") == 0


def test_one_exposition_merges_to_itself():
    """Same HELP/TYPE lines, order and formatting as prometheus-client writes: the merge is a valid exposition."""
    m = _gateways()[0]
    assert merge_expositions([m.render()]) == m.render()
    assert merge_expositions([m.render().decode()]) == m.render()
    assert merge_expositions([]) == b""


def test_own_registry_merges_as_its_render():
    """The answering gateway may pass its registry's families instead of parsing its own render."""
    a, b, c = _gateways()
    texts = [b.render(), c.render()]
    assert merge_families(
        [a.registry.collect(), *map(text_string_to_metric_families, map(bytes.decode, texts))]
    ) == merge_expositions([a.render(), *texts])
    assert merge_families([a.registry.collect()]) == a.render()


def test_what_cannot_merge_right_is_refused():
    undeclared = b"# HELP x_new A gauge.\n# TYPE x_new gauge\nx_new 1.0\n"
    with pytest.raises(ValueError, match="x_new has no merge mode"):
        merge_expositions([undeclared, undeclared])
    hist = (
        '# HELP h H.\n# TYPE h histogram\nh_bucket{{le="{0}"}} 1.0\nh_bucket{{le="+Inf"}} 1.0\nh_count 1.0\nh_sum 0.1\n'
    )
    with pytest.raises(ValueError, match="buckets"):
        merge_expositions([hist.format("0.5"), hist.format("1.0")])
    with pytest.raises(ValueError, match="counter in one exposition and a gauge"):
        merge_expositions(["# TYPE y_total counter\ny_total 1.0\n", "# TYPE y gauge\ny 1.0\n"])


def test_the_loops_histograms_export_what_prometheus_clients_would():
    """gateway/metrics.py's lock-free histograms against prometheus-client's own Histogram, fed the
    same values (on, below and above the bucket bounds): the same buckets, count and sum."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from tokenmill.gateway.metrics import _FAST, _FastHistogram

    values = [0.0, 0.0001, 0.00010001, 0.0005, 0.003, 0.25, 0.2500001, 9.99, 10.0, 10.5, 1e9]
    oracle_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    oracle = Histogram("h_seconds", "doc", ["model_name"], buckets=_FAST, registry=oracle_registry).labels("m")
    ours = _FastHistogram("h_seconds", "doc", _FAST, "m")
    ours_registry.register(ours)
    for v in values:
        oracle.observe(v)
        ours.observe(v)

    def samples(registry) -> dict:
        text = generate_latest(registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if not s.name.endswith("_created")
        }

    expected = samples(oracle_registry)
    assert samples(ours_registry) == expected
    assert expected[("h_seconds_count", (("model_name", "m"),))] == len(values)
