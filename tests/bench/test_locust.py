"""deploy/loadtest/locustfile.py: every user class runs against a real tokenmill without one failure.

locust runs headless in its own process for 15 s against `tokenmill serve` (simulated scheduler,
loopback); its stats CSV must show requests of every kind and no failures.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import ROOT, Server

LOCUSTFILE = ROOT / "deploy" / "loadtest" / "locustfile.py"
USERS = ["ShortChatUser", "LongContextUser", "StreamingChatUser", "MultiTurnUser"]
# (type, name) rows each user class must produce
EXPECTED_ROWS = {
    ("POST", "short chat"),
    ("POST", "long-context chat"),
    ("POST", "/tokenize (calibration)"),
    ("POST", "chat stream"),
    ("TTFT", "chat stream"),
    ("ITL", "chat stream"),
    ("E2E", "chat stream"),
    ("POST", "multi-turn chat"),
    ("GET", "/v1/models"),
}


def run_locust(host: str, out: Path, *, users: int, run_time: str, env: dict | None = None, classes=USERS):
    """Run locust headless; (return code, output, stats rows keyed by (type, name), failure rows)."""
    prefix = out / "run"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        host,
        "-u",
        str(users),
        "-r",
        str(users),
        "--run-time",
        run_time,
        "--stop-timeout",
        "10",
        "--csv",
        str(prefix),
        "--exit-code-on-error",
        "1",
        "--only-summary",
        "--loglevel",
        "WARNING",
        *classes,
    ]
    proc = subprocess.run(
        cmd,
        cwd=out,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "LOADTEST_LONG_CONTEXT_TOKENS": "20000", "LOADTEST_MAX_TOKENS": "48", **(env or {})},
    )
    output = proc.stdout + proc.stderr
    stats_file = Path(f"{prefix}_stats.csv")
    assert stats_file.exists(), f"locust wrote no stats (exit {proc.returncode}):\n{output[-4000:]}"
    with open(stats_file, newline="") as f:
        stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(f) if r["Name"] != "Aggregated"}
    with open(f"{prefix}_failures.csv", newline="") as f:
        failures = list(csv.DictReader(f))
    return proc.returncode, output, stats, failures


@pytest.fixture
def tokenmill():
    srv = Server("--workers", "2", "--sim-inter-token-latency-ms", "5")
    yield srv
    srv.stop()


def test_every_user_class_runs_clean(tokenmill, tmp_path):
    code, output, stats, failures = run_locust(tokenmill.url, tmp_path, users=8, run_time="6s")
    listed = [f"{f['Method']} {f['Name']}: {f['Error']} x{f['Occurrences']}" for f in failures]
    assert not failures, "failed requests:\n" + "\n".join(listed)
    failed = {key: row["Failure Count"] for key, row in stats.items() if int(row["Failure Count"])}
    assert not failed, failed
    missing = {key for key in EXPECTED_ROWS if int(stats.get(key, {}).get("Request Count", 0)) == 0}
    assert not missing, f"no requests of {sorted(missing)}; rows: {sorted(stats)}\n{output[-3000:]}"
    assert code == 0, output[-4000:]
    # the figures make sense: a stream's first token comes before its end, and streams have gaps between tokens
    median = {kind: float(stats[(kind, "chat stream")]["Median Response Time"]) for kind in ("TTFT", "E2E")}
    assert median["TTFT"] <= median["E2E"], median
    assert int(stats[("ITL", "chat stream")]["Request Count"]) > int(stats[("TTFT", "chat stream")]["Request Count"])


class BadServer(ThreadingHTTPServer):
    """A server that answers chats wrongly in turn: an HTTP error, a malformed body, a broken stream."""

    daemon_threads = True

    def __init__(self):
        self.counts = {"plain": itertools.count(), "stream": itertools.count()}
        super().__init__(("127.0.0.1", 0), BadHandler)


class BadHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes, content_type: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply(200, b'{"object": "list", "data": [{"id": "m"}]}')

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kind = "stream" if request.get("stream") else "plain"
        n = next(self.server.counts[kind]) % 3
        if n == 0:
            self.reply(500, b'{"error": {"message": "boom"}}')
        elif kind == "plain":
            self.reply(200, [b'{"choices": []}', b"not json"][n - 1])
        else:
            chunk = (
                b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
            )
            self.reply(200, [chunk, chunk + b"data: {oops\n\n"][n - 1], "text/event-stream")


def test_bad_answers_are_failures(tmp_path):
    """The locustfile fails non-200s, malformed JSON, and streams that are malformed or end early."""
    server = BadServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host = f"http://127.0.0.1:{server.server_address[1]}"
        code, output, stats, failures = run_locust(
            host, tmp_path, users=4, run_time="5s", classes=["ShortChatUser", "StreamingChatUser"]
        )
    finally:
        server.shutdown()
        server.server_close()
    assert code != 0, "locust exited 0 although requests failed"
    assert (
        int(stats[("POST", "short chat")]["Request Count"]) == int(stats[("POST", "short chat")]["Failure Count"]) > 0
    )
    assert (
        int(stats[("POST", "chat stream")]["Request Count"]) == int(stats[("POST", "chat stream")]["Failure Count"]) > 0
    )
    assert ("TTFT", "chat stream") not in stats  # a failed stream records no latencies
    errors = " | ".join(f["Error"] for f in failures)
    for expected in ["HTTP 500", "malformed answer", "stream ended without data: [DONE]", "malformed stream"]:
        assert expected in errors, f"{expected!r} not among: {errors}"
