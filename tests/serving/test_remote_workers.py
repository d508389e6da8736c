"""Tokenizer workers on other hosts: `tokenmill worker --connect tcp://...` across a real network link.

The test makes a second host with `ip netns` and a veth pair (10.231.x.0/30): the gateway listens
for remote workers on the root namespace's end, the worker runs inside the namespace and reaches
it over the veth, with CURVE keys from `tokenmill curve-keys DIR --worker NAME`. A vanished host
is made by taking the namespace's link down in the middle of a conversion: no FIN, no RST, just
silence, which is what a host that loses power or network looks like.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, Server, free_port, http
from faultutil import metric
from stream_replay import requests as stream_requests
from stream_replay import run as run_streams
from stream_replay import write_replies

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to make a network namespace (the test's second host)",
)
MODEL = "deepseek-v4"


class Host:
    """A network namespace joined to the root namespace by a veth pair."""

    def __init__(self, tag: str, octet: int):
        self.ns = f"tm{tag}"
        self.outer, self.inner = f"{self.ns}h", f"{self.ns}n"
        self.gateway_ip, self.ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)  # a leftover of a killed run
        for cmd in (
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner],
            ["ip", "link", "set", self.inner, "netns", self.ns],
            ["ip", "addr", "add", f"{self.gateway_ip}/30", "dev", self.outer],
            ["ip", "link", "set", self.outer, "up"],
            [*self.exec(), "ip", "addr", "add", f"{self.ip}/30", "dev", self.inner],
            [*self.exec(), "ip", "link", "set", self.inner, "up"],
            [*self.exec(), "ip", "link", "set", "lo", "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True)

    def exec(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def link(self, up: bool) -> None:
        subprocess.run([*self.exec(), "ip", "link", "set", self.inner, "up" if up else "down"], check=True)
        if up:  # taking a link down drops its address's route; put it back
            subprocess.run([*self.exec(), "ip", "addr", "replace", f"{self.ip}/30", "dev", self.inner], check=True)

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)


class RemoteWorker:
    """`tokenmill worker` run inside a Host's namespace."""

    def __init__(self, host: Host, endpoint: str, keys: Path, *extra: str):
        self.proc = subprocess.Popen(
            [
                *host.exec(),
                sys.executable,
                "-m",
                "tokenmill.cli",
                "worker",
                "--connect",
                endpoint,
                "--keys",
                str(keys),
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=30)
        return out


@pytest.fixture(scope="module")
def host():
    h = Host(str(os.getpid() % 100000), 1 + os.getpid() % 250)
    yield h
    h.remove()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("curve")
    subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "curve-keys", str(d), "--worker", "alpha", "--worker", "beta"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return d


def workers(server: Server) -> list[dict]:
    status, _, state = http("GET", server.url + "/debug/state", timeout=10)
    assert status == 200
    return state["workers"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def remote_alive(server: Server) -> list[dict]:
    if server.proc.poll() is not None:
        raise AssertionError(f"the gateway exited:\n{server.read_output()[-3000:]}")
    try:
        return [w for w in workers(server) if w["host"] and w["alive"]]
    except OSError:  # not listening yet
        return []


def gateway(host: Host, keys: Path, *extra: str) -> tuple[Server, str]:
    endpoint = f"tcp://{host.gateway_ip}:{free_port()}"
    server = Server(
        "--remote-workers",
        endpoint,
        "--curve-keys-dir",
        str(keys),
        "--remote-worker-timeout",
        "2",
        "--sim-inter-token-latency-ms",
        "1",
        *extra,
        ready=False,
    )
    return server, endpoint


def long_chat(seed: int) -> dict:
    """~150k tokens of varied text: a conversion that takes a second or more on this machine."""
    rng = random.Random(seed)
    text = " ".join(f"{rng.choice('abcdefghij')}{rng.randrange(10**6)}" for _ in range(60000))
    return {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": f"{seed}: {text}"}]}


def test_remote_worker_converts_like_a_local_one(host, keys, echo_server):
    """A gateway with no local workers: everything goes over the veth to the worker in the namespace.
    With the echoing scheduler the outputs are the rendered prompts, so they must equal the answers
    of a gateway whose own worker converted them."""
    server, endpoint = gateway(host, keys, "--workers", "0", "--sim-mode", "echo", "--sim-inter-token-latency-ms", "0")
    worker = RemoteWorker(host, endpoint, keys / "workers" / "alpha")
    try:
        joined = wait_for(lambda: remote_alive(server), 60, "the remote worker to join")
        assert joined[0]["pid"] and joined[0]["host"]
        wait_for(lambda: http("GET", server.url + "/ready")[0] == 200, 60, "/ready (the scheduler connects too)")
        body = {
            "model": MODEL,
            "max_tokens": 64,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Count: один, two, 三."},
            ],
        }
        here = http("POST", server.url + "/v1/chat/completions", body)
        local = http("POST", echo_server.url + "/v1/chat/completions", body)
        assert here[0] == local[0] == 200, (here, local)
        assert here[2]["choices"][0]["message"] == local[2]["choices"][0]["message"]
        assert here[2]["usage"] == local[2]["usage"]
        # streaming: the remote worker's detokenizer produces the same text, delta by delta
        stream = server.client().chat.completions.create(stream=True, **body)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == local[2]["choices"][0]["message"]["content"]
        tok_here = http("POST", server.url + "/tokenize", {"model": MODEL, "prompt": "héllo wörld"})
        tok_local = http("POST", echo_server.url + "/tokenize", {"model": MODEL, "prompt": "héllo wörld"})
        assert tok_here[2]["tokens"] == tok_local[2]["tokens"]
    finally:
        out = worker.stop()
        server.stop()
    assert "joins as worker 0" in server.read_output(), server.read_output()[-3000:]
    assert "joining the gateway" in out


def test_vanished_worker_loses_nothing_and_rejoins(host, keys):
    """The namespace's link goes down while its worker converts: after --remote-worker-timeout of
    silence the job is converted by the local worker and both requests answer 200. When the link
    comes back, the worker is told to join again, and does."""
    server, endpoint = gateway(host, keys, "--workers", "1")
    worker = RemoteWorker(host, endpoint, keys / "workers" / "beta")
    results: dict[int, tuple] = {}
    try:
        server.wait_ready(90)
        wait_for(lambda: remote_alive(server), 60, "the remote worker to join")
        # the local worker ready too: the second long request must still go to the idle remote
        # worker, not to the local worker's second conversion thread
        wait_for(lambda: all(w["alive"] for w in workers(server)), 60, "the local worker to be ready")
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    i, http("POST", server.url + "/v1/chat/completions", long_chat(i), timeout=120)
                )
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        wait_for(
            lambda: any(w["host"] and w["busy"] for w in workers(server)), 30, "the remote worker to take a conversion"
        )
        host.link(up=False)
        for t in threads:
            t.join(120)
        assert sorted(results) == [0, 1]
        for i, (status, _, body) in results.items():
            assert status == 200, (i, body)
            assert body["usage"]["prompt_tokens"] > 100000
        assert not remote_alive(server)
        host.link(up=True)
        rejoined = wait_for(lambda: remote_alive(server), 60, "the worker to join again after its link came back")
        assert rejoined[0]["host"]
        status, _, body = http(
            "POST",
            server.url + "/v1/chat/completions",
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 200, body
        # kill -9 of the worker process: the gateway counts it lost too, and serves on with its own worker
        worker.proc.send_signal(signal.SIGKILL)
        wait_for(lambda: not remote_alive(server), 30, "the killed worker to be counted lost")
        status, _, metrics = http("GET", server.url + "/metrics")
        assert 'tokenmill_workers_alive{model_name="deepseek-v4"} 1.0' in metrics.decode()
    finally:
        host.link(up=True)
        worker_out = worker.stop()
        server.stop()
    log = server.read_output()
    assert "is lost: silent for" in log, log[-4000:]
    assert "re-dispatching request" in log, log[-4000:]
    assert "joining again" in worker_out, worker_out[-3000:]


def test_unlisted_key_and_different_model_are_refused(host, keys, tmp_path):
    """A worker whose CURVE key is not in authorized_workers never joins: it exits saying why, and
    the gateway logs and counts the refusal. A worker with the right key but another chat template
    is refused at ready (its conversions would differ from the pool's)."""
    stranger = tmp_path / "stranger"
    subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "curve-keys", str(stranger), "--worker", "mallory"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    shutil.copy(keys / "gateway.key", stranger / "workers" / "mallory" / "gateway.key")  # knows the gateway's key
    from tokenmill.tokenizer_workers.model import default_model_dir

    other = tmp_path / "other-model"
    other.mkdir()
    shutil.copy(default_model_dir() / "tokenizer.json", other / "tokenizer.json")
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    server, endpoint = gateway(host, keys, "--workers", "1")
    outsider = RemoteWorker(host, endpoint, stranger / "workers" / "mallory")
    try:
        server.wait_ready(90)
        outsider.proc.wait(60)
        out = outsider.stop()
        assert outsider.proc.returncode not in (0, None)
        assert "refused this worker's CURVE key" in out, out[-3000:]
        assert [w["host"] for w in workers(server)] == [None]
        misfit = RemoteWorker(host, endpoint, keys / "workers" / "alpha", "--model", str(other))
        misfit.proc.wait(90)
        misfit_out = misfit.stop()
        assert misfit.proc.returncode not in (0, None)
        assert "tokenizer, chat templates or context length differ" in misfit_out, misfit_out[-3000:]
        status, _, metrics = http("GET", server.url + "/metrics")
        text = metrics.decode()
        assert 'tokenmill_remote_worker_refusals_total{model_name="deepseek-v4",reason="curve_key"}' in text
        assert 'tokenmill_remote_worker_refusals_total{model_name="deepseek-v4",reason="fingerprint"} 1.0' in text
        assert [w["host"] for w in workers(server)] == [None]
    finally:
        server.stop()
    log = server.read_output()
    assert "refused a remote tokenizer worker: its CURVE public key" in log
    assert "refused remote tokenizer worker" in log and "differ from this gateway's" in log


def test_link_drop_mid_stream_moves_the_streams_to_the_local_worker(host, keys, tmp_path):
    """The namespace's link goes down while its worker detokenizes streams: after --remote-worker-timeout
    of silence they move to the local worker, and every stream ends exactly as it did with the
    link up."""
    replies = write_replies(tmp_path / "replies.jsonl")
    server, endpoint = gateway(
        host, keys, "--workers", "1", "--sim-inter-token-latency-ms", "10", "--sim-replies", replies
    )
    worker = RemoteWorker(host, endpoint, keys / "workers" / "beta")
    try:
        server.wait_ready(90)
        wait_for(lambda: remote_alive(server), 60, "the remote worker to join")
        wait_for(lambda: all(w["alive"] for w in workers(server)), 60, "the local worker to be ready")
        sent = stream_requests()[:16]
        baseline = asyncio.run(run_streams(server, sent))
        for got in baseline:
            assert "error" not in got, got

        def drop_link(progress):
            wait_for(lambda: all(p[0] >= 3 for p in progress), 60, "every stream under way")
            remote = [w for w in workers(server) if w["host"] and w["alive"]]
            assert remote and remote[0]["streams"] > 0, workers(server)
            host.link(up=False)

        disturbed = asyncio.run(run_streams(server, sent, drop_link))
        assert disturbed == baseline
        assert metric(server, "tokenmill_stream_failovers_total", reason="resumed") >= 1
    finally:
        host.link(up=True)
        worker.stop()
        server.stop()
    assert "is lost: silent for" in server.read_output()
