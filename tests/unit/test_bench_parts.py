"""Parts of the benches that need no server: how passes pool into one row, how the load client reports a
server that hangs up, how the image scenario nets out an idle front's CPU."""

from __future__ import annotations

from tokenmill.bench import images as img
from tokenmill.bench.frontloop import summarize


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


def test_the_net_ratio_takes_the_idle_rate_off_each_turn():
    """1 s of first turns at 10 ms CPU, 0.5 s of resends at 3 ms, an idle front at 2 ms per s: (3 - 1) / (10 - 2)."""
    assert img._net_ratio({"first": 0.010, "resend": 0.003}, {"first": 1.0, "resend": 0.5}, 0.002) == 0.25
    assert img._net_ratio({"first": 0.010, "resend": 0.0005}, {"first": 1.0, "resend": 0.5}, 0.002) == 0.0
    assert img._net_ratio({"first": 0.001, "resend": 0.0}, {"first": 1.0, "resend": 0.5}, 0.002) is None


def test_busy_stream_targets_are_judged_on_the_medians_and_on_every_run_pair():
    from tokenmill.bench.vllm import BUSY_TARGETS, busy_targets

    def row(conversion, gap, p99, peak):
        return {"conversion_wall_s": conversion, "stream_gap_p99_ms": gap, "health_p99_ms": p99, "health_max_ms": peak}

    vllm_runs = [row(3.0, 10.0, 20.0, 50.0), row(2.0, 8.0, 16.0, 40.0)]
    ours = [row(1.5, 12.0, 1.0, 5.0), row(2.5, 6.0, 6.0, 4.0)]
    report = {
        "runs": {"vllm": {"busy_stream": vllm_runs}, "tokenmill": {"busy_stream": ours}},
        "vllm": {"busy_stream": row(2.5, 9.0, 18.0, 45.0)},
        "tokenmill": {"busy_stream": row(2.0, 9.0, 3.5, 4.5)},
    }
    got = {t["figure"]: t for t in busy_targets(report)}
    assert set(got) == {figure for figure, _ in BUSY_TARGETS}
    assert got["conversion_wall_s"]["met"] and got["conversion_wall_s"]["pairs_met"] == 1  # 2.5 s > 2.0 s in pair 2
    assert got["stream_gap_p99_ms"]["ratio"] == 1.0 and got["stream_gap_p99_ms"]["met"]  # no worse: equal passes
    assert got["stream_gap_p99_ms"]["pairs_met"] == 1  # 12 > 10 in the first pair
    assert got["health_p99_ms"]["met"] and got["health_p99_ms"]["pairs_met"] == 1  # 6 / 16 is not 4x lower
    assert got["health_max_ms"]["met"] and got["health_max_ms"]["pairs"] == 2 and got["health_max_ms"]["pairs_met"] == 2
    report["tokenmill"]["busy_stream"]["stream_gap_p99_ms"] = 9.5
    assert not {t["figure"]: t for t in busy_targets(report)}["stream_gap_p99_ms"]["met"]


def test_the_http_pairing_puts_tokenmill_in_front_of_vllms_own_server(monkeypatch, tmp_path):
    """`tokenmill bench vllm --pairing http`: one vLLM server with its token-in API on, and tokenmill in front
    of it (--engine-url), no engine process of tokenmill's own; the default pairing keeps its own engine."""
    from tokenmill.bench import vllm as bench_vllm

    started: list[tuple[str, list[str]]] = []

    class Recorded:
        def __init__(self, name, args, **kw):
            started.append((name, args))
            self.pid = len(started)

    monkeypatch.setattr(bench_vllm, "ProcessHandle", Recorded)
    stacks = bench_vllm.Stacks("python", "model", str(tmp_path), pairing="http")
    (vllm_name, vllm_args), (front_name, front_args) = started
    assert (vllm_name, front_name) == ("vllm", "tokenmill") and "--enable-scale-out" in vllm_args
    assert front_args[front_args.index("--engine-url") + 1] == f"http://127.0.0.1:{stacks.vllm_port}"
    assert "--scheduler" not in front_args
    started.clear()
    bench_vllm.Stacks("python", "model", str(tmp_path))
    assert [name for name, _ in started] == ["vllm", "engine", "tokenmill"]
    assert "--enable-scale-out" not in started[0][1] and "--scheduler" in started[2][1]
