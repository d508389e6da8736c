"""`tokenmill bench busy --quick` runs end to end and reports every figure, each one sane (conftest.run_bench checks every report; no speed is asserted)."""

from __future__ import annotations

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
        "--busy-cores",
        "1",  # one spinning core of two: the figures are all there, in less time than with both spinning
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
    assert report["workload"]["busy_cores"] == 1  # as asked (by default every core spins)
    assert "pool/inline" in stdout and "pool/thread" in stdout


def test_one_stream_kept_alive_while_long_prompts_convert_reports_sane_figures_and_every_thread():
    """measure_busy(kept_alive=True) against tokenmill serve on its simulator, as `tokenmill bench vllm
    --scenarios busy_stream` runs it on both stacks: the stream's figures, /health, the rounds, and the
    census of the server's threads over the rounds."""
    from tokenmill.bench.busy import _send_chat_rounds, measure_busy
    from tokenmill.bench.common import long_bodies
    from tokenmill.bench.servers import ServeProcess

    server = ServeProcess("pool", 1, itl_ms=5)
    try:
        rounds = [long_bodies(2, 20000, server.model) for _ in range(2)]
        row = measure_busy(
            server.port, server.model, _send_chat_rounds, rounds, 0, 32, kept_alive=True, roots=[server.pid]
        )
    finally:
        server.close()
    assert row["errors"] == [], row["errors"]
    assert row["conversion_wall_s"] > 0 and row["stream_tokens_per_s"] > 0 and row["stream_tokens_share"] > 0, row
    assert row["health_p50_ms"] <= row["health_p99_ms"] <= row["health_max_ms"], row
    assert row["stream_gap_p99_ms"] <= row["kept_alive_gap_max_ms"], row  # the wait for the next stream counts too
    threads = {(t["process"], t["thread"]): t for t in row["threads"]}
    converting = threads[("tm-worker", "tm-convert")]
    assert converting["cpu_s"] > 0 and converting["threads"] >= 2, converting  # the workers' conversion threads ran
    assert threads[("tm-gateway", "tm-gateway")]["cpu_s"] > 0
    assert all(t["cpu_s"] >= 0 and t["wait_s"] >= 0 for t in row["threads"])
    assert row["threads_s"] > 0
