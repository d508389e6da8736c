"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official client.

The simulated scheduler plays scripted replies (--sim-replies) on the embedded model (its
deepseek tool parser and think-tag reasoning parser on by default), so the answers hold real
markers, and the anthropic SDK must see what Anthropic's servers send: thinking, text and
tool_use blocks, stop reasons, usage, the stream's events (which messages.stream() checks as it
accumulates the final message), and errors in Anthropic's shape.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from conftest import Server, http

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MODEL = "deepseek-v4"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
REPLIES = [
    ("weather in Paris", f'Let me look that up.{B}{CB}get_weather{S}{{"city": "Paris"}}{CE}{E}'),
    ("sunny, 21", "It is sunny in Paris, at 21 °C."),
    ("think first", "The user asks for a sum; 2 + 2 = 4.</think>The answer is 4."),
    ("say stop", "one two STOP three four"),
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = tmp_path_factory.mktemp("replies") / "replies.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for match, text in REPLIES:
            f.write(json.dumps({"match": match, "text": text}, ensure_ascii=False) + "\n")
    srv = Server("--workers", "1", "--sim-inter-token-latency-ms", "0", "--sim-replies", str(path), "--api-key", "k1")
    yield srv
    srv.stop()


def client(srv, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=kw.pop("api_key", "k1"), max_retries=0, timeout=60, **kw)


def blocks(message) -> list[dict]:
    """A message's content blocks as plain dicts (the SDK's models dumped)."""
    return [b.model_dump(exclude_none=True) for b in message.content]


def both(srv, **body):
    """The whole answer and the streamed one's final message (the SDK accumulates the events)."""
    c = client(srv)
    whole = c.messages.create(model=MODEL, **body)
    with c.messages.stream(model=MODEL, **body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    return whole, final, events


def test_text_answer_whole_and_streamed(scripted):
    whole, final, events = both(scripted, max_tokens=64, messages=[{"role": "user", "content": "sunny, 21?"}])
    for m in (whole, final):
        assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
        assert blocks(m) == [{"type": "text", "text": "It is sunny in Paris, at 21 °C."}]
        assert m.stop_reason == "end_turn" and m.stop_sequence is None
        assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    assert whole.usage.input_tokens == final.usage.input_tokens
    names = [e.type for e in events]
    assert names[0] == "message_start" and names[-1] == "message_stop" and names[-2] == "message_delta"
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(starts)))


def test_tool_use_block_and_round_trip(scripted):
    body = dict(max_tokens=64, tools=[WEATHER], messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    whole, final, events = both(scripted, **body)
    for m in (whole, final):
        got = blocks(m)
        assert got[0] == {"type": "text", "text": "Let me look that up."}
        assert got[1]["type"] == "tool_use" and got[1]["name"] == "get_weather"
        assert got[1]["input"] == {"city": "Paris"}
        assert m.stop_reason == "tool_use"
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1]
    call = whole.content[1]
    again = client(scripted).messages.create(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER],
        messages=[
            *body["messages"],
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21"}]},
        ],
    )
    assert blocks(again) == [{"type": "text", "text": "It is sunny in Paris, at 21 °C."}]
    assert again.stop_reason == "end_turn"


def test_forced_tool_choice_says_tool_use(scripted):
    m = client(scripted).messages.create(
        model=MODEL,
        max_tokens=200,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "anything"}],
    )
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["tool_use"] and isinstance(m.content[0].input, dict)


def test_thinking_blocks(scripted):
    body = dict(
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "think first: 2+2?"}],
    )
    whole, final, events = both(scripted, **body)
    for m in (whole, final):
        got = blocks(m)
        assert [b["type"] for b in got] == ["thinking", "text"]
        assert got[0]["thinking"] == "The user asks for a sum; 2 + 2 = 4." and got[0]["signature"]
        assert got[1]["text"] == "The answer is 4."
    assert whole.content[0].signature == final.content[0].signature  # stable for the same thinking
    assert any(e.type == "content_block_delta" and e.delta.type == "signature_delta" for e in events)
    # sent back, the thinking block is accepted and the next turn goes on
    again = client(scripted).messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[
            *body["messages"],
            {"role": "assistant", "content": got},
            {"role": "user", "content": "sunny, 21?"},
        ],
    )
    assert again.content[0].text.startswith("It is sunny")
    # thinking disabled: the template closes the think block, the same words are text
    off = client(scripted).messages.create(
        model=MODEL, max_tokens=64, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "think first"}]
    )
    assert [b.type for b in off.content] == ["text"]


def test_stop_sequences_and_max_tokens(scripted):
    m = client(scripted).messages.create(
        model=MODEL, max_tokens=64, stop_sequences=["STOP"], messages=[{"role": "user", "content": "say stop"}]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    assert blocks(m) == [{"type": "text", "text": "one two "}]
    short = client(scripted).messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "say stop"}]
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_claude_code_shaped_body(scripted):
    """System blocks with cache_control, system-role messages inside messages, metadata,
    context_management, output_config, beta headers and ?beta=true: accepted and answered."""
    c = client(scripted)
    m = c.beta.messages.create(
        model=MODEL,
        max_tokens=64,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "user", "content": "sunny, 21?"},
        ],
        metadata={"user_id": "u1"},
        thinking={"type": "adaptive"},
        output_config={"effort": "high"},
        betas=["claude-code-20250219", "context-management-2025-06-27"],
        extra_body={"context_management": {"edits": []}},
    )
    # output_config.effort turns the template's thinking on (as vLLM maps reasoning_effort), and the
    # scripted reply has no </think>: all of it is thinking
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking.startswith("It is sunny")


def test_count_tokens_matches_usage(scripted):
    c = client(scripted)
    body = dict(system="Be brief.", tools=[WEATHER], messages=[{"role": "user", "content": "sunny, 21?"}])
    counted = c.messages.count_tokens(model=MODEL, **body)
    m = c.messages.create(model=MODEL, max_tokens=16, **body)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0


def test_render_gives_the_prompt_token_ids(scripted):
    """/v1/messages/render (vLLM's route): the IDs count_tokens counts, ending in the generation prompt;
    bad input is refused there as on /v1/messages (the parity rows compare the IDs with vLLM's)."""
    body = {"model": MODEL, "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    key = {"x-api-key": "k1"}
    status, _, rendered = http("POST", scripted.url + "/v1/messages/render", body, key)
    counted = client(scripted).messages.count_tokens(model=MODEL, system="Be brief.", messages=body["messages"])
    assert status == 200 and len(rendered["token_ids"]) == counted.input_tokens
    assert rendered["token_ids"][-1] == 128822  # </think>: the default template's generation prompt, thinking off
    bad = {**body, "messages": [{"role": "user", "content": [{"type": "video"}]}]}
    status, _, error = http("POST", scripted.url + "/v1/messages/render", bad, key)
    assert status == 400 and error["error"]["message"].startswith("messages[0].content[0].type")


def _refused(srv, **body) -> anthropic.APIStatusError:
    with pytest.raises(anthropic.APIStatusError) as info:
        client(srv).messages.create(model=MODEL, **body)
    return info.value


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, "messages[0].content[0].type"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]},
                ]
            },
            "messages[1].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/a.png"}}],
                    }
                ]
            },
            "messages[0].content[0]: this model takes no images",
        ),
        (
            {"tools": [{"name": "t", "input_schema": "not a schema"}], "messages": [{"role": "user", "content": "x"}]},
            "tools[0].input_schema",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 10}, "messages": [{"role": "user", "content": "x"}]},
            "thinking.budget_tokens",
        ),
    ],
    ids=["block-type", "tool-use-id", "image", "input-schema", "role", "budget"],
)
def test_bad_input_is_an_anthropic_400_naming_the_field(scripted, body, field):
    err = _refused(scripted, max_tokens=16, **body)
    assert isinstance(err, anthropic.BadRequestError)
    assert err.body["type"] == "error" and err.body["error"]["type"] == "invalid_request_error"
    assert field in err.body["error"]["message"]


def test_missing_max_tokens_and_gateway_errors_in_anthropic_shape(scripted):
    status, _, body = http(
        "POST",
        scripted.url + "/v1/messages",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": "k1"},
    )
    assert (
        status == 400 and body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
    )
    with pytest.raises(anthropic.NotFoundError) as info:
        client(scripted).messages.create(
            model="claude-sonnet-4", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as info:
        client(scripted, api_key="wrong").messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": info.value.body["error"]["message"]},
    }
    # Bearer works as well as x-api-key, and chat completions take x-api-key too
    bearer = anthropic.Anthropic(base_url=scripted.url, auth_token="k1", max_retries=0)
    assert bearer.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "sunny, 21"}]
    ).content
    status, _, _ = http(
        "POST",
        scripted.url + "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": "k1"},
    )
    assert status == 200
    status, _, body = http("GET", scripted.url + "/v1/messages/batches", headers={"x-api-key": "k1"})
    assert status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error"


def _events(raw: bytes) -> list[str]:
    return [line[7:] for line in raw.decode().splitlines() if line.startswith("event: ")]


def test_pings_while_a_long_prompt_converts():
    """A streamed request whose prompt takes longer to convert than the ping interval gets its
    stream at once, with pings until message_start; an error found later (the context) is an
    error event in Anthropic's shape; the SDK reads such a stream to the end."""
    import urllib.request

    srv = Server(
        "--workers",
        "1",
        "--sim-inter-token-latency-ms",
        "0",
        "--messages-ping-interval",
        "0.02",
        "--max-model-len",
        "100000",
    )
    try:
        words = " ".join(f"w{i} lorem ipsum dolor" for i in range(10000))  # ~60k tokens: well over 20 ms

        def stream(text: str) -> bytes:
            body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": text}]}
            req = urllib.request.Request(
                srv.url + "/v1/messages", json.dumps(body).encode(), {"content-type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                assert resp.status == 200
                return resp.read()

        names = _events(stream(words))
        first = names.index("message_start")
        assert first > 0 and set(names[:first]) == {"ping"}
        assert names[-2:] == ["message_delta", "message_stop"]
        raw = stream(" ".join([words] * 3))  # over the context: refused after the pings started
        names = _events(raw)
        assert names[0] == "ping" and names[-1] == "error" and "message_start" not in names
        err = json.loads(raw.decode().rsplit("data: ", 1)[1])
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert "context length" in err["error"]["message"]
        with client(srv, api_key="none").messages.stream(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": words}]
        ) as s:
            final = s.get_final_message()
        assert final.stop_reason == "max_tokens" and final.usage.input_tokens > 30000
    finally:
        srv.stop()
