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

Images (``image_url`` parts, and a part holding an ``image_url`` key without a type) are taken
only when the caller passes an ``images`` list (the model has an image processor): each image's
URL and field path is appended to it in prompt order, and the part becomes ``{"type": "image"}``
(transformers' form, which templates test with ``content['type'] == 'image'``), or the model's
placeholder text within the joined string for string-content templates. Otherwise images are
refused naming the part. Audio, video and embeddings are always refused. The agent APIs' converters
(Anthropic ``image`` blocks, Responses ``input_image``) put an ``ImageRef`` itself in the content, so
the part is named in their API's terms; no JSON body can hold one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ContentError", "ImageRef", "to_template_messages"]


class ContentError(ValueError):
    """A message the server refuses; ``param`` names the field at fault (a content part, or "messages")."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImageRef:
    """An image part as the request gave it: its URL (data: or http(s)) and where it was; ``media_type``
    is what an Anthropic base64 block declared (checked against the bytes)."""

    url: str
    where: str
    detail: str = "auto"
    media_type: str | None = None


_DETAILS = ("auto", "low", "high")

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


def to_template_messages(
    messages: list[dict],
    content_format: str,
    template_source: str,
    images: list[ImageRef] | None = None,
    image_text: str = "",
) -> list[dict]:
    """Convert OpenAI chat messages for a template whose content format is ``content_format``.

    ``images``: None refuses image parts; a list collects them (``image_text`` stands in for each in
    string-content templates). Raises ValueError (a ContentError naming the part where one is at
    fault), with a message for the user, for malformed messages and unsupported content.
    """
    if content_format not in _CONTENT_FORMATS:
        raise ValueError(f"content format must be 'string' or 'openai', got {content_format!r}")
    if not isinstance(messages, (list, tuple)):
        raise ValueError("'messages' must be a list of message objects.")
    developer_to_system = "developer" not in (template_source or "")
    media = _Media(images, image_text)
    return [
        _convert(index, message, content_format == "openai", developer_to_system, media)
        for index, message in enumerate(messages)
    ]


@dataclass
class _Media:
    images: list[ImageRef] | None
    image_text: str


def _convert(index: int, message, openai_format: bool, developer_to_system: bool, media: _Media) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with a 'role', got {type(message).__name__}.")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role must be a non-empty string.")

    parts = _content_parts(where, message.get("content"), openai_format, media)
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


def _content_parts(where: str, content, openai_format: bool, media: _Media) -> list:
    """The message's content as text strings ("string" format) or part dicts ("openai" format)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content} if openai_format else content]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}.content must be a string, a list of content parts, or null.")
    out = []
    for number, part in enumerate(content):
        parsed = _content_part(f"{where}.content[{number}]", part, openai_format, media)
        if parsed is not None:
            out.append(parsed)
    return out


def _content_part(where: str, part, openai_format: bool, media: _Media):
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai_format else part
    if isinstance(part, ImageRef):  # an agent API's image, already checked and named by its converter
        if media.images is None:
            _refuse_media(part.where, "image_url", media)
        media.images.append(part)
        return {"type": "image"} if openai_format else media.image_text
    if not isinstance(part, Mapping):
        raise ValueError(f"{where} must be a string or an object with a 'type'.")
    part_type = part.get("type")
    if part_type is None:
        kind = next((key for key in _MEDIA_PARTS if key in part), None)
        if kind == "image_url" and media.images is not None:
            return _image_part(where, part, openai_format, media)
        if kind is not None:
            _refuse_media(where, kind, media)
        raise ValueError(f"{where} has no 'type' field.")
    if not isinstance(part_type, str):
        raise ValueError(f"{where}.type must be a string.")
    if part_type == "image_url" and media.images is not None:
        return _image_part(where, part, openai_format, media)
    if part_type in _MEDIA_PARTS:
        _refuse_media(where, part_type, media)
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


def _image_part(where: str, part: Mapping, openai_format: bool, media: _Media):
    """An OpenAI image_url part: {"image_url": {"url": ..., "detail": ...}} (or the URL as a string)."""
    spec = part.get("image_url")
    if isinstance(spec, str):
        url, detail = spec, "auto"
    elif isinstance(spec, Mapping):
        url, detail = spec.get("url"), spec.get("detail") or "auto"
    else:
        raise ContentError(f"{where}.image_url must be an object with a 'url'.", where)
    if not isinstance(url, str) or not url:
        raise ContentError(f"{where}.image_url.url must be a non-empty string.", where)
    if detail not in _DETAILS:
        raise ContentError(f"{where}.image_url.detail must be one of {', '.join(_DETAILS)}.", where)
    media.images.append(ImageRef(url, where, detail))
    return {"type": "image"} if openai_format else media.image_text


def _refuse_media(where: str, part_type: str, media: _Media) -> None:
    kind = _MEDIA_PARTS[part_type]
    if kind == "image" and media.images is None:
        raise ContentError(
            f"{where}: this model takes no images (it has no image processor: no preprocessor_config.json of a "
            "supported family, or no image placeholder in its template), so send text content only.",
            where,
        )
    raise ContentError(f"{where}: {kind} content ('{part_type}' parts) is not supported here.", where)


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
