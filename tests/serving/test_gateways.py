"""`tokenmill serve --gateways 2`: two gateway processes on one port, sharing the tokenizer workers.

Every request here opens a new connection (urllib), so the kernel's SO_REUSEPORT hashing spreads
them over both gateways; which one answered is read from /debug/state's pid.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from conftest import Server, http

MODEL = "deepseek-v4"


def metric(text: str, name: str, default: float | None = None, **labels) -> float:
    want = {"model_name": MODEL, **labels}
    total = default
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if got == want:
            total = float(match.group(2))
    assert total is not None, f"{name}{labels} not in /metrics"
    return total


def scrape(server: Server) -> str:
    status, _, body = http("GET", server.url + "/metrics")
    assert status == 200
    return body.decode()


def states(server: Server, n: int) -> list[dict]:
    return [http("GET", server.url + "/debug/state")[2] for _ in range(n)]


def gone(pid: int) -> bool:
    """Dead, or a zombie whose threads have all exited: its sockets are closed. (A killed process's main
    thread shows as a zombie while its other threads, which share its files, are still exiting.)"""
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/status") as f:
                if "zombie" not in f.read().lower():
                    return False
    except FileNotFoundError:
        pass
    return True


def chat(server: Server, content: str, system: str = "You are terse.") -> dict:
    status, _, body = http(
        "POST",
        server.url + "/v1/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
        },
    )
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def node():
    srv = Server("--gateways", "2", "--workers", "2", "--sim-inter-token-latency-ms", "1")
    deadline = time.monotonic() + 60
    # /ready on the shared port may be answered by the gateway that connected to the scheduler first
    while len({s["pid"] for s in states(srv, 10)}) < 2 or not all(
        sum(w["alive"] for w in s["workers"]) == 2 and s["scheduler_connected"] for s in states(srv, 10)
    ):
        assert time.monotonic() < deadline, "the second gateway did not come up with both workers and the scheduler"
        time.sleep(0.2)
    yield srv
    srv.stop()


def test_both_gateways_serve_the_port_with_the_same_workers(node):
    seen = {}
    for state in states(node, 40):
        seen[state["pid"]] = state
    assert len(seen) == 2, "40 new connections all reached one gateway: SO_REUSEPORT is not spreading them"
    assert sorted(s["gateway"] for s in seen.values()) == [0, 1]
    primary = next(s for s in seen.values() if s["gateway"] == 0)
    assert sorted(primary["gateway_pids"]) == sorted(seen)
    # the same worker processes, at the same indices, in both pools
    pools = [sorted((w["index"], w["pid"]) for w in s["workers"] if w["alive"]) for s in seen.values()]
    assert pools[0] == pools[1] and len(pools[0]) == 2
    for state in seen.values():  # each answers /health and /ready for itself
        assert state["scheduler_connected"]


def test_metrics_on_either_gateway_show_the_node_totals(node):
    before = scrape(node)
    base = metric(before, "tokenmill_requests_total", 0.0, endpoint="/v1/chat/completions", status="200")
    for i in range(12):
        chat(node, f"Say {i}.")
    for _ in range(6):  # each scrape lands on either gateway; each must show all twelve, once
        text = scrape(node)
        assert metric(text, "tokenmill_requests_total", endpoint="/v1/chat/completions", status="200") == base + 12
        assert metric(text, "tokenmill_gateway_processes") == 2
        assert metric(text, "tokenmill_workers_alive") == 2  # the shared workers, not counted twice
        assert metric(text, "tokenmill_scheduler_connected") == 1


def test_a_conversation_keeps_its_worker_whichever_gateway_takes_it(node):
    """Turn after turn of one conversation, on new connections (so on both gateways), is converted
    by the worker holding its cached segments: only the new words are tokenized afresh."""
    system = "Policy. " + " ".join(
        f"Rule {i}: answer question {i} with care and cite section {i % 17}." for i in range(900)
    )
    history = [{"role": "system", "content": system}, {"role": "user", "content": "Question 0?"}]

    def turn() -> dict:
        status, _, body = http(
            "POST", node.url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": history}
        )
        assert status == 200, body
        return body

    prompt_tokens = turn()["usage"]["prompt_tokens"]
    assert prompt_tokens > 10000
    before = metric(scrape(node), "tokenmill_prompt_tokens_tokenized_total", 0.0)
    for i in range(1, 9):
        history += [{"role": "assistant", "content": f"Answer {i - 1}."}, {"role": "user", "content": f"Question {i}?"}]
        turn()
    fresh = metric(scrape(node), "tokenmill_prompt_tokens_tokenized_total") - before
    assert fresh < 0.5 * prompt_tokens, (
        f"{fresh} tokens tokenized afresh over 8 turns of a {prompt_tokens}-token prompt"
    )


def both_gateway_pids(srv: Server) -> list[int]:
    """Gateway 0's list of the node's gateway pids, once the second one is up and both have their scheduler.
    (Server() returns on the first /ready that says 200, which may come from either gateway.)"""
    deadline = time.monotonic() + 60
    while True:
        got = {s["gateway"]: s for s in states(srv, 10)}
        pids = got[0]["gateway_pids"] if 0 in got else None
        if pids and len(pids) >= 2 and len(got) == 2 and all(s["scheduler_connected"] for s in got.values()):
            return pids
        assert time.monotonic() < deadline, f"both gateways did not come up: {got}"
        time.sleep(0.2)


def test_a_gateway_that_dies_is_replaced_and_sigterm_stops_them_all():
    srv = Server("--gateways", "2", "--workers", "1", "--sim-inter-token-latency-ms", "1")
    try:
        pids = both_gateway_pids(srv)
        second = [p for p in pids if p != srv.proc.pid][0]
        os.kill(second, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not gone(second):  # until it is dead, connections already queued on its listener are reset
            assert time.monotonic() < deadline
            time.sleep(0.05)
        died = time.monotonic()
        resets = 0
        while True:  # the kernel stops sending connections to a closed listener: requests keep succeeding
            try:
                chat(srv, "Still there?")
            except ConnectionResetError:
                # a handshake the dead gateway's listener had begun is reset (unless the kernel migrates it:
                # sysctl net.ipv4.tcp_migrate_req=1); it may happen once, right after the death, not again
                resets += 1
                assert resets == 1 and time.monotonic() - died < 1.0
                continue
            found = {s["pid"] for s in states(srv, 10)}
            if len(found) == 2 and second not in found:
                break
            assert time.monotonic() < deadline, f"no replacement for gateway pid {second}: {found}"
            time.sleep(0.2)
        children = set(srv.children())
    finally:
        assert srv.stop() == 0
    assert "gateway 1 (pid" in srv.read_output() and "starting a replacement" in srv.read_output()
    time.sleep(0.5)
    alive = [p for p in children if not gone(p)]
    assert not alive, f"processes left after SIGTERM: {alive}"


def test_a_gateway_whose_loop_stalls_is_killed_and_replaced():
    """systemd's watchdog hears gateway 0 only; gateway 0 pings the others and replaces one that stops
    answering (here: SIGSTOP, as a loop stuck in a C call looks from outside)."""
    srv = Server(
        "--gateways", "2", "--workers", "1", "--sim-inter-token-latency-ms", "1", "--gateway-stall-timeout", "2"
    )
    try:
        pids = both_gateway_pids(srv)
        stalled = [p for p in pids if p != srv.proc.pid][0]
        time.sleep(1.5)  # it has answered gateway 0's pings: from now on silence counts
        os.kill(stalled, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        replaced = None
        while replaced is None:
            assert time.monotonic() < deadline, f"gateway pid {stalled} stopped answering and was not replaced"
            time.sleep(0.5)
            try:
                for state in states(srv, 6):  # a connection the stopped gateway's listener took is reset when it dies
                    if (
                        state["gateway"] == 0
                        and stalled not in state["gateway_pids"]
                        and len(state["gateway_pids"]) == 2
                    ):
                        replaced = state["gateway_pids"]
            except OSError:
                continue
        assert gone(stalled)
        deadline = time.monotonic() + 60
        while True:  # the replacement serves: both pids answer on the port again
            try:
                if {s["pid"] for s in states(srv, 10)} == set(replaced):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the replacement gateway did not come up"
            time.sleep(0.2)
        chat(srv, "Still there?")
        assert metric(scrape(srv), "tokenmill_gateway_restarts_total", reason="stalled") == 1
    finally:
        assert srv.stop() == 0
    assert "its event loop is stalled; killing it" in srv.read_output()


def test_a_shared_worker_tells_each_gateway_when_others_jobs_hold_its_threads():
    """A worker shared by the node's gateways counts, per gateway, the conversion threads busy with jobs
    of the others, and tells a gateway (WorkerBusy) only when that changes: busy while any thread
    converts another gateway's job, free when none does, never busy for its own jobs."""
    from tokenmill.tokenizer_workers import messages
    from tokenmill.tokenizer_workers.worker import TokenizerWorker, _Link

    class Sock:
        def __init__(self):
            self.told = []

        def send(self, data, flags=0):
            self.told.append(messages.from_worker.decode(data).busy)

    worker = TokenizerWorker(0, -1, None, conversion_threads=2)
    a, b, c = (_Link(Sock(), name, 0, joined=True, beats=name != "a") for name in "abc")
    worker.links = [a, b, c]

    def told():
        out = {name: link.sock.told[:] for name, link in zip("abc", (a, b, c))}
        for link in (a, b, c):
            link.sock.told.clear()
        return out

    worker._tell_busy(a, 1)  # a thread takes a job of gateway a
    assert told() == {"a": [], "b": [True], "c": [True]}
    worker._tell_busy(b, 1)  # the other thread takes one of b
    assert told() == {"a": [True], "b": [], "c": []}
    worker._tell_busy(a, -1)  # a's job is done: b's own job is all that is left
    assert told() == {"a": [], "b": [False], "c": []}
    worker._tell_busy(b, -1)
    assert told() == {"a": [False], "b": [], "c": [False]}
