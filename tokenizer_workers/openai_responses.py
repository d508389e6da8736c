"""OpenAI Responses bodies -> the chat request the chat-completions path builds, as vLLM 0.32 converts them.

One conversion layer over the shared chat core: ``instructions`` becomes the leading system message,
``input`` items become chat messages (``function_call`` / ``custom_tool_call`` the assistant's
tool calls, ``*_output`` tool messages, ``reasoning`` the assistant's reasoning; ``input_image`` parts
the chat path's images, ``file_id`` refused: no file store), flat Responses tools
become chat tools (a ``custom`` tool a function taking one string ``input``, as vLLM shows it), and
``text.format`` becomes ``response_format``. Rendering, tokenizing, parsing and caching are then the
chat path's own. Errors name the Responses field (``input[3].call_id``).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers.chat_messages import ImageRef

_json = msgspec.json.Encoder()
CUSTOM_INPUT_KEY = "input"  # the one argument of the function a custom tool is shown as (vLLM's)
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_DETAILS = ("auto", "low", "high", "original")  # none changes a Qwen2-VL image (as in vLLM)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


# the values OpenAI documents for `include`, which vLLM 0.32 accepts too (a Literal of its
# ResponsesRequest): none of them adds anything here (no hosted tools, no encrypted reasoning; Codex
# asks for reasoning.encrypted_content every turn); anything else is refused, as both refuse it
_INCLUDE = frozenset(
    (
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    )
)


class ResponsesRequest(msgspec.Struct):
    """The Responses API's request body (OpenAI's fields, and the vLLM extensions the chat path shares)."""

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    include: list[str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # vLLM's extensions, as its chat path takes them
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    request_id: str | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)


class Converted(msgspec.Struct):
    """What the gateway's Responses framer needs besides the chat conversion."""

    chat: oa.ChatCompletionRequest
    custom_tools: list[str]  # tool names whose calls are custom_tool_call items (input, not arguments)
    namespaces: dict[str, str]  # a namespace's function as the model sees it (namespace__name) -> its namespace
    echo: bytes  # the request fields the response object repeats, as a JSON object
    affinity: str | None  # prompt_cache_key: the conversation's identity, when the client names one


def parse(body: bytes) -> ResponsesRequest:
    return oa.decode(_decoder, body)


def convert(body: bytes) -> Converted:
    req = parse(body)
    _refuse_unsupported(req)
    tools, custom, namespaces = _tools(req.tools)
    chat = oa.ChatCompletionRequest(
        model=req.model,
        messages=_messages(req),
        tools=tools or None,
        tool_choice=_tool_choice(req.tool_choice, tools),
        parallel_tool_calls=req.parallel_tool_calls,
        max_tokens=req.max_output_tokens,
        response_format=_response_format(req.text),
        reasoning_effort=_effort(req.reasoning),
        stream=req.stream,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        stop=req.stop,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        include_reasoning=req.include_reasoning,
        chat_template_kwargs=req.chat_template_kwargs,
        request_id=req.request_id,
    )
    return Converted(chat, sorted(custom), namespaces, _echo(req), req.prompt_cache_key)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields this server cannot honour, refused by name (docs/api/request-fields.md says why)."""
    if req.store:
        raise oa.InvalidRequest(
            "store: true is not supported: this server keeps no responses (send store: false, and the "
            "whole conversation in input).",
            "store",
        )
    if req.previous_response_id is not None:
        raise oa.InvalidRequest(
            "previous_response_id is not supported: this server keeps no responses; send the whole "
            "conversation in input.",
            "previous_response_id",
        )
    if req.background:
        raise oa.InvalidRequest("background responses are not supported.", "background")
    if req.conversation is not None:
        raise oa.InvalidRequest("conversation is not supported: this server keeps no conversations.", "conversation")
    if req.prompt is not None:
        raise oa.InvalidRequest("prompt (a stored prompt template) is not supported.", "prompt")
    if req.stream_options is not None and not req.stream:
        raise oa.InvalidRequest("stream_options can only be set when stream is true.", "stream_options")
    if req.top_logprobs:
        raise oa.InvalidRequest("top_logprobs is not supported on /v1/responses.", "top_logprobs")
    if req.truncation not in (None, "disabled"):
        raise oa.InvalidRequest(
            "truncation 'auto' is not supported: a prompt longer than the context is refused.", "truncation"
        )
    if req.max_tool_calls is not None:
        raise oa.InvalidRequest("max_tool_calls is not supported.", "max_tool_calls")
    for i, name in enumerate(req.include or ()):
        if name == "message.output_text.logprobs":
            raise oa.InvalidRequest("include 'message.output_text.logprobs' is not supported.", f"include[{i}]")
        if name not in _INCLUDE:
            raise oa.InvalidRequest(f"include[{i}] must be one of {', '.join(sorted(_INCLUDE))}.", f"include[{i}]")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise oa.InvalidRequest(
            f"max_output_tokens must be at least 1, got {req.max_output_tokens}.", "max_output_tokens"
        )


def _effort(reasoning: dict | None) -> str | None:
    if reasoning is None:
        return None
    effort = reasoning.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise oa.InvalidRequest(
            f"reasoning.effort must be one of {list(_EFFORTS)}, got {effort!r}.", "reasoning.effort"
        )
    return effort


def _tools(tools: list | None) -> tuple[list[dict], set[str], dict[str, str]]:
    """Flat Responses tools as chat tools, as vLLM shows them: a custom tool a function of one string, a
    namespace's functions as ``namespace__name``; hosted tools (web search and the like, which only
    OpenAI's servers run) are not shown to the model."""
    out, custom, namespaces, seen = [], set(), {}, set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise oa.InvalidRequest(f"{where} must be an object.", where)
        kind = tool.get("type")
        if kind in HOSTED_TOOLS:
            continue
        if kind == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace:
                raise oa.InvalidRequest(f"{where}.name must be a non-empty string.", f"{where}.name")
            if not isinstance(members, list):
                raise oa.InvalidRequest(f"{where}.tools must be a list of function tools.", f"{where}.tools")
            for j, member in enumerate(members):
                if not isinstance(member, dict) or member.get("type") != "function":
                    raise oa.InvalidRequest(f"{where}.tools[{j}] must be a function tool.", f"{where}.tools[{j}].type")
                function = _function(member, f"{where}.tools[{j}]", seen, f"{namespace}__")
                namespaces[function["function"]["name"]] = namespace
                out.append(function)
            continue
        if kind not in ("function", "custom"):
            raise oa.InvalidRequest(
                f"{where}.type {kind!r} is not supported: this server runs function, custom and namespace tools "
                f"(hosted tools, {', '.join(sorted(HOSTED_TOOLS))}, are not shown to the model).",
                f"{where}.type",
            )
        if kind == "custom":
            fmt = tool.get("format")
            if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):  # as vLLM: no grammar formats
                raise oa.InvalidRequest(
                    f"{where}.format: custom tools with a {fmt.get('type')!r} format are not supported; only "
                    "free-form text custom tools are.",
                    f"{where}.format",
                )
            tool = {**tool, "parameters": _CUSTOM_PARAMETERS}
        function = _function(tool, where, seen)
        if kind == "custom":
            custom.add(function["function"]["name"])
        out.append(function)
    return out, custom, namespaces


HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "computer_use_preview",
        "image_generation",
        "local_shell",
        "mcp",
    }
)
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": [CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}


def _function(tool: dict, where: str, seen: set, prefix: str = "") -> dict:
    """One function (or custom) tool in chat's form, checked."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise oa.InvalidRequest(f"{where}.name must be a non-empty string.", f"{where}.name")
    name = prefix + name
    if name in seen:
        raise oa.InvalidRequest(f"{where}.name {name!r} names two tools.", f"{where}.name")
    seen.add(name)
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise oa.InvalidRequest(f"{where}.description must be a string.", f"{where}.description")
    parameters = tool.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise oa.InvalidRequest(
            f"{where}.parameters must be a JSON Schema object (type 'object').", f"{where}.parameters"
        )
    function = {"name": name, "description": description, "parameters": parameters}
    if tool.get("type") == "function" and tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _tool_choice(choice, tools: list[dict]):
    """Responses' tool_choice in chat's form: the names move into a function object."""
    if choice is None or choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise oa.InvalidRequest("tool_choice 'required' needs tools.", "tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise oa.InvalidRequest(f"tool_choice names {name!r}, which is not among the tools.", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise oa.InvalidRequest(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}.", "tool_choice"
    )


def _response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format (json_schema: structured outputs, as response_format does)."""
    if text is None:
        return None
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise oa.InvalidRequest("text.format must be an object.", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise oa.InvalidRequest("text.format.schema must be a JSON Schema object.", "text.format.schema")
        inner = {"name": fmt.get("name") or "response", "schema": schema}
        if fmt.get("strict") is not None:
            inner["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": inner}
    raise oa.InvalidRequest(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.", "text.format.type"
    )


def _messages(req: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = req.input
    if items is None:
        raise oa.InvalidRequest("input is required: a string or a list of items.", "input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    calls: set[str] = set()  # call_ids of the calls so far: an output must answer one of them
    for i, item in enumerate(items):
        _item(messages, calls, item, f"input[{i}]")
    if len(messages) == 0:
        raise oa.InvalidRequest("input must not be empty.", "input")
    return messages


def _last_assistant(messages: list[dict]) -> dict | None:
    return messages[-1] if messages and messages[-1].get("role") == "assistant" else None


def _item(messages: list[dict], calls: set[str], item, where: str) -> None:
    """One input item into the chat messages, merged into the assistant message before it as vLLM merges:
    reasoning, text and tool calls of one turn are one assistant message."""
    if not isinstance(item, dict):
        raise oa.InvalidRequest(f"{where} must be an object.", where)
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise oa.InvalidRequest(f"{where}.role must be one of {list(_ROLES)}, got {role!r}.", f"{where}.role")
        text = _text(item.get("content"), f"{where}.content", role != "assistant")
        previous = _last_assistant(messages)
        if role == "assistant" and previous is not None and previous.get("content") is None:
            previous["content"] = text
        else:
            messages.append({"role": role, "content": text})
    elif kind in ("function_call", "custom_tool_call"):
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise oa.InvalidRequest(f"{where}.call_id must be a non-empty string.", f"{where}.call_id")
        if not isinstance(name, str) or not name:
            raise oa.InvalidRequest(f"{where}.name must be a non-empty string.", f"{where}.name")
        if kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise oa.InvalidRequest(f"{where}.arguments must be a JSON string.", f"{where}.arguments")
        else:
            payload = item.get("input")
            if not isinstance(payload, str):
                raise oa.InvalidRequest(f"{where}.input must be a string.", f"{where}.input")
            arguments = json.dumps({CUSTOM_INPUT_KEY: payload}, ensure_ascii=False)
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace:  # as the model saw the tool
            name = f"{namespace}__{name}"
        calls.add(call_id)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        previous = _last_assistant(messages)
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if call_id not in calls:
            raise oa.InvalidRequest(
                f"{where}.call_id {call_id!r} answers no earlier function_call or custom_tool_call in input.",
                f"{where}.call_id",
            )
        output = item.get("output")
        if isinstance(output, list):
            output = _text(output, f"{where}.output", True)
        elif not isinstance(output, str):
            raise oa.InvalidRequest(f"{where}.output must be a string or a list of parts.", f"{where}.output")
        messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise oa.InvalidRequest(
                "encrypted_content is not supported: send the reasoning as content.",
                f"{where}.encrypted_content",
            )
        reasoning = ""
        for key in ("content", "summary"):  # as vLLM: the content's text, else the summary's
            parts = item.get(key)
            if isinstance(parts, list) and parts:
                first = parts[0]
                if not isinstance(first, dict) or not isinstance(first.get("text"), str):
                    raise oa.InvalidRequest(f"{where}.{key}[0].text must be a string.", f"{where}.{key}[0].text")
                reasoning = first["text"]
                break
        previous = _last_assistant(messages)
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = reasoning
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
    else:
        raise oa.InvalidRequest(
            f"{where}.type {kind!r} is not supported; supported item types: message, function_call, "
            "function_call_output, custom_tool_call, custom_tool_call_output, reasoning.",
            f"{where}.type",
        )


def _text(content, where: str, parts_ok: bool):
    """A message's content: a string, or its parts as chat text parts and images (user-side only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise oa.InvalidRequest(f"{where} must be a string or a list of parts.", where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise oa.InvalidRequest(f"{where}[{j}] must be an object.", f"{where}[{j}]")
        kind = part.get("type")
        if kind == "input_image" and parts_ok:
            out.append(_input_image(part, f"{where}[{j}]"))
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            whose = "an assistant message takes text only" if kind == "input_image" else "not supported here"
            raise oa.InvalidRequest(f"{where}[{j}]: {kind} parts: {whose}.", f"{where}[{j}]")
        if kind not in _TEXT_PARTS:
            raise oa.InvalidRequest(f"{where}[{j}].type {kind!r} is not a text part.", f"{where}[{j}].type")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise oa.InvalidRequest(f"{where}[{j}].{key} must be a string.", f"{where}[{j}].{key}")
        out.append({"type": "text", "text": part[key]})
    if not parts_ok:  # the assistant's text, as vLLM takes it: one string
        return "".join(p["text"] for p in out)
    return out


def _input_image(part: dict, where: str) -> ImageRef:
    """An input_image part as the chat path's image: ``image_url`` a data: or http(s) URL; ``file_id``
    needs OpenAI's file store, which this server has not."""
    if part.get("file_id") is not None:
        raise oa.InvalidRequest(
            f"{where}.file_id: there is no file store here; send the image as image_url (a data: or http(s) URL).",
            f"{where}.file_id",
        )
    url, detail = part.get("image_url"), part.get("detail") or "auto"
    if not isinstance(url, str) or not url:
        raise oa.InvalidRequest(
            f"{where}.image_url must be a non-empty string (a data: or http(s) URL).", f"{where}.image_url"
        )
    if detail not in _DETAILS:
        raise oa.InvalidRequest(f"{where}.detail must be one of {', '.join(_DETAILS)}.", f"{where}.detail")
    return ImageRef(url, where, detail)


def _echo(req: ResponsesRequest) -> bytes:
    """The request fields a Response object repeats, with OpenAI's defaults."""
    reasoning = req.reasoning or {}
    return _json.encode(
        {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "service_tier": req.service_tier or "auto",
            "store": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": req.truncation or "disabled",
            "user": req.user,
            "background": False,
        }
    )
