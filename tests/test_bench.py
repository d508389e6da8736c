"""`tokenmill bench --quick` runs end to end and reports every figure (values are not asserted)."""

from __future__ import annotations

from conftest import run_bench
from tokenmill.bench import summarize

MODE_KEYS = {"health_p99_ms", "health_max_ms", "stream_gap_p99_ms", "stream_gap_max_ms",
             "loop_lag_p99_ms", "loop_lag_max_ms", "requests_per_s", "prompt_tokens_per_s"}  # fmt: skip


def test_bench_quick_json_has_every_key(tmp_path):
    # the smallest load that still runs every part: the figures are not asserted, the report's shape is
    report, stdout = run_bench(tmp_path, "--quick", "--requests", "2", "--tokens", "20000", "--rounds", "1", "--passes", "1",
                               "--small-requests", "200")
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
    assert "pool/inline" in stdout and "pool/thread" in stdout


def test_passes_pool_their_samples_and_their_time():
    """A mode's passes (run in mirrored order) count as one run: samples pooled, throughput over the summed time."""
    first = {"long": {"elapsed": 1.0, "prompt_tokens": [100, 100], "errors": []}, "health": [1.0] * 99 + [50.0],
             "gaps": [20.0, 21.0], "lag": {"p99_ms": 3.0, "max_ms": 9.0}}
    second = {"long": {"elapsed": 3.0, "prompt_tokens": [200, 200], "errors": ["503: busy"]}, "health": [2.0] * 100,
              "gaps": [22.0], "lag": {"p99_ms": 5.0, "max_ms": 7.0}}  # fmt: skip
    row = summarize([first, second])
    assert row["prompt_tokens_per_s"] == 600 / 4.0 and row["requests_per_s"] == 1.0
    assert row["long_requests"] == 4 and row["passes"] == 2 and row["errors"] == ["503: busy"]
    assert row["health_probes"] == 200 and row["health_max_ms"] == 50.0
    assert row["loop_lag_p99_ms"] == 5.0 and row["loop_lag_max_ms"] == 9.0  # the worse pass
    assert row["stream_gap_max_ms"] == 22.0
