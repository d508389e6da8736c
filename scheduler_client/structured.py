"""The engine-independent checks of a structured-output spec (protocol 1.1 ``Generate.structured``).

The engine decides what a spec means: its grammar backend compiles it, and a spec it cannot compile
comes back as an ``error`` with ``param`` ``"structured"`` (docs/engines/scheduler-protocol.md §3.1). What
holds for every engine is checked here, in the tokenizer workers, before a request leaves: the kind
is known, JSON is valid where the kind is JSON text, ``choice`` is a non-empty list of strings, and
the spec stays under the size and nesting limits below. No regex, grammar or JSON Schema dialect is
judged here: backends differ on those (vLLM's xgrammar and guidance, SGLang's, llguidance in the
simulator), so one hand-written opinion would be wrong for some engine in both directions.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tokenmill.scheduler_client.protocol import STRUCTURED_KINDS, Structured

# The documented limits (docs/api/request-fields.md): far above any real spec, low enough that no
# backend is handed something that can exhaust its stack or memory before it compiles anything.
MAX_SPEC_CHARS = 256 * 1024  # the spec text (a schema's JSON, a regex, a grammar, a whitespace pattern)
MAX_CHOICES = 4096  # entries of a choice list ...
MAX_CHOICES_CHARS = 256 * 1024  # ... and their characters together
MAX_NESTING = 64  # arrays and objects inside each other in a JSON spec, and groups in a regex or grammar

_JSON_KINDS = ("json_schema", "structural_tag")

__all__ = ["MAX_CHOICES", "MAX_NESTING", "MAX_SPEC_CHARS", "StructuredError", "check", "whitespace_problem"]


class StructuredError(ValueError):
    """A spec no engine could use; ``where`` names the field, ``str()`` is the user-facing message."""

    def __init__(self, detail: str, where: str) -> None:
        self.detail = detail
        self.where = where
        super().__init__(f"{where}: {detail}")


def check(s: Structured, where: str | None = None) -> None:
    """Raise :class:`StructuredError` (naming ``where``, by default the kind) if ``s`` fails a check
    that holds for every engine."""
    where = s.kind if where is None else where
    problem = _problem(s)
    if problem is not None:
        raise StructuredError(problem, where)
    if s.whitespace_pattern is not None:
        problem = whitespace_problem(s.whitespace_pattern)
        if problem is not None:
            raise StructuredError(problem, "whitespace_pattern")


def whitespace_problem(pattern: Any) -> str | None:
    """What is wrong with a whitespace pattern (protocol 1.2), or None: a string (as vLLM's model takes it)
    under the size and nesting limits; the engine compiles it as a regex of its own dialect."""
    if not isinstance(pattern, str):
        return f"must be a string, got {type(pattern).__name__}"
    return _text_problem(pattern, "pattern", False, blank_ok=True)


def _problem(s: Structured) -> str | None:
    kind = s.kind
    if kind not in STRUCTURED_KINDS:
        return f"unknown kind {kind!r}; expected one of {', '.join(STRUCTURED_KINDS)}"
    if kind == "json_object":
        return None
    if kind == "choice":
        return _choice_problem(s.choices)
    problem = _text_problem(s.spec, "spec", kind in _JSON_KINDS)
    if problem is not None or kind not in _JSON_KINDS:
        return problem
    try:
        value = json.loads(s.spec)  # depth is checked first, so the parser never recurses past it
    except json.JSONDecodeError as exc:
        return f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
    if kind == "json_schema" and not isinstance(value, (dict, bool)):
        return f"a JSON schema is an object or a boolean, got {type(value).__name__}"
    if kind == "structural_tag" and not isinstance(value, dict):
        return f"a structural tag is a JSON object, got {type(value).__name__}"
    return None


def _choice_problem(choices: Any) -> str | None:
    if not isinstance(choices, list) or not choices:
        return "needs a non-empty list of strings to choose from"
    if len(choices) > MAX_CHOICES:
        return f"has {len(choices)} choices; at most {MAX_CHOICES} are accepted"
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            return f"choice [{i}] must be a string, got {type(c).__name__}"
    if sum(len(c) for c in choices) > MAX_CHOICES_CHARS:
        return f"the choices are longer than {MAX_CHOICES_CHARS} characters together"
    return None


def _text_problem(text: Any, what: str, is_json: bool, blank_ok: bool = False) -> str | None:
    if not isinstance(text, str) or not (blank_ok or text.strip()):
        return f"the {what} is empty"
    if len(text) > MAX_SPEC_CHARS:
        return f"the {what} has {len(text)} characters; at most {MAX_SPEC_CHARS} are accepted"
    depth = _nesting(text, is_json)
    if depth > MAX_NESTING:
        return f"the {what} nests brackets {depth} deep; at most {MAX_NESTING} levels are accepted"
    return None


@functools.lru_cache(maxsize=256)
def _nesting(text: str, is_json: bool) -> int:
    """The deepest nesting of ( [ { in ``text`` (not escaped with a backslash; in JSON, outside strings):
    a bound on the recursion any parser of it needs, whatever its dialect. Memoized: it runs per request."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"' and is_json:
            in_string = not in_string
        elif in_string:
            continue
        elif ch in "([{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest
