"""Anthropic Messages bodies (``/v1/messages``, ``/v1/messages/count_tokens``) -> the chat request.

The Messages API is converted into the same ``ChatCompletionRequest`` the chat-completions path
builds, as vLLM 0.32 converts it (vllm/entrypoints/anthropic/serving.py), so rendering,
tokenization, the tool-call and reasoning parsers, the segment cache and conversation affinity
are the chat path's. Every refusal names the Messages field (``messages[2].content[0].tool_use_id``).

* ``system``: a string or text blocks, joined with ``""``; a block starting with
  ``x-anthropic-billing-header`` (Claude Code's per-request hash) is dropped, as vLLM drops it.
* System-role messages inside ``messages`` stay in place as system messages, or are merged into
  the leading system prompt when the template refuses a system message after the first
  (``merge_inline_system``, probed once per template by the converter).
* ``tool_use`` -> an assistant tool call (``input`` as JSON arguments), ``tool_result`` -> a
  ``tool`` message (its text blocks joined with ``"\\n"``); ``thinking`` -> the assistant's
  ``reasoning``; ``redacted_thinking`` is dropped (opaque); ``document`` is refused by name.
* ``image`` (user messages and ``tool_result`` content; source ``base64`` with a media_type, or
  ``url``) -> the chat path's image (an ``ImageRef`` naming the block, a base64 source as a
  ``data:`` URL whose bytes must be of the declared type); a ``tool_result``'s images follow its
  ``tool`` message as a user message, as vLLM places them. A text-only model refuses them by name.
* ``tool_choice`` ``auto`` / ``any`` (-> ``required``) / ``tool`` (-> a named function) / ``none``;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
* ``thinking``: ``disabled`` -> ``reasoning_effort: "none"`` (the template's thinking switch off),
  ``enabled`` -> ``enable_thinking: true`` (its ``budget_tokens`` checked, not enforced: max_tokens
  bounds the answer), ``adaptive`` leaves the template's default; ``output_config.effort`` ->
  ``reasoning_effort``; ``output_config.format`` (json_schema) -> ``response_format``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers.chat_messages import ImageRef

_BILLING = "x-anthropic-billing-header"
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's list
_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document")


class MessagesRequest(msgspec.Struct):
    """The Messages API body; fields it defines that have no effect here are decoded (so a wrong
    type is a 400) and ignored (docs/api/request-fields.md says why)."""

    model: str | None = None
    messages: list[Any] | None = None
    max_tokens: int | None = None
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # accepted without effect: Anthropic's bookkeeping and server-side features with no meaning here
    metadata: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    inference_geo: Any = None
    mcp_servers: list[Any] | None = None


_decoder = msgspec.json.Decoder(MessagesRequest)


def parse(body: bytes | memoryview) -> MessagesRequest:
    return oa.decode(_decoder, body)


def _bad(message: str, param: str) -> oa.InvalidRequest:
    return oa.InvalidRequest(f"{param}: {message}", param)


def _text_of(blocks: list, param: str) -> str:
    """The text of a list of text blocks (system, system-role messages), billing headers dropped."""
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _bad("only text blocks are allowed here.", f"{param}[{j}].type")
        text = block.get("text")
        if not isinstance(text, str):
            raise _bad("a text block needs a string text.", f"{param}[{j}].text")
        if text and not text.startswith(_BILLING):
            parts.append(text)
    return "".join(parts)


def _image(block: dict, at: str) -> ImageRef:
    """An image block as the chat path's image; its source is checked here, its bytes by the worker."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad("an image block needs a source object.", f"{at}.source")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _MEDIA_TYPES:
            raise _bad(f"must be one of {', '.join(_MEDIA_TYPES)}, got {media!r}.", f"{at}.source.media_type")
        if not isinstance(data, str) or not data:
            raise _bad("must be a non-empty base64 string.", f"{at}.source.data")
        return ImageRef(f"data:{media};base64,{data}", at, media_type=media)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise _bad("must be an http(s) URL.", f"{at}.source.url")
        return ImageRef(url, at)
    if kind == "file":
        raise _bad(
            "file sources need Anthropic's Files API, which this server has not; send base64 or url.",
            f"{at}.source.type",
        )
    raise _bad(f"must be 'base64' or 'url', got {kind!r}.", f"{at}.source.type")


def _tool_result(content, param: str) -> tuple[str, list[ImageRef]]:
    """A tool_result's text (its text blocks joined with "\\n") and its images."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise _bad("must be a string or a list of blocks.", param)
    texts, images = [], []
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            if not isinstance(item.get("text"), str):
                raise _bad("a text block needs a string text.", f"{param}[{k}].text")
            texts.append(item["text"])
        elif kind == "image":
            images.append(_image(item, f"{param}[{k}]"))
        elif kind == "document":
            raise _bad("document blocks are not supported here.", f"{param}[{k}].type")
        elif kind != "tool_reference":
            raise _bad(f"unknown block type {kind!r}; expected text or image.", f"{param}[{k}].type")
    return "\n".join(texts), images


def chat_messages(req: MessagesRequest, merge_inline_system: bool) -> list[dict]:
    """The OpenAI chat messages of a Messages request, checked block by block."""
    if not isinstance(req.messages, list) or not req.messages:
        raise oa.InvalidRequest("messages: must be a non-empty list of messages.", "messages")
    system = []
    if isinstance(req.system, str):
        if req.system and not req.system.startswith(_BILLING):
            system.append(req.system)
    elif req.system is not None:
        system.append(_text_of(req.system, "system"))
    out: list[dict] = []
    seen_calls: set[str] = set()
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad("each message must be an object.", where)
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"role must be 'user' or 'assistant', got {role!r}.", f"{where}.role")
        if not isinstance(content, (str, list)):
            raise _bad("content must be a string or a list of blocks.", f"{where}.content")
        if role == "system":  # Claude Code's in-conversation reminders
            text = content if isinstance(content, str) else _text_of(content, f"{where}.content")
            if text.startswith(_BILLING):
                text = ""
            if merge_inline_system:
                system.append(text)
            elif text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        out.extend(_blocks(role, content, f"{where}.content", seen_calls))
    if system and any(system):
        out.insert(0, {"role": "system", "content": "".join(system)})
    return out


def _blocks(role: str, content: list, where: str, seen_calls: set[str]) -> list[dict]:
    """One Messages message's blocks -> its chat message, and a ``tool`` message per tool_result."""
    texts: list[dict | ImageRef] = []  # the message's text and image parts, in order
    calls: list[dict] = []
    reasoning: list[str] = []
    tool_messages: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCK_TYPES:
            raise _bad(f"unknown content block type {kind!r}; expected one of {', '.join(_BLOCK_TYPES)}.", f"{at}.type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad("a text block needs a string text.", f"{at}.text")
            if block["text"]:
                texts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            if role != "user":
                raise _bad("image blocks belong to user messages.", f"{at}.type")
            texts.append(_image(block, at))
        elif kind == "document":
            raise _bad("document blocks are not supported here.", f"{at}.type")
        elif kind == "thinking":
            if role != "assistant":
                raise _bad("thinking blocks belong to assistant messages.", f"{at}.type")
            if not isinstance(block.get("thinking"), str):
                raise _bad("a thinking block needs a string thinking.", f"{at}.thinking")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque (encrypted by Anthropic's servers): nothing a template could show
        elif kind == "tool_use":
            if role != "assistant":
                raise _bad("tool_use blocks belong to assistant messages.", f"{at}.type")
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a tool_use block needs a string id.", f"{at}.id")
            if not isinstance(name, str) or not name:
                raise _bad("a tool_use block needs a string name.", f"{at}.name")
            if not isinstance(args, dict):
                raise _bad("input must be an object.", f"{at}.input")
            seen_calls.add(call_id)
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
        else:  # tool_result
            if role != "user":
                raise _bad("tool_result blocks belong to user messages.", f"{at}.type")
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in seen_calls:
                raise _bad(f"tool_use_id {call_id!r} matches no earlier tool_use block.", f"{at}.tool_use_id")
            text, images = _tool_result(block.get("content"), f"{at}.content")
            tool_messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            if images:
                tool_messages.append({"role": "user", "content": images})
    message: dict[str, Any] = {"role": role}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if texts:
        only = texts[0]
        message["content"] = only["text"] if len(texts) == 1 and isinstance(only, dict) else texts
    out = list(tool_messages)  # tool results answer the previous turn: they come first
    if texts or calls or reasoning or not tool_messages:
        message.setdefault("content", "" if not (calls or reasoning) else None)
        out.append(message)
    return out


def chat_tools(tools: list | None) -> list[dict] | None:
    """Anthropic tools (name, description, input_schema) as OpenAI function tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad("each tool must be an object.", f"tools[{i}]")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad("a tool needs a string name.", f"tools[{i}].name")
        if tool.get("type") not in (None, "custom"):
            raise _bad(
                f"server tool type {tool['type']!r} is not available here; give custom tools with input_schema.",
                f"tools[{i}].type",
            )
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise _bad("input_schema must be a JSON schema object with type 'object'.", f"tools[{i}].input_schema")
        if "properties" in schema and not isinstance(schema["properties"], dict):
            raise _bad("properties must be an object.", f"tools[{i}].input_schema.properties")
        function: dict[str, Any] = {"name": name, "description": tool.get("description"), "parameters": schema}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict | None, tools: list | None) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    if choice is None:
        return ("auto" if tools else None), None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {t.get("name") for t in tools or () if isinstance(t, dict)}:
            raise _bad(f"names {name!r}, which is not among the tools.", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise _bad(f"type must be 'auto', 'any', 'tool' or 'none', got {kind!r}.", "tool_choice.type")


def _reasoning_effort(req: MessagesRequest) -> str | None:
    effort = None
    config = req.output_config or {}
    if config.get("effort") is not None:
        if config["effort"] not in _EFFORTS:
            raise _bad(f"effort must be one of {', '.join(_EFFORTS)}.", "output_config.effort")
        effort = config["effort"]
    thinking = req.thinking
    if thinking is not None:
        kind = thinking.get("type")
        if kind == "disabled":
            effort = "none"
        elif kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
                raise _bad("budget_tokens must be an integer of at least 1024.", "thinking.budget_tokens")
            if req.max_tokens is not None and budget >= req.max_tokens:
                raise _bad("budget_tokens must be less than max_tokens.", "thinking.budget_tokens")
        elif kind != "adaptive":
            raise _bad(f"type must be 'enabled', 'disabled' or 'adaptive', got {kind!r}.", "thinking.type")
    return effort


def _response_format(config: dict | None) -> dict | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("format must be {'type': 'json_schema', 'schema': {...}}.", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": fmt["schema"]}}


def to_chat_request(
    req: MessagesRequest, merge_inline_system: bool, count_only: bool = False
) -> oa.ChatCompletionRequest:
    """The chat-completions request the Messages request means (max_tokens required unless counting)."""
    if not count_only:
        if req.max_tokens is None:
            raise oa.InvalidRequest("max_tokens: Field required.", "max_tokens")
        if req.max_tokens < 1:
            raise _bad(f"must be at least 1, got {req.max_tokens}.", "max_tokens")
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise _bad("must be between 0 and 1.", "temperature")
        if req.top_k is not None and req.top_k < 0:
            raise _bad("must be a non-negative integer.", "top_k")
        if any(s == "" for s in req.stop_sequences or ()):
            raise _bad("stop sequences must not be empty.", "stop_sequences")
    tools = chat_tools(req.tools)
    tool_choice, parallel = _tool_choice(req.tool_choice, req.tools)
    return oa.ChatCompletionRequest(
        model=req.model,
        messages=chat_messages(req, merge_inline_system),
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences) if req.stop_sequences else None,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stream=req.stream and not count_only,
        tools=tools,
        tool_choice=tool_choice if tools else None,
        parallel_tool_calls=parallel,
        reasoning_effort=_reasoning_effort(req),
        # thinking enabled turns the template's thinking switch on (vLLM only sets a budget, which
        # leaves a template that defaults to off without thinking: docs/api/agent-apis.md)
        chat_template_kwargs={"enable_thinking": True} if (req.thinking or {}).get("type") == "enabled" else None,
        response_format=_response_format(req.output_config),
    )
