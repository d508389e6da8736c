"""ipc:// in a private directory; tcp:// only with CURVE (or an explicit --insecure-tcp)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from conftest import ROOT, Server, free_port


def test_runtime_dir_is_private(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o755)
    srv = Server("--workers", "1", "--runtime-dir", str(runtime))
    try:
        assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
        socks = sorted(p.name for p in runtime.iterdir())
        assert socks == ["scheduler.sock"]  # the workers hold socket pairs: nothing to connect to
    finally:
        srv.stop()
    assert not (runtime / "scheduler.sock").exists()  # no stale socket files after a stop


def test_worker_link_is_a_socket_pair(tmp_path):
    """The gateway and the worker it spawned are linked by a connected Unix socket pair (the runtime
    directory test shows there is no socket file for workers to connect to)."""
    srv = Server("--workers", "1", "--runtime-dir", str(tmp_path / "rt"))
    try:
        resp = srv.client().chat.completions.create(
            model="deepseek-v4", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert resp.usage.completion_tokens == 2
        worker = next(pid for pid in child_pids(srv.proc.pid) if b"tokenmill.tokenizer_workers.worker" in cmdline(pid))
        ours = unix_socket_inodes(srv.proc.pid)
        theirs = unix_socket_inodes(worker)
        peers = unix_peers()
        linked = [inode for inode in theirs if peers.get(inode) in ours]
        assert len(linked) == 1, (theirs, ours)
    finally:
        srv.stop()


def test_removed_worker_endpoint_setting_says_why(tmp_path):
    config = tmp_path / "tokenmill.toml"
    config.write_text('worker_endpoint = "tcp://127.0.0.1:5999"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "worker_endpoint" in proc.stderr and "socket pair" in proc.stderr and "remote_workers" in proc.stderr


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def unix_socket_inodes(pid: int) -> set[int]:
    """The inodes of the Unix sockets a process holds open."""
    unix = {int(line.split()[6]) for line in open("/proc/net/unix").read().splitlines()[1:]}
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in unix:
                inodes.add(inode)
    return inodes


def unix_peers() -> dict[int, int]:
    """Each connected Unix socket's peer, by inode (ss shows them; the kernel pairs inodes)."""
    out = subprocess.run(["ss", "-xpH"], capture_output=True, text=True).stdout
    peers = {}
    for line in out.splitlines():
        fields = line.split()
        # Netid State Recv-Q Send-Q Local-Address Port Peer-Address Port ...
        try:
            peers[int(fields[5])] = int(fields[7])
        except (IndexError, ValueError):
            continue
    return peers


def test_tcp_scheduler_without_keys_is_refused():
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--port",
            str(free_port()),
            "--scheduler",
            f"tcp://127.0.0.1:{port}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "CURVE" in proc.stderr + proc.stdout and "--insecure-tcp" in proc.stderr + proc.stdout


def test_tcp_scheduler_with_curve_keys(tmp_path):
    keys = tmp_path / "keys"
    made = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "curve-keys", str(keys)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(os.stat(keys / "client.key_secret").st_mode) == 0o600
    port = free_port()
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "simulate-scheduler",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--curve-secret-key-file",
            str(keys / "scheduler.key_secret"),
            "--inter-token-latency-ms",
            "1",
        ],
        cwd=ROOT,
    )
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
