"""A real vLLM behind tokenmill, side by side with vLLM's own OpenAI server on the same model.

One tiny random-weight Llama (tokenmill/tiny_model.py, made here, no download) is
served twice, on the CPU build of vLLM (the `.venv-vllm` that ./scripts/test.sh builds):

* by vLLM's own server: `python -m vllm.entrypoints.openai.api_server --model DIR ...`;
* by `tokenmill engine --backend vllm` (vLLM's AsyncLLM fed token IDs) behind `tokenmill serve`.

Both vLLM processes start together (~40 s on 2 cores with `enforce_eager`), as soon as pytest has
collected the tests, so that they load while the other modules run; they run with the same engine
settings, so the same prompt IDs and sampling parameters give the same tokens. The tests
check that what a client sees is the same on both: /tokenize IDs, greedy and seeded sampled
completions (streamed and not), usage and finish reasons; that every difference is one of the
documented ones (docs/engines/tokenmill-engine.md, "Where answers differ from vLLM's own server"),
asserted as that difference; and
the bridge's contract with the real engine: client disconnects abort inside vLLM, over-long
prompts and out-of-vocabulary IDs are clean 400s, vLLM's own validation reaches the client,
`stop_token_ids` / `ignore_eos` as docs/engines/scheduler-protocol.md says, protocol 1.1 straight over
the scheduler protocol (logprobs, structured outputs, min_tokens, logit_bias, ... against what
vLLM's own server returns for the same request), and an engine killed mid-stream (the last
test: it costs another engine start).

Skipped where vLLM's CPU build cannot run (tests/vllm_env.py says why).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

import pytest
from vllm_env import missing_reason

_why = missing_reason()
if _why:
    pytest.skip(_why, allow_module_level=True)

import openai  # noqa: E402
import vllm_stack  # noqa: E402
from conftest import Server, http  # noqa: E402
from protocol_client import ProtocolClient  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from vllm_stack import EOS, EOS_TEXT, MAX_MODEL_LEN, NAME, VOCAB, Engine, Stack, wait_all  # noqa: E402

from tokenmill.scheduler_client.protocol import (  # noqa: E402
    FEATURES,
    Error,
    Generate,
    Outputs,
    SamplingParams,
    Stats,
    Structured,
    Welcome,
    bytes_to_floats,
    frame_to_ids,
    ids_to_frame,
)

# the shared stack (tests/vllm_stack.py): started once per session, as soon as the tests are collected
start_early = vllm_stack.start_early
stack = vllm_stack.module_fixture()


# ---- requests -------------------------------------------------------------------------------------


@dataclass
class Out:
    text: str
    finish: str | None
    usage: tuple[int, int, int] | None
    ids: list[int] | None  # generated token IDs (vLLM's return_token_ids)


def _usage(u) -> tuple[int, int, int] | None:
    return None if u is None else (u.prompt_tokens, u.completion_tokens, u.total_tokens)


# request fields the openai client does not know: they go in extra_body
NOT_OPENAI = {
    "chat_template_kwargs",
    "continue_final_message",
    "add_generation_prompt",
    "skip_special_tokens",
    "stop_token_ids",
    "ignore_eos",
    "top_k",
}


def _extra(body: dict) -> dict:
    extra = dict(body.pop("extra_body", None) or {})
    for key in NOT_OPENAI & set(body):
        extra[key] = body.pop(key)
    return extra


def chat(client: openai.OpenAI, stream: bool = False, ids: bool = False, **body) -> Out:
    extra = _extra(body)
    if ids:
        extra["return_token_ids"] = True
    if not stream:
        r = client.chat.completions.create(model=NAME, extra_body=extra or None, **body)
        c = r.choices[0]
        text = _raw(getattr(c.message, "reasoning", None), c.message.content)
        return Out(text, c.finish_reason, _usage(r.usage), getattr(c, "token_ids", None))
    chunks = list(
        client.chat.completions.create(
            model=NAME, stream=True, stream_options={"include_usage": True}, extra_body=extra or None, **body
        )
    )
    reasoning = "".join(getattr(c.delta, "reasoning", None) or "" for k in chunks for c in k.choices) or None
    content = [c.delta.content for k in chunks for c in k.choices if c.delta.content is not None]
    out = _joined(chunks, lambda c: None, ids)
    return Out(_raw(reasoning, "".join(content) if content else None), out.finish, out.usage, out.ids)


def _raw(reasoning: str | None, content: str | None) -> str:
    """The model's text before the stack's reasoning parser (deepseek_v3: on when the template thinks)
    split it at "</think>", which it drops: the generated tokens' decode, as the tests compare it."""
    if reasoning is None:
        return content or ""
    return reasoning + ("</think>" + content if content is not None else "")


def complete(client: openai.OpenAI, stream: bool = False, ids: bool = False, **body) -> Out:
    extra = _extra(body)
    if ids:
        extra["return_token_ids"] = True
    if not stream:
        r = client.completions.create(model=NAME, extra_body=extra or None, **body)
        c = r.choices[0]
        return Out(c.text, c.finish_reason, _usage(r.usage), getattr(c, "token_ids", None))
    chunks = list(
        client.completions.create(
            model=NAME, stream=True, stream_options={"include_usage": True}, extra_body=extra or None, **body
        )
    )
    return _joined(chunks, lambda c: c.text, ids)


def _joined(chunks, piece, ids: bool) -> Out:
    text, finishes, token_ids = "", [], []
    for chunk in chunks:
        for c in chunk.choices:
            text += piece(c) or ""
            token_ids += getattr(c, "token_ids", None) or []
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert len(finishes) == 1, finishes
    assert chunks[-1].usage is not None and not chunks[-1].choices  # the usage chunk comes last
    return Out(text, finishes[0], _usage(chunks[-1].usage), token_ids if ids else None)


def pairs(stack: Stack, *requests: tuple) -> list[tuple[Out, Out]]:
    """Each (kind, body) request sent to vLLM's server (asking for its generated token IDs) and to
    tokenmill: [(vllm_out, tokenmill_out), ...]. All go to one server, then all to the other: after a
    request, an idle vLLM keeps polling its queues for about a second (shm_broadcast's busy loop), which
    on 2 cores slows the other server's next request ~10x when they alternate."""
    vs = [kind(stack.v, ids=True, **json.loads(json.dumps(body))) for kind, body in requests]
    ts = [kind(stack.t, **body) for kind, body in requests]
    return list(zip(vs, ts))


def streamed_and_not(kind, **body) -> list[tuple]:
    return [(kind, dict(body, stream=False)), (kind, dict(body, stream=True))]


def held_back(tokenizer: Tokenizer, ids: list[int], skip_special: bool = True) -> str:
    """What an incremental detokenizer has sent once the tokens end: the decode of the longest prefix of
    ids whose text does not end in U+FFFD (DecodeStream holds back text that may still complete)."""
    for n in range(len(ids), -1, -1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=skip_special)
        if not text.endswith("\ufffd"):
            return text
    return ""


def assert_equivalent(stack: Stack, v: Out, t: Out, skip_special: bool = True) -> None:
    """Same tokens (vLLM's, whose decode is tokenmill's text, less what an incremental detokenizer holds
    back at the end: the bytes of a character the output ends inside), finish reason, usage and text."""
    assert v.ids is not None and len(v.ids) == v.usage[1]
    assert (t.finish, t.usage) == (v.finish, v.usage)
    assert t.text == held_back(stack.tokenizer, v.ids, skip_special), (
        "tokenmill's text is not the decode of vLLM's tokens: they generated other tokens"
    )
    assert t.text == v.text


def tokenize(url: str, body: dict) -> dict:
    status, _, answer = http("POST", url + "/tokenize", {"model": NAME, **body}, timeout=60)
    assert status == 200, answer
    return answer


def metric(stack: Stack, name: str) -> float:
    status, _, text = http("GET", stack.front.url + "/metrics")
    assert status == 200
    text = text.decode() if isinstance(text, bytes) else str(text)
    match = re.search(rf'^{name}\{{model_name="{NAME}"\}} (\S+)$', text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for(predicate, timeout: float, what: str, detail=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{detail()}")
        time.sleep(0.1)


# ---- conversations --------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

CONVERSATIONS = {
    "plain": {"messages": [{"role": "user", "content": "Hello!"}]},
    "system_multi_turn": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "Ça va ?"},
        ]
    },
    "unicode": {
        "messages": [
            {
                "role": "user",
                "content": "Emoji 🎉👩‍👩‍👧, CJK 漢字かな, Arabic مرحبا, é vs e\u0301, zero\u200bwidth, tabs\tand\n"
                "newlines",
            }
        ]
    },
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
    "tool_round_trip": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        ],
        "tools": [WEATHER],
    },
    "thinking": {
        "messages": [{"role": "user", "content": "Think first."}],
        "chat_template_kwargs": {"enable_thinking": True},
    },
    "thinking_off": {
        "messages": [{"role": "user", "content": "Do not think."}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "earlier_reasoning": {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning": "hmm"},
            {"role": "user", "content": "Q2"},
        ],
        "chat_template_kwargs": {"thinking": True},
    },
    "content_parts": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}
        ]
    },
    "developer_role": {"messages": [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "x"}]},
    "special_tokens_in_text": {"messages": [{"role": "user", "content": "<｜end▁of▁sentence｜> and <think>"}]},
    "continue_final_message": {
        "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
}


# ---- equivalence ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_tokenize_ids_equal_vllm(stack, name):
    """POST /tokenize with messages (and tools, template kwargs, ...): the same IDs, count and limit."""
    body = CONVERSATIONS[name]
    v, t = tokenize(stack.vllm.url, body), tokenize(stack.front.url, body)
    assert t == v
    assert t["max_model_len"] == MAX_MODEL_LEN and t["count"] == len(t["tokens"]) > 2


def test_tokenize_prompt_equals_vllm(stack):
    for body in (
        {"prompt": "Hello world, ça va? 漢字"},
        {"prompt": "x", "add_special_tokens": True},
        {"prompt": "<think>hi</think>", "add_special_tokens": False},
    ):
        assert tokenize(stack.front.url, body) == tokenize(stack.vllm.url, body), body


def test_reasoning_content_field_is_rendered_by_tokenmill_only(stack):
    """Known difference: vLLM 0.32 passes an assistant message's `reasoning` to the template but drops
    `reasoning_content`; tokenmill passes either under both names."""
    base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    with_field = lambda key: [base[0], {**base[1], key: "hmm"}]  # noqa: E731
    ids = {}
    for key in ("reasoning", "reasoning_content", None):
        messages = with_field(key) if key else base
        for side, url in (("v", stack.vllm.url), ("t", stack.front.url)):
            ids[side, key] = tokenize(url, {"messages": messages, "add_generation_prompt": False})["tokens"]
    assert ids["t", "reasoning"] == ids["v", "reasoning"] == ids["t", "reasoning_content"]
    assert ids["v", "reasoning_content"] == ids["v", None] == ids["t", None] != ids["t", "reasoning_content"]


def test_greedy_chat_equals_vllm(stack):
    """Greedy chat completions of every conversation, streamed and not: the same text, finish reason
    and usage."""
    requests = []
    for body in CONVERSATIONS.values():
        body = dict(body, max_tokens=6, temperature=0)
        if "tools" in body:
            body["tool_choice"] = "none"  # the model's text, whatever the tool parser makes of it
        requests += streamed_and_not(chat, **body)
    names = [name for name in CONVERSATIONS for _ in range(2)]
    for name, (v, t) in zip(names, pairs(stack, *requests), strict=True):
        assert v.finish == "length" and v.usage[1] == 6, name
        assert_equivalent(stack, v, t)


def test_tools_without_tool_choice(stack):
    """Tools in a request that leaves tool_choice unset ("auto"): both servers run the deepseek_v31 parser
    (tests/vllm_stack.py) and answer alike. (Without a tool-call parser vLLM refuses it, 400, where
    tokenmill answers as with "none": docs/api/request-fields.md; the stack no longer shows that.)"""
    body = dict(CONVERSATIONS["tools"], max_tokens=4, temperature=0)
    v = chat(stack.v, ids=True, **body)
    t = chat(stack.t, **body)
    assert_equivalent(stack, v, t)


SAMPLING = [
    dict(temperature=1.0, seed=11),
    dict(temperature=1.0, seed=12, top_p=0.9),
    dict(temperature=0.7, seed=13, top_k=50),
    dict(temperature=1.0, seed=14, presence_penalty=0.5, frequency_penalty=0.5),
    dict(temperature=1.3, seed=2**40 + 15, top_k=1000, top_p=0.95),
]


def test_seeded_sampling_equals_vllm(stack):
    """The same seed draws the same tokens in both, for each set of sampling parameters: chat and
    completions, streamed and not. Sampling at temperature 1 from this model is close to uniform over
    the vocabulary, so the texts are full of partial UTF-8 byte tokens and special tokens."""
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story about a cat."}]
    requests = []
    for params in SAMPLING:
        requests += streamed_and_not(chat, messages=messages, max_tokens=12, **params)
        requests += streamed_and_not(complete, prompt="Once upon a time", max_tokens=12, **params)
    results = pairs(stack, *requests)
    for (_kind, _body), (v, t) in zip(requests, results, strict=True):
        assert v.usage[1] == 12 or v.finish == "stop"
        assert_equivalent(stack, v, t)
    texts = [t.text for _, t in results]
    assert len(set(texts)) == len(texts) // 2  # streamed == not streamed; another seed, another text


def test_seeded_sampling_is_reproducible_and_seed_dependent(stack):
    messages = [{"role": "user", "content": "Roll the dice."}]
    a = chat(stack.t, messages=messages, max_tokens=10, temperature=1, seed=5)
    b = chat(stack.t, messages=messages, max_tokens=10, temperature=1, seed=5, stream=True)
    c = chat(stack.t, messages=messages, max_tokens=10, temperature=1, seed=6)
    assert a.text == b.text != c.text


def test_greedy_completions_equal_vllm(stack):
    """/v1/completions from text and from token IDs, streamed and not."""
    requests = []
    for prompt in ("The river wound slowly", [2581, 9605, 100, 200, 300, 400], "漢字かな🎉"):
        requests += streamed_and_not(complete, prompt=prompt, max_tokens=8, temperature=0)
    for v, t in pairs(stack, *requests):
        assert v.finish == "length"
        assert_equivalent(stack, v, t)


# ---- stopping -------------------------------------------------------------------------------------

FAREWELL = "We wave farewell"  # the model's cue: " farewell" -> " goodbye" -> EOS (tokenmill/tiny_model.py)
GOODBYE_IDS = [55411, EOS]


def test_eos_ends_with_stop_like_vllm(stack):
    """The model says " goodbye" then EOS: finish "stop", the EOS counted but not shown."""
    requests = streamed_and_not(complete, prompt=FAREWELL, max_tokens=8, temperature=0)
    messages = [{"role": "user", "content": "Leave"}, {"role": "assistant", "content": FAREWELL}]
    requests += streamed_and_not(
        chat, max_tokens=8, temperature=0, continue_final_message=True, add_generation_prompt=False, messages=messages
    )
    for v, t in pairs(stack, *requests):
        assert v.ids == GOODBYE_IDS and (v.text, v.finish, v.usage[1]) == (" goodbye", "stop", 2)
        assert_equivalent(stack, v, t)


def test_skip_special_tokens_false_shows_eos_in_tokenmill_only(stack):
    """Known difference: with skip_special_tokens false, tokenmill's text is decode(all tokens), the EOS
    that ended the request included; vLLM never shows the token that stopped a request."""
    requests = streamed_and_not(complete, prompt=FAREWELL, max_tokens=8, temperature=0, skip_special_tokens=False)
    for v, t in pairs(stack, *requests):
        assert (v.finish, v.usage) == (t.finish, t.usage) and v.finish == "stop" and v.ids == GOODBYE_IDS
        assert v.text == " goodbye"
        assert t.text == " goodbye" + EOS_TEXT == stack.tokenizer.decode(v.ids, skip_special_tokens=False)


def test_stop_token_ids_end_the_request_like_vllm(stack):
    """A client's stop_token_ids end the request with "stop", the stop token counted in usage on both.
    Known difference: tokenmill's text includes the stop token's text (it is the decode of the tokens),
    vLLM's leaves it out (its detokenizer skips the token that stopped the request)."""
    prompt = "The river wound slowly"
    ids = complete(stack.v, ids=True, prompt=prompt, max_tokens=10, temperature=0).ids
    i = next(i for i in range(2, 10) if ids[i] not in ids[:i])
    requests = streamed_and_not(complete, prompt=prompt, max_tokens=10, temperature=0, stop_token_ids=[ids[i]])
    for v, t in pairs(stack, *requests):
        assert v.ids == ids[: i + 1] and (v.finish, v.usage) == (t.finish, t.usage)
        assert v.finish == "stop" and v.usage[1] == i + 1
        assert v.text == stack.tokenizer.decode(ids[:i])
        assert t.text == stack.tokenizer.decode(ids[: i + 1]) != v.text


def test_ignore_eos_goes_past_eos_like_vllm(stack):
    """ignore_eos: the model's EOS no longer stops it (finish "length"); an explicit stop_token_ids
    entry still does, EOS included (docs/engines/scheduler-protocol.md §3.2)."""
    body = {"prompt": "Time to say goodbye", "max_tokens": 4, "temperature": 0}  # the cue: next comes EOS
    requests = streamed_and_not(complete, **body, ignore_eos=True)
    requests += streamed_and_not(complete, **body, ignore_eos=True, skip_special_tokens=False)
    requests += streamed_and_not(complete, **body, ignore_eos=True, stop_token_ids=[EOS])
    requests += [(complete, body)]
    results = pairs(stack, *requests)
    for v, t in results[0:2]:
        assert v.ids[0] == EOS and v.finish == "length" and v.usage[1] == 4
        assert_equivalent(stack, v, t)
    for v, t in results[2:4]:
        assert v.ids[0] == EOS and v.text.startswith(EOS_TEXT)  # not the stopping token: both show it
        assert_equivalent(stack, v, t, skip_special=False)
    for v, t in results[4:7]:  # stop_token_ids [EOS] with ignore_eos, and no ignore_eos at all
        assert (v.ids, v.finish, v.text) == ([EOS], "stop", "")
        assert_equivalent(stack, v, t)


def test_incomplete_utf8_at_the_end(stack):
    """The model's last token is the first two bytes of a three-byte character: neither server shows them
    (vLLM's incremental detokenizer holds them back and never flushes them; tokenmill drops them too)."""
    requests = streamed_and_not(complete, prompt="We are halfway", max_tokens=1, temperature=0)
    requests += streamed_and_not(
        chat,
        max_tokens=1,
        temperature=0,
        continue_final_message=True,
        add_generation_prompt=False,
        messages=[{"role": "user", "content": "How far?"}, {"role": "assistant", "content": "We are halfway"}],
    )
    for v, t in pairs(stack, *requests):
        assert v.ids == [689] and (v.finish, v.usage[1]) == ("length", 1)
        assert (v.text, t.text) == ("", "")
        assert_equivalent(stack, v, t)


def test_token_prompt_ending_mid_character(stack):
    """Known difference: a token-ID prompt that ends inside a UTF-8 sequence. vLLM primes its
    detokenizer with the prompt, and its first output carries the decoded prompt text; tokenmill's
    text is the completion's alone."""
    prompt = [2581, 9605, 689]  # "We wave" + the bytes E6 B5
    for v, t in pairs(stack, *streamed_and_not(complete, prompt=prompt, max_tokens=3, temperature=0)):
        assert (v.finish, v.usage) == (t.finish, t.usage)
        assert t.text == stack.tokenizer.decode(v.ids)
        assert v.text == stack.tokenizer.decode(prompt) + t.text == "We wave\ufffd" + t.text


# ---- errors ---------------------------------------------------------------------------------------


def _error(status_body) -> dict:
    status, _, body = status_body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    return {"status": status, **body["error"]}


def test_prompt_longer_than_max_model_len_is_a_clean_400(stack):
    long = "word " * 5000
    # vLLM's messages; for a prompt of exactly max_model_len IDs it clamps max_tokens to 0, then refuses that
    context = "maximum context length is 4096 tokens"
    cases = [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": long}], "max_tokens": 4},
            "messages",
            context,
        ),
        ("/v1/completions", {"prompt": long, "max_tokens": 4}, "prompt", context),
        (
            "/v1/completions",
            {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1},
            "prompt",
            "max_tokens must be at least 1, got 0",
        ),
    ]
    for path, body, param, vllm_says in cases:
        t = _error(http("POST", stack.front.url + path, {"model": NAME, **body}))
        v = _error(http("POST", stack.vllm.url + path, {"model": NAME, **body}))
        assert v["status"] == 400 and vllm_says in v["message"], v
        assert (t["status"], t["type"], t["param"]) == (400, "BadRequestError", param)
        assert t["code"] == "context_length_exceeded"
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in t["message"]
    # the longest prompt that fits: both serve it
    [(v, t)] = pairs(stack, (complete, {"prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1, "temperature": 0}))
    assert v.usage == t.usage == (MAX_MODEL_LEN - 1, 1, MAX_MODEL_LEN)


def test_prompt_plus_max_tokens_over_the_limit(stack):
    """Known difference: a prompt that fits but asks for more tokens than the context has left. tokenmill
    refuses it (400, as OpenAI does); vLLM 0.32 clamps max_tokens to what is left and serves it."""
    body = {"model": NAME, "prompt": [5] * 4000, "max_tokens": 200, "temperature": 0}
    t = _error(http("POST", stack.front.url + "/v1/completions", body))
    assert (t["status"], t["param"], t["code"]) == (400, "prompt", "context_length_exceeded")
    status, _, v = http("POST", stack.vllm.url + "/v1/completions", body, timeout=120)
    assert status == 200 and v["usage"]["completion_tokens"] <= MAX_MODEL_LEN - 4000


def test_a_gateway_without_max_model_len_takes_the_engines(stack):
    """A gateway started without --max-model-len loads the model's 65,536 positions from config.json,
    but the engine's Welcome says 4,096: requests are checked against the smaller, so an over-long
    prompt is the same clear 400 naming the field, before it reaches the engine."""
    bare = Server(
        "--model",
        str(stack.model),
        "--scheduler",
        stack.engine.endpoint,
        "--served-model-name",
        NAME,
        "--workers",
        "1",
        timeout=120,
    )
    try:
        assert http("GET", bare.url + "/v1/models")[2]["data"][0]["max_model_len"] == MAX_MODEL_LEN
        body = {"model": NAME, "prompt": [5] * 5000, "max_tokens": 4}
        e = _error(http("POST", bare.url + "/v1/completions", body))
        assert (e["status"], e["type"], e["param"], e["code"]) == (
            400,
            "BadRequestError",
            "prompt",
            "context_length_exceeded",
        )
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e["message"]
        ok = complete(bare.client(), prompt="Hi", max_tokens=2, temperature=0)
        assert ok.finish == "length"
    finally:
        assert bare.stop() == 0


def test_token_outside_the_vocabulary_is_a_clean_400(stack):
    body = {"model": NAME, "prompt": [5, VOCAB], "max_tokens": 1}
    t = _error(http("POST", stack.front.url + "/v1/completions", body))
    v = _error(http("POST", stack.vllm.url + "/v1/completions", body))
    assert v["status"] == 400 and str(VOCAB) in v["message"]
    assert (t["status"], t["param"]) == (400, "prompt") and f"Token ID {VOCAB} is out of range" in t["message"]
    # the engine checks too, for front ends that do not: a protocol error carrying the request ID
    error = engine_generate(stack.engine.endpoint, [5, VOCAB])
    assert isinstance(error, Error) and error.request_id == "oov" and error.code == "bad_request", error


def test_vllm_validation_errors_reach_the_client(stack):
    """stop_token_ids outside the vocabulary: the gateway's workers refuse them (naming the field), as
    vLLM's server does; a front end that does not check gets vLLM's own message from the engine in the
    protocol's error, which the gateway turns into a 400 carrying it (tests/unit/test_engine_bridges.py)."""
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [200000]}
    t = _error(http("POST", stack.front.url + "/v1/completions", body))
    v = _error(http("POST", stack.vllm.url + "/v1/completions", body))
    assert v["status"] == t["status"] == 400 and t["param"] == "stop_token_ids"
    assert "200000" in t["message"] and "200000" in v["message"]
    error = engine_generate(stack.engine.endpoint, [5, 6], stop_token_ids=[200000])
    assert isinstance(error, Error) and error.request_id == "oov", error
    assert "token_id(s) [200000] in stop_token_ids contain out-of-vocab token ids" in error.message
    ok = complete(stack.t, prompt="Hi", max_tokens=2, temperature=0)  # and the engine carries on
    assert ok.finish == "length"


@contextlib.contextmanager
def engine_session(endpoint: str, name: str):
    """A front end that has said Hello to the engine over the scheduler protocol, closed afterwards."""
    front = ProtocolClient(endpoint)
    try:
        front.hello(name)
        yield front
    finally:
        front.close()


def engine_cancelled_total(endpoint: str) -> int:
    """The engine's cancelled_total, from the Stats it sends a new session (every 0.2 s here)."""
    with engine_session(endpoint, "test-stats") as front:
        for message in front.messages(10):
            if isinstance(message, Stats):
                return message.cancelled_total
    raise AssertionError("no Stats from the engine")


def engine_generate(endpoint: str, prompt: list[int], max_new_tokens: int = 1, stop_token_ids: list[int] | None = None):
    """One request straight to the engine over the scheduler protocol: the Error, or the final output."""
    with engine_session(endpoint, "test-vllm") as front:
        sent = False
        for message in front.messages(30):
            if isinstance(message, Welcome) and not sent:
                gen = Generate(
                    request_id="oov",
                    prompt_token_count=len(prompt),
                    max_new_tokens=max_new_tokens,
                    sampling=SamplingParams(temperature=0.0),
                    stop_token_ids=[EOS, *(stop_token_ids or [])],
                )
                front.send(gen, ids_to_frame(prompt))
                sent = True
            elif isinstance(message, Error):
                return message
            elif isinstance(message, Outputs) and any(o.finish_reason for o in message.outputs):
                return message
    raise AssertionError("no answer from the engine")


# ---- protocol 1.1, straight to the engine -----------------------------------------------------------


@dataclass
class Result:
    tokens: list[int]
    finish: str
    error: str | None
    logprobs: list[float]
    top_ids: list[int]
    top_logprobs: list[float]


def engine_run(endpoint: str, requests: dict[str, tuple[list[int], dict]], timeout: float = 120) -> dict:
    """Requests on one session straight to the engine, one after another: request_id -> Result, or the
    Error. Each value is (prompt IDs, Generate keywords; "sampling" a dict of SamplingParams fields)."""
    results: dict = {}
    with engine_session(endpoint, "test-1.1") as front:
        messages = front.messages(timeout)
        welcome = next(m for m in messages if isinstance(m, Welcome))
        results["welcome"] = welcome
        for rid, (prompt, fields) in requests.items():
            fields = dict(fields)
            sampling = SamplingParams(**fields.pop("sampling", {}))
            fields.setdefault("stop_token_ids", [EOS])
            gen = Generate(request_id=rid, prompt_token_count=len(prompt), sampling=sampling, **fields)
            front.send(gen, ids_to_frame(prompt))
            got = Result([], "", None, [], [], [])
            for message in messages:
                if isinstance(message, Error):
                    assert message.request_id == rid, message
                    results[rid] = message
                    break
                if not isinstance(message, Outputs):
                    continue
                for out in message.outputs:
                    assert out.request_id == rid
                    got.tokens += frame_to_ids(out.token_ids)
                    got.logprobs += bytes_to_floats(out.logprobs)
                    got.top_ids += frame_to_ids(out.top_ids)
                    got.top_logprobs += bytes_to_floats(out.top_logprobs)
                    got.finish, got.error = out.finish_reason or "", out.error
                if got.finish:
                    results[rid] = got
                    break
            else:
                raise AssertionError(f"no answer to {rid} from the engine")
    return results


def vllm_completion(stack: Stack, prompt: list[int], **body) -> dict:
    """vLLM's own server, the same request by token IDs: its choice, with token IDs (and logprobs keyed by IDs)."""
    body = {
        "model": NAME,
        "prompt": prompt,
        "temperature": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **body,
    }
    status, _, answer = http("POST", stack.vllm.url + "/v1/completions", body, timeout=120)
    assert status == 200, answer
    return answer["choices"][0]


def _token_id(key: str) -> int:
    assert key.startswith("token_id:"), key
    return int(key[len("token_id:") :])


def whitespace_tokens(tokenizer: Tokenizer) -> list[int]:
    """The tokens that decode to whitespace only: a random model's greedy JSON is all whitespace, so the
    structured-output tests ban them with logit_bias."""
    return [i for i in range(tokenizer.get_vocab_size()) if (t := tokenizer.decode([i])) and not t.strip()]


RIVER = [671, 12334, 21928, 13257]  # "The river wound slowly"


def test_engine_announces_every_feature_it_honours(stack):
    """Every 1.1 and 1.2 feature, but priority (vLLM schedules fcfs unless told otherwise, and then
    ignores a priority), kv_transfer_params (nothing consumes them without a KV connector) and images,
    by hash, by shared memory or not (a text-only model; tests/engines/test_vllm_images.py has the Qwen2-VL one)."""
    with engine_session(stack.engine.endpoint, "test-welcome") as front:
        welcome = next(m for m in front.messages(10) if isinstance(m, Welcome))
    assert welcome.features == sorted(
        set(FEATURES)
        - {
            "priority",
            "kv_transfer_params",
            "images",
            "images.by_hash",
            "images.shm",
            "structured.disable_any_whitespace",
            "structured.whitespace_pattern",
        }
    )
    assert welcome.max_logprobs == 20  # vLLM's max_logprobs default


def test_logprobs_equal_vllm(stack):
    """logprobs 3: one chosen logprob per token and 3 top entries, best first; greedy picks the top entry;
    the values are those vLLM's server returns for the same request (its raw logprobs). With the best
    token banned (logit_bias), the chosen one is vLLM's second and its logprob equals that entry; a
    sampled token has its entry's logprob wherever it is among the top."""
    n = 8
    got = engine_run(
        stack.engine.endpoint,
        {
            "top3": (RIVER, {"max_new_tokens": n, "sampling": {"temperature": 0}, "logprobs": 3}),
            "chosen": (RIVER, {"max_new_tokens": n, "sampling": {"temperature": 0}, "logprobs": 0}),
            "sampled": (RIVER, {"max_new_tokens": n, "sampling": {"temperature": 1, "seed": 3}, "logprobs": 5}),
        },
    )
    top3 = got["top3"]
    assert (top3.finish, len(top3.tokens), len(top3.logprobs)) == ("length", n, n)
    assert len(top3.top_ids) == len(top3.top_logprobs) == 3 * n
    for i, token in enumerate(top3.tokens):
        ids, values = top3.top_ids[3 * i : 3 * i + 3], top3.top_logprobs[3 * i : 3 * i + 3]
        assert values == sorted(values, reverse=True), values
        # greedy: the chosen token is the best (the bfloat16 model's logprobs tie now and then)
        assert top3.logprobs[i] == values[0] and token in [t for t, v in zip(ids, values) if v == values[0]]
        assert -20 < values[-1] <= values[0] < 0
    chosen = got["chosen"]
    assert chosen.tokens == top3.tokens and chosen.top_ids == chosen.top_logprobs == []
    assert chosen.logprobs == pytest.approx(top3.logprobs, abs=1e-5)
    sampled = got["sampled"]
    assert len(sampled.top_ids) == len(sampled.top_logprobs) == 5 * n
    for i, token in enumerate(sampled.tokens):
        ids = sampled.top_ids[5 * i : 5 * i + 5]
        if token in ids:  # the chosen token's logprob is its entry's
            assert sampled.logprobs[i] == sampled.top_logprobs[5 * i + ids.index(token)]
        else:
            assert sampled.logprobs[i] <= sampled.top_logprobs[5 * i + 4]

    banned = top3.tokens[0]
    ban_fields = {"max_new_tokens": 1, "sampling": {"temperature": 0, "logit_bias": {banned: -100.0}}, "logprobs": 3}
    ban = engine_run(stack.engine.endpoint, {"ban": (RIVER, ban_fields)})["ban"]
    # raw logprobs: the banned token still ranks first; the chosen one is among the next and has that entry's logprob
    assert banned in ban.top_ids and ban.top_logprobs[ban.top_ids.index(banned)] == ban.top_logprobs[0]
    assert ban.tokens[0] != banned and ban.tokens[0] in ban.top_ids
    assert ban.logprobs == [ban.top_logprobs[ban.top_ids.index(ban.tokens[0])]]

    v = vllm_completion(stack, RIVER, max_tokens=n, logprobs=3)
    assert v["token_ids"] == top3.tokens
    assert top3.logprobs == pytest.approx(v["logprobs"]["token_logprobs"], abs=1e-4)
    for i, entries in enumerate(v["logprobs"]["top_logprobs"]):  # vLLM's server: {"token_id:N": logprob}
        theirs = sorted(((round(lp, 4), _token_id(k)) for k, lp in entries.items()), reverse=True)
        ours = sorted(
            zip((round(x, 4) for x in top3.top_logprobs[3 * i : 3 * i + 3]), top3.top_ids[3 * i : 3 * i + 3]),
            reverse=True,
        )
        assert theirs == ours, i


SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "n"],
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"enum": [1, 2, 3]}},
}
CHOICES = ["yes", "no", "maybe so"]


def test_structured_outputs_equal_vllm(stack):
    """Greedy constrained decoding through the engine: JSON valid for the schema, one of the choices, a
    regex / grammar / structural-tag match, each ending in EOS ("stop"); the same tokens as vLLM's server
    for the same constraint. Constraints vLLM cannot compile are protocol errors naming "structured"."""
    no_space = {t: -100.0 for t in whitespace_tokens(stack.tokenizer)}
    greedy = {"temperature": 0}
    prompts = {"river": RIVER, "cat": stack.tokenizer.encode("Describe a cat").ids}
    requests = {}
    for name, prompt in prompts.items():
        requests[f"json-{name}"] = (
            prompt,
            {
                "max_new_tokens": 60,
                "sampling": {**greedy, "logit_bias": no_space},
                "structured": Structured(kind="json_schema", spec=json.dumps(SCHEMA)),
            },
        )
        requests[f"choice-{name}"] = (
            prompt,
            {"max_new_tokens": 20, "sampling": greedy, "structured": Structured(kind="choice", choices=CHOICES)},
        )
    requests["regex"] = (
        RIVER,
        {"max_new_tokens": 20, "sampling": greedy, "structured": Structured(kind="regex", spec="[0-9]{3}-[a-z]{2}")},
    )
    requests["grammar"] = (
        RIVER,
        {
            "max_new_tokens": 20,
            "sampling": greedy,
            "structured": Structured(kind="grammar", spec='root ::= "ab" ("c" | "d")'),
        },
    )
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}
    requests["tag"] = (
        RIVER,
        {
            "max_new_tokens": 20,
            "sampling": greedy,
            "structured": Structured(kind="structural_tag", spec=json.dumps(tag)),
        },
    )
    requests["object"] = (
        RIVER,
        {
            "max_new_tokens": 12,
            "sampling": {**greedy, "logit_bias": no_space},
            "structured": Structured(kind="json_object"),
        },
    )
    requests["bad-schema"] = (RIVER, {"max_new_tokens": 5, "structured": Structured(kind="json_schema", spec="{not")})
    requests["bad-regex"] = (RIVER, {"max_new_tokens": 5, "structured": Structured(kind="regex", spec="(unclosed")})
    got = engine_run(stack.engine.endpoint, requests)

    def text(rid: str) -> str:
        r = got[rid]
        assert r.finish == "stop" and r.tokens[-1] == EOS, (rid, r)  # the grammar completed, then only EOS
        return stack.tokenizer.decode(r.tokens[:-1], skip_special_tokens=False)

    for name in prompts:
        value = json.loads(text(f"json-{name}"))
        assert set(value) == {"name", "n"} and len(value["name"]) <= 8 and value["n"] in (1, 2, 3), value
        assert text(f"choice-{name}") in CHOICES
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text("regex"))
    assert text("grammar") in ("abc", "abd")
    assert text("tag") == "hello"
    assert stack.tokenizer.decode(got["object"].tokens).lstrip().startswith("{")
    for rid in ("bad-schema", "bad-regex"):
        assert isinstance(got[rid], Error) and (got[rid].code, got[rid].param) == ("bad_request", "structured")

    bias = {str(t): b for t, b in no_space.items()}
    for name, prompt in prompts.items():
        v = vllm_completion(stack, prompt, max_tokens=60, logit_bias=bias, structured_outputs={"json": SCHEMA})
        assert v["token_ids"] == got[f"json-{name}"].tokens
        v = vllm_completion(stack, prompt, max_tokens=20, structured_outputs={"choice": CHOICES})
        assert v["token_ids"] == got[f"choice-{name}"].tokens


FAREWELL_IDS = [2581, 9605, 75336]  # "We wave farewell": the model's cue for " goodbye" then EOS


def test_sampling_fields_equal_vllm(stack):
    """min_tokens keeps EOS out until that many tokens, logit_bias -100 bans a token, min_p and
    repetition_penalty are vLLM's: the same tokens as vLLM's server for each."""
    assert FAREWELL_IDS == stack.tokenizer.encode(FAREWELL).ids
    plain = engine_run(stack.engine.endpoint, {"plain": (RIVER, {"max_new_tokens": 6, "sampling": {"temperature": 0}})})
    first = plain["plain"].tokens[0]
    cases = {
        "eos": (FAREWELL_IDS, {"max_tokens": 8}),
        "min-tokens": (FAREWELL_IDS, {"max_tokens": 8, "min_tokens": 5}),
        "ban": (RIVER, {"max_tokens": 6, "logit_bias": {first: -100.0}}),
        "boost": (RIVER, {"max_tokens": 3, "logit_bias": {42: 100.0}}),
        "repetition": (RIVER, {"max_tokens": 8, "repetition_penalty": 1.5}),
        "min-p": (FAREWELL_IDS, {"max_tokens": 6, "temperature": 1.0, "seed": 7, "min_p": 0.5}),
    }
    requests = {}
    for rid, (prompt, body) in cases.items():
        sampling = {
            "temperature": body.get("temperature", 0),
            **{
                k: v
                for k, v in body.items()
                if k in ("seed", "min_p", "repetition_penalty", "min_tokens", "logit_bias")
            },
        }
        requests[rid] = (prompt, {"max_new_tokens": body["max_tokens"], "sampling": sampling})
    got = engine_run(stack.engine.endpoint, requests)
    assert (got["eos"].tokens, got["eos"].finish) == (GOODBYE_IDS, "stop")
    assert EOS not in got["min-tokens"].tokens[:5] and len(got["min-tokens"].tokens) >= 5
    assert got["min-tokens"].tokens[0] == GOODBYE_IDS[0]
    assert got["ban"].tokens[0] != first and first not in got["ban"].tokens
    assert got["boost"].tokens == [42, 42, 42]
    assert got["min-p"].tokens[:2] == GOODBYE_IDS  # min_p 0.5 leaves only the cue's follower, then EOS
    for rid, (prompt, body) in cases.items():
        if "logit_bias" in body:
            body = {**body, "logit_bias": {str(t): b for t, b in body["logit_bias"].items()}}
        # the protocol went to the engine without a front end, so without the model's sampling defaults
        # (tests/vllm_stack.py's SAMPLING_DEFAULTS), which vLLM's server would add: turned off here
        neutral = {"temperature": 0, "repetition_penalty": 1.0, "top_k": -1, "top_p": 1.0}
        v = vllm_completion(stack, prompt, **{**neutral, **body})
        assert v["token_ids"] == got[rid].tokens, rid


# ---- disconnects and engine failure -----------------------------------------------------------------

RUNNING = "tokenmill_scheduler_num_requests_running"


def engine_cpu_s(engine: Engine) -> float:
    """CPU seconds used so far by the engine process and its descendants (vLLM's engine core, worker)."""
    pids, todo = [], [engine.proc.pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        todo += [int(p) for p in children.split()]
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_over(engine: Engine, seconds: float) -> float:
    before = engine_cpu_s(engine)
    time.sleep(seconds)
    return engine_cpu_s(engine) - before


def test_client_disconnect_aborts_the_request_in_vllm(stack):
    """A client that hangs up mid-stream: vLLM stops working on the request. The engine's running count
    (reported through the gateway's /metrics) returns to 0 at once, and vLLM's processes go idle although
    the request had thousands of tokens to go (ignore_eos: nothing else ends it)."""

    def detail() -> str:
        return f"running {metric(stack, RUNNING)}; engine log:\n{stack.engine.log()[-3000:]}"

    cancelled = engine_cancelled_total(stack.engine.endpoint)
    stream = stack.t.completions.create(
        model=NAME, prompt="Go on and on", max_tokens=3000, stream=True, temperature=0, extra_body={"ignore_eos": True}
    )
    received = 0
    for _chunk in stream:
        received += 1
        if received == 3:
            break
    wait_for(lambda: metric(stack, RUNNING) == 1, 10, "the engine to report one running request", detail)
    stream.close()  # the HTTP client goes away mid-generation
    wait_for(lambda: metric(stack, RUNNING) == 0, 15, "the running count to return to 0", detail)
    time.sleep(1.5)  # an idle vLLM polls its queues for a second after its last step
    idle = cpu_over(stack.engine, 2.0)  # decoding here costs 1-2 CPU seconds a second
    assert idle < 0.3, f"vLLM is still busy after the disconnect: {idle:.2f} CPU seconds in 2 s"
    wait_for(
        lambda: engine_cancelled_total(stack.engine.endpoint) == cancelled + 1,
        10,
        "the engine to count the cancelled request",
        detail,
    )
    aborted_lines = stack.engine.log().count(" aborted.")
    assert aborted_lines >= 1  # vLLM logs the disconnected one
    ok = complete(stack.t, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.finish == "length"
    # a request that finished is neither counted nor logged by vLLM as aborted
    assert engine_cancelled_total(stack.engine.endpoint) == cancelled + 1
    assert stack.engine.log().count(" aborted.") == aborted_lines


def _sse_events(resp) -> list:
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_engine_killed_mid_stream_then_restarted(stack):
    """Last: SIGKILL of `tokenmill engine` mid-stream ends the stream with an error event
    `scheduler_unavailable` and [DONE], and vLLM's own processes die with the engine; new requests get
    503 until an engine is back; then they succeed. The engine that comes back was started with the
    stack, on another socket file that is renamed to the endpoint's now: to the gateway that is an
    engine restarted at its endpoint, without another vLLM start (~30 s) in the test."""
    expected = complete(stack.v, prompt="After the storm", max_tokens=6, temperature=0)
    conn = HTTPConnection("127.0.0.1", stack.front.port, timeout=60)
    body = {
        "model": NAME,
        "prompt": "Go on and on",
        "max_tokens": 3000,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(6):  # a few events in: the request is running in vLLM
        assert resp.readline().startswith(b"data: {")
        resp.readline()
    os.kill(stack.engine.proc.pid, signal.SIGKILL)
    stack.engine.killed = True
    events = _sse_events(resp)
    conn.close()
    assert events[-1] == "[DONE]", events[-3:]
    error = events[-2]["error"]
    assert error["code"] == "scheduler_unavailable" and error["type"] == "ServiceUnavailableError", error
    assert all("choices" in e for e in events[:-2])

    status, headers, answer = http(
        "POST", stack.front.url + "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    )
    assert status == 503 and answer["error"]["code"] == "scheduler_unavailable", answer
    assert "retry-after" in {k.lower() for k in headers}
    assert http("GET", stack.front.url + "/ready")[0] == 503

    # vLLM's engine-core and worker processes die with it (tokenmill engine's reaper), not only the engine
    group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == stack.engine.proc.pid]
    wait_for(lambda: not [p for p in group if _running(p)], 15, "vLLM's processes to die with the engine")
    stack.engine.stop()
    t0 = time.monotonic()
    endpoint = stack.engine.endpoint
    if stack.standby is not None:  # started with the stack: it takes over the endpoint's socket file
        wait_all(stack.standby)
        os.rename(stack.standby.endpoint.removeprefix("ipc://"), endpoint.removeprefix("ipc://"))
        stack.engine, stack.standby = stack.standby, None
        stack.engine.endpoint = endpoint
    else:  # a new engine: a vLLM start
        stack.engine = Engine(stack.model, endpoint, stack.engine.log_path)
        wait_all(stack.engine)
    wait_for(lambda: http("GET", stack.front.url + "/ready")[0] == 200, 30, "the gateway to reconnect")
    print(f"\nengine back and reconnected in {time.monotonic() - t0:.1f} s")
    again = complete(stack.t, prompt="After the storm", max_tokens=6, temperature=0)
    assert (again.text, again.finish, again.usage) == (expected.text, expected.finish, expected.usage)


def test_openai_answers_with_1_1_fields_equal_vllms_server(stack):
    """The whole path, client to client: the same request to vLLM's own server and to tokenmill in
    front of the same engine gives the same answer for n with a seed (choice i sampled with seed + i),
    logprobs (chat's entries: token text, bytes, the top list in vLLM's order; values within float
    tolerance), a JSON-schema response_format and a choice constraint (greedy: the same text). A named
    tool_choice needs a tool parser on vLLM's server, which this one runs without; its constraint is
    the function's parameters schema, so tokenmill's arguments must be what vLLM writes under that
    schema."""
    no_space = {str(t): -100 for t in whitespace_tokens(stack.tokenizer)}
    messages = [{"role": "user", "content": "Describe a cat."}]
    bodies = {
        "n": dict(messages=messages, n=3, seed=21, temperature=1, max_tokens=8),
        "logprobs": dict(messages=messages, logprobs=True, top_logprobs=3, temperature=0, max_tokens=8),
        "schema": dict(
            messages=messages,
            temperature=0,
            max_tokens=60,
            logit_bias=no_space,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        ),
        "choice": dict(messages=messages, temperature=0, max_tokens=20, structured_outputs={"choice": CHOICES}),
        "tool": dict(
            messages=messages,
            temperature=0,
            max_tokens=60,
            logit_bias=no_space,
            tools=[{"type": "function", "function": {"name": "describe", "parameters": SCHEMA}}],
            tool_choice={"type": "function", "function": {"name": "describe"}},
        ),
    }
    got = {}
    for side, url in (("vllm", stack.vllm.url), ("tokenmill", stack.front.url)):
        for name, body in bodies.items():
            if side == "vllm" and name == "tool":  # the same prompt (tools rendered), the same constraint
                body = {**body, "tool_choice": "none", "structured_outputs": {"json": SCHEMA}}
            status, _, out = http("POST", url + "/v1/chat/completions", {"model": NAME, **body}, timeout=120)
            assert status == 200, (side, name, out)
            got[side, name] = out
    v, t = got["vllm", "n"], got["tokenmill", "n"]
    assert [c["message"]["content"] for c in t["choices"]] == [c["message"]["content"] for c in v["choices"]]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # vLLM adds null *_details
    assert [t["usage"][k] for k in counts] == [v["usage"][k] for k in counts]

    def entries(out):
        return [
            (e["token"], e["bytes"], e["logprob"], [(x["token"], x["logprob"]) for x in e["top_logprobs"]])
            for e in out["choices"][0]["logprobs"]["content"]
        ]

    ve, te = entries(got["vllm", "logprobs"]), entries(got["tokenmill", "logprobs"])
    assert len(te) == len(ve) == 8
    for (vt, vb, vl, vtop), (tt, tb, tl, ttop) in zip(ve, te, strict=True):
        assert (tt, tb) == (vt, vb) and abs(tl - vl) < 1e-4
        assert [x[0] for x in ttop] == [x[0] for x in vtop]
        assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(ttop, vtop))
    for name in ("schema", "choice"):
        assert (
            got["tokenmill", name]["choices"][0]["message"]["content"]
            == got["vllm", name]["choices"][0]["message"]["content"]
        )
    assert json.loads(got["tokenmill", "schema"]["choices"][0]["message"]["content"]).keys() == {"name", "n"}
    [tc] = got["tokenmill", "tool"]["choices"][0]["message"]["tool_calls"]
    assert tc["function"]["name"] == "describe"
    assert json.loads(tc["function"]["arguments"]) == json.loads(
        got["vllm", "tool"]["choices"][0]["message"]["content"]
    )
    assert got["tokenmill", "tool"]["choices"][0]["finish_reason"] == "stop"  # a named function, as OpenAI and vLLM
