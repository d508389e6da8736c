"""Rendering chat templates exactly as HuggingFace transformers 5.x ``apply_chat_template`` does.

The behaviour matched (see ../shared/notes/chat-template-semantics.md and transformers'
``utils/chat_template_utils.py``):

* an ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
  ``loopcontrols`` and a ``{% generation %}`` tag that renders its body unchanged;
* transformers' ``tojson`` filter (no HTML escaping, ``ensure_ascii=False``, keys kept in order),
  ``raise_exception``, ``strftime_now`` (local time), a restricted ``dict`` and a ``namespace``
  that refuses ``_``-prefixed attributes;
* input preprocessing of transformers 5.x: keys whose value is None are dropped from each message,
  everything is rebuilt from plain JSON types, and a message's reasoning is copied to both
  ``thinking`` and ``reasoning_content``;
* variables: ``messages``, ``tools`` and ``documents`` (None when absent), ``add_generation_prompt``,
  then the special tokens, overridden by default kwargs, overridden by per-request kwargs;
* ``continue_final_message``: the final message is tagged, rendered, and the output cut at the tag.

Every failure a request can cause is raised as :class:`TemplateError`, whose text is meant for users.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateError", "ChatTemplates", "render_conversation"]

# Names transformers passes a message's reasoning under; the first is the one templates read.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Variables the renderer sets itself; kwargs may not replace them (transformers raises TypeError).
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_COMPILED_CACHE_SIZE = 128


class TemplateError(Exception):
    """A chat template could not be rendered; ``str(exc)`` is a message for the user."""


class _RaisedByTemplate(jinja2.exceptions.TemplateError):
    """What the template's own ``raise_exception(message)`` raises."""


# ---------------------------------------------------------------------------------------------
# The Jinja environment


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        node = jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body)
        return node.set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


def _raise_exception(message):
    raise _RaisedByTemplate(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson sorts keys and escapes <, >, & and ' for HTML; transformers' does neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    # Looked up at call time through the module global, so tests can pin the clock.
    return datetime.now().strftime(fmt)


class _DictFactory:
    """The template's ``dict``: builds dicts, but exposes nothing of the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _refuse_private_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
            "Please rename the attribute."
        )


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses ``_``-prefixed attribute names."""

    def __init__(*args, **kwargs):  # noqa: N805 - same trick as Jinja's, so namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _refuse_private_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _refuse_private_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with its verdict on an attribute remembered per (type, name).

    Jinja's checks (``is_internal_attribute``, ``modifies_known_mutable``) look at nothing
    but the object's type and the attribute's name, and they were two fifths of the time
    it takes to render a short chat; the verdicts are the same, only computed once.
    """

    def __init__(self, **options):
        super().__init__(**options)
        self._verdicts: dict = {}

    def is_safe_attribute(self, obj, attr: str, value) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < 4096:
                self._verdicts[key] = verdict
        return verdict


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _make_environment()


@lru_cache(maxsize=_COMPILED_CACHE_SIZE)
def _compile_cached(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def _compile(source: str) -> jinja2.Template:
    if not isinstance(source, str):
        raise TemplateError("the chat template must be a string")
    try:
        return _compile_cached(source)
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateError(_describe(exc)) from None


# ---------------------------------------------------------------------------------------------
# Inputs, as transformers 5.x prepares them


def _plain(value: Any) -> Any:
    """A fresh copy built from plain JSON types (transformers' ``_plain_template_data``)."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{kind.__name__}>"


def _prepare_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TemplateError("messages must be a list of message objects")
    if not messages:
        raise TemplateError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{index}] must be an object, got {type(message).__name__}")
        # transformers 5.x drops keys whose value is None (content=None becomes undefined).
        message = _plain({key: value for key, value in message.items() if value is not None})
        reasoning = next((message[key] for key in _REASONING_KEYS if message.get(key) is not None), None)
        if reasoning is not None:
            # Same key order as transformers: "thinking" first, "reasoning_content" where it was (or last).
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _tag_final_message(messages: list[dict], field: str, source: str) -> str:
    """Append the continuation tag to the final message; return the text the output must contain."""
    last = messages[-1]
    final = last.get(field)
    if final is None:
        raise TemplateError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [field]
    if field in _REASONING_KEYS:
        fields = [key for key in _REASONING_KEYS if last.get(key) == final]
    if not any(name in source for name in fields):
        raise TemplateError(
            f'continue_final_message is set to "{field}" but this chat template does not read that field'
        )
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                if not isinstance(text, str):
                    raise TemplateError("continue_final_message: the final message's last text part is not a string")
                part["text"] = text + _CONTINUE_TAG
                return text
        raise TemplateError("continue_final_message is set but the final message has no text to continue")
    if not isinstance(final, str):
        raise TemplateError("continue_final_message is set but the final message's content is not text")
    for name in fields:
        last[name] = last[name] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final_text: str) -> str:
    marker = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or marker not in rendered:
        raise TemplateError(
            "continue_final_message is set but the final message does not appear in the rendered chat; "
            "this chat template changes or drops the final message, so it cannot be continued"
        )
    loc = rendered.rindex(marker)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    # The template trimmed the trailing space after the tag, so trailing whitespace is not reliable.
    return rendered[:loc].rstrip()


# ---------------------------------------------------------------------------------------------
# Content-format detection (vLLM: a for-loop over message['content'] means "openai")


class _Unrecognised(Exception):
    pass


def _is_name(node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is ``name`` (or ``name[key]`` / ``name.key``), possibly filtered, tested or sliced."""
    while True:
        if isinstance(node, jinja2.nodes.Filter):
            if node.node is None:
                return False
            node = node.node
        elif isinstance(node, jinja2.nodes.Test) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        ):
            node = node.node
        else:
            break
    if key is None:
        return _is_name(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable ``{% set %}`` from it, transitively."""
    found = [name]
    queue = deque([name])
    seen = {name}
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _reads(assign.node, current):
                if not isinstance(assign.target, jinja2.nodes.Name):
                    raise _Unrecognised
                target = assign.target.name
                found.append(target)
                if target not in seen:
                    seen.add(target)
                    queue.append(target)
    return found


def _loop_targets(root: jinja2.nodes.Template, names: list[str], key: str | None = None):
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, name, key) for name in names):
            if not isinstance(loop.target, jinja2.nodes.Name):
                raise _Unrecognised
            yield loop.target.name


@lru_cache(maxsize=64)
def _detect_content_format(source: str) -> str:
    try:
        root = _ENV.parse(source)
    except Exception:
        return "string"
    try:
        message_names = list(_loop_targets(root, _aliases(root, "messages")))
        next(_loop_targets(root, message_names, "content"))
    except StopIteration:
        return "string"
    except _Unrecognised:
        return "string"
    return "openai"


# ---------------------------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    """The user-facing text of an error raised while compiling or rendering a template.

    Callers add their own "chat template error" prefix, so none is added here.
    """
    if isinstance(exc, _RaisedByTemplate):
        return str(exc)  # the template's own message, as written
    if isinstance(exc, jinja2.exceptions.TemplateSyntaxError):
        return f"syntax error on line {exc.lineno}: {exc.message}"
    if isinstance(exc, jinja2.exceptions.TemplateError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class ChatTemplates:
    """A model's chat templates (name -> source) and the variables they are rendered with."""

    def __init__(
        self,
        templates: dict[str, str],
        special_tokens: dict[str, str],
        default_kwargs: dict | None = None,
    ):
        self.templates = dict(templates)
        self.special_tokens = dict(special_tokens)
        self.default_kwargs = dict(default_kwargs or {})

    def select(self, template_name: str | None, tools) -> str:
        """The source of the template to use (transformers' rule for several named templates)."""
        if not self.templates:
            raise TemplateError(
                "this model has no chat template; start the server with --chat-template FILE "
                "or send one in the request's chat_template"
            )
        if template_name is not None:
            try:
                return self.templates[template_name]
            except KeyError:
                names = ", ".join(sorted(self.templates))
                raise TemplateError(f"unknown chat template {template_name!r}; this model has: {names}") from None
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        names = ", ".join(sorted(self.templates))
        raise TemplateError(
            f"this model has several chat templates and none is named 'default'; choose one of: {names}"
        )

    def content_format(self, template_source: str) -> str:
        """``"openai"`` when the template loops over a message's content, else ``"string"`` (as vLLM)."""
        return _detect_content_format(template_source)

    def render(
        self,
        messages: list[dict],
        *,
        tools: list | None = None,
        documents: list | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        template_name: str | None = None,
        template_source: str | None = None,
        kwargs: dict | None = None,
    ) -> str:
        source = template_source if template_source is not None else self.select(template_name, tools)
        template = _compile(source)
        chat = _prepare_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise TemplateError(
                "continue_final_message and add_generation_prompt cannot both be set: continue_final_message "
                "continues the final message, add_generation_prompt starts a new assistant message"
            )
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, Mapping) for tool in tools):
                raise TemplateError("tools must be a list of JSON schema objects")
            tools = _plain(tools)
        if documents is not None:
            if not isinstance(documents, (list, tuple)) or not all(isinstance(doc, Mapping) for doc in documents):
                raise TemplateError("documents must be a list of objects with 'title' and 'text' keys")
            documents = _plain(documents)
        variables = {**self.special_tokens, **self.default_kwargs, **(kwargs or {})}
        if clash := sorted(_RESERVED_VARIABLES & variables.keys()):
            raise TemplateError(f"chat template kwargs cannot set {', '.join(clash)}")
        variables = _plain(variables)

        final_text = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = _tag_final_message(chat, field, source)
        try:
            rendered = template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as exc:  # whatever the template does wrong is the request's error
            raise TemplateError(_describe(exc)) from None
        if final_text is not None:
            rendered = _cut_at_tag(rendered, final_text)
        return rendered


def render_conversation(templates: ChatTemplates, conversation: dict) -> str:
    """Render a conversation file (../shared/fixtures/conversations format) to the prompt string.

    Its ``messages`` are already in the template (HuggingFace) format, so they go to the template as
    they are, like ``tokenizer.apply_chat_template(messages, tools=..., **template_kwargs)``.
    """
    if not isinstance(conversation, Mapping):
        raise TemplateError("a conversation must be a JSON object with 'messages'")
    messages = conversation.get("messages")
    if not isinstance(messages, list):
        raise TemplateError("a conversation needs 'messages', a list of message objects")
    kwargs = conversation.get("template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise TemplateError("'template_kwargs' must be an object")
    return templates.render(
        messages,
        tools=conversation.get("tools"),
        documents=conversation.get("documents"),
        add_generation_prompt=bool(conversation.get("add_generation_prompt", False)),
        continue_final_message=conversation.get("continue_final_message", False) or False,
        template_name=conversation.get("template_name"),
        kwargs=dict(kwargs),
    )
