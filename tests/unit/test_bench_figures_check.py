"""The check every bench test applies to its report (conftest.insane_figures) finds what it should."""

from __future__ import annotations

from conftest import insane_figures


def test_out_of_order_percentiles_and_negative_figures_are_found_anywhere():
    report = {
        "levels": [{"gap_p50_ms": 3.0, "gap_p99_ms": 2.0, "gap_max_ms": 5.0, "delivered_tokens_per_s": -1}],
        "lag": {"p99_ms": 4.0, "max_ms": 3.0},
        "health_share": -0.1,
    }
    assert sorted(insane_figures(report)) == [
        "report.health_share = -0.1 < 0",
        "report.lag: p99_ms = 4.0 > max_ms = 3.0",
        "report.levels[0].delivered_tokens_per_s = -1 < 0",
        "report.levels[0]: gap_p50_ms = 3.0 > gap_p99_ms = 2.0",
    ]


def test_a_sane_report_passes():
    report = {"modes": {"pool": {"health_p50_ms": 0.4, "health_p99_ms": 0.9, "health_max_ms": 3.1, "errors": []}}}
    assert insane_figures(report) == []
