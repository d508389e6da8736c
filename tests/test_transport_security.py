"""ipc:// in a private directory; tcp:// only with CURVE (or an explicit --insecure-tcp)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT, Server, free_port


def test_runtime_dir_is_private(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o755)
    srv = Server("--workers", "1", "--runtime-dir", str(runtime))
    try:
        assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
        socks = sorted(p.name for p in runtime.iterdir())
        assert socks == ["scheduler.sock", "workers.sock"]
    finally:
        srv.stop()
    assert not (runtime / "workers.sock").exists()  # no stale socket files after a stop


def test_tcp_worker_link_uses_curve(tmp_path):
    """Workers reached over tcp:// get ephemeral CURVE keys; a plain client cannot talk to the gateway's socket."""
    import zmq

    port = free_port()
    srv = Server("--workers", "1", "--worker-endpoint", f"tcp://127.0.0.1:{port}")
    try:
        resp = srv.client().chat.completions.create(model="deepseek-v4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert resp.usage.completion_tokens == 2
        # an intruder without the keys gets no handshake: its messages never arrive
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)  # fmt: skip
        sock.connect(f"tcp://127.0.0.1:{port}")
        from zmq.utils.monitor import recv_monitor_message

        events = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not events:
            if monitor.poll(200):
                events.append(recv_monitor_message(monitor)["event"])
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
        sock.close(0)
        monitor.close(0)
        ctx.term()
    finally:
        srv.stop()


def test_tcp_scheduler_without_keys_is_refused():
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(free_port()), "--scheduler", f"tcp://127.0.0.1:{port}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "CURVE" in proc.stderr + proc.stdout and "--insecure-tcp" in proc.stderr + proc.stdout


def test_tcp_scheduler_with_curve_keys(tmp_path):
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "tokenmill.cli", "curve-keys", str(keys)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(os.stat(keys / "client.key_secret").st_mode) == 0o600
    port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "simulate-scheduler", "--bind", f"tcp://127.0.0.1:{port}",
                            "--curve-secret-key-file", str(keys / "scheduler.key_secret"), "--inter-token-latency-ms", "1"],
                           cwd=ROOT)  # fmt: skip
    try:
        srv = Server("--workers", "1", "--scheduler", f"tcp://127.0.0.1:{port}", "--curve-keys-dir", str(keys))
        try:
            resp = srv.client().completions.create(model="deepseek-v4", prompt="hello", max_tokens=3)
            assert resp.usage.completion_tokens == 3
        finally:
            srv.stop()
    finally:
        sim.terminate()
        sim.wait(30)
