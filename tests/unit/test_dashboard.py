"""deploy/grafana and deploy/prometheus, read as files: the dashboard's layout and panels, which of
tokenmill's series each query reads and how (a counter or a histogram through rate() or increase(),
a gauge never), that every panel follows $model_name, and the provisioning files. A real Prometheus
parses, runs and alerts on them in tests/serving/test_prometheus.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import yaml
from conftest import ROOT

from tokenmill.gateway.metrics import Metrics

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tokenmill-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "tokenmill-alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"

# ---- the selectors of a query ---------------------------------------------------------------------
# Prometheus itself parses and runs every query (tests/serving/test_prometheus.py). What it does not
# check, and these do: which of our series a query reads, whether it reads a counter or a histogram
# through rate() or increase() and never a gauge, and whether every panel follows $model_name.

SELECTOR = re.compile(r"\b(tokenmill_\w+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
RATE_OF = re.compile(r"\b(rate|irate|increase)\(\s*$")


@dataclass
class Selector:
    metric: str
    matchers: dict[str, tuple[str, str]]
    rated: bool  # the argument of rate(), irate() or increase()
    ranged: bool  # followed by a range: [5m]


def selectors(expr: str) -> list[Selector]:
    """Every tokenmill series a query reads, in order, with its label matchers."""
    found = []
    for m in SELECTOR.finditer(expr):
        matchers = {k: (op, v) for k, op, v in MATCHER.findall(m[2] or "")}
        rated = bool(RATE_OF.search(expr[: m.start()]))
        found.append(Selector(m[1], matchers, rated, expr[m.end() :].lstrip().startswith("[")))
    return found


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as Prometheus would see them once Grafana has filled them in."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)  # $model_name, ${instance}: only ever inside matcher strings


def series_types() -> dict[str, str]:
    """Every sample name gateway/metrics.py exports -> its family's type."""
    types = {}
    for family in Metrics("m").registry.collect():
        if family.type == "counter":
            types[family.name + "_total"] = "counter"
        elif family.type == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                types[family.name + suffix] = "histogram"
        else:
            types[family.name] = family.type
    return types


def misreadings(queries: list[tuple[str, str]], types: dict[str, str]) -> list[str]:
    """A series we do not export, a counter or a histogram read raw, a gauge put through rate()."""
    problems = []
    for where, expr in queries:
        for s in selectors(grafana_to_promql(expr)):
            kind = types.get(s.metric)
            if kind is None:
                problems.append(f"{where}: {s.metric} is not exported")
            elif kind in ("counter", "histogram") and not (s.rated and s.ranged):
                problems.append(f"{where}: {s.metric} is a {kind}; read it through rate() or increase()")
            elif kind not in ("counter", "histogram") and s.rated:
                problems.append(f"{where}: {s.metric} is a {kind}; rate() of it means nothing")
    return problems


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
    used = {s.metric for p in panels for t in p["targets"] for s in selectors(t["expr"])}
    wanted = cache_series()
    assert len(wanted) == 10, sorted(wanted)  # the pattern still finds them all (a new one needs a panel too)
    assert wanted <= used, f"not on the Tokenization cache row: {sorted(wanted - used)}"

    def steps(title):
        p = by_title[title]
        assert p["type"] == "stat" and p["fieldConfig"]["defaults"]["color"]["mode"] == "thresholds", title
        return [(s["color"], s["value"]) for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    # mismatches: a count (ceil of the increase), green at 0, red from the first one
    mismatches = by_title["Tokenization cache mismatches"]
    assert [s.metric for t in mismatches["targets"] for s in selectors(t["expr"])] == [
        "tokenmill_tokenize_cache_mismatches_total"
    ]
    assert mismatches["targets"][0]["expr"].startswith("ceil(")
    assert steps("Tokenization cache mismatches") == [("green", None), ("red", 1)]
    # enabled: red unless 1
    assert steps("Tokenization cache enabled") == [("red", None), ("green", 1)]

    # the share is from_cache / (from_cache + tokenized); CPU per request divides by chat completions answered
    share = selectors(by_title["Prompt tokens from cache"]["targets"][0]["expr"])
    assert [s.metric for s in share] == [
        "tokenmill_prompt_tokens_from_cache_total",
        "tokenmill_prompt_tokens_from_cache_total",
        "tokenmill_prompt_tokens_tokenized_total",
    ]
    per_request = selectors(by_title["Tokenize CPU per chat request"]["targets"][0]["expr"])
    assert [(s.metric, s.matchers.get("endpoint")) for s in per_request] == [
        ("tokenmill_tokenize_cpu_seconds_total", None),
        ("tokenmill_requests_total", ("=", "/v1/chat/completions")),
    ]
    assert by_title["Tokenization cache bytes per worker"]["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert re.match(
        r"sum by \(instance, worker\)", by_title["Tokenization cache bytes per worker"]["targets"][0]["expr"]
    )


def test_every_dashboard_selector_filters_by_model():
    for where, expr in dashboard_queries():
        for s in selectors(expr):
            if where == "variable model_name":
                continue  # lists the models
            op, value = s.matchers.get("model_name", (None, None))
            assert (op, value) == ("=~", "$model_name"), f"{where}: {s.metric} ignores $model_name"


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


# ---- what a query reads ------------------------------------------------------------------------


def test_every_query_reads_exported_series_counters_through_rate_and_gauges_raw():
    types = series_types()
    queries = dashboard_queries() + alert_queries()
    assert len(queries) > 40
    problems = misreadings(queries, types)
    assert not problems, "\n".join(problems)


def test_the_check_catches_the_usual_slips():
    """A counter without _total, a bucket read raw, a gauge rated, a counter read raw, a metric we do not have."""
    types = series_types()
    mistakes = [
        'sum(rate(tokenmill_requests{model_name=~"$model_name"}[5m]))',  # the family name, not the sample
        "histogram_quantile(0.9, sum by (le) (tokenmill_time_to_first_token_seconds_bucket))",
        "tokenmill_requests_total",
        "rate(tokenmill_workers_busy[5m])",
        "rate(tokenmill_no_such_metric_total[5m])",
        "rate(tokenmill_tokenize_cache_bytes[5m])",  # a gauge
        "avg_over_time(tokenmill_tokenize_cache_mismatches_total[5m])",  # a counter, but not through rate()
    ]
    for expr in mistakes:
        assert misreadings([("t", expr)], types), f"not caught: {expr}"
    fine = [
        'sum by (reason) (rate(tokenmill_aborts_total{reason=~"x"}[5m]))',
        "histogram_quantile(0.9, sum by (le) (rate(tokenmill_time_to_first_token_seconds_bucket[$__rate_interval])))",
        "sum(avg_over_time(tokenmill_workers_busy[10m]))",
    ]
    assert misreadings([("t", e) for e in fine], types) == []


def test_the_readme_lists_every_alert_with_its_severity_and_wait():
    """An operator paged at night reads the README's alert table: one row per rule in the file, with the
    severity and `for:` the rule has, and nothing it no longer has."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Alerts") :]
    section = section[: section.index("\n## ")]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| (Tokenmill\w+) \(([^)]*)\) \|", section, re.M)}
    rules = {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert set(rows) == set(rules), (set(rules) - set(rows), set(rows) - set(rules))
    for name, rule in rules.items():
        wait = rule.get("for")
        expected = rule["labels"]["severity"] + (f", {wait[:-1]} {wait[-1]}" if wait else "")
        assert rows[name] == expected, (name, rows[name], expected)
