"""docs/api/request-fields.md's Anthropic Messages table, walked against a running server: every field
the Messages body defines is listed, every listed field with a sample value is answered (honoured
or accepted), and the values this server cannot honour are 400s naming the field."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, http

from tokenmill.tokenizer_workers.anthropic_messages import MessagesRequest

USER = [{"role": "user", "content": "Hello"}]
TOOL = {"name": "t", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}

# a value for each row's fields (a body patch, or headers), sent with model, max_tokens and messages
SAMPLES = {
    "model": {"model": "deepseek-v4"},
    "max_tokens": {"max_tokens": 3},
    "messages": {
        "messages": [*USER, {"role": "assistant", "content": "Hi."}, {"role": "system", "content": "Be kind."}, *USER]
    },
    "system": {"system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]},
    "stop_sequences": {"stop_sequences": ["\n\n"]},
    "stream": {"stream": True},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 5},
    "tools": {"tools": [TOOL]},
    "tool_choice": {"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
    "thinking": {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}},
    "output_config": {"output_config": {"effort": "low"}},
    "metadata": {"metadata": {"user_id": "u1"}},
    "context_management": {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
    "service_tier": {"service_tier": "auto"},
    "inference_geo": {"inference_geo": "us"},
    "container": {"container": None},
    "mcp_servers": {"mcp_servers": []},
    "cache_control": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}
        ]
    },
    "anthropic-version": {"headers": {"anthropic-version": "2023-06-01"}},
    "anthropic-beta": {"headers": {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}},
    "x-api-key": {"headers": {"x-api-key": "anything"}},
}

# values refused with a 400 whose message names the field
REFUSED = [
    ({"max_tokens": None}, "max_tokens"),
    (  # the default model is text-only
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}
            ]
        },
        "messages[0].content[0]",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].source.type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "tools[0].type"),
    ({"tools": [{"name": "t", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool", "name": "missing"}, "tools": [TOOL]}, "tool_choice.name"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"temperature": 1.5}, "temperature"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
]


def rows() -> dict[str, str]:
    """field -> kind, from the table."""
    doc = (ROOT / "docs" / "api" / "request-fields.md").read_text()
    table = doc.split("## Anthropic Messages", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            assert len(cells) == 4 and cells[3], line[:80]
            for name in re.findall(r"`([a-z_-]+)`", cells[0]):
                out[name] = cells[1]
    return out


def test_the_table_lists_every_field():
    listed = rows()
    assert set(MessagesRequest.__struct_fields__) <= set(listed)
    assert set(listed) == set(SAMPLES)
    assert set(listed.values()) <= {"honoured", "accepted"}


def _send(server, patch: dict):
    patch = dict(patch)
    headers = patch.pop("headers", {})
    body = {"model": "deepseek-v4", "max_tokens": 3, "messages": USER, **patch}
    body = {k: v for k, v in body.items() if v is not None or k == "container"}
    return http("POST", server.url + "/v1/messages?beta=true", body, headers=headers)


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_every_listed_field_is_answered(server, field):
    status, _, body = _send(server, SAMPLES[field])
    assert status == 200, (field, body)
    if not SAMPLES[field].get("stream"):
        assert body["type"] == "message" and body["content"] and body["stop_reason"], body


@pytest.mark.parametrize("patch, param", REFUSED, ids=[p for _, p in REFUSED])
def test_refused_values_name_the_field(server, patch, param):
    status, _, body = _send(server, patch)
    assert status == 400, (param, body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(param), body
