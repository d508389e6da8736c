"""`tokenmill bench --quick` runs end to end and reports every figure, each one sane (conftest.run_bench checks every report; no speed is asserted)."""

from __future__ import annotations

from conftest import run_bench

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
