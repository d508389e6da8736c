"""Across nodes: HAProxy with deploy/haproxy/tokenmill.cfg in front of two real `tokenmill serve` nodes.

The config under test is the shipped file with only its addresses, log target, admin socket and
daemon/chroot/user lines changed (render_config); its health-check and retry settings are the real ones.
Which node served a request is read from each node's own /metrics (tokenmill_requests_total of
/v1/chat/completions, status 200) and from the X-Tokenmill-Node header the config adds; the first
test checks that the two agree. docs/operations/cross-node.md describes what these tests pin down.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, Server, free_port, http

CONFIG = ROOT / "deploy" / "haproxy" / "tokenmill.cfg"
HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None
)
pytestmark = pytest.mark.skipif(
    HAPROXY is None,
    reason="haproxy is not installed (Debian/Ubuntu: apt-get install haproxy; scripts/test.sh installs it when run as root)",
)

# a decode step of 5 ms: a 600-token stream lasts ~3 s, longer than HAProxy takes to mark a node down
NODE_ARGS = ("--workers", "1", "--sim-inter-token-latency-ms", "5", "--shutdown-timeout", "20")
MODEL = "deepseek-v4"
SERVED = re.compile(r"^tokenmill_requests_total\{([^}]*)\} (\S+)$", re.M)


# ---- the cluster ------------------------------------------------------------------------------


def render_config(text: str, nodes: list[str], port: int, stats_port: int, admin_sock: Path) -> str:
    """The deploy file for loopback: node addresses, listen ports, log to stderr, admin socket in tmp."""

    def sub(pattern: str, repl, count_expected: int | None = None, flags=re.M) -> None:
        nonlocal text
        text, n = re.subn(pattern, repl, text, flags=flags)
        assert n and (count_expected is None or n == count_expected), f"{CONFIG}: expected {pattern!r} ({n} found)"

    names: list[str] = []

    def server(m: re.Match) -> str:
        if m.group(2) not in names:
            names.append(m.group(2))
        return f"{m.group(1)}{nodes[names.index(m.group(2))]}{m.group(4)}"

    sub(r"^(\s*server\s+(\S+)\s+)(\S+)(.*)$", server)
    assert len(names) == len(nodes), f"{CONFIG} lists {names}; the test runs {len(nodes)} nodes"
    sub(r"^(\s*bind\s+):8080\b", rf"\g<1>127.0.0.1:{port}", 1)
    sub(r"^(\s*bind\s+)127\.0\.0\.1:8404\b", rf"\g<1>127.0.0.1:{stats_port}", 1)
    sub(r"^\s*(chroot|user|group|daemon)\b.*\n", "")
    sub(r"^(\s*log\s+)/dev/log(\s)", r"\1stderr format raw\2", 1)
    sub(r"^(\s*stats\s+socket\s+)/run/haproxy/admin\.sock", rf"\g<1>{admin_sock}", 1)
    return text


class Router:
    """haproxy -db (foreground) on a rendered copy of the deploy config."""

    def __init__(self, tmp: Path, nodes: list[Server]):
        self.sock = tmp / "admin.sock"
        if len(str(self.sock)) > 100:  # a unix socket path has at most 107 bytes
            self.sock = Path(tempfile.mkdtemp(prefix="tm-haproxy-")) / "admin.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "haproxy.cfg"
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        cfg.write_text(render_config(CONFIG.read_text(), addresses, self.port, free_port(), self.sock))
        self.log_path = tmp / "haproxy.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(cfg)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.wait(
                lambda s: (
                    len(s) == 2 * len(nodes)
                    and all(
                        st == "UP" and (check == "L7OK" or bk == "tokenmill_any") for (bk, _), (st, check) in s.items()
                    )
                ),
                15,
                "every node UP after a passed check",
            )
        except BaseException:
            self.stop()
            raise

    def admin(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.sock))
            s.sendall(command.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def servers(self) -> dict[tuple[str, str], tuple[str, str]]:
        """(backend, server) -> (status, last check) from the admin socket's `show stat`."""
        lines = self.admin("show stat").splitlines()
        head = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(head, line.split(","))) for line in lines[1:] if line]
        return {
            (r["pxname"], r["svname"]): (r["status"], r["check_status"])
            for r in rows
            if r["svname"] not in ("FRONTEND", "BACKEND") and r["pxname"] != "stats"
        }

    def status(self, name: str) -> str:
        return self.servers()[("tokenmill_sessions", name)][0]

    def wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if ok(self.servers()):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(
            f"haproxy: not {what} in {timeout} s: {self.servers()}\n{self.log_path.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Cluster:
    """Two tokenmill nodes (node1, node2 in the config's order) behind the router."""

    def __init__(self, tmp: Path):
        self.nodes: list[Server] = []
        self.router = None
        try:
            self.nodes = [Server(*NODE_ARGS, ready=False) for _ in range(2)]  # start both, then wait: ~5 s
            for node in self.nodes:
                node.wait_ready()
            self.router = Router(tmp, self.nodes)
        except BaseException:
            self.close()
            raise
        self.names = ["node1", "node2"]

    def node(self, name: str) -> Server:
        return self.nodes[self.names.index(name)]

    def other(self, name: str) -> str:
        return self.names[1 - self.names.index(name)]

    def close(self) -> None:
        if self.router:
            self.router.stop()
        for node in self.nodes:
            if node.proc.poll() is None:
                node.stop()
            else:
                node.read_output()

    def counts(self) -> dict[str, int]:
        """Chat completions each node answered 200, from the node's own /metrics (-1: node gone)."""
        out = {}
        for name, node in zip(self.names, self.nodes):
            try:
                _, _, body = http("GET", node.url + "/metrics", timeout=5)
            except OSError:
                out[name] = -1
                continue
            text = body.decode() if isinstance(body, bytes) else str(body)
            out[name] = sum(
                int(float(v))
                for labels, v in SERVED.findall(text)
                if 'endpoint="/v1/chat/completions"' in labels and 'status="200"' in labels
            )
        return out

    def running(self, name: str) -> int:
        _, _, body = http("GET", self.node(name).url + "/metrics", timeout=5)
        m = re.search(r"^tokenmill_num_requests_running\{[^}]*\} (\S+)$", body.decode(), re.M)
        return int(float(m.group(1))) if m else 0

    def client(self, session: str | None = None):
        import openai

        headers = {"X-Session-Id": session} if session else {}
        return openai.OpenAI(
            base_url=self.router.url + "/v1", api_key="none", max_retries=0, timeout=20, default_headers=headers
        )

    def chat(self, session: str | None, messages=None, max_tokens: int = 4, **kw) -> tuple[int, str | None, dict]:
        """A non-streamed chat completion through the router: (status, X-Tokenmill-Node, body)."""
        body = {
            "model": MODEL,
            "messages": messages or [{"role": "user", "content": "Hello"}],
            "max_tokens": max_tokens,
            **kw,
        }
        status, headers, answer = http(
            "POST",
            self.router.url + "/v1/chat/completions",
            body,
            headers={"X-Session-Id": session} if session else {},
            timeout=20,
        )
        return status, _header(headers, "x-tokenmill-node"), answer


def _header(headers: dict, name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cross-node"))
    yield c
    c.close()


def sessions_by_node(c: Cluster, count: int = 12) -> dict[str, list[str]]:
    """Where each of `count` session ids lands with no load (deterministic: the ring and the hash are)."""
    out: dict[str, list[str]] = {name: [] for name in c.names}
    for i in range(count):
        status, node, _ = c.chat(f"conversation-{i}")
        assert status == 200
        out[node].append(f"conversation-{i}")
    return out


class StreamOutcome:
    def __init__(self):
        self.node: str | None = None
        self.started = threading.Event()
        self.chunks = 0
        self.finish: str | None = None
        self.error: BaseException | None = None


def stream_in_thread(c: Cluster, session: str, max_tokens: int) -> tuple[threading.Thread, StreamOutcome]:
    """A streamed chat completion through the router with the OpenAI SDK, read to its end in a thread."""
    out = StreamOutcome()

    def run():
        try:
            raw = c.client(session).chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a long story."}],
                max_tokens=max_tokens,
                stream=True,
            )
            out.node = raw.headers.get("x-tokenmill-node")
            out.started.set()
            for chunk in raw.parse():
                out.chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    out.finish = chunk.choices[0].finish_reason
        except BaseException as exc:  # examined by the test
            out.error = exc
        finally:
            out.started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert out.started.wait(30), "the stream did not start"
    return t, out


# ---- the tests ----------------------------------------------------------------------------------


def test_shipped_config_is_valid():
    """`haproxy -c` accepts deploy/haproxy/tokenmill.cfg as shipped (the test renders only addresses and paths)."""
    res = subprocess.run([HAPROXY, "-c", "-f", str(CONFIG)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_conversation_stays_on_one_node_and_sessions_spread(cluster):
    """8 conversations of 3 turns each (the history grows): every turn of one conversation reaches the
    same node, and the conversations land on both nodes. Checked with the nodes' own counters."""
    clients = {f"chat-{i}": cluster.client(f"chat-{i}") for i in range(8)}  # X-Session-Id on every request
    histories = {session: [{"role": "system", "content": f"You are assistant {session}."}] for session in clients}
    placement: dict[str, set[str]] = {}
    before = cluster.counts()
    for turn in range(3):
        for session, client in clients.items():
            histories[session].append({"role": "user", "content": f"Question {turn}?"})
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=histories[session], max_tokens=4
            )
            histories[session].append({"role": "assistant", "content": raw.parse().choices[0].message.content})
            after = cluster.counts()
            grew = [name for name in cluster.names if after[name] == before[name] + 1]
            assert len(grew) == 1 and sum(after.values()) == sum(before.values()) + 1, (before, after)
            assert raw.headers.get("x-tokenmill-node") == grew[0]  # the router's header tells the truth
            placement.setdefault(session, set()).add(grew[0])
            before = after
    print("placement:", {s: sorted(n) for s, n in placement.items()})
    assert all(len(nodes) == 1 for nodes in placement.values()), placement
    used = {next(iter(nodes)) for nodes in placement.values()}
    assert used == set(cluster.names), f"all 8 sessions on {used}"


def test_without_session_header_requests_spread_by_least_connections(cluster):
    """No X-Session-Id: leastconn. Idle nodes take turns; a node busy with a stream is skipped; the
    OpenAI `user` field alone gives no affinity (HAProxy does not read bodies)."""
    before = cluster.counts()
    for _ in range(6):
        assert cluster.chat(None, user="alice")[0] == 200
    after = cluster.counts()
    spread = {name: after[name] - before[name] for name in cluster.names}
    assert sum(spread.values()) == 6 and min(spread.values()) >= 2, spread

    thread, stream = stream_in_thread(cluster, None, max_tokens=1500)  # ~7 s on one node: the chats end well before it
    busy = stream.node
    assert busy in cluster.names, stream.error
    busy_node = cluster.nodes[cluster.names.index(busy)]
    answered = []  # (node, whether the busy node still streamed when the chat was answered)
    for _ in range(4):
        node = cluster.chat(None)[1]
        # judged by the node, not by the client: a client starved of CPU reads the stream's end from its
        # socket buffer long after the node (and the router) are done with it
        answered.append((node, http("GET", busy_node.url + "/debug/state", timeout=5)[2]["generations"] > 0))
    thread.join(30)
    assert stream.error is None and stream.finish == "length"
    during = [node for node, streaming in answered if streaming]  # (a loaded machine may outlast the stream)
    assert during and during == [cluster.other(busy)] * len(during), (busy, answered)


def test_planned_drain_through_the_admin_socket_moves_every_request(cluster):
    """`set server ... state drain` (the documented maintenance step before stopping a node): its
    sessions, big requests included, and keyless requests all go to the other node; `state ready`
    brings its sessions back."""
    by_node = sessions_by_node(cluster, 8)
    drained = max(cluster.names, key=lambda n: len(by_node[n]))
    other = cluster.other(drained)
    cluster.router.admin(f"set server tokenmill_sessions/{drained} state drain")
    try:
        big = [{"role": "user", "content": "word " * 5000}]
        got = [cluster.chat(s, messages=big if i % 2 else None)[:2] for i, s in enumerate(by_node[drained])]
        got += [cluster.chat(None)[:2] for _ in range(4)]
        assert got == [(200, other)] * len(got), got
    finally:
        cluster.router.admin(f"set server tokenmill_sessions/{drained} state ready")
    assert [cluster.chat(s)[:2] for s in by_node[drained]] == [(200, drained)] * len(by_node[drained])


def test_a_draining_node_finishes_its_streams_and_its_sessions_move(tmp_path):
    """SIGTERM one node while its streams run and its sessions keep sending: the streams end normally,
    every new request gets 200 (HAProxy retries the node's 503 `shutdown` on the other node), the health
    check takes the node out of the pool while it still drains, and its sessions land on the other node.
    A request over HAProxy's buffer (16 KB) cannot be retried: in the second or so before the check
    sees /ready fail it may get the node's 503 `shutdown` with Retry-After, the one documented error."""
    c = Cluster(tmp_path)
    try:
        by_node = sessions_by_node(c)
        victim = max(c.names, key=lambda n: len(by_node[n]))
        survivor = c.other(victim)
        # a stream on each node: the survivor's must not notice anything
        streams = [stream_in_thread(c, s, max_tokens=600) for s in [by_node[survivor][0], *by_node[victim][:3]]]  # ~3 s
        assert [out.node for _, out in streams] == [survivor] + [victim] * 3
        c.node(victim).proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()

        answers, left_pool_at, streaming_then = [], None, None
        big = [{"role": "user", "content": "word " * 5000}]  # ~25 KB of JSON: over tune.bufsize
        i = 0
        while time.monotonic() - t0 < 2.0 or (left_pool_at is None and time.monotonic() - t0 < 10):
            session = by_node[victim][i % len(by_node[victim])]
            status, node, body = c.chat(session, messages=big if i % 4 == 0 else None)
            code = body.get("error", {}).get("code") if isinstance(body, dict) and "error" in body else None
            answers.append((time.monotonic() - t0, i % 4 == 0, status, node, code))
            if left_pool_at is None and c.router.status(victim).startswith("DOWN"):
                left_pool_at = time.monotonic() - t0
                streaming_then = sum(t.is_alive() for t, _ in streams[1:])
            i += 1
        for thread, _ in streams:
            thread.join(max(1.0, 45 - (time.monotonic() - t0)))  # all of them within 45 s of the signal
        print("after SIGTERM (s, big body, status, node, code):", [(round(a[0], 2), *a[1:]) for a in answers])
        print(f"left the pool after {left_pool_at:.2f} s, with {streaming_then} of its streams still running")

        # every stream finished normally, the draining node's included
        for _, out in streams:
            assert out.error is None and out.finish == "length", (out.node, out.error, out.finish, out.chunks)
        # small requests: always 200; big ones: 200, or the node's own 503 `shutdown` before it left the pool
        for answer in answers:
            at, is_big, status, node, code = answer
            documented = is_big and status == 503 and code == "shutdown" and at <= left_pool_at
            assert status == 200 or documented, (answer, left_pool_at)
        assert all(node == survivor for _, _, status, node, _ in answers if status == 200), answers
        # the node left the pool while it still drained (streams running on it), then stopped cleanly
        assert streaming_then, "the draining node's streams ended before HAProxy took it out of the pool"
        assert c.node(victim).proc.wait(30) == 0
        assert c.router.status(victim).startswith("DOWN")
    finally:
        c.close()


def test_a_killed_node_fails_only_its_streams(tmp_path):
    """SIGKILL one node's process group with requests in flight on it. Its streams break off (no
    finish_reason, no [DONE]: the SDK raises a connection error); a non-streamed request in flight is
    sent again to the other node and answered 200; one over HAProxy's buffer gets HAProxy's 502
    `node_failed`; new requests of its sessions go to the other node and get 200."""
    c = Cluster(tmp_path)
    try:
        by_node = sessions_by_node(c)
        victim = max(c.names, key=lambda n: len(by_node[n]))
        survivor = c.other(victim)
        sessions = by_node[victim]
        results: dict[str, tuple] = {}

        def call(key: str, session: str, messages=None) -> None:
            results[key] = c.chat(session, messages=messages, max_tokens=2000)  # ~10 s

        # a stream on the survivor too: it must not notice anything. Every request lasts long enough to be
        # running beside the others while the big one converts (seconds, on a machine busy with other tests)
        survivor_stream = stream_in_thread(c, by_node[survivor][0], max_tokens=3000)
        big = [{"role": "user", "content": "word " * 5000}]  # over tune.bufsize: HAProxy cannot send it again
        calls = [
            threading.Thread(target=call, args=("small", sessions[0])),
            threading.Thread(target=call, args=("big", sessions[1 % len(sessions)], big)),
        ]
        for t in calls:
            t.start()
        streams = [stream_in_thread(c, s, max_tokens=3000) for s in sessions[:2]]
        deadline = time.monotonic() + 30
        while c.running(victim) < 4 and time.monotonic() < deadline:  # all four are generating on the victim
            time.sleep(0.05)
        assert (c.running(victim), c.running(survivor)) == (4, 1), [out.node for _, out in streams]
        time.sleep(0.3)  # some tokens out
        os.killpg(c.node(victim).proc.pid, signal.SIGKILL)
        t0 = time.monotonic()

        after = [c.chat(sessions[i % len(sessions)]) for i in range(6)]
        elapsed = time.monotonic() - t0
        for t in [*calls, *(t for t, _ in [*streams, survivor_stream])]:
            t.join(max(1.0, 45 - (time.monotonic() - t0)))  # all of them within 45 s of the kill
        print("new requests after SIGKILL:", [(s, n) for s, n, _ in after], f"in {elapsed:.2f} s")
        print(
            "in flight:",
            {k: (v[0], v[1], v[2].get("error") if isinstance(v[2], dict) else v[2]) for k, v in results.items()},
        )
        print(
            "streams:", [(out.node, out.chunks, out.finish, [repr(e) for e in _chain(out.error)]) for _, out in streams]
        )

        assert all(status == 200 and node == survivor for status, node, _ in after), after
        status, node, body = results["small"]
        assert status == 200 and node == survivor and body["usage"]["completion_tokens"] == 2000, results["small"]
        status, node, body = results["big"]
        assert status == 502 and body["error"]["code"] == "node_failed", results["big"]
        for _, out in streams:
            assert out.node == victim and out.chunks > 0 and out.finish is None, (out.node, out.chunks, out.finish)
            assert out.error is not None and _is_connection_error(out.error), repr(out.error)
        out = survivor_stream[1]  # the other node's stream did not notice
        assert out.node == survivor and out.error is None and out.finish == "length", (out.node, out.error, out.finish)
        c.router.wait(lambda s: s[("tokenmill_sessions", victim)][0].startswith("DOWN"), 5, f"{victim} DOWN")
    finally:
        c.close()


def _is_connection_error(exc: BaseException) -> bool:
    """What the SDK raises when the body of a stream is cut: an httpx protocol error, or openai's wrapper."""
    import openai

    names = {type(e).__name__ for e in _chain(exc)}
    return isinstance(exc, openai.APIConnectionError) or bool(
        names & {"RemoteProtocolError", "ReadError", "IncompleteRead"}
    )


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__
