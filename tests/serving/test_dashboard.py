"""deploy/grafana and deploy/prometheus: every series the dashboard and the alert rules query is one a
real tokenmill exports, with the labels (and, for `=` matchers, the label values) they use, and the
files are what Grafana and Prometheus load.

PromQL is checked by a small lexer/walker below, not by Prometheus: it finds every metric
selector, label matcher and grouping label, checks bracket balance and function names, and
that counters (and histogram buckets) are only read through rate()/increase() and gauges never are.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from http.client import HTTPConnection

import pytest
import yaml
from conftest import ROOT, Server, http
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tokenmill-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "tokenmill-alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"

# ---- a PromQL walker ---------------------------------------------------------------------------

AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "limitk",
    "limit_ratio",
}
FUNCTIONS = {
    "abs",
    "absent",
    "absent_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "day_of_month",
    "day_of_week",
    "days_in_month",
    "delta",
    "deriv",
    "exp",
    "floor",
    "histogram_quantile",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "ln",
    "log2",
    "log10",
    "minute",
    "month",
    "predict_linear",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sort",
    "sort_desc",
    "sqrt",
    "time",
    "timestamp",
    "vector",
    "year",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "sum_over_time",
    "count_over_time",
    "quantile_over_time",
    "stddev_over_time",
    "stdvar_over_time",
    "last_over_time",
    "present_over_time",
}
COUNTER_READERS = {"rate", "irate", "increase", "resets", "changes"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2"}
# series Prometheus makes itself for every target, and labels it adds to every scraped series
SYNTHETIC_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
TARGET_LABELS = {"instance", "job", "cluster"}  # cluster: prometheus.yml's static label

TOKEN = re.compile(
    r"""\s+|(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)"""
    r"""|(?P<duration>(?:\d+(?:ms|s|m|h|d|w|y))+)"""
    r"""|(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"""
    r"""|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)"""
    r"""|(?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,:(){}\[\]])"""
)


@dataclass
class Selector:
    metric: str
    matchers: dict[str, tuple[str, str]] = field(default_factory=dict)  # label -> (op, value)
    functions: list[str] = field(default_factory=list)  # enclosing function calls, innermost last


@dataclass
class Query:
    expr: str
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as Prometheus would see them once Grafana has filled them in."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)  # $model_name, ${instance}: only ever inside matcher strings


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup:
            tokens.append((m.lastgroup, m.group()))
    return tokens


def parse(expr: str) -> Query:
    """Walk a PromQL expression: selectors with their matchers and enclosing functions, grouping labels."""
    query = Query(expr)
    tokens = tokenize(grafana_to_promql(expr))
    stack: list[str] = []  # "(" entries carry the function name ("" for plain parentheses)
    i = 0

    def expect(kind, value=None):
        nonlocal i
        if i >= len(tokens) or tokens[i][0] != kind or (value is not None and tokens[i][1] != value):
            got = tokens[i][1] if i < len(tokens) else "end of expression"
            raise ValueError(f"expected {value or kind}, got {got!r} in {expr!r}")
        i += 1
        return tokens[i - 1][1]

    def label_list() -> list[str]:
        nonlocal i
        expect("op", "(")
        labels = []
        while tokens[i][1] != ")":
            labels.append(expect("ident"))
            if tokens[i][1] == ",":
                i += 1
        expect("op", ")")
        return labels

    def matchers() -> dict[str, tuple[str, str]]:
        nonlocal i
        expect("op", "{")
        found = {}
        while tokens[i][1] != "}":
            label = expect("ident")
            op = expect("op")
            if op not in ("=", "!=", "=~", "!~"):
                raise ValueError(f"bad matcher operator {op!r} in {expr!r}")
            found[label] = (op, expect("string")[1:-1])
            if tokens[i][1] == ",":
                i += 1
        expect("op", "}")
        return found

    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "ident" and value in GROUPING:
            i += 1
            if i < len(tokens) and tokens[i][1] == "(":
                query.grouping.update(label_list())
            continue
        if (
            kind == "ident"
            and i + 1 < len(tokens)
            and tokens[i + 1][1] == "("
            and (value in FUNCTIONS or value in AGGREGATIONS)
        ):
            stack.append(value)
            i += 2
            continue
        if kind == "ident" and value in AGGREGATIONS and i + 1 < len(tokens) and tokens[i + 1][1] in GROUPING:
            i += 2  # sum by (x) (...): the grouping comes first
            query.grouping.update(label_list())
            stack.append(value)
            expect("op", "(")
            continue
        if kind == "ident" and value not in KEYWORDS:
            if i + 1 < len(tokens) and tokens[i + 1][1] == "(":
                raise ValueError(f"unknown function {value!r} in {expr!r}")
            selector = Selector(value, functions=[f for f in stack if f])
            i += 1
            if i < len(tokens) and tokens[i][1] == "{":
                selector.matchers = matchers()
            query.selectors.append(selector)
            continue
        if value == "{":  # a selector without a metric name
            raise ValueError(f"selectors must name their metric in {expr!r}")
        if value == "(":
            stack.append("")
        elif value == ")":
            if not stack:
                raise ValueError(f"unbalanced ')' in {expr!r}")
            stack.pop()
        elif value == "[":
            i += 1
            expect("duration")
            if tokens[i][1] == ":":
                i += 1
                if tokens[i][0] == "duration":
                    i += 1
            expect("op", "]")
            continue
        elif value in ("]", "}"):
            raise ValueError(f"unbalanced {value!r} in {expr!r}")
        i += 1
    if stack:
        raise ValueError(f"unclosed '(' in {expr!r}")
    return query


def test_promql_walker_reads_what_it_should():
    q = parse(
        "histogram_quantile(0.99, sum by (instance, le) "
        '(rate(tokenmill_x_bucket{model_name=~"$model_name"}[$__rate_interval])))'
    )
    assert [(s.metric, s.matchers, s.functions) for s in q.selectors] == [
        ("tokenmill_x_bucket", {"model_name": ("=~", ".*")}, ["histogram_quantile", "sum", "rate"])
    ]
    assert q.grouping == {"instance", "le"}
    q = parse("sum(rate(a_total[5m])) by (reason) / clamp_min(sum(b), 1e-9) > 0.1")
    assert [s.metric for s in q.selectors] == ["a_total", "b"] and q.grouping == {"reason"}
    assert parse('up{job="tokenmill"} == 0').selectors[0].matchers == {"job": ("=", "tokenmill")}
    for broken in [
        "sum(rate(a_total[5m])",
        "rate(a_total[5m]))",
        "rates(a_total[5m])",
        'a{b="c"',
        "a[5q]",
        'a{b=="c"}',
        "sum by (x (a)",
    ]:
        with pytest.raises((ValueError, IndexError)):
            parse(broken)


# ---- the files -------------------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(all_panels(p.get("panels", [])))  # collapsed rows keep theirs inside
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query variable."""
    found = []
    for p in all_panels(dashboard()["panels"]):
        for t in p.get("targets", []):
            found.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            # Grafana's label_values(selector, label) lists label's values: as PromQL, count by (label) (selector)
            m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q)
            assert m, f"variable {v['name']}: expected label_values(selector, label), got {q!r}"
            found.append((f"variable {v['name']}", f"count by ({m[2]}) ({m[1]})"))
    return found


def alert_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]


def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    assert variables["model_name"]["datasource"]["uid"] == "${datasource}"
    assert "model_name" in variables["model_name"]["definition"]

    panels = all_panels(d["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    grid: dict[tuple[int, int], str] = {}
    for p in panels:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in grid, f"{p['title']!r} overlaps {grid[(x, y)]!r}"
                grid[(x, y)] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"{p['title']!r} has no query"
        assert p.get("description"), f"{p['title']!r} says nothing about what it shows"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip(), p["title"]

    titles = " | ".join(p["title"] for p in panels).lower()
    for topic in [
        "requests by status",
        "errors",
        "time to first token",
        "inter-token",
        "end-to-end",
        "queue wait",
        "event-loop lag",
        "tokenizer workers",
        "worker restarts",
        "token throughput",
        "running and waiting",
        "render",
        "tokenize",
        "detokenize",
        "aborts by reason",
        "rejections by reason",
        "tokenization cache",
        "prompt tokens from cache",
        "tokenize cpu per chat request",
        "tokenization cpu",
        "cache bytes per worker",
        "evictions",
        "cache mismatches",
        "cache enabled",
        "stream failovers by reason",
        "token history kept for stream failover",
    ]:
        assert topic in titles, f"no panel about {topic}"


def row_panels(d: dict, title: str) -> list[dict]:
    """The panels under row `title` of an open dashboard (or inside it, when the row is collapsed)."""
    panels = d["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title)
    inside = list(panels[start].get("panels", []))
    for p in panels[start + 1 :]:
        if p["type"] == "row":
            break
        inside.append(p)
    return inside


# every family of the workers' tokenization cache (gateway/metrics.py), as the samples Prometheus stores
CACHE_FAMILY = re.compile(
    r"tokenmill_(tokenize_(cache_\w+|cpu_seconds|prefix_reuses)|prompt_tokens_(from_cache|tokenized))"
)


def cache_series() -> set[str]:
    families = [f for f in Metrics("m").registry.collect() if CACHE_FAMILY.fullmatch(f.name)]
    return {f.name + "_total" if f.type == "counter" else f.name for f in families}


def test_tokenization_cache_row():
    """The "Tokenization cache" row reads every cache series gateway/metrics.py defines, and its stats alarm right."""
    d = dashboard()
    panels = row_panels(d, "Tokenization cache")
    by_title = {p["title"]: p for p in panels}
    used = {s.metric for p in panels for t in p["targets"] for s in parse(t["expr"]).selectors}
    wanted = cache_series()
    assert len(wanted) == 10, sorted(wanted)  # the pattern still finds them all (a new one needs a panel too)
    assert wanted <= used, f"not on the Tokenization cache row: {sorted(wanted - used)}"

    def steps(title):
        p = by_title[title]
        assert p["type"] == "stat" and p["fieldConfig"]["defaults"]["color"]["mode"] == "thresholds", title
        return [(s["color"], s["value"]) for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    # mismatches: a count (ceil of the increase), green at 0, red from the first one
    mismatches = by_title["Tokenization cache mismatches"]
    assert [s.metric for t in mismatches["targets"] for s in parse(t["expr"]).selectors] == [
        "tokenmill_tokenize_cache_mismatches_total"
    ]
    assert mismatches["targets"][0]["expr"].startswith("ceil(")
    assert steps("Tokenization cache mismatches") == [("green", None), ("red", 1)]
    # enabled: red unless 1
    assert steps("Tokenization cache enabled") == [("red", None), ("green", 1)]

    # the share is from_cache / (from_cache + tokenized); CPU per request divides by chat completions answered
    share = parse(by_title["Prompt tokens from cache"]["targets"][0]["expr"])
    assert [s.metric for s in share.selectors] == [
        "tokenmill_prompt_tokens_from_cache_total",
        "tokenmill_prompt_tokens_from_cache_total",
        "tokenmill_prompt_tokens_tokenized_total",
    ]
    per_request = parse(by_title["Tokenize CPU per chat request"]["targets"][0]["expr"])
    assert [(s.metric, s.matchers.get("endpoint")) for s in per_request.selectors] == [
        ("tokenmill_tokenize_cpu_seconds_total", None),
        ("tokenmill_requests_total", ("=", "/v1/chat/completions")),
    ]
    assert by_title["Tokenization cache bytes per worker"]["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert "worker" in parse(by_title["Tokenization cache bytes per worker"]["targets"][0]["expr"]).grouping


def test_every_dashboard_selector_filters_by_model():
    for where, expr in dashboard_queries():
        for s in parse(expr).selectors:
            if where == "variable model_name":
                continue  # lists the models
            op, value = s.matchers.get("model_name", (None, None))
            assert (op, value) == ("=~", ".*") and "$model_name" in expr, f"{where}: {s.metric} ignores $model_name"


def test_prometheus_and_grafana_provisioning_files():
    prom = yaml.safe_load(PROMETHEUS.read_text())
    for rule_file in prom["rule_files"]:
        assert (PROMETHEUS.parent / rule_file).is_file(), rule_file
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "tokenmill")
    assert job.get("metrics_path", "/metrics") == "/metrics" and job["static_configs"][0]["targets"]
    assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in job["static_configs"][0]["targets"])
    for j in prom["scrape_configs"]:
        if "scrape_timeout" in j:
            assert float(j["scrape_timeout"].rstrip("s")) <= float(j.get("scrape_interval", "15s").rstrip("s"))

    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert rule["labels"]["severity"] in ("critical", "warning") and rule["annotations"]["summary"]

    sources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert sources["apiVersion"] == 1 and sources["datasources"][0]["type"] == "prometheus"
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tokenmill.yml").read_text())
    assert providers["apiVersion"] == 1
    assert providers["providers"][0]["type"] == "file" and providers["providers"][0]["options"]["path"]


# ---- against a real tokenmill ----------------------------------------------------------------


def drive_traffic(srv: Server) -> None:
    """Enough requests for every labelled series the dashboard reads to exist."""
    chat = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "Count to ten, please."}]}
    for _i in range(3):
        status, _, body = http("POST", srv.url + "/v1/chat/completions", {**chat, "max_tokens": 8}, timeout=30)
        assert status == 200, body
        status, _, raw = http(
            "POST", srv.url + "/v1/chat/completions", {**chat, "max_tokens": 12, "stream": True}, timeout=30
        )
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    status, _, _ = http("POST", srv.url + "/v1/chat/completions", {"model": "deepseek-v4", "messages": "nope"})
    assert status == 400
    status, _, _ = http("POST", srv.url + "/v1/chat/completions", b"{" + b" " * 70_000 + b"}")
    assert status == 413  # a rejection: body_too_large

    # a streaming client that leaves after its first chunk: an abort (client_disconnect)
    conn = HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({**chat, "max_tokens": 5000, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()


def scrape(srv: Server) -> dict[str, dict]:
    """sample name -> {"type": family type, "labels": label names seen, "values": label -> values seen,
    "value": total}."""
    status, _, text = http("GET", srv.url + "/metrics")
    assert status == 200
    series: dict[str, dict] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            entry = series.setdefault(sample.name, {"type": family.type, "labels": set(), "values": {}, "value": 0.0})
            entry["labels"].update(sample.labels)
            for label, value in sample.labels.items():
                entry["values"].setdefault(label, set()).add(value)
            entry["value"] += sample.value
    return series


@pytest.fixture(scope="module")
def exported():
    srv = Server("--workers", "1", "--sim-inter-token-latency-ms", "2", "--max-body-bytes", "65536")
    try:
        drive_traffic(srv)
        deadline = time.monotonic() + 10
        while True:
            series = scrape(srv)
            if "tokenmill_aborts_total" in series or time.monotonic() > deadline:
                return series
            time.sleep(0.1)
    finally:
        srv.stop()


def check_queries(queries: list[tuple[str, str]], series: dict[str, dict]) -> list[str]:
    problems = []
    for where, expr in queries:
        query = parse(expr)
        labels_here = set(TARGET_LABELS)
        for s in query.selectors:
            if s.metric in SYNTHETIC_SERIES:
                labels_here |= set(s.matchers)
                continue
            if s.metric not in series:
                problems.append(f"{where}: {s.metric} is not exported")
                continue
            kind = series[s.metric]["type"]
            labels = series[s.metric]["labels"] | TARGET_LABELS
            labels_here |= labels
            for label in set(s.matchers) - labels:
                problems.append(f"{where}: {s.metric} has no label {label!r}")
            for label, (op, value) in s.matchers.items():
                seen = series[s.metric]["values"].get(label)
                if op == "=" and seen is not None and value not in seen:
                    problems.append(f"{where}: {s.metric} never has {label}={value!r} (seen: {sorted(seen)})")
            cumulative = kind in ("counter", "histogram", "summary")
            read_as_counter = any(f in COUNTER_READERS for f in s.functions)
            if cumulative and not read_as_counter:
                problems.append(f"{where}: {s.metric} is a {kind}; read it through rate() or increase()")
            if not cumulative and read_as_counter:
                problems.append(f"{where}: {s.metric} is a {kind}; rate() of it means nothing")
            if s.metric.endswith("_bucket") and ("histogram_quantile" not in s.functions or "le" not in query.grouping):
                problems.append(f"{where}: {s.metric} outside histogram_quantile(..., sum by (le) ...)")
        for label in query.grouping - labels_here:
            problems.append(f"{where}: grouping by {label!r}, which none of its series has")
    return problems


def test_dashboard_queries_use_exported_series(exported):
    queries = dashboard_queries()
    assert len(queries) > 30
    problems = check_queries(queries, exported)
    assert not problems, "\n".join(problems)


def test_alert_rules_use_exported_series(exported):
    queries = alert_queries()
    assert queries
    problems = check_queries(queries, exported)
    assert not problems, "\n".join(problems)


def test_histograms_on_the_dashboard_have_data(exported):
    """After real traffic, every histogram a panel shows has observations, so no panel is empty."""
    used = {s.metric for _, e in dashboard_queries() for s in parse(e).selectors}
    empty = sorted(m for m in used if m.endswith("_bucket") and exported[m[: -len("_bucket")] + "_count"]["value"] == 0)
    assert not empty, f"no observations: {empty}"


def test_tokenization_cache_series_are_live(exported):
    """The test model passes the cache's self-test, so the cache row is checked against series with data."""
    assert exported["tokenmill_tokenize_cache_enabled"]["value"] == 1
    assert exported["tokenmill_tokenize_cache_bytes"]["values"]["worker"] == {"0"}
    tokens = ("tokenmill_prompt_tokens_from_cache_total", "tokenmill_prompt_tokens_tokenized_total")
    assert sum(exported[name]["value"] for name in tokens) > 0
    assert exported["tokenmill_tokenize_cpu_seconds_total"]["value"] > 0
    assert cache_series() <= set(exported)


def test_checker_catches_mistakes(exported):
    """The check fails on the usual slips: a counter without _total, a bucket read raw, a gauge rated, a typo'd label."""
    mistakes = [
        'sum(rate(tokenmill_requests{model_name=~"$model_name"}[5m]))',  # the family name, not the sample
        'histogram_quantile(0.9, rate(tokenmill_time_to_first_token_seconds{model_name=~"$m"}[5m]))',
        "histogram_quantile(0.9, sum by (instance) (rate(tokenmill_time_to_first_token_seconds_bucket[5m])))",
        "tokenmill_requests_total",
        "rate(tokenmill_workers_busy[5m])",
        "sum by (reasons) (rate(tokenmill_aborts_total[5m]))",
        'sum(rate(tokenmill_aborts_total{reasn="x"}[5m]))',
        "rate(tokenmill_no_such_metric_total[5m])",
        'sum(rate(tokenmill_requests_total{endpoint="/v1/chat/completion"}[5m]))',  # a value never exported
        "rate(tokenmill_tokenize_cache_bytes[5m])",  # a gauge
        "tokenmill_tokenize_cache_mismatches_total",  # a counter read raw
    ]
    for expr in mistakes:
        assert check_queries([("t", expr)], exported), f"not caught: {expr}"
    assert check_queries([("t", 'sum by (reason) (rate(tokenmill_aborts_total{reason=~"x"}[5m]))')], exported) == []
    chat = 'sum(rate(tokenmill_requests_total{endpoint="/v1/chat/completions", status="200"}[5m]))'
    assert check_queries([("t", chat)], exported) == []
