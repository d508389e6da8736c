"""OpenAI messages -> template messages (vLLM's rules), and ChatTemplates' rendering rules."""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path

import pytest

from tokenmill.tokenizer_workers import chat_template as chat_template_module
from tokenmill.tokenizer_workers.chat_messages import to_template_messages
from tokenmill.tokenizer_workers.chat_template import ChatTemplates, TemplateError, render_conversation

DEFAULT_TEMPLATE = (
    Path(__file__).resolve().parents[2] / "tokenmill" / "default_model" / "chat_template.jinja"
).read_text(encoding="utf-8")
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def render(source: str, messages=None, **options) -> str:
    special = options.pop("special_tokens", {"bos_token": "<s>", "eos_token": "</s>"})
    default_kwargs = options.pop("default_kwargs", None)
    return ChatTemplates({"default": source}, special, default_kwargs).render(
        messages if messages is not None else [{"role": "user", "content": "hi"}], **options
    )


# ---------------------------------------------------------------------------------------------
# to_template_messages


def test_string_format_joins_text_parts_with_newlines():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, "two", {"type": "input_text", "text": "three"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": None}]},
    ]
    out = to_template_messages(messages, "string", PLAIN)
    assert out == [{"role": "user", "content": "one\ntwo\nthree"}, {"role": "assistant", "content": "no"}]


def test_string_format_null_content_becomes_empty_string():
    out = to_template_messages([{"role": "assistant", "content": None}], "string", PLAIN)
    assert out == [{"role": "assistant", "content": ""}]


def test_openai_format_wraps_strings_and_keeps_lists():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
        {"role": "assistant", "content": None},
    ]
    out = to_template_messages(messages, "openai", PLAIN)
    assert out == [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": []},
    ]


def test_openai_format_joins_all_text_tool_messages():
    messages = [
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
        }
    ]
    out = to_template_messages(messages, "openai", PLAIN)
    assert out == [{"role": "tool", "content": "x\ny", "tool_call_id": "c1"}]


def test_tool_call_arguments_are_parsed_to_objects():
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo", "n": 2}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{not json"}},
        {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1, 2]"}},
        {"id": "d", "type": "function", "function": {"name": "i", "arguments": "7"}},
        {"id": "e", "type": "function", "function": {"name": "j", "arguments": {"already": "dict"}}},
        {"id": "f", "type": "function", "function": {"name": "k"}},
        {"id": "g", "type": "function", "function": {"name": "l", "arguments": ""}},
    ]
    messages = [{"role": "assistant", "content": None, "tool_calls": calls}]
    original = copy.deepcopy(messages)
    out = to_template_messages(messages, "string", PLAIN)
    arguments = [call["function"]["arguments"] for call in out[0]["tool_calls"]]
    assert arguments == [{"city": "Oslo", "n": 2}, {}, {}, {}, {"already": "dict"}, {}, {}]
    assert out[0]["tool_calls"][0] == {
        "id": "a",
        "type": "function",
        "function": {"name": "f", "arguments": {"city": "Oslo", "n": 2}},
    }
    assert messages == original, "the request's messages are not modified"


def test_empty_tool_calls_are_dropped():
    out = to_template_messages([{"role": "assistant", "content": "ok", "tool_calls": []}], "string", PLAIN)
    assert out == [{"role": "assistant", "content": "ok"}]


def test_reasoning_is_passed_under_both_names():
    for key in ("reasoning", "reasoning_content"):
        out = to_template_messages([{"role": "assistant", "content": "4", key: "2+2"}], "string", PLAIN)
        assert out == [{"role": "assistant", "content": "4", "reasoning": "2+2", "reasoning_content": "2+2"}]


def test_only_template_fields_are_kept():
    messages = [
        {"role": "user", "content": "hi", "name": "ann", "extra": 1, "tool_call_id": "x"},
        {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"},
    ]
    out = to_template_messages(messages, "string", PLAIN)
    assert out == [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"},
    ]


def test_developer_becomes_system_unless_the_template_knows_it():
    messages = [{"role": "developer", "content": "rules"}]
    assert to_template_messages(messages, "string", PLAIN) == [{"role": "system", "content": "rules"}]
    aware = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"
    assert to_template_messages(messages, "string", aware) == [{"role": "developer", "content": "rules"}]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"image_url": "https://example.com/cat.png"},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    ],
)
def test_media_parts_are_refused_clearly(part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    for content_format in ("string", "openai"):
        with pytest.raises(ValueError) as info:
            to_template_messages(messages, content_format, PLAIN)
        message = str(info.value)
        assert "messages[0].content[1]" in message and info.value.param == "messages[0].content[1]"
        if "image_url" in part:  # a model without an image processor
            assert "takes no images" in message
        else:
            assert "not supported" in message


def test_image_parts_are_collected_in_prompt_order_for_a_model_that_takes_images():
    url = "data:image/png;base64,AAAA"
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "low"}}, "Hi"]},
        {"role": "user", "content": [{"image_url": "https://example.com/b.png"}]},
    ]
    refs = []
    out = to_template_messages(messages, "openai", PLAIN, refs, "<img>")
    assert out[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Hi"}]
    assert out[1]["content"] == [{"type": "image"}]
    assert [(r.url, r.where, r.detail) for r in refs] == [
        (url, "messages[0].content[0]", "low"),
        ("https://example.com/b.png", "messages[1].content[0]", "auto"),
    ]
    assert to_template_messages(messages, "string", PLAIN, [], "<img>")[0]["content"] == "<img>\nHi"
    for bad in ({"type": "image_url"}, {"type": "image_url", "image_url": {"url": url, "detail": "max"}}):
        with pytest.raises(ValueError) as info:
            to_template_messages([{"role": "user", "content": [bad]}], "openai", PLAIN, [], "<img>")
        assert info.value.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([{"content": "no role"}], "messages[0].role"),
        (["just a string"], "messages[0] must be an object"),
        ([{"role": "user", "content": 5}], "messages[0].content must be"),
        ([{"role": "user", "content": [{"type": "hologram"}]}], "unsupported content part type 'hologram'"),
        ([{"role": "user", "content": [{"text": "no type"}]}], "has no 'type'"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "needs a string 'text'"),
        ([{"role": "assistant", "tool_calls": "f()"}], "tool_calls must be a list"),
        ([{"role": "assistant", "tool_calls": [{"id": "x"}]}], "tool_calls[0] must be an object with a 'function'"),
    ],
)
def test_malformed_messages_raise_value_error(messages, fragment):
    with pytest.raises(ValueError) as info:
        to_template_messages(messages, "string", PLAIN)
    assert fragment in str(info.value)


def test_unknown_content_format_is_refused():
    with pytest.raises(ValueError):
        to_template_messages([{"role": "user", "content": "x"}], "auto", PLAIN)


# ---------------------------------------------------------------------------------------------
# ChatTemplates: selection and content format


def test_select_named_templates():
    templates = ChatTemplates({"default": "D", "tool_use": "T", "rag": "R"}, {})
    assert templates.select(None, None) == "D"
    assert templates.select(None, []) == "T"  # tools given (even empty) -> tool_use
    assert templates.select("rag", None) == "R"
    assert templates.select("default", [{"type": "function"}]) == "D"
    with pytest.raises(TemplateError, match="unknown chat template 'nope'"):
        templates.select("nope", None)


def test_select_single_none_and_ambiguous():
    assert ChatTemplates({"only": "O"}, {}).select(None, [{}]) == "O"
    assert ChatTemplates({"tool_use": "T", "other": "X"}, {}).select(None, [{}]) == "T"
    with pytest.raises(TemplateError, match="none is named 'default'"):
        ChatTemplates({"tool_use": "T", "other": "X"}, {}).select(None, None)
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplates({}, {}).select(None, None)
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplates({}, {}).render([{"role": "user", "content": "x"}])


def test_template_source_overrides_selection():
    templates = ChatTemplates({"default": "model"}, {})
    assert templates.render([{"role": "user", "content": "x"}], template_source="request") == "request"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content | list %}x{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for c in m.tool_calls %}x{% endfor %}{% endfor %}", "string"),
        ("{% for m in other %}{% for p in m.content %}x{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %", "string"),  # does not parse
    ],
)
def test_content_format_detection(source, expected):
    assert ChatTemplates({}, {}).content_format(source) == expected


def test_default_template_is_string_format():
    assert ChatTemplates({}, {}).content_format(DEFAULT_TEMPLATE) == "string"


# ---------------------------------------------------------------------------------------------
# ChatTemplates: environment and variables


def test_tojson_matches_transformers():
    data = {"z": 1, "a": "<b>&'é"}
    assert render("{{ x | tojson }}", kwargs={"x": data}) == '{"z": 1, "a": "<b>&\'é"}'
    assert render("{{ x | tojson(indent=2) }}", kwargs={"x": {"k": [1]}}) == '{\n  "k": [\n    1\n  ]\n}'
    assert (
        render("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}", kwargs={"x": data}) == '{"a":"<b>&\'é","z":1}'
    )
    assert render("{{ x | tojson(ensure_ascii=true) }}", kwargs={"x": "é"}) == '"\\u00e9"'


def test_raise_exception_message_is_user_facing():
    with pytest.raises(TemplateError) as info:
        render("{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    assert str(info.value) == "Conversation roles must alternate user/assistant"


def test_template_errors_become_template_error():
    with pytest.raises(TemplateError, match="syntax error on line 2"):
        render("ok\n{% if %}")
    with pytest.raises(TemplateError, match="has no attribute"):
        render("{{ messages[0].nope.deeper }}")
    with pytest.raises(TemplateError, match="TypeError"):
        render("{{ 'a' + 1 }}")
    with pytest.raises(TemplateError, match="underscore-prefixed"):
        render("{% set ns = namespace(ok=1) %}{% set ns._hidden = 2 %}")
    with pytest.raises(TemplateError, match="underscore-prefixed"):
        render("{% set ns = namespace(_x=1) %}")


def test_environment_features():
    assert render("{% generation %}kept {{ 1 + 1 }}{% endgeneration %}") == "kept 2"
    assert render("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "012"
    assert render("{{ dict(a=1) | tojson }} {{ dict.fromkeys(['x']) | tojson }}") == '{"a": 1} {"x": null}'
    assert render("{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 2 %}{{ ns.n }}") == "2"
    assert render("a\n{% if true %}\n  b\n{% endif %}\n") == "a\n  b\n"  # trim/lstrip blocks, final newline dropped


def test_strftime_now_uses_local_clock(monkeypatch):
    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 7, 26, 10, 0, 0)

    monkeypatch.setattr(chat_template_module, "datetime", Fixed)
    assert render("{{ strftime_now('%d %b %Y') }}") == "26 Jul 2024"


def test_absent_tools_and_documents_are_none():
    source = "{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }}"
    assert render(source) == "True True False"
    assert render(source, tools=[], documents=[], add_generation_prompt=True) == "False False True"


def test_variable_precedence():
    source = "{{ bos_token }}|{{ eos_token }}|{{ flavour }}"
    templates = ChatTemplates(
        {"default": source}, {"bos_token": "<s>", "eos_token": "</s>"}, {"eos_token": "E", "flavour": "d"}
    )
    assert templates.render([{"role": "user", "content": "x"}]) == "<s>|E|d"
    assert templates.render([{"role": "user", "content": "x"}], kwargs={"bos_token": "B", "flavour": "r"}) == "B|E|r"
    with pytest.raises(TemplateError, match="cannot set messages"):
        templates.render([{"role": "user", "content": "x"}], kwargs={"messages": []})


def test_none_valued_keys_are_dropped():
    source = (
        "{% for m in messages %}{% if m.content is none %}none{% elif m.content is defined %}defined"
        "{% else %}undefined{% endif %};{% endfor %}"
    )
    messages = [{"role": "assistant", "content": None, "tool_calls": None}, {"role": "user", "content": "x"}]
    assert render(source, messages) == "undefined;defined;"


def test_reasoning_is_copied_to_thinking_and_reasoning_content():
    source = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    messages = [
        {"role": "assistant", "content": "4", "reasoning_content": "r1"},
        {"role": "assistant", "reasoning": "r2", "content": "5"},
        {"role": "assistant", "content": "6", "thinking": "r3"},
    ]
    lines = [json.loads(line) for line in render(source, messages).splitlines()]
    assert list(lines[0].items()) == [
        ("thinking", "r1"),
        ("role", "assistant"),
        ("content", "4"),
        ("reasoning_content", "r1"),
    ]
    assert list(lines[1].items()) == [
        ("thinking", "r2"),
        ("role", "assistant"),
        ("reasoning", "r2"),
        ("content", "5"),
        ("reasoning_content", "r2"),
    ]
    assert list(lines[2].items()) == [
        ("thinking", "r3"),
        ("role", "assistant"),
        ("content", "6"),
        ("reasoning_content", "r3"),
    ]


def test_messages_are_not_modified():
    messages = [{"role": "user", "content": "x", "reasoning_content": None}, {"role": "assistant", "content": "y"}]
    original = copy.deepcopy(messages)
    render(PLAIN, messages, continue_final_message=True)
    assert messages == original


def test_empty_and_malformed_conversations():
    with pytest.raises(TemplateError, match="empty conversation"):
        render(PLAIN, [])
    with pytest.raises(TemplateError, match=r"messages\[0\] must be an object"):
        render(PLAIN, ["hello"])
    with pytest.raises(TemplateError, match="tools must be a list"):
        render(PLAIN, tools=["f"])


# ---------------------------------------------------------------------------------------------
# continue_final_message


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PREFILL = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Crimson leaves "}]


def test_continue_final_message_cuts_at_the_final_message():
    out = render(CHATML, PREFILL, continue_final_message=True)
    assert out == "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\nCrimson leaves "


def test_continue_final_message_when_the_template_trims_content():
    trimming = CHATML.replace("{{ m.content }}", "{{ m.content | trim }}")
    out = render(trimming, PREFILL, continue_final_message=True)
    assert out == "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\nCrimson leaves"


def test_continue_final_message_with_list_content():
    source = "{% for m in messages %}[{% for p in m.content %}{{ p.text }}{% endfor %}]{% endfor %}"
    messages = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(source, messages, continue_final_message=True) == "[ab"


def test_continue_final_message_errors():
    with pytest.raises(TemplateError, match="cannot both be set"):
        render(CHATML, PREFILL, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(TemplateError, match="does not appear"):
        render("{% for m in messages %}{{ m.role }}{% endfor %}{# content #}", PREFILL, continue_final_message=True)
    with pytest.raises(TemplateError, match="does not read"):
        render("{% for m in messages %}{{ m.role }}{% endfor %}", PREFILL, continue_final_message=True)
    with pytest.raises(TemplateError, match='no "content"'):
        render(CHATML, [{"role": "assistant", "content": None}], continue_final_message=True)


# ---------------------------------------------------------------------------------------------
# The embedded model's template (tokenmill/default_model/chat_template.jinja)


def default(messages, **options) -> str:
    special = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
    return render(DEFAULT_TEMPLATE, messages, special_tokens=special, **options)


def test_default_template_basic_turns():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "old reasoning"},
        {"role": "user", "content": "3+3?"},
    ]
    assert default(messages, add_generation_prompt=True) == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜>"
        "<｜User｜>3+3?<｜Assistant｜></think>"
    )
    for kwargs in ({"thinking": True}, {"enable_thinking": True}):
        assert default(messages, add_generation_prompt=True, kwargs=kwargs).endswith(
            "<｜User｜>3+3?<｜Assistant｜><think>"
        )
    assert default(messages, add_generation_prompt=True, kwargs={"enable_thinking": False, "thinking": True}).endswith(
        "<｜Assistant｜></think>"
    )


def test_default_template_tool_round_trip():
    messages = to_template_messages(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Need the tool.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"t": 3}'},
        ],
        "string",
        DEFAULT_TEMPLATE,
    )
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather now.", "parameters": {"type": "object"}},
        }
    ]
    out = default(messages, tools=tools, add_generation_prompt=True, kwargs={"thinking": True})
    assert '### get_weather\nWeather now.\nParameters: {"type": "object"}\n' in out
    assert out.endswith(
        "<｜User｜>Weather in Oslo?<｜Assistant｜><think>Need the tool.</think>"
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"t": 3}<｜tool▁output▁end｜><｜tool▁outputs▁end｜><think>'
    )


def test_default_template_refuses_list_content_and_unknown_roles():
    with pytest.raises(TemplateError, match="only accepts text content"):
        default([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    with pytest.raises(TemplateError, match="Unsupported message role"):
        default([{"role": "narrator", "content": "x"}])


def test_render_conversation_reads_the_conversation_format():
    templates = ChatTemplates({"default": CHATML}, {})
    conversation = {"messages": PREFILL, "continue_final_message": True, "template_kwargs": {}}
    assert render_conversation(templates, conversation).endswith("Crimson leaves ")
    with pytest.raises(TemplateError, match="needs 'messages'"):
        render_conversation(templates, {"message": []})


def test_the_framers_text_templates_give_the_bytes_the_dict_encoding_gives():
    """Text and reasoning events are built from per-choice byte templates (one string encode per
    token); they must be byte for byte what encoding the whole chunk gives."""
    import msgspec

    from tokenmill.gateway.openai_format import Framer
    from tokenmill.tokenizer_workers.messages import CompletionShape

    for kind in ("chat", "completion"):
        for include_usage, continuous in ((False, False), (True, False), (True, True)):
            framer = Framer(
                kind,
                CompletionShape(include_usage=include_usage, continuous_usage=continuous),
                response_id="chatcmpl-x",
                created=1796000000,
                model='model "with" quotes',
                prompt_tokens=[5] * 8,
            )
            for text in ("hi", 'a"b\\c\n\t', "日本語🙂", "", "@x@", "\u2028"):
                for index in (0, 7):
                    usage = (
                        msgspec.Raw(b'{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}')
                        if continuous
                        else None
                    )
                    assert framer.text_chunk(index, text, 3) == framer.text_chunk_slow(index, text, usage)
                    assert framer.reasoning_chunk(index, text, 3) == framer.reasoning_chunk_slow(index, text, usage)
