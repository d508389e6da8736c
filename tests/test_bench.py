"""`tokenmill bench --quick` runs end to end and reports every figure (values are not asserted)."""

from __future__ import annotations

from conftest import run_bench

MODE_KEYS = {"health_p99_ms", "health_max_ms", "stream_gap_p99_ms", "stream_gap_max_ms",
             "loop_lag_p99_ms", "loop_lag_max_ms", "requests_per_s", "prompt_tokens_per_s"}  # fmt: skip


def test_bench_quick_json_has_every_key(tmp_path):
    # the smallest load that still runs every part: the figures are not asserted, the report's shape is
    report, stdout = run_bench(tmp_path, "--quick", "--requests", "2", "--tokens", "20000", "--rounds", "1")
    assert set(report["modes"]) == {"inline", "thread", "pool"}
    for mode, row in report["modes"].items():
        assert MODE_KEYS <= set(row), (mode, sorted(MODE_KEYS - set(row)))
        assert row["errors"] == [], (mode, row["errors"])
        assert row["long_requests"] == 2 * 2 and row["passes"] == 2  # each mode twice, in mirrored order
    assert 0 < report["worker_efficiency"]
    assert {"cores", "python", "tokenizers"} <= set(report["machine"])
    assert set(report["small_requests"]) == {"inline", "pool"}
    assert set(report["small"]) == {"8", "64"}
    for row in report["small"].values():
        assert set(row) == {"pool_req_s", "inline_req_s", "pool_p50_ms", "inline_p50_ms"}
        assert row["pool_req_s"] > 0 and row["inline_req_s"] > 0
    assert "pool/inline" in stdout and "pool/thread" in stdout
