"""The benchmarks' /health prober (tokenmill/bench/common.py): it reads whole HTTP answers through
httptools, counts what fails, and reconnects after a server closes on it."""

from __future__ import annotations

import http.server
import multiprocessing as mp
import threading
import time

from tokenmill.bench.common import timed_health_prober


class _Flaky(http.server.BaseHTTPRequestHandler):
    """200 with a body, except every 5th request: a 503; every 7th: the connection closed unanswered."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the probed servers
    served = 0

    def do_GET(self):
        cls = type(self)
        cls.served += 1
        if cls.served % 7 == 0:
            self.close_connection = True
            return
        status, body = (503, b'{"status":"draining"}') if cls.served % 5 == 0 else (200, b'{"status":"ok"}')
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_prober_counts_only_whole_200_answers_and_reconnects():
    server = _serve()
    try:
        ctx = mp.get_context("spawn")  # as the benches run it: a process of its own (it leaves the session)
        stop, out, started = ctx.Event(), ctx.Queue(), ctx.Event()
        prober = ctx.Process(target=timed_health_prober, args=(server.server_address[1], stop, out, started))
        prober.start()
        assert started.wait(60)
        deadline = time.monotonic() + 30
        while _Flaky.served < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        kind, latencies, starts = out.get(timeout=30)
        prober.join(30)
    finally:
        server.shutdown()
    served = _Flaky.served
    failed = served // 5 + served // 7 - served // 35
    assert kind == "health" and served >= 40
    # the answered 200s only (give or take the one in flight when it stopped): 503s and closes are not latencies
    assert served - failed - 1 <= len(latencies) <= served - failed
    assert all(latency > 0 for latency in latencies) and len(starts) == len(latencies)
    assert starts == sorted(starts)


def test_with_count_failures_a_refused_connection_is_a_probe_too():
    import socket
    import subprocess
    import sys

    from conftest import ROOT

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (  # in a process of its own: the prober leaves its session and asks for real-time scheduling
        "import threading\n"
        "from tokenmill.bench.common import probe_health\n"
        "stop, latencies = threading.Event(), []\n"
        "threading.Timer(0.3, stop.set).start()\n"
        f"probe_health({port}, stop, latencies, count_failures=True, timeout=5)\n"
        "print(len(latencies))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 3, "refused connections count as probes that failed"


def test_cpu_stalls_are_the_spans_a_cpu_watcher_was_held_off():
    """Stopping a watcher (SIGSTOP: to it, as a host taking its CPU away) for 0.3 s is a stall of
    about that length on that CPU; the watchers that ran on are not."""
    import os
    import signal

    from tokenmill.bench.common import CpuStalls, outside

    ctx = mp.get_context("spawn")
    stalls = CpuStalls(ctx)
    stalls.wait_ready()
    held = stalls.processes[0]
    os.kill(held.pid, signal.SIGSTOP)
    time.sleep(0.3)
    os.kill(held.pid, signal.SIGCONT)
    time.sleep(0.2)
    spans = stalls.finish()
    if spans is None:  # no real-time privilege here: the bench reports no figure
        assert os.geteuid() != 0
        return
    long = [(a, b) for a, b in spans if b - a > 0.1]
    assert len(long) == 1, spans
    a, b = long[0]
    assert 0.2 <= b - a <= 1.0
    # a probe that overlaps the span is left out of the clear figures, one before or after it is not
    starts, latencies = [a - 0.05, a + 0.01, b + 0.01], [10.0, 5.0, 1.0]
    assert outside(starts, latencies, long) == [10.0, 1.0]
    assert outside([a - 0.05], [60.0], long) == []
