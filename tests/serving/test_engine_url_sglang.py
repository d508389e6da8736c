"""`tokenmill serve --engine-url` in front of SGLang's own server (the SGLang flavour, engines/http_sglang.py),
here the stand-in of tests/fake_sglang_server.py (SGLang 0.5.23's shapes): auto-detection, the text of the
token IDs it streams with cumulative and incremental output alike, explicit aborts (a client hang-up, a
stop string), the fields SGLang cannot carry refused by name, its faults, and the start-up checks (another
tokenization, another model, a flavour named for the other server). One fake and one tokenmill serve the
module; the refusals start their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import ROOT, Server, free_port, http
from faultutil import metric, wait_until
from test_engine_url import FakeEngine, bridge_exits, serve

from tokenmill.bench.servers import ProcessHandle
from tokenmill.tokenizer_workers.model import default_model_dir, load_model

MODEL = "deepseek-v4"
HELLO = [{"role": "user", "content": "Tell me about the mill wheel and the river"}]
REPLY = "The mill wheel turns slowly, and the river carries the evening light past it."


class FakeSGLang(ProcessHandle):
    def __init__(self, *args: str, itl_ms: float = 10.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            "fake SGLang",
            [
                sys.executable,
                str(ROOT / "tests" / "fake_sglang_server.py"),
                "--port",
                str(self.port),
                "--itl-ms",
                str(itl_ms),
                *args,
            ],
            cwd=ROOT,
            new_session=True,
        )
        wait_until(self.up, 30, what="the fake SGLang answering")

    def up(self) -> bool:
        try:
            return http("GET", self.url + "/health", timeout=1)[0] == 200
        except OSError:
            return False

    def state(self) -> dict:
        return http("GET", self.url + "/fake/state")[2]

    def set(self, **settings) -> None:
        assert http("POST", self.url + "/fake/mode", settings)[0] == 200


@pytest.fixture(scope="module")
def stack():
    engine = FakeSGLang("--max-model-len", "65536")
    front = serve(engine.url)  # --engine-flavour auto
    yield engine, front
    try:
        assert front.stop() == 0
    finally:
        engine.stop()
    out = front.output()  # the bridge found SGLang by asking (auto) and said what it checked
    assert "engine at " + engine.url + ": SGLang 0.5.23" in out and "canary equal" in out, out[-3000:]


@pytest.fixture
def fake(stack):
    engine, _front = stack
    engine.set(mode="ok", incremental=False, stream_interval=1, reply=REPLY)
    return engine


def _stream(front: Server, **body) -> tuple[str, str | None, list]:
    """A streamed chat's text, finish reason and logprobs content."""
    text, finish, logprobs = "", None, []
    for chunk in front.client().chat.completions.create(model=MODEL, messages=HELLO, stream=True, **body):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += choice.logprobs.content
    return text, finish, logprobs


def test_auto_detection_picks_sglang_and_a_chat_and_a_stream_give_the_text_of_its_token_ids(stack, fake):
    engine, front = stack
    answer = front.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=100)
    reply_ids = load_model(None).tokenizer.encode(REPLY, add_special_tokens=False).ids
    # the fake's reply and then the model's EOS, which SGLang ended the request at by itself
    assert answer.choices[0].message.content == REPLY and answer.choices[0].finish_reason == "stop", answer
    assert answer.usage.completion_tokens == len(reply_ids) + 1
    assert engine.state()["finished"] and not engine.state()["aborted"]
    text, finish, _ = _stream(front, max_tokens=100)
    assert (text, finish) == (REPLY, "stop")

    body = engine.state()["last_body"]
    params = body["sampling_params"]
    assert body["stream"] is True and body["rid"].startswith("tm") and body["input_ids"]
    assert params["max_new_tokens"] == 100 and params["top_k"] == -1 and "ignore_eos" not in params
    assert set(load_model(None).eos_token_ids) <= set(params["stop_token_ids"])  # SGLang ends the request there
    # only SGLang's own sampling keys (it refuses others): the fake took the request
    assert "detokenize" not in params and "max_tokens" not in params and "seed" not in params

    # the request's settings under SGLang's names; a client's ignore_eos turns SGLang's stop tokens off
    answer = front.client().chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=40,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.5,
        logit_bias={"11": 2.0},
        response_format={"type": "json_object"},
        extra_body={"top_k": 5, "min_p": 0.05, "min_tokens": 3, "cache_salt": "tenant-a", "ignore_eos": True},
    )
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 40, answer
    body = engine.state()["last_body"]
    params = body["sampling_params"]
    assert body["cache_salt"] == "tenant-a" and params["ignore_eos"] is True, body
    assert (params["temperature"], params["top_p"], params["top_k"], params["min_p"]) == (0.5, 0.9, 5, 0.05)
    assert (params["presence_penalty"], params["min_new_tokens"], params["logit_bias"]) == (0.5, 3, {"11": 2.0})
    assert params["json_schema"] == '{"type": "object"}', params


def test_cumulative_and_incremental_output_give_the_same_text_and_logprobs(stack, fake):
    engine, front = stack
    results = []
    for incremental in (False, True):
        engine.set(incremental=incremental, stream_interval=3)  # three tokens an event
        text, finish, logprobs = _stream(front, max_tokens=100, logprobs=True, top_logprobs=2)
        events = engine.state()["last_events"]
        total = engine.state()["generated"][engine.state()["last_body"]["rid"]]
        if incremental:  # each event holds its new tokens only
            assert sum(events) == total and max(events) <= 3, events
        else:  # each event holds every token so far
            assert events == sorted(events) and events[-1] == total and len(events) > 2, events
        assert logprobs and {p.logprob for p in logprobs} == {-0.5}
        assert all([t.logprob for t in p.top_logprobs] == [-0.5, -1.5] for p in logprobs)
        results.append((text, finish, len(logprobs)))
    assert results[0] == results[1] and results[0][:2] == (REPLY, "stop"), results


def test_a_long_cumulative_answer_whose_events_outgrow_a_read_buffer(stack, fake):
    engine, front = stack
    engine.set(reply=None, stream_interval=2500)  # echo the prompt; the last event is 25,000 IDs and their text
    text, finish, _ = _stream(front, max_tokens=25000)
    assert finish == "length" and len(text) > 50000
    assert engine.state()["last_events"][-1] == 25000


def _open_stream(front: Server, n: int, **body):
    """Open a stream and read until ``n`` content chunks came; the client, the response and its lines."""
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


def test_a_client_hanging_up_and_a_stop_string_each_abort_the_request_on_the_engine(stack, fake):
    engine, front = stack
    engine.set(reply=None)  # echo: it would go on for all 2000 tokens
    before = len(engine.state()["aborted"])
    client, response, _lines = _open_stream(front, 3)
    assert len(engine.state()["running"]) == 1
    response.close()
    client.close()
    state = wait_until(lambda: (s := engine.state())["aborted"][before:] and not s["running"] and s, 10, what="abort")
    rid = state["aborted"][before]
    assert rid.startswith("tm") and rid not in state["finished"] and state["generated"][rid] < 2000, state

    # a stop string the workers match: SGLang would go on; the bridge aborts it there
    answer = front.client().completions.create(
        model=MODEL, prompt="alpha beta gamma delta", max_tokens=200, stop=[" gamma"]
    )
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].text == "alpha beta"
    state = wait_until(
        lambda: (s := engine.state())["aborted"][before + 1 :] and not s["running"] and s, 10, what="abort"
    )
    rid = state["aborted"][before + 1]
    assert rid not in state["finished"] and state["generated"][rid] < 200, state


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # exited, not yet reaped: gone all the same
    except OSError:
        return False


def test_a_gateway_killed_with_kill_9_still_aborts_its_requests_on_the_engine(stack, fake):
    """SGLang notices a closed connection only by polling, seconds later: the bridge, told by SIGTERM when
    its gateway dies, aborts what it was serving explicitly and exits."""
    engine, _front = stack
    engine.set(reply=None)  # echo: it would go on for all 2000 tokens
    front = serve(engine.url)
    try:
        before = len(engine.state()["aborted"])
        (bridge,) = http("GET", front.url + "/debug/state")[2]["engine_bridges"]
        client, response, _lines = _open_stream(front, 3)
        (rid,) = engine.state()["running"]
        os.kill(front.proc.pid, signal.SIGKILL)
        state = wait_until(
            lambda: (s := engine.state())["aborted"][before:] and not s["running"] and s, 10, what="the abort"
        )
        assert state["aborted"][before:] == [rid] and rid not in state["finished"], state
        assert state["generated"][rid] < 2000, state
        wait_until(lambda: not _alive(bridge["pid"]), 25, what="the bridge exiting")
        response.close()
        client.close()
    finally:
        front.stop()


def test_what_sglang_cannot_carry_gets_a_400_naming_the_field(stack, fake):
    engine, front = stack
    requests = engine.state()["requests"]
    for field, value in (
        ("bad_words", ["river"]),  # not in SGLang's sampling parameters
        ("allowed_token_ids", [1, 2, 3]),
        ("prompt_logprobs", 1),  # SGLang gives no rank for a prompt token
        ("seed", 7),  # ignored by SGLang without --enable-deterministic-inference
    ):
        status, _, error = http(
            "POST",
            front.url + "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0.7, field: value},
        )
        assert status == 400 and error["error"]["param"] == field, (field, error)
    assert engine.state()["requests"] == requests  # none of them reached the engine
    # SGLang's own refusal, an error event before the first token: a 400 naming the field too
    engine.set(mode="refuse")
    status, _, error = http("POST", front.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status == 400 and error["error"]["param"] == "top_p", error
    assert error["error"]["message"].endswith(": top_p must be in (0, 1], got 1.0."), error
    engine.set(mode="ok")
    # greedy needs no seed: one with temperature 0 goes through
    status, _, answer = http(
        "POST",
        front.url + "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0, "seed": 7},
    )
    assert status == 200, answer


def test_an_engines_faults_end_that_request_with_a_clear_error_and_the_others_go_on(stack, fake):
    engine, front = stack
    client = front.client()
    errors = metric(front, "tokenmill_rank_errors_total", rank="0")
    for mode, words in (("malformed", "malformed event"), ("oov", "vocabulary"), ("drop", "broke")):
        engine.set(mode=mode, reply=None)
        with pytest.raises(openai.APIError) as caught:
            for _ in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stream=True):
                pass
        assert words in str(caught.value), (mode, caught.value)
        engine.set(mode="ok")
        answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
        assert answer.choices[0].finish_reason == "length", mode
    assert metric(front, "tokenmill_rank_errors_total", rank="0") == errors + 3


def _bridge(engine, *args: str) -> subprocess.CompletedProcess:
    """One `tokenmill engine --backend http` against ``engine`` (a fake), as `tokenmill serve` starts it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.engines.bridge",
            "--backend",
            "http",
            "--engine-url",
            engine.url,
            "--bind",
            f"ipc:///tmp/tokenmill-test-sglang-{engine.port}.sock",
            "--engine-wait-s",
            "20",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_another_tokenization_or_another_model_is_refused_with_what_differs(tmp_path):
    engine = FakeSGLang("--mode", "skewed")
    front = serve(engine.url, ready=False)
    try:
        assert wait_until(lambda: bridge_exits(front), 30) == ["exit status 2"]  # refused: retried only slowly
        status, _, ready = http("GET", front.url + "/ready")
        assert status == 503 and ready["engines"] == [{"url": engine.url, "connected": False}], ready
    finally:
        front.stop()
        engine.stop()
    out = front.output()
    assert "tokenizes the canary conversation differently" in out and "first difference at token 1" in out, out[-3000:]

    # an SGLang whose /v1/tokenize takes no messages: tokenmill's rendering, tokenized there, is compared
    engine = FakeSGLang("--mode", "skewed", "--old-tokenize")
    try:
        done = _bridge(engine)
    finally:
        engine.stop()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "tokenizes tokenmill's rendering of the canary conversation differently" in done.stderr, done.stderr[-3000:]

    # another model: its model_type and architectures are not those of the directory tokenmill serves
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).symlink_to(default_model_dir() / name)
    (model / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]})
    )
    engine = FakeSGLang("--model-type", "llama", "--architectures", "LlamaForCausalLM")
    try:
        done = _bridge(engine, "--model", str(model))
    finally:
        engine.stop()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "whose model_type is 'llama'" in done.stderr and "'deepseek_v4'" in done.stderr, done.stderr[-3000:]


def test_a_flavour_named_for_the_other_server_is_refused_saying_which_it_is():
    sglang, vllm = FakeSGLang(), FakeEngine()
    try:
        as_vllm = _bridge(sglang, "--engine-flavour", "vllm")
        as_sglang = _bridge(vllm, "--engine-flavour", "sglang")
    finally:
        sglang.stop()
        vllm.stop()
    assert as_vllm.returncode == 2 and "is SGLang's server" in as_vllm.stderr, as_vllm.stderr[-3000:]
    assert as_sglang.returncode == 2 and "is not an SGLang server" in as_sglang.stderr, as_sglang.stderr[-3000:]


def test_the_lora_adapters_sglang_lists_are_models_here_and_go_as_its_lora_path():
    """SGLang lists its loaded LoRA adapters in /v1/models as children of the base model, as vLLM does, and
    takes an adapter's name as /generate's lora_path: tokenmill lists them and sends a request naming one so."""
    engine = FakeSGLang("--lora", "sql")
    front = serve(engine.url)
    try:
        cards = {card["id"]: card for card in front.client().models.list().model_dump()["data"]}
        assert cards["sql"]["parent"] == MODEL, cards
        answer = front.client().chat.completions.create(model="sql", messages=HELLO, max_tokens=5)
        assert answer.model == "sql" and engine.state()["last_body"]["lora_path"] == "sql"
        front.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
        assert "lora_path" not in engine.state()["last_body"]
    finally:
        assert front.stop() == 0
        engine.stop()
