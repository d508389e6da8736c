"""docs/api/request-fields.md's /v1/responses table, walked against a running server: every field of the
request struct is listed, every refused field is refused with a 400 naming it, every other field is
answered (never a silent drop of something that would change the output)."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, Server, http

from tokenmill.tokenizer_workers.openai_responses import ResponsesRequest

MODEL = "deepseek-v4"
# a value each field is sent with: refused rows must be refused with it, the others answered
VALUES = {
    "model": MODEL,
    "input": "Hello",
    "instructions": "Be brief.",
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "low", "summary": "auto"},
    "max_output_tokens": 4,
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "stream": False,
    "stream_options": None,  # only with stream: sent below
    "temperature": 0.5,
    "top_p": 0.9,
    "prompt_cache_key": "conversation-1",
    "include": ["message.output_text.logprobs"],
    "store": True,
    "previous_response_id": "resp_abc",
    "background": True,
    "conversation": "conv_abc",
    "prompt": {"id": "pmpt_abc"},
    "top_logprobs": 2,
    "truncation": "auto",
    "max_tool_calls": 3,
    "metadata": {"k": "v"},
    "user": "u1",
    "safety_identifier": "s1",
    "service_tier": "auto",
    "top_k": 5,
    "min_p": 0.1,
    "seed": 7,
    "stop": ["\n\n"],
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "include_reasoning": False,
    "chat_template_kwargs": {"enable_thinking": False},
    "request_id": "abc123",
}
# refused fields whose default (or OpenAI's harmless values) is accepted
ACCEPTED_AS = {"store": False, "include": ["reasoning.encrypted_content"], "truncation": "disabled"}


def table() -> dict[str, str]:
    """field -> its row's tokenmill cell, from the /v1/responses section of the docs."""
    doc = (ROOT / "docs" / "api" / "request-fields.md").read_text()
    section = doc.split("## /v1/responses", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_every_field_is_in_the_table():
    assert set(table()) == set(ResponsesRequest.__struct_fields__) == set(VALUES)


@pytest.fixture(scope="module")
def server():
    srv = Server("--workers", "1", "--sim-inter-token-latency-ms", "0")
    yield srv
    srv.stop()


def post(server, body):
    return http(
        "POST", server.url + "/v1/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **body}
    )


@pytest.mark.parametrize("field", sorted(VALUES))
def test_the_table_against_the_server(server, field):
    cell = table()[field]
    body = {field: VALUES[field]}
    if field == "stream_options":
        body = {"stream": True, "stream_options": {"include_obfuscation": False}}
    status, _, answer = post(server, body)
    assert cell.startswith(("**honoured**", "**accepted**", "**refused**")), cell
    if "**refused**" in cell:  # refused with the value sent; a row that accepts some values too, with those
        assert status == 400, answer
        assert answer["error"]["param"].split("[")[0] == field, answer
        assert cell.startswith("**refused**") or field in ACCEPTED_AS, cell
        if field not in ACCEPTED_AS:
            return
        status, _, answer = post(server, {field: ACCEPTED_AS[field]})
    assert status == 200, answer
    if not body.get("stream"):
        assert answer["object"] == "response"


def test_stream_options_without_stream_is_refused(server):
    status, _, answer = post(server, {"stream_options": {"include_obfuscation": False}})
    assert status == 400 and answer["error"]["param"] == "stream_options"
