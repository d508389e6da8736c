"""`tokenmill bench busy --quick` runs end to end and reports every figure (values are not asserted)."""

from __future__ import annotations

import os

from conftest import run_bench


def test_bench_busy_reports_every_figure_for_every_mode(tmp_path):
    report, stdout = run_bench(
        tmp_path,
        "busy",
        "--quick",
        "--passes",
        "1",
        "--requests",
        "1",
        "--tokens",
        "20000",
        "--rounds",
        "1",
        "--busy-rate",
        "10",
    )
    assert set(report["modes"]) == {"inline", "thread", "pool"}
    for mode, row in report["modes"].items():
        assert {
            "health_p50_ms",
            "health_p99_ms",
            "health_max_ms",
            "loop_lag_p99_ms",
            "loop_lag_max_ms",
            "conversion_wall_s",
            "chat_ttft_p50_ms",
            "chat_ttft_p99_ms",
            "chat_e2e_p99_ms",
            "chats",
        } <= set(row), mode
        assert row["errors"] == [], (mode, row["errors"])
        assert row["chats"] > 0 and row["conversion_wall_s"] > 0 and row["health_p99_ms"] is not None, (mode, row)
    assert report["workload"]["busy_cores"] == os.cpu_count()
    assert "pool/inline" in stdout and "pool/thread" in stdout
