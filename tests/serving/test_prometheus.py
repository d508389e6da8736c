"""deploy/prometheus and deploy/grafana judged by a real Prometheus (Debian's ``prometheus`` package,
with ``promtool``, which scripts/test.sh installs): the scrape config and the rule file pass
promtool's checks, every alert's unit tests pass (deploy/prometheus/tokenmill-alerts.test.yml), and a
Prometheus scraping a live ``tokenmill serve --gateways 2`` under load answers every query of every
dashboard panel with data that makes sense, and sees a killed worker as the alert says."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
from http.client import HTTPConnection

import numpy as np
import pytest
import yaml
from conftest import ROOT, Server, free_port, http
from image_model import make_vl_model
from PIL import Image

from tokenmill.bench.servers import ProcessHandle

DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
ALERTS = PROMETHEUS_DIR / "tokenmill-alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "tokenmill-alerts.test.yml"
SCRAPE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "tokenmill-dashboard.json"
MODEL = "Tiny-Qwen2-VL"

pytestmark = pytest.mark.skipif(
    not (shutil.which("promtool") and shutil.which("prometheus")),
    reason="Prometheus is not installed (scripts/test.sh installs Debian's prometheus package as root)",
)


def promtool(*args: str, cwd=PROMETHEUS_DIR) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]


# ---- promtool ------------------------------------------------------------------------------------


def test_promtool_accepts_the_shipped_config_and_rules_and_refuses_broken_ones(tmp_path):
    checked = promtool("check", "config", str(SCRAPE_CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1 rule files found" in checked.stdout  # the config names the rule file beside it, and it parses
    rules = promtool("check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"{len(alerts())} rules found" in rules.stdout

    broken = tmp_path / "broken-alerts.yml"
    broken.write_text(ALERTS.read_text().replace("(tokenmill_workers_alive) == 0", "(tokenmill_workers_alive == 0", 1))
    refused = promtool("check", "rules", str(broken))
    assert refused.returncode != 0 and "TokenmillNoTokenizerWorkers" not in refused.stdout.split("SUCCESS")[0]
    assert "parse error" in (refused.stdout + refused.stderr)
    config = tmp_path / "prometheus.yml"
    config.write_text(SCRAPE_CONFIG.read_text().replace("scrape_timeout: 4s", "scrape_timeout: 40s"))
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    refused = promtool("check", "config", str(config), cwd=tmp_path)  # a timeout longer than the interval
    assert refused.returncode != 0, refused.stdout


def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not():
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    fired, quiet = set(), set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert fired == names and quiet == names, (names - fired, names - quiet)
    ran = promtool("test", "rules", ALERT_TESTS.name)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "SUCCESS" in ran.stdout


def test_the_alert_tests_fail_when_an_alert_changes(tmp_path):
    """Each case pins its alert's threshold, `for:` and annotations: a rule that waits longer, or says
    something else, fails its test."""
    text = ALERTS.read_text()
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    changes = {
        "TokenmillDown": (
            'expr: up{job="tokenmill"} == 0\n        for: 1m',
            'expr: up{job="tokenmill"} == 0\n        for: 3m',
        ),
        "TokenmillServerErrors": ("> 0.01", "> 0.2"),
        "TokenmillRankErrors": ("rank_requests_total[5m])) > 0.1", "rank_requests_total[5m])) > 0.3"),
        "TokenmillEventLoopLag": ("event-loop lag p99", "loop lag p99"),
    }
    for alert, (old, new) in changes.items():
        assert text.count(old) == 1, old
        (tmp_path / ALERTS.name).write_text(text.replace(old, new))
        ran = promtool("test", "rules", ALERT_TESTS.name, cwd=tmp_path)
        assert ran.returncode != 0 and alert in ran.stdout + ran.stderr, (alert, ran.stdout)


# ---- a live Prometheus ---------------------------------------------------------------------------


class Prometheus(ProcessHandle):
    """A Prometheus on loopback with a temporary data directory, scraping ``target`` every second with
    the shipped scrape job and evaluating the shipped alert rules every second; ready when constructed,
    stopped (SIGTERM, then SIGKILL) by stop()."""

    def __init__(self, target: str, workdir):
        config = yaml.safe_load(SCRAPE_CONFIG.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(ALERTS)]
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tokenmill"]
        job.update(scrape_interval="1s", scrape_timeout="1s")
        job["static_configs"][0]["targets"] = [target]
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            "prometheus",
            f"--config.file={path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        super().__init__("prometheus", args, log=workdir / "prometheus.log")
        self.wait_until(lambda: http("GET", self.url + "/-/ready", timeout=2)[0] == 200, 60)

    def api(self, path: str, **params) -> dict:
        status, _, answer = http("GET", f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30)
        assert status == 200 and isinstance(answer, dict) and answer["status"] == "success", (path, params, answer)
        return answer["data"]

    def wait_up(self, timeout: float = 60) -> None:
        """Until the target has been scraped (Prometheus hands discovered targets to its scrapers every 5 s)."""
        self.wait_until(lambda: any(t["health"] == "up" for t in self.api("targets")["activeTargets"]), timeout)

    def wait_scraped_after(self, moment: float, timeout: float = 30) -> None:
        """Until Prometheus holds a scrape of the target taken after ``moment`` (a time.time())."""
        self.wait_until(
            lambda: any(float(r["value"][1]) > moment for r in self.query('timestamp(up{job="tokenmill"})')),
            timeout,
        )

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]


def _png(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def drive_load(srv: Server) -> None:
    """A bounded load through every API the dashboard has panels for, over about five seconds: chats
    (whole and streamed), Anthropic Messages, an image chat, a bad request, a body too large, and a
    client that leaves."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten, please."}]}
    for i in range(6):
        status, _, body = http("POST", srv.url + "/v1/chat/completions", {**chat, "max_tokens": 8}, timeout=30)
        assert status == 200, body
        status, _, raw = http(
            "POST", srv.url + "/v1/chat/completions", {**chat, "max_tokens": 12, "stream": True}, timeout=30
        )
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        messages = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": f"Hello {i}"}]}
        status, _, body = http("POST", srv.url + "/v1/messages", messages, timeout=30)
        assert status == 200, body
        image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": _png(i % 2)}}]
        status, _, body = http(
            "POST",
            srv.url + "/v1/chat/completions",
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": image}]},
            timeout=60,
        )
        assert status == 200, body
        time.sleep(0.4)  # spread over several scrapes, so that rates see the counters move
    assert http("POST", srv.url + "/v1/chat/completions", {"model": MODEL, "messages": "nope"})[0] == 400
    assert http("POST", srv.url + "/v1/chat/completions", b"{" + b" " * 70_000 + b"}")[0] == 413
    conn = HTTPConnection("127.0.0.1", srv.port, timeout=30)  # leaves after its first chunk: an abort
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


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(tokenmill serve --gateways 2 on a vision model, a Prometheus scraping it), after a bounded load."""
    model = make_vl_model(tmp_path_factory.mktemp("vl"))
    srv = Server(
        "--gateways", "2", "--workers", "1", "--model", str(model), "--sim-inter-token-latency-ms", "2",
        "--max-body-bytes", "65536", "--tool-call-parser", "hermes",
    )  # fmt: skip
    prometheus = None
    try:
        prometheus = Prometheus(f"127.0.0.1:{srv.port}", tmp_path_factory.mktemp("prometheus"))
        prometheus.wait_up()
        drive_load(srv)
        prometheus.wait_scraped_after(time.time() + 1)  # the load's last counts, and a scrape after them
        yield srv, prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        srv.stop()


def filled(expr: str, instance: str) -> str:
    """A panel's query as Prometheus gets it once Grafana has filled in its variables."""
    expr = re.sub(r"\$__rate_interval\b|\$\{__rate_interval\}|\$__range\b|\$\{__range\}|\$__interval\b", "5m", expr)
    expr = re.sub(r"\$\{?model_name\}?", MODEL, expr)
    return re.sub(r"\$\{?instance\}?", instance, expr)  # in a regex matcher: its dots match themselves too


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every target of every panel, collapsed rows' panels included."""

    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in walk(dashboard["panels"]) for t in p.get("targets", [])]


def test_prometheus_scrapes_every_gateway_through_the_one_port(live):
    srv, prometheus = live
    (target,) = prometheus.api("targets")["activeTargets"]
    assert target["health"] == "up" and target["labels"]["job"] == "tokenmill", target
    assert target["labels"]["cluster"] == "inference"  # the shipped scrape config's static label
    (processes,) = prometheus.query("sum(tokenmill_gateway_processes)")
    assert float(processes["value"][1]) == 2


def test_every_dashboard_query_returns_data_that_makes_sense(live):
    srv, prometheus = live
    instance = f"127.0.0.1:{srv.port}"
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:  # the variables' own queries list this node
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            selector, label = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query).groups()
            values = prometheus.api("label/" + label + "/values", **{"match[]": filled(selector, instance)})
            assert (MODEL if label == "model_name" else instance) in values, (variable["name"], values)
    empty, bad, quantiles = [], [], {}
    for title, ref, expr in panel_queries():
        result = prometheus.query(filled(expr, instance))
        if not result:
            empty.append(f"{title} {ref}: {expr}")
            continue
        values = [float(r["value"][1]) for r in result]
        if any(math.isnan(v) or v < 0 for v in values):  # a quantile of nothing observed is NaN
            bad.append(f"{title} {ref}: {values}")  # rates, counts, gauges, ratios, quantiles: none negative
        grouping = re.match(r"\s*\w+ by \(([^)]*)\)", expr)  # the outermost aggregation's labels
        for label in [g.strip() for g in grouping[1].split(",")] if grouping else []:
            if not any(r["metric"].get(label) for r in result):
                bad.append(f"{title} {ref}: grouped by {label!r}, which none of its series has")
        q = re.match(r"\s*histogram_quantile\((0\.\d+),(.*)\)\s*$", expr, re.S)
        if q and len(result) == 1:
            quantiles.setdefault((title, q[2]), []).append((float(q[1]), values[0]))
    assert not empty, "queries with no series:\n" + "\n".join(empty)
    assert not bad, bad
    assert len(quantiles) >= 8, quantiles  # TTFT, ITL, end-to-end, queue waits, render, tokenize...
    for (title, _), points in quantiles.items():
        ordered = [v for _, v in sorted(points) if not math.isnan(v)]
        assert ordered == sorted(ordered), (title, points)  # p50 <= p90 <= p99
    (requests,) = prometheus.query(f'sum(increase(tokenmill_requests_total{{instance="{instance}"}}[5m]))')
    assert float(requests["value"][1]) >= 24  # the counters moved: 24 requests answered 200, and more


def test_every_series_the_alerts_read_is_scraped(live):
    _, prometheus = live
    scraped = set(prometheus.api("label/__name__/values"))
    for alert in alerts():
        for name in re.findall(r"\b(?:tokenmill_\w+|up)\b(?=\s*[{\[)])", alert["expr"]):
            assert name in scraped, f"{alert['alert']}: {name} is not among what Prometheus scraped"


def test_a_killed_worker_makes_the_restart_alert_fire(live):
    srv, prometheus = live
    expr = next(a["expr"] for a in alerts() if a["alert"] == "TokenmillWorkerRestarts")
    assert prometheus.query(expr) == []
    workers = [
        pid
        for pid in srv.children()
        if b"tokenmill.tokenizer_workers.worker" in open(f"/proc/{pid}/cmdline", "rb").read()  # noqa: SIM115
    ]
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    firing = []
    while time.monotonic() < deadline and not firing:
        time.sleep(1)
        firing = [
            a for a in prometheus.api("alerts")["alerts"] if a["labels"]["alertname"] == "TokenmillWorkerRestarts"
        ]
    assert firing and firing[0]["state"] == "firing", prometheus.api("alerts")
    assert prometheus.query(expr), "the alert's expression is true in Prometheus"
    assert firing[0]["labels"]["instance"] == f"127.0.0.1:{srv.port}"
