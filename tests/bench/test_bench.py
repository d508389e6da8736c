"""`tokenmill bench --quick` runs end to end and reports every figure, each one sane (conftest.run_bench checks every report; no speed is asserted)."""

from __future__ import annotations

from conftest import run_bench

from tokenmill.bench.frontloop import summarize

MODE_KEYS = {
    "health_p99_ms",
    "health_max_ms",
    "stream_gap_p99_ms",
    "stream_gap_max_ms",
    "loop_lag_p99_ms",
    "loop_lag_max_ms",
    "requests_per_s",
    "prompt_tokens_per_s",
}


def test_bench_quick_json_has_every_key(tmp_path):
    # the smallest load that still runs every part: its shape and sane figures are checked, not its speed
    report, stdout = run_bench(
        tmp_path,
        "--quick",
        "--requests",
        "2",
        "--tokens",
        "20000",
        "--rounds",
        "1",
        "--passes",
        "1",
        "--small-requests",
        "200",
    )
    assert set(report["modes"]) == {"inline", "thread", "pool"}
    for mode, row in report["modes"].items():
        assert MODE_KEYS <= set(row), (mode, sorted(MODE_KEYS - set(row)))
        assert row["errors"] == [], (mode, row["errors"])
        assert row["long_requests"] == 2 and row["passes"] == 1
    assert 0 < report["worker_efficiency"]
    assert {"cores", "python", "tokenizers"} <= set(report["machine"])
    assert set(report["small_requests"]) == {"inline", "pool"}
    assert set(report["small"]) == {"8", "64"}
    for row in report["small"].values():
        assert set(row) == {"pool_req_s", "inline_req_s", "pool_p50_ms", "inline_p50_ms"}
        assert row["pool_req_s"] > 0 and row["inline_req_s"] > 0
    assert set(report["medium"]) == {
        "clients",
        "body_bytes",
        "pool_req_s",
        "inline_req_s",
        "pool_p50_ms",
        "inline_p50_ms",
    }
    assert report["medium"]["pool_req_s"] > 0 and report["medium"]["inline_req_s"] > 0
    assert report["small_requests"]["pool"]["medium-16"]["errors"] == 0
    assert "pool/inline" in stdout and "pool/thread" in stdout and "pool/inline at medium-16" in stdout


def test_passes_pool_their_samples_and_their_time():
    """A mode's passes (run in mirrored order) count as one run: samples pooled, throughput over the summed time."""
    first = {
        "long": {"elapsed": 1.0, "prompt_tokens": [100, 100], "errors": []},
        "health": [1.0] * 99 + [50.0],
        "gaps": [20.0, 21.0],
        "lag": {"p99_ms": 3.0, "max_ms": 9.0},
    }
    second = {
        "long": {"elapsed": 3.0, "prompt_tokens": [200, 200], "errors": ["503: busy"]},
        "health": [2.0] * 100,
        "gaps": [22.0],
        "lag": {"p99_ms": 5.0, "max_ms": 7.0},
    }
    row = summarize([first, second])
    assert row["prompt_tokens_per_s"] == 600 / 4.0 and row["requests_per_s"] == 1.0
    assert row["long_requests"] == 4 and row["passes"] == 2 and row["errors"] == ["503: busy"]
    assert row["health_probes"] == 200 and row["health_max_ms"] == 50.0
    assert row["loop_lag_p99_ms"] == 5.0 and row["loop_lag_max_ms"] == 9.0  # the worse pass
    assert row["stream_gap_max_ms"] == 22.0


def test_the_load_client_counts_answers_and_keeps_what_went_wrong(server):
    """The small-request benchmark's client: every request answered once over its keep-alive
    connections; a refusal is an error with its status and body, never a latency."""
    import json

    from tokenmill.bench.load_client import post_many

    model = server.client().models.list().data[0].id
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello there."}]}
    good = post_many(server.port, "/v1/chat/completions", json.dumps(chat).encode(), 40, 4, timeout=60)
    assert len(good["latencies"]) == 40 and good["errors"] == []
    assert all(x > 0 for x in good["latencies"]) and good["cpu_s"] > 0

    wrong = post_many(
        server.port, "/v1/chat/completions", json.dumps({**chat, "model": "nope"}).encode(), 6, 2, timeout=60
    )
    assert wrong["latencies"] == [] and len(wrong["errors"]) == 6
    assert all(e.startswith("404: ") and "model_not_found" in e for e in wrong["errors"])


def test_the_load_client_reports_a_server_that_hangs_up_instead_of_waiting():
    import socket
    import threading

    from tokenmill.bench.load_client import post_many

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)

    def hang_up() -> None:  # read each request, answer nothing, close
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.close()

    t = threading.Thread(target=hang_up, daemon=True)
    t.start()
    try:
        res = post_many(listener.getsockname()[1], "/v1/chat/completions", b"{}", 10, 2, timeout=30)
    finally:
        t.join(30)
        listener.close()
    assert res["latencies"] == [] and len(res["errors"]) == 2
    assert all("closed before the answer was complete" in e for e in res["errors"])
