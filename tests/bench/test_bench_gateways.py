"""`tokenmill bench gateways` runs end to end: one and two gateway processes on the same loads, every
figure reported (figures sane, no speed asserted; both gateways must have been up and both nodes served)."""

from __future__ import annotations

from conftest import run_bench

NODE_KEYS = {
    "gateways",
    "gateway_pids_seen",
    "ready_s",
    "processes",
    "pss_mib",
    "gateways_pss_mib",
    "idle_cpu_share",
    "metrics_scrape_p50_ms",
    "small",
    "streams",
}


def test_bench_gateways_compares_one_and_two_gateways(tmp_path):
    report, stdout = run_bench(
        tmp_path, "gateways", "--quick", "--levels", "64", "--window", "0.5", "--workers", "1", timeout=240
    )
    one, two = report["nodes"]
    for node, gateways in ((one, 1), (two, 2)):
        assert NODE_KEYS <= set(node), sorted(NODE_KEYS - set(node))
        assert node["gateways"] == gateways
        assert node["gateway_pids_seen"] == gateways  # every gateway process answered on the port
        assert node["pss_mib"] > node["gateways_pss_mib"] > 0
        for clients in ("8", "64"):
            assert node["small"][clients]["errors"] == 0
            assert node["small"][clients]["requests_per_s"] > 0
        (level,) = node["streams"]
        assert level["streams"] == 64 and level["errors"] == [], level
        assert level["delivered_tokens_per_s"] > 0
    assert two["processes"] == one["processes"] + 1  # the second gateway, and nothing else
    assert "2/1" in stdout and "64 streams: delivered tokens/s" in stdout
