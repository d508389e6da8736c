"""Property-based fuzzing of request bodies: whatever arrives, the answer is a 2xx or an
OpenAI-style 4xx, never a 5xx and never a hang.

Bodies are random JSON values, objects with the real field names and wrongly typed values,
mutated valid bodies (fields dropped, replaced, set to edge values), byte-level corruptions
of valid bodies, and raw invalid bytes. The run is bounded and reproducible
(derandomize=True, a fixed number of examples, no example database).
"""

from __future__ import annotations

import copy
import http.client
import json

import pytest
from conftest import Server
from faultutil import CHAT_MODEL, ERROR_FIELDS, idle, wait_until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
FIELDS = sorted(
    {
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "n",
        "stream",
        "stream_options",
        "skip_special_tokens",
        "logprobs",
        "tools",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "echo",
        "add_special_tokens",
        "return_token_strs",
        "tokens",
    }
)
VALID = {
    "/v1/chat/completions": {
        "model": CHAT_MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_tokens": 3,
        "temperature": 0.5,
        "stop": ["\n\n"],
        "seed": 3,
    },
    "/v1/completions": {"model": CHAT_MODEL, "prompt": "Once upon a time", "max_tokens": 3, "top_p": 0.9},
    "/tokenize": {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "add_generation_prompt": True,
    },
    "/detokenize": {"model": CHAT_MODEL, "tokens": [1, 2, 3]},
}
EDGE = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    1e308,
    -1e308,
    0.5,
    "",
    " ",
    "0",
    "\x00",
    "\ud800",
    "🙂" * 50,
    [],
    {},
    [[]],
    [None],
    {"": None},
    [1, "a"],
    [-5],
    [10**12],
    "x" * 5000,
]

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(EDGE)
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10) | st.sampled_from(FIELDS), inner, max_size=4)
    ),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "wizard", ""]) | json_values,
            "content": st.text(max_size=60) | json_values,
        },
        optional={
            "name": json_values,
            "tool_calls": json_values,
            "tool_call_id": json_values,
            "reasoning_content": json_values,
        },
    ),
    max_size=4,
)


def encode(value) -> bytes:
    # allow_nan: NaN and Infinity go out as the invalid JSON tokens they are
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def typed_fields(draw) -> bytes:
    """An object of the real field names with values of any type."""
    body = draw(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
    if draw(st.booleans()):
        body["messages"] = draw(messages)
    return encode(body)


@st.composite
def mutated(draw, endpoint: str) -> bytes:
    body = copy.deepcopy(VALID[endpoint])
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(set(FIELDS) | set(body))))
        action = draw(st.sampled_from(["drop", "random", "edge", "messages"]))
        if action == "drop":
            body.pop(key, None)
        elif action == "random":
            body[key] = draw(json_values)
        elif action == "edge":
            body[key] = draw(st.sampled_from(EDGE))
        else:
            body["messages"] = draw(messages)
    return encode(body)


@st.composite
def corrupted(draw, endpoint: str) -> bytes:
    data = bytearray(encode(VALID[endpoint]))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


def bodies(endpoint: str):
    return st.one_of(
        json_values.map(encode),
        typed_fields(),
        mutated(endpoint),
        corrupted(endpoint),
        st.binary(max_size=300),
    )


cases = st.sampled_from(ENDPOINTS).flatmap(lambda ep: st.tuples(st.just(ep), bodies(ep)))

HANDPICKED = [
    b"[" * 100_000,
    b'{"messages": ' + b"[" * 50_000,
    b'{"model": "deepseek-v4", "messages": [{"role": "user", "content": ' + b"[" * 20_000 + b"]" * 20_000 + b"}]}",
    b"\xef\xbb\xbf" + encode(VALID["/v1/completions"]),
    b"\xff\xfe\x00\x00",
    b'{"model": "deepseek-v4", "prompt": "\\ud800", "max_tokens": 2}',
    b'{"model": "deepseek-v4", "prompt": "a", "max_tokens": 1e400}',
    b'{"model": "deepseek-v4", "prompt": "a", "max_tokens": 2, "max_tokens": "x"}',
    b'{"model": "deepseek-v4", "prompt": [[1, 2], [3, -1]], "max_tokens": 2}',
    b'{"model": "deepseek-v4", "prompt": "a", "max_tokens": 2, "temperature": NaN}',
    b'{"model": "deepseek-v4", "messages": [{"role": "user", "content": "a"}], "stream": true, "stream_options": 5}',
    b'{"model": "deepseek-v4", "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]}',
    b"null",
    b"\x00" * 64,
]


@pytest.fixture(scope="module")
def fuzz_server():
    srv = Server(
        "--workers",
        "2",
        "--sim-inter-token-latency-ms",
        "0",
        "--max-model-len",
        "2048",
        "--max-body-bytes",
        str(1 << 20),
    )
    yield srv
    srv.stop()


def post(srv, path: str, body: bytes) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)  # a hang fails the example
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("content-type", "")
    finally:
        conn.close()


def check(srv, path: str, body: bytes) -> int:
    status, payload, content_type = post(srv, path, body)
    assert status < 500, f"{path} {body[:300]!r} -> {status} {payload[:500]!r}"
    if status >= 400:
        answer = json.loads(payload)
        assert isinstance(answer, dict) and isinstance(answer.get("error"), dict), payload[:500]
        assert set(answer["error"]) == ERROR_FIELDS, answer
        assert isinstance(answer["error"]["message"], str) and answer["error"]["message"], answer
    elif content_type.startswith("text/event-stream"):
        events = [e for e in payload.split(b"\n\n") if e.strip()]
        assert events and events[-1] == b"data: [DONE]", payload[-300:]
        for e in events[:-1]:
            json.loads(e.removeprefix(b"data: "))
    else:
        json.loads(payload)
    return status


STATUSES: dict = {}


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(case=cases)
@example(case=("/v1/chat/completions", HANDPICKED[0]))
def test_fuzzed_bodies_get_2xx_or_openai_4xx(fuzz_server, case):
    path, body = case
    status = check(fuzz_server, path, body)
    STATUSES[status] = STATUSES.get(status, 0) + 1


def test_handpicked_hostile_bodies(fuzz_server):
    for body in HANDPICKED:
        for path in ENDPOINTS:
            check(fuzz_server, path, body)


def test_fuzzing_left_nothing_behind(fuzz_server):
    print(f"[fuzz] statuses over the property run: {dict(sorted(STATUSES.items()))}")
    assert wait_until(lambda: idle(fuzz_server), 30, what="an idle server after fuzzing")
    for w in idle(fuzz_server)["workers"]:
        assert w["alive"] and not w["busy"]
