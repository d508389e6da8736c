"""OpenAI chat-completion messages -> the messages a chat template sees, converted as vLLM does.

* ``content``: a string, a list of parts, or null. For the ``"string"`` content format the text parts
  are joined with ``"\\n"`` (null gives ``""``); for ``"openai"`` the content stays a list of
  ``{"type": "text", "text": ...}`` parts (a plain string becomes one such part, null an empty list),
  except that an all-text ``tool`` message is joined into a string again.
* ``tool_calls[].function.arguments``: a JSON string is parsed; invalid JSON or anything but an
  object becomes ``{}``. An empty ``tool_calls`` list is dropped.
* ``reasoning`` / ``reasoning_content`` of an assistant message is passed under both names.
* Only the fields templates read are kept: role, content, name, tool_calls (assistant),
  tool_call_id (tool), reasoning (assistant), task, tools (developer).
* ``developer`` becomes ``system`` when the template never mentions "developer".

Images, audio, video and embeddings are refused: this front end serves text-only models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

__all__ = ["to_template_messages"]

_CONTENT_FORMATS = ("string", "openai")
# Part type -> the key that holds its text.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Text parts whose missing text makes vLLM skip the part rather than fail.
_SKIPPED_WHEN_EMPTY = ("text", "refusal")
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "prompt_embeds": "embedding",
}
_SUPPORTED_PART_TYPES = ", ".join(sorted([*_TEXT_PARTS, "tool_reference"]))


def to_template_messages(messages: list[dict], content_format: str, template_source: str) -> list[dict]:
    """Convert OpenAI chat messages for a template whose content format is ``content_format``.

    Raises ValueError, with a message for the user, for malformed messages and unsupported content.
    """
    if content_format not in _CONTENT_FORMATS:
        raise ValueError(f"content format must be 'string' or 'openai', got {content_format!r}")
    if not isinstance(messages, (list, tuple)):
        raise ValueError("'messages' must be a list of message objects.")
    developer_to_system = "developer" not in (template_source or "")
    return [
        _convert(index, message, content_format == "openai", developer_to_system)
        for index, message in enumerate(messages)
    ]


def _convert(index: int, message, openai_format: bool, developer_to_system: bool) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with a 'role', got {type(message).__name__}.")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role must be a non-empty string.")

    parts = _content_parts(where, message.get("content"), openai_format)
    if openai_format:
        content = parts
        if role == "tool" and all(part.get("type") == "text" for part in parts):
            content = "\n".join(part["text"] for part in parts)
    else:
        content = "\n".join(parts)
    result: dict = {"role": role, "content": content}

    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            calls = _tool_calls(where, tool_calls)
            if calls:
                result["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content must be a string.")
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]

    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        if message.get("tools") is not None:
            result["tools"] = message["tools"]
        if developer_to_system:
            result["role"] = "system"
    return result


def _content_parts(where: str, content, openai_format: bool) -> list:
    """The message's content as text strings ("string" format) or part dicts ("openai" format)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content} if openai_format else content]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}.content must be a string, a list of content parts, or null.")
    out = []
    for number, part in enumerate(content):
        parsed = _content_part(f"{where}.content[{number}]", part, openai_format)
        if parsed is not None:
            out.append(parsed)
    return out


def _content_part(where: str, part, openai_format: bool):
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai_format else part
    if not isinstance(part, Mapping):
        raise ValueError(f"{where} must be a string or an object with a 'type'.")
    part_type = part.get("type")
    if part_type is None:
        media = next((key for key in _MEDIA_PARTS if key in part), None)
        if media is not None:
            _refuse_media(where, media)
        raise ValueError(f"{where} has no 'type' field.")
    if not isinstance(part_type, str):
        raise ValueError(f"{where}.type must be a string.")
    if part_type in _MEDIA_PARTS:
        _refuse_media(where, part_type)
    if part_type in _TEXT_PARTS:
        key = _TEXT_PARTS[part_type]
        text = part.get(key)
        if text is None and part_type in _SKIPPED_WHEN_EMPTY:
            return None
        if not isinstance(text, str):
            raise ValueError(f"{where}: a '{part_type}' part needs a string '{key}'.")
        return {"type": "text", "text": text} if openai_format else text
    if part_type == "tool_reference":
        name = part.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{where}: a 'tool_reference' part needs a string 'name'.")
        return {"type": "tool_reference", "name": name} if openai_format else name
    raise ValueError(f"{where}: unsupported content part type {part_type!r}; supported types: {_SUPPORTED_PART_TYPES}.")


def _refuse_media(where: str, part_type: str) -> None:
    kind = _MEDIA_PARTS[part_type]
    raise ValueError(
        f"{where}: {kind} content ('{part_type}' parts) is not supported; this server serves "
        "text-only models, so send text content only."
    )


def _tool_calls(where: str, tool_calls) -> list[dict]:
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"{where}.tool_calls must be a list.")
    calls = []
    for number, call in enumerate(tool_calls):
        call_where = f"{where}.tool_calls[{number}]"
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise ValueError(f"{call_where} must be an object with a 'function' object.")
        function = dict(call["function"])
        function["arguments"] = _arguments(function.get("arguments"))
        calls.append({**call, "function": function})
    return calls


def _arguments(arguments) -> dict:
    """Tool-call arguments as a dict: templates expect an object, not OpenAI's JSON string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}
