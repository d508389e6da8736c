"""SIGTERM while conversions are stuck: they are answered, and the process still exits."""

from __future__ import annotations

import http.client
import json
import signal
import threading

from conftest import Server
from faultutil import state, wait_until

# ~2 billion template loop iterations: minutes of CPU, far longer than the shutdown timeout
STUCK = "{% for i in range(100000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}x"


def test_sigterm_answers_stuck_and_queued_conversions():
    srv = Server(
        "--workers", "1", "--trust-request-chat-template", "--shutdown-timeout", "1", "--conversion-timeout", "600"
    )
    results: list = []

    def post():
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        body = json.dumps(
            {"model": "deepseek-v4", "messages": [{"role": "user", "content": "hi"}], "chat_template": STUCK}
        )
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            results.append((resp.status, json.loads(resp.read())))
        except Exception as exc:  # reported below
            results.append(("exception", repr(exc)))
        finally:
            conn.close()

    threads = [threading.Thread(target=post) for _ in range(3)]  # one converting, two queued
    for t in threads:
        t.start()
    try:
        wait_until(lambda: state(srv)["conversions_in_flight"] == 3, timeout=30, what="3 conversions in flight")
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0  # bounded: the stuck conversion would take minutes
    finally:
        srv.stop()
    for t in threads:
        t.join(30)
    print("answers:", [(s, b["error"]["code"] if isinstance(b, dict) else b) for s, b in results])
    assert len(results) == 3
    assert all(status == 503 and body["error"]["code"] == "shutdown" for status, body in results), results
