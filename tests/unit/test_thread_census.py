"""The benches' thread census (tokenmill/bench/threads.py) and the kept-alive stream's figures
(tokenmill/bench/busy.py): what they report is what the threads and the stream did."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tokenmill.bench import threads as census
from tokenmill.bench.busy import kept_alive_figures

# A process with a named thread that spins and one that sleeps in short naps; it prints its pid.
_WORKLOAD = textwrap.dedent(
    """
    import ctypes, hashlib, threading, time, sys
    libc = ctypes.CDLL(None)
    def named(name):
        libc.prctl(15, ctypes.c_char_p(name.encode()))  # PR_SET_NAME: this thread's comm
    def spin():
        named("spinner-0")
        block = b"x" * (1 << 20)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            hashlib.sha256(block).digest()  # computes with the GIL released: no switches to hand it over
    def nap():
        named("napper-3")
        for _ in range(30000):
            time.sleep(0.001)
    for target in (spin, nap):
        threading.Thread(target=target, daemon=True).start()
    print("up", flush=True)
    time.sleep(30)
    """
)


def test_a_spinning_thread_shows_cpu_and_a_napping_one_voluntary_switches():
    proc = subprocess.Popen([sys.executable, "-c", _WORKLOAD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        time.sleep(0.2)
        before = census.census([proc.pid])
        time.sleep(1.0)
        after = census.census([proc.pid])
    finally:
        proc.kill()
        proc.wait()
    rows = {r.thread: r for r in census.by_role(census.delta(before, after))}
    spinner, napper = rows["spinner"], rows["napper"]  # trailing numbers folded into the role
    assert spinner.cpu + spinner.wait > 0.8, spinner  # a whole second running or waiting for a core
    assert napper.voluntary > 50 and napper.cpu < spinner.cpu, napper  # it blocked every millisecond or so
    assert spinner.cpu > 0.2 and spinner.voluntary < napper.voluntary / 4, (spinner, napper)
    assert spinner.policy == "other" and spinner.nice == "0"
    assert all(r.cpu >= 0 and r.wait >= 0 for r in rows.values())
    text = census.table(list(rows.values()), 1.0)
    assert "spinner" in text.splitlines()[1], text  # the busiest first


def test_roles_fold_numbered_names_and_a_thread_born_since_counts_whole():
    assert census.role("tm-convert-1") == "tm-convert"
    assert census.role("tm-worker-12") == "tm-worker"
    assert census.role("ZMQbg/IO/0") == "ZMQbg/IO/"
    assert census.role("VLLM::Worker") == "VLLM::Worker"
    sample = census.ThreadSample(1, 2, "p", "t-1", 1.5, 0.5, 3, 4, 0, "other")
    (share,) = census.delta({}, {2: sample})
    assert (share.cpu, share.wait, share.voluntary, share.involuntary) == (1.5, 0.5, 3, 4)
    other = census.ThreadSample(1, 3, "p", "t-2", 1.0, 0.0, 1, 1, 5, "batch")
    (row,) = census.by_role(census.delta({}, {2: sample, 3: other}))
    assert (row.threads, row.cpu, row.nice, row.policy) == (2, 2.5, "0/5", "other/batch")


def test_kept_alive_figures_count_the_wait_for_the_next_stream():
    # before the window: one stream at 100 events/s; in the window [10, 12): a stream with 10 ms gaps,
    # then 500 ms before the next stream's first event, then 10 ms gaps again
    first = [9.0 + k * 0.01 for k in range(100)]  # 9.00 .. 9.99
    second = [10.0 + k * 0.01 for k in range(50)]  # 10.00 .. 10.49
    third = [10.99 + k * 0.01 for k in range(100)]  # 10.99 .. 11.98
    figures = kept_alive_figures([(8.9, first), (9.995, second), (10.5, third)], (10.0, 12.0), 1.0)
    assert figures["stream_gap_p99_ms"] < 11  # within each stream, the wait never shows
    assert 499 < figures["kept_alive_gap_max_ms"] < 501  # across streams it does
    assert figures["stream_tokens_per_s"] == 75.0  # 150 events in 2 s
    assert figures["stream_tokens_share"] == 0.75  # against 100/s in the second before
