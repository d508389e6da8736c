"""`tokenmill bench busy --quick` runs end to end and reports every figure, each one sane (conftest.run_bench checks every report; no speed is asserted)."""

from __future__ import annotations

import os
import signal
import time

import pytest
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


_SLEEP_WITH_CHILD = """
import os, sys, time
name, cpus = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    if name:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    time.sleep(60)
    os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two CPUs")
def test_split_cores_puts_each_engine_on_the_model_workers_cpus_and_each_front_end_on_the_others():
    """`tokenmill bench vllm --split-cores` on stand-ins for the two stacks' process trees: vLLM's API
    server with a model worker below it (bound to one CPU, as vLLM's OpenMP binding does), tokenmill's
    engine bridge, and tokenmill serve with a worker below it."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from tokenmill.bench.common import process_tree
    from tokenmill.bench.vllm import Stacks

    engine_cpu = min(os.sched_getaffinity(0))
    procs = [
        subprocess.Popen([sys.executable, "-c", _SLEEP_WITH_CHILD, name, cpus], stdout=subprocess.PIPE, text=True)
        for name, cpus in (("VLLM::Worker", str(engine_cpu)), ("", ""), ("tm-worker-0", ""))
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        trees = [list(process_tree(p.pid)) for p in procs]
        deadline = time.monotonic() + 10
        while any(len(t) < 2 for t in trees) and time.monotonic() < deadline:
            time.sleep(0.05)
            trees = [list(process_tree(p.pid)) for p in procs]
        model_worker = trees[0][1]
        while _comm(model_worker) != "VLLM::Worker" and time.monotonic() < deadline:
            time.sleep(0.05)
        stacks = Stacks.__new__(Stacks)
        stacks.procs = [SimpleNamespace(pid=p.pid) for p in procs]
        split = stacks.split_cores()
        front = set(os.sched_getaffinity(0)) - {engine_cpu}
        assert split == {"engine": [engine_cpu], "front": sorted(front)}
        api, bridge, serve = (p.pid for p in procs)
        for pid in (model_worker, *trees[1]):  # vLLM's engine below its API server; tokenmill's bridge tree
            assert os.sched_getaffinity(pid) == {engine_cpu}, pid
        for pid in (api, *trees[2]):  # vLLM's API server; tokenmill serve and its worker
            assert os.sched_getaffinity(pid) == front, pid
    finally:
        for p in procs:
            for pid in process_tree(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()
