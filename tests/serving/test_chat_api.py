"""OpenAI-request-to-template conversion rules, observed through /tokenize and /v1/chat/completions."""

from __future__ import annotations

import pytest
from conftest import Server, http


@pytest.fixture(scope="module")
def trusting_server():
    srv = Server(
        "--workers",
        "1",
        "--trust-request-chat-template",
        "--default-chat-template-kwargs",
        '{"greeting": "hello", "tone": "dry"}',
    )
    yield srv
    srv.stop()


def rendered(srv, template: str, messages: list, **extra):
    status, _, body = http(
        "POST",
        srv.url + "/tokenize",
        {"messages": messages, "chat_template": template, "return_token_strs": True, **extra},
    )
    return status, body


def assert_renders(srv, tokenizer, template, messages, expected: str, **extra):
    status, body = rendered(srv, template, messages, **extra)
    assert status == 200, body
    assert body["tokens"] == tokenizer.encode(expected, add_special_tokens=False).ids, tokenizer.decode(body["tokens"])


STRING_TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
PARTS_TEMPLATE = "{% for m in messages %}{% for p in m.content %}<{{ p.type }}:{{ p.text }}>{% endfor %}{% endfor %}"


def test_text_parts_join_with_newlines_for_string_templates(trusting_server, default_tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    assert_renders(trusting_server, default_tokenizer, STRING_TEMPLATE, messages, "[user]first\nsecond\n")


def test_parts_stay_a_list_for_templates_that_iterate_them(trusting_server, default_tokenizer):
    messages = [
        {"role": "user", "content": "plain"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert_renders(trusting_server, default_tokenizer, PARTS_TEMPLATE, messages, "<text:plain><text:a><text:b>")


def test_tool_call_arguments_become_objects(trusting_server, default_tokenizer):
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endfor %}"
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
    ]
    assert_renders(trusting_server, default_tokenizer, template, messages, "get_weather(Paris)")


def test_developer_becomes_system_unless_the_template_knows_it(trusting_server, default_tokenizer):
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert_renders(
        trusting_server, default_tokenizer, "{% for m in messages %}{{ m.role }};{% endfor %}", messages, "system;user;"
    )
    knows = "{% for m in messages %}{{ m.role }};{% endfor %}{# developer #}"
    assert_renders(trusting_server, default_tokenizer, knows, messages, "developer;user;")


def test_template_kwargs_request_beats_server_default(trusting_server, default_tokenizer):
    template = "{{ greeting }} {{ tone }} {{ bos_token }}"
    messages = [{"role": "user", "content": "x"}]
    assert_renders(trusting_server, default_tokenizer, template, messages, "hello dry <｜begin▁of▁sentence｜>")
    assert_renders(
        trusting_server,
        default_tokenizer,
        template,
        messages,
        "bonjour dry <｜begin▁of▁sentence｜>",
        chat_template_kwargs={"greeting": "bonjour"},
    )


def test_raise_exception_is_a_400_with_the_template_message(trusting_server):
    template = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok"
    client = trusting_server.client()
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="deepseek-v4",
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            extra_body={"chat_template": template},
        )
    assert "System role not supported" in info.value.body["message"]
    status, body = rendered(trusting_server, template, [{"role": "system", "content": "s"}])
    assert status == 400 and "System role not supported" in body["error"]["message"]


def test_chat_completion_prompt_is_the_rendered_template(trusting_server, default_tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    resp = trusting_server.client().chat.completions.create(
        model="deepseek-v4", messages=messages, max_tokens=1, extra_body={"chat_template": STRING_TEMPLATE}
    )
    assert resp.usage.prompt_tokens == len(default_tokenizer.encode("[user]one\ntwo\n", add_special_tokens=False).ids)


def test_image_parts_are_refused_clearly(trusting_server):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    status, _, body = http(
        "POST", trusting_server.url + "/v1/chat/completions", {"model": "deepseek-v4", "messages": messages}
    )
    assert status == 400 and "image" in body["error"]["message"].lower()


def test_request_template_refused_without_trust(server):
    status, _, body = http(
        "POST", server.url + "/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}
    )
    assert status == 400 and body["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in body["error"]["message"]


def test_default_template_with_tools_and_thinking(server, default_tokenizer):
    """The embedded template renders tools and the thinking switch; /tokenize shows the prompt."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "Current time",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = [{"role": "user", "content": "What time is it?"}]
    status, _, plain = http("POST", server.url + "/tokenize", {"messages": messages})
    status2, _, with_tools = http("POST", server.url + "/tokenize", {"messages": messages, "tools": tools})
    assert status == status2 == 200
    assert "get_time" in default_tokenizer.decode(with_tools["tokens"]) and with_tools["count"] > plain["count"]
    status, _, thinking = http(
        "POST", server.url + "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}
    )
    assert status == 200 and thinking["tokens"] != plain["tokens"]
