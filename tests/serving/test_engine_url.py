"""`tokenmill serve --engine-url` in front of engine servers' token-in HTTP API, here the stand-in of
tests/fake_vllm_server.py (vLLM 0.32's shapes; tests/engines/test_vllm_field_parity.py runs the same path
against a real `vllm serve --enable-scale-out`): streams, explicit aborts on the server (client hang-up,
a stop string the workers matched, shutdown), the start-up checks (no token-in API, another
tokenization), replicas (one killed and started again), and an engine's faults (malformed events,
token IDs outside the vocabulary, a dropped connection, no engine at all)."""

from __future__ import annotations

import os
import signal
import sys
import threading

import httpx
import openai
import pytest
from conftest import ROOT, Server, free_port, http
from faultutil import metric, wait_until

from tokenmill.bench.servers import ProcessHandle

MODEL = "deepseek-v4"
HELLO = [{"role": "user", "content": "Tell me about the mill wheel and the river"}]


class FakeEngine(ProcessHandle):
    def __init__(self, *args: str, port: int | None = None, itl_ms: float = 20.0, wait: bool = True) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            "fake vLLM",
            [
                sys.executable,
                str(ROOT / "tests" / "fake_vllm_server.py"),
                "--port",
                str(self.port),
                "--itl-ms",
                str(itl_ms),
                *args,
            ],
            cwd=ROOT,
            new_session=True,
        )
        if wait:
            wait_until(lambda: self.up(), 30, what="the fake engine answering")

    def up(self) -> bool:
        try:
            return http("GET", self.url + "/health", timeout=1)[0] == 200
        except OSError:
            return False

    def state(self) -> dict:
        return http("GET", self.url + "/fake/state")[2]

    def mode(self, mode: str) -> None:
        assert http("POST", self.url + "/fake/mode", {"mode": mode})[0] == 200


def serve(*urls: str, ready: bool = True, **kw) -> Server:
    """`tokenmill serve --engine-url URL ...`; arguments that do not start with http are more flags."""
    args = ["--workers", "1"]
    for url in urls:
        args += ["--engine-url", url] if url.startswith("http") else [url]
    return Server(*args, ready=ready, **kw)


def ranks(front: Server) -> list[dict]:
    return http("GET", front.url + "/debug/state")[2]["scheduler_ranks"]


@pytest.fixture
def engine():
    fake = FakeEngine()
    yield fake
    fake.stop()


def test_chat_streams_from_the_engine_and_the_request_carries_the_protocol_fields(engine):
    front = serve(engine.url)
    try:
        client = front.client()
        text = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=HELLO,
                max_tokens=12,
                stream=True,
                temperature=0.5,
                seed=11,
                top_p=0.9,
                extra_body={"min_p": 0.05, "cache_salt": "tenant-a"},
            )
            if chunk.choices
        )
        assert text  # the fake echoes the prompt's tokens: the template's text comes back
        body = engine.state()["last_body"]
        params = body["sampling_params"]
        assert body["stream"] is True and body["cache_salt"] == "tenant-a" and body["model"] == "fake-model"
        assert (params["max_tokens"], params["temperature"], params["seed"], params["top_p"], params["min_p"]) == (
            12,
            0.5,
            11,
            0.9,
            0.05,
        )
        assert params["ignore_eos"] is True and params["detokenize"] is False
        assert params["stop_token_ids"]  # the model's EOS: the bridge ends the request there
        assert body["request_id"].startswith("tm")
        # bad_words go as the words (vLLM's API tokenizes them itself), recovered from the workers' tokens
        status, _, answer = http(
            "POST",
            front.url + "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 2, "bad_words": ["river", "  mill wheel", "它是一种"]},
        )
        assert status == 200, answer
        assert engine.state()["last_body"]["sampling_params"]["bad_words"] == ["river", "mill wheel", "它是一种"]
        # what these servers were not said to honour is refused, naming it: they would ignore it silently
        for field, value in (("priority", 3), ("kv_transfer_params", {"do_remote_decode": True})):
            status, _, error = http(
                "POST", front.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
            )
            assert status == 400 and error["error"]["param"] == field, error
    finally:
        assert front.stop() == 0


def test_the_lora_adapters_the_server_lists_are_models_here():
    """vLLM lists its LoRA adapters in /v1/models as children of the base model: tokenmill lists them too,
    takes a request naming one, sends it to the engine by that name and answers with it as the model; a
    name neither serves is a 404 naming what is served."""
    fake = FakeEngine("--lora", "sql", "--lora", "poet")
    front = serve(fake.url)
    try:
        cards = {card["id"]: card for card in front.client().models.list().model_dump()["data"]}
        assert cards[MODEL]["parent"] is None and {cards[n]["parent"] for n in ("sql", "poet")} == {MODEL}
        answer = front.client().chat.completions.create(model="sql", messages=HELLO, max_tokens=3)
        assert answer.model == "sql" and fake.state()["last_body"]["model"] == "sql"
        answer = front.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert answer.model == MODEL and fake.state()["last_body"]["model"] == "fake-model"
        status, _, error = http(
            "POST", front.url + "/v1/chat/completions", {"model": "sqll", "messages": HELLO, "max_tokens": 2}
        )
        assert status == 404 and error["error"]["code"] == "model_not_found", error
        assert "`sql`" in error["error"]["message"] and "`poet`" in error["error"]["message"]
    finally:
        assert front.stop() == 0
        fake.stop()


def test_priority_and_kv_transfer_params_go_to_servers_said_to_honour_them(engine):
    """--engine-scheduling-policy priority and --engine-kv-connector: the operator's word for what vLLM's API
    does not tell. A request's priority goes with it; kv_transfer_params go unstreamed (vLLM's token-in API
    returns the connector's answer only whole) and the connector's answer comes back to the client."""
    front = serve(engine.url, "--engine-scheduling-policy", "priority", "--engine-kv-connector")
    try:
        base = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        status, _, answer = http("POST", front.url + "/v1/completions", {**base, "priority": -7})
        assert status == 200, answer
        assert engine.state()["last_body"]["priority"] == -7
        asked = {"do_remote_decode": True, "remote_host": "10.0.0.5"}
        status, _, answer = http("POST", front.url + "/v1/completions", {**base, "kv_transfer_params": asked})
        assert status == 200, answer
        body = engine.state()["last_body"]
        assert body["kv_transfer_params"] == asked and body["stream"] is False and "priority" not in body
        assert answer["kv_transfer_params"] == {"remote_engine_id": "fake", "asked": asked}
        assert len(answer["choices"][0]["text"]) > 0 and answer["usage"]["completion_tokens"] == 3
    finally:
        assert front.stop() == 0


def _stream_until_tokens(front: Server, n: int, **body):
    """Open a stream and read until ``n`` content chunks came; returns the client, the open response and
    its line iterator (kept: once collected, httpx closes the response, which hangs up)."""
    client = httpx.Client(timeout=30)
    request = client.build_request(
        "POST",
        front.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 2000, "stream": True, **body},
    )
    response = client.send(request, stream=True)
    assert response.status_code == 200
    seen = 0
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: ") and '"content"' in line:
            seen += 1
            if seen >= n:
                break
    return client, response, lines


def test_a_client_hanging_up_a_stop_string_and_a_shutdown_each_abort_the_request_on_the_engine(engine):
    front = serve(engine.url, "--shutdown-timeout", "1")  # the drain gives up on the open stream after 1 s
    try:
        client, response, _lines = _stream_until_tokens(front, 3)
        assert len((s := engine.state())["running"]) == 1, s
        response.close()
        client.close()
        state = wait_until(lambda: (s := engine.state())["aborted"] and not s["running"] and s, 10, what="the abort")
        assert state["aborted"][0].startswith("generate-tokens-tm"), state  # explicit, by the server's ID
        assert state["finished"] == []

        # a stop string the workers match: the engine would go on; the bridge aborts it there
        prompt_text = "alpha beta gamma delta"
        answer = front.client().completions.create(model=MODEL, prompt=prompt_text, max_tokens=200, stop=[" gamma"])
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].text == "alpha beta"
        state = wait_until(lambda: (s := engine.state())["aborted"][1:] and not s["running"] and s, 10, what="abort")
        assert len(state["aborted"]) == 2 and state["finished"] == []

        # shutdown: the gateway ends its streams, the bridge aborts them on the engine
        client, response, _lines = _stream_until_tokens(front, 2)
        assert front.stop() == 0
        state = wait_until(lambda: (s := engine.state())["aborted"][2:] and not s["running"] and s, 10, what="abort")
        assert len(state["aborted"]) == 3
        client.close()
    finally:
        front.stop()


def test_a_bridge_told_to_stop_aborts_its_requests_on_the_engine_first(engine):
    """SIGTERM to the bridge alone (as systemd or an operator may send it; the gateway then starts a new
    one) while it streams: before it exits it aborts the request on the engine, by the server's ID,
    without waiting for the gateway to say so."""
    front = serve(engine.url)
    try:
        client, response, _lines = _stream_until_tokens(front, 2)
        assert len((s := engine.state())["running"]) == 1, s
        (bridge,) = http("GET", front.url + "/debug/state")[2]["engine_bridges"]
        os.kill(bridge["pid"], signal.SIGTERM)
        state = wait_until(lambda: (s := engine.state())["aborted"] and not s["running"] and s, 10, what="the abort")
        assert state["aborted"][0].startswith("generate-tokens-tm") and state["finished"] == [], state
        client.close()
    finally:
        assert front.stop() == 0


def bridge_exits(front: Server) -> list[str]:
    return [how for bridge in http("GET", front.url + "/debug/state")[2]["engine_bridges"] for how in bridge["exits"]]


def test_no_token_in_api_or_another_tokenization_is_refused_with_what_differs():
    engine = FakeEngine("--mode", "forbidden")
    front = serve(engine.url, ready=False)
    try:
        status, headers, error = wait_until(
            lambda: (
                (r := http("POST", front.url + "/v1/chat/completions", {"model": MODEL, "messages": HELLO}))[0] == 503
                and r
            ),
            30,
        )
        assert error["error"]["code"] == "scheduler_unavailable" and headers.get("retry-after"), (headers, error)
        status, _, ready = http("GET", front.url + "/ready")
        assert status == 503 and ready["engines"] == [{"url": engine.url, "connected": False}], ready
        assert wait_until(lambda: bridge_exits(front), 30) == ["exit status 2"]  # refused: retried only slowly
    finally:
        front.stop()
        engine.stop()
    out = front.output()
    assert "--enable-scale-out" in out and "refused its engine" in out, out[-3000:]

    engine = FakeEngine("--mode", "skewed")
    front = serve(engine.url, ready=False)
    try:
        wait_until(lambda: bridge_exits(front), 30)
    finally:
        front.stop()
        engine.stop()
    out = front.output()
    assert "tokenizes the canary conversation differently" in out and "first difference at token 1" in out, out[-3000:]


def test_two_replicas_serve_as_one_and_a_killed_one_comes_back():
    a, b = FakeEngine(), FakeEngine()
    front = serve(a.url, b.url)
    try:
        wait_until(lambda: all(r["connected"] for r in ranks(front)), 20, what="both ranks")
        client = front.client()
        for i in range(6):  # new conversations go to the least loaded replica: both serve
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"conversation {i}"}], max_tokens=3
            )
        assert a.state()["requests"] and b.state()["requests"]
        # per replica: which URL each rank is, its requests and first tokens
        for rank, fake in enumerate((a, b)):
            assert metric(front, "tokenmill_engine_info", rank=str(rank), url=fake.url) == 1
            sent = metric(front, "tokenmill_rank_requests_total", rank=str(rank))
            assert sent == fake.state()["requests"] > 0
            assert metric(front, "tokenmill_rank_time_to_first_token_seconds_count", rank=str(rank)) == sent
        port = b.port
        b.stop()  # the replica goes away: the bridge sees its health fail and exits; its rank is lost
        wait_until(lambda: [r["connected"] for r in ranks(front)] == [True, False], 30, what="the rank lost")
        before = a.state()["requests"]
        for i in range(4):  # everything goes to the live one meanwhile
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"meanwhile {i}"}], max_tokens=3
            )
            assert answer.choices[0].finish_reason == "length"
        assert a.state()["requests"] == before + 4
        b = FakeEngine(port=port)  # back on the same address: a new bridge waits for it and says welcome
        wait_until(lambda: all(r["connected"] for r in ranks(front)), 30, what="the replica back")
    finally:
        assert front.stop() == 0
        a.stop()
        b.stop()


def test_an_engines_faults_end_that_request_with_a_clear_error_and_the_others_go_on(engine):
    front = serve(engine.url)
    try:
        client = front.client()
        for mode, words in (("malformed", "malformed event"), ("oov", "vocabulary"), ("drop", "broke")):
            engine.mode(mode)
            with pytest.raises(openai.APIError) as caught:  # the stream's error event
                for _ in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stream=True):
                    pass
            assert words in str(caught.value), (mode, caught.value)
            engine.mode("ok")
            answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
            assert answer.choices[0].finish_reason == "length", mode
        assert http("GET", front.url + "/health")[0] == 200
        assert metric(front, "tokenmill_rank_errors_total", rank="0") == 3
    finally:
        assert front.stop() == 0


def test_no_engine_at_start_gets_503s_and_serving_begins_when_it_answers():
    port = free_port()
    front = serve(f"http://127.0.0.1:{port}", ready=False)
    engine = None
    try:
        status, headers, error = wait_until(
            lambda: (
                (r := http("POST", front.url + "/v1/chat/completions", {"model": MODEL, "messages": HELLO}))[0] == 503
                and r
            ),
            30,
        )
        assert headers.get("retry-after") and error["error"]["type"], (headers, error)
        engine = FakeEngine(port=port)
        wait_until(lambda: http("GET", front.url + "/ready")[0] == 200, 30, what="serving")
        answer = front.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
        assert answer.choices[0].finish_reason == "length"
        front.proc.send_signal(signal.SIGTERM)
        assert front.proc.wait(30) == 0
    finally:
        front.stop()
        if engine is not None:
            engine.stop()


def _streams(front: Server, bodies: list[dict]) -> list[tuple]:
    """Every body streamed at once: (text, finish reason, completion tokens) each, or the error it ended with."""
    results: list = [None] * len(bodies)

    def one(i: int) -> None:
        client = front.client()
        text, finish, usage = "", None, None
        try:
            for chunk in client.chat.completions.create(
                model=MODEL, stream=True, stream_options={"include_usage": True}, **bodies[i]
            ):
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            results[i] = (text, finish, usage)
        except openai.APIError as exc:
            results[i] = ("error", str(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_a_replica_killed_mid_stream_and_its_greedy_streams_go_on_unbroken():
    """kill -9 of one of two replicas while greedy streams run on both: each stream goes on on the other
    replica from its prompt and the tokens it had, and its client sees the same text, finish and usage as
    an undisturbed run. Sampled streams that were on it end with a clear error instead."""
    a, b = FakeEngine("--chain", itl_ms=15), FakeEngine("--chain", itl_ms=15)
    front = serve(a.url, b.url)
    try:
        wait_until(lambda: all(r["connected"] for r in ranks(front)), 20, what="both ranks")
        greedy = [
            {"messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 80, "temperature": 0}
            for i in range(8)
        ]
        sampled = [
            {"messages": [{"role": "user", "content": f"sampled {i}"}], "max_tokens": 80, "temperature": 1, "seed": i}
            for i in range(2)
        ]
        undisturbed = _streams(front, greedy + sampled)
        assert all(r[1] == "length" and r[2] == 80 for r in undisturbed), undisturbed

        killer = threading.Timer(0.5, lambda: os.kill(b.pid, signal.SIGKILL))  # ~30 tokens into the streams
        killer.start()
        disturbed = _streams(front, greedy + sampled)
        killer.join()
        assert disturbed[: len(greedy)] == undisturbed[: len(greedy)]
        for got, want in zip(disturbed[len(greedy) :], undisturbed[len(greedy) :], strict=True):
            assert got == want or (got[0] == "error" and "scheduler" in got[1].lower()), got
        assert metric(front, "tokenmill_stream_failovers_total", reason="rank_resumed") >= 1
    finally:
        assert front.stop() == 0
        a.stop()
        b.stop()
