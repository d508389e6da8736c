"""The OpenAI Responses API (/v1/responses) through the real HTTP path, with the official openai client.

The simulated scheduler plays scripted replies (--sim-replies), markers included, so the worker's
tool-call and reasoning parsers run as for chat completions; the answers must be the output items
and events OpenAI's clients read: ids and call_ids equal in added, done and final forms, every event
numbered, one terminal event.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from conftest import Server, http

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
REPLIES = [
    ("weather in Paris", f'Let me look that up.{B}{CB}get_weather{S}{{"city": "Paris"}}{CE}{E}'),
    ("sunny, 21", "It is sunny in Paris, at 21 °C."),
    ("think first", "The user asks for a sum; 2 + 2 = 4.</think>The answer is 4."),
    ("patch the file", f'{B}{CB}apply_patch{S}{{"input": "*** Begin Patch\\n+hello\\n*** End Patch"}}{CE}{E}'),
    ("patched ok", "Done: the file is patched."),
    ("spawn a helper", f'{B}{CB}multi__get_weather{S}{{"city": "Oslo"}}{CE}{E}'),
    ("cloudy, 12", "Oslo is cloudy."),
]
MODEL = "deepseek-v4"
CUSTOM_SCHEMA = {  # what a custom tool is shown to the template as (vLLM's shim)
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("replies") / "replies.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for match, text in REPLIES:
            f.write(json.dumps({"match": match, "text": text}, ensure_ascii=False) + "\n")
    srv = Server("--workers", "1", "--sim-inter-token-latency-ms", "0", "--sim-replies", str(path))
    yield srv
    srv.stop()


def events_of(client, **body) -> tuple[list, object]:
    """The stream's events, and get_final_response() (which needs exactly the terminal event)."""
    with client.responses.stream(model=MODEL, **body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    return events, final


def unparsed(value):
    """A dumped item without the client's own parsed fields (get_final_response adds them)."""
    if isinstance(value, dict):
        return {k: unparsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [unparsed(v) for v in value]
    return value


def check_stream(events, final) -> None:
    """The contract every stream keeps: numbered events, one terminal event last, items with the same id
    (and call_id) in added, done and the final output, dense output indexes."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    terminal = [e for e in events if e.type in ("response.completed", "response.incomplete", "response.failed")]
    assert terminal == [events[-1]]
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in added] == list(range(len(added))) == [e.output_index for e in done]
    for a, d, item in zip(added, done, final.output):
        assert a.item.id == d.item.id == item.id
        assert getattr(a.item, "call_id", None) == getattr(d.item, "call_id", None) == getattr(item, "call_id", None)
        assert unparsed(d.item.model_dump()) == unparsed(item.model_dump())
    assert len(final.output) == len(done)


def test_render_gives_the_prompt_token_ids(server):
    """/v1/responses/render (vLLM's route): the prompt's IDs, as many as a response's input_tokens."""
    body = {"model": MODEL, "instructions": "Be brief.", "input": "hi", "max_output_tokens": 1}
    status, _, rendered = http("POST", server.url + "/v1/responses/render", body)
    r = server.client().responses.create(**body)
    assert status == 200 and len(rendered["token_ids"]) == r.usage.input_tokens
    status, _, error = http("POST", server.url + "/v1/responses/render", {**body, "include": ["nope"]})
    assert status == 400 and error["error"]["param"] == "include[0]"


def test_create_answers_text(server):
    r = server.client().responses.create(model=MODEL, input="Tell me something about tokenizers.", max_output_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.output_text == message.content[0].text and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.store is False and r.max_output_tokens == 8


def test_stream_equals_create(server):
    client = server.client()
    body = {"input": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER]}
    events, final = events_of(client, **body)
    check_stream(events, final)
    assert events[-1].type == "response.completed" and final.status == "completed"
    whole = client.responses.create(model=MODEL, **body)
    strip = lambda r: [  # noqa: E731 - ids differ between two responses, nothing else may
        {k: v for k, v in unparsed(item.model_dump()).items() if k not in ("id", "call_id")} for item in r.output
    ]
    assert strip(whole) == strip(final)
    message, call = final.output
    assert message.content[0].text == "Let me look that up."
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == message.content[0].text
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert call.id.startswith("fc_") and call.call_id
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [a.arguments for a in args] == [call.arguments] and args[0].item_id == call.id
    assert final.usage.input_tokens == whole.usage.input_tokens > 0


@pytest.mark.parametrize("output", ["sunny, 21", [{"type": "input_text", "text": "sunny, 21"}]], ids=["str", "parts"])
def test_function_call_round_trip(server, output):
    client = server.client()
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
    second = client.responses.create(model=MODEL, input=history, tools=[WEATHER])
    assert second.output_text == "It is sunny in Paris, at 21 °C." and second.status == "completed"
    # the same conversation through chat completions renders the same prompt
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me look that up.",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
    )
    assert chat.usage.prompt_tokens == second.usage.input_tokens


def test_reasoning_items(server):
    client = server.client()
    body = {"input": "Please think first: what is 2 + 2?", "reasoning": {"effort": "high"}}
    events, final = events_of(client, **body)
    check_stream(events, final)
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == "The user asks for a sum; 2 + 2 = 4."
    assert message.content[0].text == "The answer is 4."
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text
    whole = client.responses.create(model=MODEL, **body)
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning.content[0].text
    assert whole.reasoning.effort == "high"
    # effort "none" turns the template's thinking off, as chat's reasoning_effort does: no reasoning item
    off = client.responses.create(model=MODEL, input="Please think first: what is 2 + 2?", reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"]
    # a reasoning item sent back renders as the assistant's reasoning
    history = [
        {"role": "user", "content": "Please think first: what is 2 + 2?"},
        *[i.model_dump(exclude_none=True) for i in whole.output],
        {"role": "user", "content": "And 3 + 3?"},
    ]
    again = client.responses.create(model=MODEL, input=history, reasoning={"effort": "high"}, max_output_tokens=4)
    assert again.usage.input_tokens > whole.usage.input_tokens


def test_incomplete_on_max_output_tokens_streamed(server):
    """OpenAI ends such a stream with response.incomplete (vLLM with response.completed: docs/api/agent-apis.md);
    the openai client's get_final_response() wants response.completed, so the terminal event's response is read."""
    with server.client().responses.stream(model=MODEL, input="Tell me a long story.", max_output_tokens=5) as stream:
        events = list(stream)
    final = events[-1].response
    check_stream(events, final)
    assert events[-1].type == "response.incomplete"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.usage.output_tokens == 5


def test_custom_tool_call(server):
    """Codex's custom tools: shown to the model as a function of one string, answered as custom_tool_call."""
    client = server.client()
    body = {"input": "Please patch the file.", "tools": [PATCH, WEATHER]}
    events, final = events_of(client, **body)
    check_stream(events, final)
    (call,) = final.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.id.startswith("ctc_")
    assert call.input == "*** Begin Patch\n+hello\n*** End Patch"
    assert [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [call.input]
    history = [
        {"role": "user", "content": "Please patch the file."},
        call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "patched ok"},
    ]
    second = client.responses.create(model=MODEL, input=history, tools=[PATCH])
    # the chat path on the same conversation: the same prompt, and the same split into reasoning and text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Please patch the file."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "apply_patch", "arguments": json.dumps({"input": call.input})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "patched ok"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": "apply_patch", "description": "Apply a patch.", "parameters": CUSTOM_SCHEMA},
            }
        ],
    )
    assert chat.usage.prompt_tokens == second.usage.input_tokens
    texts = [(i.type, (i.content[0].text if i.content else "")) for i in second.output]
    message = chat.choices[0].message
    expected = (
        [("reasoning", message.model_extra["reasoning_content"])]
        if message.model_extra.get("reasoning_content")
        else []
    )
    expected += [("message", message.content)] if message.content else []
    assert texts == expected and "Done: the file is patched." in str(texts)


def test_structured_output_from_text_format(server):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
        "required": ["city", "temp"],
        "additionalProperties": False,
    }
    r = server.client().responses.create(
        model=MODEL,
        input="Give me a city and a temperature.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
    )
    value = json.loads(r.output_text)
    assert set(value) == {"city", "temp"} and isinstance(value["temp"], int)


def test_instructions_and_tool_choice(server):
    client = server.client()
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    told = client.responses.create(model=MODEL, input="hi", instructions="You are terse.", max_output_tokens=1)
    assert told.usage.input_tokens > plain.usage.input_tokens and told.instructions == "You are terse."
    forced = client.responses.create(
        model=MODEL, input="hi", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}
    )
    (call,) = forced.output
    assert call.type == "function_call" and "city" in json.loads(call.arguments)


def refused(server, body: dict) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().responses.create(model=MODEL, **body)
    error = info.value.body
    assert set(error) >= {"message", "type", "param", "code"}, error
    return info.value


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "input[0].call_id"),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c2", "output": "x"},
                ]
            },
            "input[2].call_id",
        ),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "hi", "tools": [{"type": "teleport"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "nope"}]}, "tools[0].parameters"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"input": "hi", "include": ["reasoning.encrypted_content", "reasoning.summary"]}, "include[1]"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input[0].encrypted_content"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    error = refused(server, body)
    assert error.body["param"] == param, error.body
    assert re.sub(r"\[\d+\]", "", param).split(".")[-1] in error.body["message"], error.body


def test_store_false_and_omitted_are_accepted(server):
    client = server.client()
    for extra in ({}, {"store": False}):
        r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, **extra)
        assert r.store is False


def test_what_codex_sends_is_accepted(server):
    """Codex 0.169 asks for encrypted reasoning and sends hosted and namespace tools on every turn: the
    reasoning comes back as text (no encrypted_content), hosted tools are not shown to the model, and a
    namespace's functions are shown as namespace__name and answered as name in that namespace."""
    client = server.client()
    agents_ns = {
        "type": "namespace",
        "name": "multi",
        "description": "Sub-agents.",
        "tools": [{**WEATHER, "name": "get_weather"}],
    }
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, tools=[WEATHER])
    r = client.responses.create(
        model=MODEL,
        input="hi",
        max_output_tokens=1,
        tools=[WEATHER, {"type": "web_search"}],
        include=["reasoning.encrypted_content"],
        reasoning={"summary": "auto"},
        extra_body={"client_metadata": {"thread_id": "t"}},
    )
    assert r.usage.input_tokens == plain.usage.input_tokens  # web_search is not in the prompt
    r = client.responses.create(model=MODEL, input="Please spawn a helper.", tools=[agents_ns])
    (call,) = r.output
    assert (call.type, call.name, call.namespace) == ("function_call", "get_weather", "multi")
    assert json.loads(call.arguments) == {"city": "Oslo"}
    history = [
        {"role": "user", "content": "Please spawn a helper."},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "cloudy, 12"},
    ]
    assert client.responses.create(model=MODEL, input=history, tools=[agents_ns]).output_text == "Oslo is cloudy."


def test_prompt_cache_key_is_echoed(server):
    r = server.client().responses.create(model=MODEL, input="hi", max_output_tokens=1, prompt_cache_key="session-42")
    assert r.prompt_cache_key == "session-42"


def test_unknown_model_and_get_are_openai_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client().responses.create(model="gpt-9", input="hi")
    status, _, body = http("GET", server.url + "/v1/responses/resp_123")
    assert status == 404 and body["error"]["code"] == "not_found"


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_sdk_tool_loop(server, streamed):
    """The OpenAI Agents SDK's agent loop: the model calls the tool, the SDK runs it and sends the whole
    history back (function_call with its id, function_call_output), and the model answers."""
    agents = pytest.importorskip("agents")
    import asyncio

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    agent = agents.Agent(
        name="weather",
        instructions="Answer weather questions with the tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(MODEL, client),
    )

    async def run():
        if not streamed:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert calls == ["Paris"]
    assert result.final_output == "It is sunny in Paris, at 21 °C."
    kinds = [item.type for item in result.new_items]
    assert kinds == ["message_output_item", "tool_call_item", "tool_call_output_item", "message_output_item"]


def test_engine_lost_mid_stream_is_one_response_failed(tmp_path):
    """A failure after the stream started ends it with one response.failed (OpenAI's terminal event;
    vLLM has none), carrying the error's code; nothing follows it."""
    from faultutil import Simulator

    endpoint = f"ipc://{tmp_path}/s.sock"
    sim = Simulator(endpoint, "--inter-token-latency-ms", "20", "--model", "default")
    srv = None
    try:
        srv = Server("--scheduler", endpoint, "--workers", "1")
        with srv.client().responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=3000) as stream:
            events = []
            for event in stream:
                events.append(event)
                if event.type == "response.output_text.delta" and len(events) == 6:
                    sim.kill()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        last = events[-1]
        assert last.type == "response.failed" and last.response.status == "failed"
        assert last.response.error.code == "scheduler_unavailable" and last.response.error.message
        assert [e.type for e in events].count("response.failed") == 1
        assert not any(e.type in ("response.completed", "response.incomplete") for e in events)
        # the message item it was writing is closed first, so the failed response's output is whole
        assert [e.type for e in events[-4:-1]] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        assert last.response.output[0].id == events[2].item.id
    finally:
        if srv is not None:
            srv.stop()
        sim.stop()
