"""Every request field OpenAI or vLLM defines is honoured, accepted without effect, or refused with a
400 naming it (tokenizer_workers/request_fields.py, docs/api/request-fields.md): never silently dropped."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, http

from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers.request_fields import IGNORED, REFUSED, RefusableFields

CHAT = [{"role": "user", "content": "Hello"}]

# a value each refused field must be refused with
NON_DEFAULT = {
    "structural_tag": {"type": "structural_tag"},
    "guided_decoding_backend": "xgrammar",
    "logits_processors": ["my.module:Proc"],
    "best_of": 2,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "verbosity": "low",
    "mm_processor_kwargs": {"a": 1},
}
# defaults that clients send, which must be accepted
DEFAULTS = {
    "response_format": {"type": "text"},
    "logit_bias": {},
    "min_p": 0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "best_of": 1,
    "top_logprobs": 0,
    "parallel_tool_calls": True,
    "modalities": ["text"],
    "bad_words": [],
    "suffix": "",
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "use_beam_search": False,
    "length_penalty": 1,
    "priority": 0,
    "return_token_ids": False,
    "kv_transfer_params": {},
    "vllm_xargs": {},
}


def test_the_table_the_struct_and_the_docs_agree():
    assert set(NON_DEFAULT) == set(REFUSED)
    doc = (ROOT / "docs" / "api" / "request-fields.md").read_text()
    listed = set(re.findall(r"`([a-z_]+)`", doc))
    honoured = (set(oa.ChatCompletionRequest.__struct_fields__) | set(oa.CompletionRequest.__struct_fields__)) - set(
        RefusableFields.__struct_fields__
    )
    missing = (set(REFUSED) | set(IGNORED) | honoured) - listed
    assert not missing, f"docs/api/request-fields.md does not list {sorted(missing)}"


def test_the_honoured_table_says_what_vllm_does():
    """docs/api/request-fields.md's Honoured table has a "vLLM 0.32" column, filled in on every row
    (tests/engines/test_vllm_field_parity.py checks what it says against vLLM's own server)."""
    doc = (ROOT / "docs" / "api" / "request-fields.md").read_text()
    table = doc.split("## Honoured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert [c.strip() for c in rows[0].strip("|").split("|")] == ["field", "endpoints", "notes", "vLLM 0.32"]
    assert len(rows) > 30
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4 and cells[0].startswith("`") and cells[3], line[:80]
    assert "tests/engines/test_vllm_field_parity.py" in table


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_every_refused_field_is_a_400_naming_it(server, endpoint):
    base = {"model": "deepseek-v4", "max_tokens": 2}
    base.update({"messages": CHAT} if "chat" in endpoint else {"prompt": "Hello"})
    for name, value in NON_DEFAULT.items():
        status, _, body = http("POST", server.url + endpoint, {**base, name: value})
        assert status == 400, (name, status, body)
        assert body["error"]["param"] == name and name in body["error"]["message"], body
        assert body["error"]["type"] == "BadRequestError"
    status, _, body = http(
        "POST", server.url + endpoint, {**base, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    )
    assert status == 200, body  # honoured (tests/serving/test_vllm_fields.py)
    status, _, body = http(
        "POST", server.url + endpoint, {**base, **DEFAULTS, **{k: None for k in REFUSED if k not in DEFAULTS}}
    )
    assert status == 200, body  # every default (or null) at once is fine
    status, _, body = http(
        "POST",
        server.url + endpoint,
        {**base, **{k: "x" for k in IGNORED if k != "metadata"}, "metadata": {"k": "v"}, "store": False},
    )
    assert status == 200, body


def test_reasoning_effort_reaches_the_chat_template(tmp_path):
    from tokenmill.tokenizer_workers.converter import Converter
    from tokenmill.tokenizer_workers.settings import ConverterSettings

    template = tmp_path / "t.jinja"
    template.write_text("{{ reasoning_effort | default('unset') }}|{% for m in messages %}{{ m.content }}{% endfor %}")
    converter = Converter(ConverterSettings(chat_template_file=str(template)))
    chat = oa.parse("chat", b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}')
    assert converter.render(chat.messages, chat) == "low|hi"
    # as vLLM 0.32: the request's reasoning_effort wins over chat_template_kwargs'
    chat = oa.parse(
        "chat",
        b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low", '
        b'"chat_template_kwargs": {"reasoning_effort": "high"}}',
    )
    assert converter.render(chat.messages, chat) == "low|hi"
    chat = oa.parse("chat", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert converter.render(chat.messages, chat) == "unset|hi"
    # and it turns thinking on ("none": off) unless chat_template_kwargs says otherwise, as vLLM 0.32
    template.write_text("{{ enable_thinking | default('unset') }}|{% for m in messages %}{{ m.content }}{% endfor %}")
    converter = Converter(ConverterSettings(chat_template_file=str(template)))
    for body, expected in (
        (b'"reasoning_effort": "low"', "True|hi"),
        (b'"reasoning_effort": "none"', "False|hi"),
        (b'"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": false}', "False|hi"),
        (b'"max_tokens": 1', "unset|hi"),
    ):
        chat = oa.parse("chat", b'{"messages": [{"role": "user", "content": "hi"}], ' + body + b"}")
        assert converter.render(chat.messages, chat) == expected, body
    with pytest.raises(oa.InvalidRequest) as refused:  # vLLM 0.32's values only
        oa.parse("chat", b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}')
    assert refused.value.param == "reasoning_effort"
