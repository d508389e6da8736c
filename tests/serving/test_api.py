"""The end-to-end path through real processes, driven by the official openai client."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import Server, http

CHAT = [{"role": "user", "content": "Tell me about tokenizers."}]


def model_name(srv) -> str:
    return srv.client().models.list().data[0].id


def test_models_health_ready_metrics(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["deepseek-v4"]
    status, _, body = http("GET", server.url + "/v1/models")
    assert body["data"][0]["max_model_len"] == 8192
    assert http("GET", server.url + "/health")[0] == 200
    status, _, body = http("GET", server.url + "/ready")
    assert status == 200 and body["workers_alive"] == 2 and body["scheduler_connected"] is True
    status, headers, text = http("GET", server.url + "/metrics")
    assert status == 200 and b"tokenmill_event_loop_lag_seconds_bucket" in text


def test_chat_non_streaming(server):
    client = server.client()
    resp = client.chat.completions.create(model="deepseek-v4", messages=CHAT, max_tokens=7, seed=1)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == "deepseek-v4"
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    # the prompt tokens are those of the rendered chat, as /tokenize counts them
    status, _, tok = http("POST", server.url + "/tokenize", {"messages": CHAT})
    assert status == 200 and resp.usage.prompt_tokens == tok["count"]
    assert resp.usage.total_tokens == tok["count"] + 7


def test_chat_streaming_with_usage(server):
    client = server.client()
    stream = client.chat.completions.create(
        model="deepseek-v4",
        messages=CHAT,
        max_tokens=12,
        stream=True,
        seed=5,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # same seed, same tokens: the non-streamed text is identical
    again = client.chat.completions.create(model="deepseek-v4", messages=CHAT, max_tokens=12, seed=5)
    assert again.choices[0].message.content == text


def test_completions_string_tokens_and_lists(server, default_tokenizer):
    client = server.client()
    one = client.completions.create(model="deepseek-v4", prompt="Once upon a time", max_tokens=4)
    assert one.object == "text_completion" and len(one.choices) == 1 and one.usage.completion_tokens == 4
    # a string prompt is encoded with special tokens (BOS), as transformers does for plain text
    ids = default_tokenizer.encode("Once upon a time", add_special_tokens=True).ids
    assert one.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model="deepseek-v4", prompt=ids, max_tokens=3)
    assert by_ids.usage.prompt_tokens == len(ids)
    many = client.completions.create(model="deepseek-v4", prompt=[ids, ids[:2]], max_tokens=2)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == len(ids) + 2 and many.usage.completion_tokens == 4
    texts = client.completions.create(model="deepseek-v4", prompt=["a", "b", "c"], max_tokens=1)
    assert len(texts.choices) == 3


def test_streamed_text_equals_full_decode(echo_server, default_tokenizer):
    """Echo mode generates the prompt's own tokens, so we know the IDs the stream carries."""
    text = "Grüße aus Köln! 東京の天気は晴れ。🙂🚀 emoji split across byte-level tokens, and\n\ttabs."
    ids = default_tokenizer.encode(text, add_special_tokens=False).ids
    stream = echo_server.client().completions.create(model="deepseek-v4", prompt=ids, max_tokens=len(ids), stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == default_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len([p for p in pieces if p]) > 5  # it really streamed, piece by piece


def test_stop_strings_cut_and_excluded(echo_server, default_tokenizer):
    client = echo_server.client()
    prompt = "alpha beta gamma STOP delta epsilon"
    ids = default_tokenizer.encode(prompt, add_special_tokens=False).ids
    resp = client.completions.create(model="deepseek-v4", prompt=ids, max_tokens=len(ids), stop=["STOP"])
    assert resp.choices[0].text == "alpha beta gamma "
    assert resp.choices[0].finish_reason == "stop"
    # streamed: the held-back prefix " ST" must never leak
    stream = client.completions.create(
        model="deepseek-v4", prompt=ids, max_tokens=len(ids), stop=["STOP", "zzz"], stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == "alpha beta gamma "
    assert chunks[-1].finish_reason == "stop"
    # a stop string that never occurs changes nothing
    resp = client.completions.create(model="deepseek-v4", prompt=ids, max_tokens=len(ids), stop="nowhere")
    assert resp.choices[0].text == prompt and resp.choices[0].finish_reason == "length"


def test_stop_token_ids(echo_server, default_tokenizer):
    ids = default_tokenizer.encode("one two three four", add_special_tokens=False).ids
    resp = echo_server.client().completions.create(
        model="deepseek-v4", prompt=ids, max_tokens=len(ids), extra_body={"stop_token_ids": [ids[2]]}
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].text == default_tokenizer.decode(ids[:3])
    vocab = default_tokenizer.get_vocab_size(with_added_tokens=True)
    status, _, body = http(
        "POST",
        echo_server.url + "/v1/completions",
        {"model": "deepseek-v4", "prompt": ids, "stop_token_ids": [ids[2], vocab]},
    )
    assert status == 400 and body["error"]["param"] == "stop_token_ids" and str(vocab) in body["error"]["message"], body


def test_detokenize_and_tokenize_prompt(server, default_tokenizer):
    status, _, body = http("POST", server.url + "/tokenize", {"prompt": "hello world"})
    assert status == 200
    assert body["tokens"] == default_tokenizer.encode("hello world", add_special_tokens=True).ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    status, _, body = http("POST", server.url + "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"].endswith("hello world")


# ---- bad input: every case gets an OpenAI-style 4xx error naming the problem ----------------


def assert_error(status, body, expected_status, *words):
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for word in words:
        assert word in err["message"], err


@pytest.mark.parametrize(
    "body, status, words, param",
    [
        (b"{not json", 400, ["not valid JSON"], None),
        (b"[1, 2]", 400, ["object"], None),
        (b"", 400, ["empty"], None),
        (b" \n\t\r\x0b ", 400, ["empty"], None),  # whitespace only: empty too (the worker checks it in place)
        ({"model": "deepseek-v4"}, 400, ["messages"], "messages"),
        ({"model": "deepseek-v4", "messages": []}, 400, ["messages"], "messages"),
        ({"model": "deepseek-v4", "messages": "hi"}, 400, ["array"], "messages"),
        (
            {"model": "deepseek-v4", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            ["role", "wizard"],
            "messages[0].role",
        ),
        ({"model": "deepseek-v4", "messages": CHAT, "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
        ({"model": "deepseek-v4", "messages": CHAT, "max_tokens": -5}, 400, ["max_tokens"], "max_tokens"),
        ({"model": "deepseek-v4", "messages": CHAT, "max_tokens": "ten"}, 400, ["int"], "max_tokens"),
        ({"model": "deepseek-v4", "messages": CHAT, "temperature": 7}, 400, ["temperature"], "temperature"),
        ({"model": "deepseek-v4", "messages": CHAT, "n": 0}, 400, ["n must be between 1"], "n"),
        ({"model": "deepseek-v4", "messages": CHAT, "seed": 2**63}, 400, ["seed"], "seed"),
        ({"model": "deepseek-v4", "messages": CHAT, "tool_choice": "required"}, 400, ["tool_choice"], "tool_choice"),
        ({"model": "gpt-9", "messages": CHAT}, 404, ["gpt-9", "does not exist"], "model"),
        ({"model": "deepseek-v4", "messages": CHAT, "max_tokens": 9000}, 400, ["8192", "9000"], "messages"),
    ],
)
def test_bad_chat_requests(server, body, status, words, param):
    got_status, _, got = http("POST", server.url + "/v1/chat/completions", body)
    assert_error(got_status, got, status, *words)
    assert got["error"]["param"] == param


def test_prompt_over_context_names_both_numbers(server):
    long_prompt = "word " * 9000
    status, _, body = http(
        "POST", server.url + "/v1/completions", {"model": "deepseek-v4", "prompt": long_prompt, "max_tokens": 10}
    )
    assert_error(status, body, 400, "8192")
    assert body["error"]["code"] == "context_length_exceeded"
    assert "in the completion" in body["error"]["message"]


def test_the_engines_context_length_is_checked_before_it_is_reached():
    """A scheduler whose Welcome says a smaller context than the model's: the workers check requests
    against it, so an over-long one is the same clear 400 as the model's limit gives, naming the field."""
    srv = Server("--workers", "1", "--sim-max-model-len", "64", "--sim-inter-token-latency-ms", "1")
    try:
        status, _, body = http("GET", srv.url + "/v1/models")
        assert body["data"][0]["max_model_len"] == 64
        status, _, body = http(
            "POST",
            srv.url + "/v1/chat/completions",
            {"model": "deepseek-v4", "messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 30},
        )
        assert_error(status, body, 400, "64")
        assert body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "messages"
        status, _, body = http(
            "POST",
            srv.url + "/v1/chat/completions",
            {"model": "deepseek-v4", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 5, body
        status, _, body = http("POST", srv.url + "/tokenize", {"model": "deepseek-v4", "prompt": "Hi"})
        assert body["max_model_len"] == 64
    finally:
        srv.stop()


def test_bad_completion_prompts(server):
    for prompt in ([], [1, "a"], [[]], [999999999], [[1, 2], "x"], None):
        status, _, body = http("POST", server.url + "/v1/completions", {"model": "deepseek-v4", "prompt": prompt})
        assert_error(status, body, 400)
        assert body["error"]["param"] == "prompt"


def _raw_post(port: int, head: bytes, body_chunks) -> bytes:
    """Send a request on a raw socket, tolerating a server that answers before the body is sent."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except OSError:
            pass  # the server already answered and stopped reading
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data and b'"error"' in data and data.rstrip().endswith(b"}"):
                    break
        except OSError:
            pass
        return data


def test_body_too_large(server):
    big = json.dumps({"model": "deepseek-v4", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(big)}\r\n\r\n"
    ).encode()
    answer = _raw_post(server.port, head, [big[i : i + 65536] for i in range(0, len(big), 65536)])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert_error(413, body, 413, "limit")
    # without a Content-Length (chunked), the limit applies as the body arrives
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = [b"%x\r\n%s\r\n" % (65536, big[i : i + 65536]) for i in range(0, 2 << 20, 65536)]
    answer = _raw_post(server.port, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_unknown_fields_are_ignored(server):
    """Another vendor's extension is ignored, as vLLM does; OpenAI's and vLLM's own fields are not
    (test_request_fields.py)."""
    status, _, body = http(
        "POST",
        server.url + "/v1/chat/completions",
        {"model": "deepseek-v4", "messages": CHAT, "max_tokens": 2, "vendor_extension": {"x": 1}, "user": "u-1"},
    )
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


def test_routes_and_methods(server):
    status, _, body = http("GET", server.url + "/v1/nope")
    assert_error(status, body, 404)
    status, _, body = http("GET", server.url + "/v1/chat/completions")
    assert_error(status, body, 405)


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="deepseek-v4", messages=CHAT, max_tokens=0)
    assert "max_tokens" in str(info.value)


def test_the_loop_lag_timer_slows_down_while_nothing_is_in_flight(server):
    """5 ms samples while a request is in flight, 50 ms while none is (an idle loop has no lag to
    find, and each wake-up of an idle process costs CPU). Counts of samples, not durations: a
    timer can fire late on a busy machine, never early."""
    import time

    def samples() -> int:
        status, _, body = http("GET", server.url + "/debug/loop-lag")
        assert status == 200
        return body["count"]

    before = samples()
    time.sleep(1.0)
    idle = samples() - before
    assert idle <= 1.0 / 0.05 + 2, idle  # at most one per 50 ms

    client = server.client()
    model = client.models.list().data[0].id
    before, t0 = samples(), time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=1000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
    busy, elapsed = samples() - before, time.monotonic() - t0
    assert tokens > 0
    assert busy > elapsed / 0.05 + 2, (busy, elapsed)  # more than the idle rate could give


def test_unknown_paths_share_one_metric_series(server):
    """A scanner trying a thousand paths must not add a thousand series to /metrics."""
    import re

    for path in ("/wp-login.php", "/v1/nope-1", "/v1/nope-2", "/.env"):
        status, _, body = http("GET", server.url + path)
        assert_error(status, body, 404)
    _, _, text = http("GET", server.url + "/metrics")
    text = text.decode()
    assert not re.search(r'endpoint="(/wp-login\.php|/v1/nope-1|/v1/nope-2|/\.env)"', text)
    unmatched = re.search(r'tokenmill_requests_total\{[^}]*endpoint="unmatched"[^}]*status="404"\} (\S+)', text)
    assert unmatched and float(unmatched.group(1)) >= 4
