"""Tool calls and reasoning through the real HTTP path: scripted model outputs, the official client.

The simulated scheduler plays scripted replies (--sim-replies), so the model "says" exactly
what a real model would, markers included, and the response must be what OpenAI's clients
expect: message.tool_calls / delta.tool_calls, finish_reason "tool_calls", reasoning under
both of its names, and the streamed deltas joined equal to the non-streamed message.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import Server, http

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, SEARCH]
REPLIES = [
    ("weather in Paris", f'Let me look that up.{B}{CB}get_weather{S}{{"city": "Paris"}}{CE}{E}'),
    ("two cities", f'{B}{CB}get_weather{S}{{"city": "Zürich 😀"}}{CE}{CB}get_weather{S}{{"city": "東京"}}{CE}{E}'),
    ("sunny, 21", "It is sunny in Paris, at 21 °C."),
    ("think first", "The user asks for a sum; 2 + 2 = 4.</think>The answer is 4."),
    ("think then call", f"Need the weather.</think>{B}{CB}search{S}{{}}{CE}{E}"),
    ("unknown tool", f'{B}{CB}launch_rockets{S}{{"n": 3}}{CE}{E}'),
]


def write_replies(path) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for match, text in REPLIES:
            f.write(json.dumps({"match": match, "text": text}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The embedded model: its parsers are on by default (auto: deepseek_v31 tools, think-tag reasoning)."""
    replies = write_replies(tmp_path_factory.mktemp("replies") / "replies.jsonl")
    srv = Server("--workers", "1", "--sim-inter-token-latency-ms", "0", "--sim-replies", replies)
    yield srv
    srv.stop()


_EXTENSIONS = ("chat_template_kwargs", "include_reasoning", "skip_special_tokens")  # not in OpenAI's client


def ask(content: str, **extra) -> dict:
    body = {"model": "deepseek-v4", "messages": [{"role": "user", "content": content}], **extra}
    outside = {k: body.pop(k) for k in _EXTENSIONS if k in body}
    if outside:
        body["extra_body"] = {**body.get("extra_body", {}), **outside}
    return body


def joined_stream(client, body: dict) -> dict:
    """The streamed deltas joined the way client libraries join them."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            assert (delta.model_extra or {}).get("reasoning") == (delta.model_extra or {}).get("reasoning_content")
            for item in delta.tool_calls or []:
                call = calls.setdefault(item.index, {"id": None, "name": None, "arguments": ""})
                if item.id:
                    assert call["id"] is None, "a call's id is sent once"
                    call["id"] = item.id
                    assert item.type == "function"
                if item.function and item.function.name:
                    call["name"] = item.function.name
                if item.function and item.function.arguments:
                    call["arguments"] += item.function.arguments
            finish = choice.finish_reason or finish
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "finish": finish,
        "calls": [{"name": c["name"], "arguments": json.loads(c["arguments"])} for _, c in sorted(calls.items())],
    }


def whole(client, body: dict) -> dict:
    choice = client.chat.completions.create(**body).choices[0]
    message = choice.message
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        calls.append({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
    return {
        "content": message.content,
        "reasoning": extra.get("reasoning_content"),
        "finish": choice.finish_reason,
        "calls": calls,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_comes_back_as_tool_calls(scripted, stream):
    body = ask("What is the weather in Paris?", tools=TOOLS)
    client = scripted.client()
    got = joined_stream(client, body) if stream else whole(client, body)
    assert got == {
        "content": "Let me look that up.",
        "reasoning": None,
        "finish": "tool_calls",
        "calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    }


def test_streamed_equals_whole_for_every_reply(scripted):
    client = scripted.client()
    for match, _ in REPLIES:
        for extra in ({"tools": TOOLS}, {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}}):
            body = ask(f"Please: {match}", **extra)
            assert joined_stream(client, body) == whole(client, body), (match, extra)


def test_two_calls_with_unicode_arguments(scripted):
    got = whole(scripted.client(), ask("two cities please", tools=TOOLS))
    assert got["calls"] == [
        {"name": "get_weather", "arguments": {"city": "Zürich 😀"}},
        {"name": "get_weather", "arguments": {"city": "東京"}},
    ]
    assert got["content"] is None and got["finish"] == "tool_calls"


def test_reasoning_is_separated_when_thinking(scripted):
    body = ask("think first: 2+2?", chat_template_kwargs={"enable_thinking": True})
    got = whole(scripted.client(), body)
    assert got == {
        "content": "The answer is 4.",
        "reasoning": "The user asks for a sum; 2 + 2 = 4.",
        "finish": "stop",
        "calls": [],
    }
    # with thinking off the template closes the think block itself, so the same words are content
    off = whole(scripted.client(), ask("think first: 2+2?"))
    assert off["reasoning"] is None and off["content"] == "The user asks for a sum; 2 + 2 = 4.</think>The answer is 4."


def test_reasoning_then_call(scripted):
    got = whole(scripted.client(), ask("think then call", tools=TOOLS, chat_template_kwargs={"enable_thinking": True}))
    assert got == {
        "content": None,
        "reasoning": "Need the weather.",
        "finish": "tool_calls",
        "calls": [{"name": "search", "arguments": {}}],
    }


def test_include_reasoning_false_drops_it(scripted):
    body = ask("think first", chat_template_kwargs={"enable_thinking": True}, include_reasoning=False)
    got = whole(scripted.client(), body)
    assert got["reasoning"] is None and got["content"] == "The answer is 4."


def test_truncated_call_is_content_and_counted(scripted):
    def failures() -> float:
        _, _, text = http("GET", scripted.url + "/metrics")
        line = [x for x in text.decode().splitlines() if x.startswith("tokenmill_tool_call_parse_failures_total{")]
        return float(line[0].rsplit(" ", 1)[1]) if line else 0.0

    before = failures()
    got = whole(scripted.client(), ask("What is the weather in Paris?", tools=TOOLS, max_tokens=10))
    assert got["finish"] == "length" and got["calls"] == []
    assert got["content"].startswith("Let me look that up.") and CB in got["content"]
    assert failures() == before + 1


def test_call_to_undeclared_function_is_content(scripted):
    got = whole(scripted.client(), ask("unknown tool", tools=TOOLS))
    assert got["calls"] == [] and got["finish"] == "stop"
    assert got["content"] == f'{CB}launch_rockets{S}{{"n": 3}}{CE}'


def test_no_tools_or_tool_choice_none_leave_the_text_alone(scripted):
    client = scripted.client()
    for body in (ask("weather in Paris"), ask("weather in Paris", tools=TOOLS, tool_choice="none")):
        got = whole(client, body)
        assert got["calls"] == [] and got["finish"] == "stop"
        assert got["content"] == REPLIES[0][1]


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "launch_rockets"}}, "sometimes", 3])
def test_a_tool_choice_that_is_no_choice_is_a_400(scripted, choice):
    """required and named functions are honoured (tests/serving/test_generation_fields.py); these are mistakes."""
    status, _, body = http("POST", scripted.url + "/v1/chat/completions", ask("hi", tools=TOOLS, tool_choice=choice))
    assert status == 400 and body["error"]["param"] == "tool_choice", body


def test_a_turn_with_the_calls_and_results_renders_and_continues(scripted):
    """The agent loop: the model's calls go back as an assistant message, the results as tool messages."""
    client = scripted.client()
    first = client.chat.completions.create(**ask("What is the weather in Paris?", tools=TOOLS))
    message = first.choices[0].message
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(model="deepseek-v4", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is sunny in Paris, at 21 °C."
    assert second.choices[0].finish_reason == "stop"
    # the rendered prompt holds the call exactly as the template writes it
    status, _, tok = http(
        "POST",
        scripted.url + "/detokenize",
        {"tokens": http("POST", scripted.url + "/tokenize", {"messages": messages, "tools": TOOLS})[2]["tokens"]},
    )
    assert f'{CB}get_weather{S}{{"city": "Paris"}}{CE}' in tok["prompt"]


def special_marker_model(tmp_path) -> str:
    """The embedded tokenizer with the tool-call markers made special tokens, as some models ship them."""
    from tokenmill.tokenizer_workers.model import default_model_dir

    src = default_model_dir()
    out = tmp_path / "special-markers"
    out.mkdir()
    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        if "tool" in token["content"]:
            token["special"] = True
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = src.parent / "tokenmill" / "default_model" / "chat_template.jinja"
    if not template.is_file():
        from tokenmill.tokenizer_workers.model import _DEFAULT_TEMPLATE as template
    config["chat_template"] = template.read_text(encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return str(out)


def test_markers_that_are_special_tokens_are_seen_whatever_skip_special_tokens_says(tmp_path):
    model = special_marker_model(tmp_path)
    replies = write_replies(tmp_path / "replies.jsonl")
    srv = Server(
        "--workers",
        "1",
        "--model",
        model,
        "--tool-call-parser",
        "auto",
        "--sim-inter-token-latency-ms",
        "0",
        "--sim-replies",
        replies,
    )
    try:
        client = srv.client()
        name = client.models.list().data[0].id
        for skip in (True, False):
            body = {
                "model": name,
                "messages": [{"role": "user", "content": "weather in Paris"}],
                "tools": TOOLS,
                "extra_body": {"skip_special_tokens": skip},
            }
            for got in (whole(client, body), joined_stream(client, body)):
                assert got["calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}], skip
                # asked for special tokens, the client gets the EOS token's text too, as without tools
                assert got["content"] == "Let me look that up." + ("" if skip else "<｜end▁of▁sentence｜>")
        # without tools the markers are ordinary special tokens again: skipped by default
        plain = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "weather in Paris"}])
        assert plain.choices[0].message.content == 'Let me look that up.get_weather{"city": "Paris"}'
    finally:
        srv.stop()
    shutil.rmtree(model, ignore_errors=True)


def test_without_a_parser_tools_leave_the_text_alone(tmp_path):
    replies = write_replies(tmp_path / "replies.jsonl")
    srv = Server(
        "--workers",
        "1",
        "--tool-call-parser",
        "none",
        "--reasoning-parser",
        "none",
        "--sim-inter-token-latency-ms",
        "0",
        "--sim-replies",
        replies,
    )
    try:
        got = whole(srv.client(), ask("weather in Paris", tools=TOOLS))
        assert got == {"content": REPLIES[0][1], "reasoning": None, "finish": "stop", "calls": []}
        thinking = whole(srv.client(), ask("think first", chat_template_kwargs={"enable_thinking": True}))
        assert thinking["reasoning"] is None and thinking["content"] == REPLIES[3][1]
        assert http("GET", srv.url + "/debug/state")[2]["parsers"] == {
            "tool_call_parser": None,
            "reasoning_parser": None,
        }
    finally:
        srv.stop()


@pytest.mark.parametrize("line", ['{"match": "", "text": "x"}', "not json", '{"match": "a"}'])
def test_a_bad_replies_file_stops_the_simulator_with_its_line(tmp_path, line):
    import subprocess
    import sys

    path = tmp_path / "replies.jsonl"
    path.write_text('{"match": "ok", "text": "fine"}\n' + line + "\n", encoding="utf-8")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "simulate-scheduler",
            "--bind",
            f"ipc://{tmp_path}/s.sock",
            "--replies",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and f"{path}:2:" in proc.stderr, proc.stderr


def test_reasoning_sent_back_renders_under_either_name(scripted):
    """vLLM's `reasoning` and the older `reasoning_content` reach the template the same way."""
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}

    def prompt(key: str) -> str:
        messages = [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", key: "Add two and two.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"},
        ]
        status, _, body = http("POST", scripted.url + "/tokenize", {"messages": messages, "tools": TOOLS})
        assert status == 200, body
        return http("POST", scripted.url + "/detokenize", {"tokens": body["tokens"]})[2]["prompt"]

    rendered = prompt("reasoning")
    assert "<think>Add two and two.</think>" in rendered
    assert rendered == prompt("reasoning_content")
