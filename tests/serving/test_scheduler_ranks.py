"""Data-parallel scheduler ranks behind one gateway (gateway/scheduler_ranks.py), for real.

Each rank is a simulated scheduler process with a model of an engine's prefix cache
(--prefix-cache-tokens): a prompt whose beginning it prefilled before is reported in
``cached_tokens``, which reaches the client as ``usage.prompt_tokens_details.cached_tokens``.
So whether a conversation's turns reach the rank that holds its history is visible from outside.
"""

from __future__ import annotations

import http.client as httpclient
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, Server, http

SYSTEM = "You are a careful assistant who answers questions about rivers, mills and weather. " * 8


class Sim:
    """A simulated scheduler rank on an ipc:// endpoint."""

    def __init__(self, endpoint: str, *args: str):
        self.endpoint = endpoint
        self.args = args
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.engines.simulated",
                "--bind",
                self.endpoint,
                "--model",
                "default",
                "--inter-token-latency-ms",
                "1",
                "--prefix-cache-tokens",
                "1000000",
                *self.args,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def ranks(tmp_path):
    sims = [Sim(f"ipc://{tmp_path}/rank{i}.sock") for i in range(2)]
    yield sims
    for sim in sims:
        sim.kill()


def serve(sims, *args) -> Server:
    """A gateway in front of ``sims``, returned once every rank has said welcome: a request sent earlier
    goes to the ranks connected so far (on a loaded machine a rank can lag the gateway's readiness)."""
    flags = [x for s in sims for x in ("--scheduler", s.endpoint)]
    srv = Server("--workers", "1", *flags, *args)
    srv.wait_until(lambda: http("GET", srv.url + "/ready")[2]["missing_ranks"] == [], 60, interval=0.05)
    return srv


def conversation(client, name: str, turns: int) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) of each turn of one growing conversation. ``client`` may be a
    function making one client per turn (a new connection each)."""
    messages = [{"role": "system", "content": f"{SYSTEM} Conversation {name}."}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} of {name}: how fast does the river run?"})
        reply = (client() if callable(client) else client).chat.completions.create(
            model="deepseek-v4", messages=messages, max_tokens=8, temperature=0
        )
        details = reply.usage.prompt_tokens_details
        out.append((reply.usage.prompt_tokens, details.cached_tokens if details else 0))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return out


def metric(srv, name: str) -> dict[str, float]:
    _, _, text = http("GET", srv.url + "/metrics")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return {
        m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}\{{[^}}]*rank="(\d+)"[^}}]*\}} (\S+)$', text, re.M)
    }


def test_conversations_stay_on_the_rank_that_holds_their_history(ranks):
    srv = serve(ranks)
    try:
        client = srv.client()
        per_turn = [conversation(client, f"c{i}", 4) for i in range(6)]
        # after the first turn (which may find the shared system prompt), every turn finds its history
        for turns in per_turn:
            for prompt, cached in turns[1:]:
                assert cached >= prompt - 64, turns  # all but the new turn's tail (16-token blocks)
        sent = metric(srv, "tokenmill_rank_requests_total")
        assert set(sent) == {"0", "1"} and min(sent.values()) >= 4, sent  # both ranks serve (6 conversations)
        cached = metric(srv, "tokenmill_rank_cached_prompt_tokens_total")
        assert sum(cached.values()) == sum(c for turns in per_turn for _, c in turns)
        _, _, ready = http("GET", srv.url + "/ready")
        assert ready["ready"] and ready["missing_ranks"] == [], ready
    finally:
        srv.stop()


def on_gateway(srv, pid: int) -> httpclient.HTTPConnection:
    """A keep-alive connection that the kernel gave to the gateway process ``pid``."""
    for _ in range(400):
        conn = httpclient.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("GET", "/debug/state")
        if json.loads(conn.getresponse().read())["pid"] == pid:
            return conn
        conn.close()
    raise AssertionError(f"400 connections and none reached gateway pid {pid}")


def test_several_gateways_keep_a_conversation_on_the_rank_with_its_history(ranks):
    """--gateways 2 in front of two ranks, the turns of each conversation alternating between the
    gateways: a gateway that did not see the previous turn learns its rank from the conversation's worker."""
    srv = serve(ranks, "--gateways", "2")
    try:
        pids, deadline = set(), time.monotonic() + 60
        while len(pids) < 2:  # both gateways up, each with the worker and both ranks
            assert time.monotonic() < deadline, "the second gateway did not come up"
            status, _, state = http("GET", srv.url + "/debug/state")
            if status == 200 and state["scheduler_connected"] and all(w["alive"] for w in state["workers"]):
                pids.add(state["pid"])
            time.sleep(0.05)
        gateways = sorted(pids)
        # a request with no conversation moves gateway 0's tie-breaking turn on by one: left to
        # themselves, the two gateways would now place a new conversation on different ranks
        conn = on_gateway(srv, gateways[0])
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"model": "deepseek-v4", "prompt": "Hi", "max_tokens": 1}),
            {"Content-Type": "application/json"},
        )
        assert conn.getresponse().status == 200
        conn.close()
        per_turn = []
        for c in range(6):
            messages = [{"role": "system", "content": f"{SYSTEM} Conversation g{c}."}]
            turns = []
            for turn in range(4):
                messages.append({"role": "user", "content": f"Question {turn} of g{c}: how fast does the river run?"})
                conn = on_gateway(srv, gateways[(c + turn) % 2])
                conn.request(
                    "POST",
                    "/v1/chat/completions",
                    json.dumps({"model": "deepseek-v4", "messages": messages, "max_tokens": 8, "temperature": 0}),
                    {"Content-Type": "application/json"},
                )
                reply = json.loads(conn.getresponse().read())
                conn.close()
                usage = reply["usage"]
                turns.append(
                    (usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                )
                messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            per_turn.append(turns)
        for turns in per_turn:
            for prompt, cached in turns[1:]:
                assert cached >= prompt - 64, per_turn
        sent = metric(srv, "tokenmill_rank_requests_total")  # the node's totals, both gateways'
        assert set(sent) == {"0", "1"} and sum(sent.values()) == 25, sent
    finally:
        srv.stop()


def test_round_robin_loses_the_cache_that_affinity_keeps(ranks):
    shares = {}
    for policy in ("round_robin", "affinity"):
        srv = serve(ranks, "--dp-policy", policy)
        try:
            client = srv.client()
            turns = [t for i in range(4) for t in conversation(client, f"{policy}{i}", 5)[1:]]
            shares[policy] = sum(c for _, c in turns) / sum(p for p, _ in turns)
        finally:
            srv.stop()
    # round robin sends a turn where the previous one was not: the engine recomputes that turn's history
    assert shares["affinity"] > 0.8 and shares["round_robin"] < shares["affinity"] - 0.1, shares


def test_a_rank_that_dies_fails_only_its_own_requests(ranks):
    srv = serve(ranks)
    try:
        client = srv.client()
        streams = [
            client.chat.completions.create(
                model="deepseek-v4",
                max_tokens=100000,
                stream=True,
                messages=[{"role": "user", "content": f"Story {i}."}],
            )
            for i in range(6)
        ]
        for s in streams:  # every stream has had tokens from its rank (sampled: another rank cannot go on
            for chunk in s:  # with them, so the lost rank's fail; one with none yet would move and survive)
                if chunk.choices and chunk.choices[0].delta.content:
                    break
        _, _, state = http("GET", srv.url + "/debug/state")
        on_rank = {r["rank"]: r["in_flight"] for r in state["scheduler_ranks"]}
        assert on_rank[0] and on_rank[1], state  # both ranks have some (least loaded: new conversations spread)
        ranks[1].kill()
        failed = survived = 0
        for s in streams:  # what was sent before the kill drains at once; then an error, or more tokens
            until = time.monotonic() + 1.5
            try:
                for _ in s:
                    if time.monotonic() > until:
                        survived += 1
                        break
            except Exception as exc:  # the stream's error event
                assert "scheduler" in str(exc).lower() or "unavailable" in str(exc).lower(), exc
                failed += 1
        assert failed == on_rank[1] and survived == on_rank[0], (failed, survived, on_rank)
        for s in streams:
            s.close()
        # new requests go to the rank that is left, and the gateway says which one is missing
        for _ in range(3):
            assert (
                client.chat.completions.create(
                    model="deepseek-v4", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                .choices[0]
                .finish_reason
                == "length"
            )
        _, _, ready = http("GET", srv.url + "/ready")
        assert ready["ready"] and ready["missing_ranks"] == [ranks[1].endpoint], ready
        ranks[1].start()  # back: it says welcome again and takes requests
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and http("GET", srv.url + "/ready")[2]["missing_ranks"]:
            time.sleep(0.1)
        assert http("GET", srv.url + "/ready")[2]["missing_ranks"] == []
    finally:
        srv.stop()


def test_an_unreachable_or_different_rank_is_reported_and_not_used(tmp_path):
    good = Sim(f"ipc://{tmp_path}/good.sock")
    odd = Sim(f"ipc://{tmp_path}/odd.sock", "--vocab-size", "1000")  # another model's vocabulary
    nobody = f"ipc://{tmp_path}/nobody.sock"
    srv = Server("--workers", "1", "--scheduler", good.endpoint, "--scheduler", odd.endpoint, "--scheduler", nobody)
    try:
        client = srv.client()
        for i in range(4):
            out = client.chat.completions.create(
                model="deepseek-v4", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
            )
            assert out.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 30  # the odd rank's Welcome may come late (its process started late)
        while True:
            _, _, ready = http("GET", srv.url + "/ready")
            assert ready["ready"] and sorted(ready["missing_ranks"]) == sorted([odd.endpoint, nobody]), ready
            refused = {r["endpoint"]: r["refused"] for r in ready["scheduler_ranks"]}
            if refused[odd.endpoint] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "vocab_size 1000" in (refused[odd.endpoint] or "") and refused[nobody] is None, ready
        assert metric(srv, "tokenmill_rank_requests_total") == {"0": 4.0, "1": 0.0, "2": 0.0}
        srv.stop()
        assert "refused: vocab_size 1000 is smaller than the served tokenizer's" in srv.read_output()
    finally:
        srv.stop()
        good.kill()
        odd.kill()


def test_the_same_endpoint_twice_is_refused_at_start():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--scheduler",
            "ipc:///tmp/a.sock",
            "--scheduler",
            "ipc:///tmp/b.sock,ipc:///tmp/a.sock",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "ipc:///tmp/a.sock listed more than once" in proc.stderr + proc.stdout
