"""`tokenmill bench dp --engine sim` runs end to end: two simulated scheduler ranks with a modelled prefix
cache, one run per --dp-policy; affinity keeps conversations where their history is cached."""

from __future__ import annotations

from conftest import run_bench

POLICY_KEYS = {
    "cached_share",
    "late_ttft_p50_ms",
    "late_ttft_p99_ms",
    "ideal_cached_share",
    "missed_turns",
    "requests_per_rank",
    "errors",
}


def test_bench_dp_sim_affinity_keeps_the_prefix_cache(tmp_path):
    report, stdout = run_bench(
        tmp_path, "dp", "--engine", "sim", "--quick", "--conversations", "4", "--turns", "5", timeout=180
    )
    assert report["engine"] == "sim"
    ideal = report["ideal_cached_share"]
    assert 0.5 < ideal < 1
    for policy in ("affinity", "round_robin", "least_loaded"):
        row = report[policy]
        assert POLICY_KEYS <= set(row), sorted(POLICY_KEYS - set(row))
        assert row["errors"] == [], row
        assert row["late_ttft_p50_ms"] > 0
        assert row["prompt_token_mismatches"] == 0  # usage.prompt_tokens == what /tokenize says
        assert sum(row["requests_per_rank"]) == row["turns"]
        assert all(n > 0 for n in row["requests_per_rank"]), row  # both ranks served
        assert row["cached_share"] <= row["ideal_cached_share"] + 1e-9
    affinity, round_robin = report["affinity"], report["round_robin"]
    assert affinity["cached_share"] > round_robin["cached_share"]
    assert affinity["cached_share"] >= 0.9 * ideal, (affinity, ideal)
    assert "of ideal" in stdout
