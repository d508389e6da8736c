"""The structured-output spec model that validation and generation share.

The error a bad spec raises (:class:`StructuredError`, and :class:`SpecProblem`, a problem at a
path inside the spec, which becomes one), the size limits, the regular-expression dialect
(Python ``re`` without what constrained decoding cannot do: patterns parse to a :class:`Regex`
or are refused here, for the workers and the simulator alike) and the JSON Schema basics both
sides read (types, local ``$ref`` resolution). The grammar dialect is in
:mod:`scheduler_client.structured.grammar`.
"""

from __future__ import annotations

import json
import math
import re
from re import _constants as _sre
from re import _parser as _sre_parse
from typing import Any
from urllib.parse import unquote

MAX_COUNT = 100_000  # the largest repeat count / length bound accepted (an instance must be writable)
MAX_NESTING = 64  # schema / grammar / structural-tag nesting


class StructuredError(ValueError):
    """A structured-output spec that cannot be used; ``str()`` is a user-facing message.

    ``where`` names the spec's field (as the caller passed it, or the kind); ``detail`` is the
    rest of the message (for JSON schemas it starts with the path inside the schema).
    """

    def __init__(self, detail: str, where: str | None = None) -> None:
        self.detail = detail
        self.where = where
        if where and detail.startswith("."):
            message = where + detail
        elif where:
            message = f"{where}: {detail}"
        else:
            message = detail.lstrip(".")
        super().__init__(message)


class SpecProblem(Exception):
    """Internal: a problem at a path inside the spec."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message

    def detail(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def show(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# =========================================================================== regular expressions

_UNSUPPORTED_OPS = {
    _sre.GROUPREF: "backreferences (\\1, (?P=name)) are not supported: constrained decoding needs a regular language",
    _sre.GROUPREF_EXISTS: "conditional groups (?(1)yes|no) are not supported",
    _sre.ASSERT: "lookahead/lookbehind assertions ((?=...), (?<=...)) are not supported",
    _sre.ASSERT_NOT: "negative lookahead/lookbehind assertions ((?!...), (?<!...)) are not supported",
    _sre.ATOMIC_GROUP: "atomic groups (?>...) are not supported",
    _sre.POSSESSIVE_REPEAT: "possessive quantifiers (*+, ++, ?+, {m,n}+) are not supported",
}
REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT)


class Regex:
    __slots__ = ("pattern", "tree", "compiled")

    def __init__(self, pattern: str, tree, compiled: re.Pattern) -> None:
        self.pattern = pattern
        self.tree = tree
        self.compiled = compiled


def parse_regex(pattern: str):
    """(tree, None) or (None, problem) for a pattern."""
    try:
        tree = _sre_parse.parse(pattern)
        compiled = re.compile(pattern)
    except re.error as exc:
        return None, f"invalid regular expression: {exc}"
    except (RecursionError, OverflowError, ValueError) as exc:
        return None, f"invalid regular expression: {exc}"
    problem = _regex_unsupported(tree, 0)
    if problem is not None:
        return None, problem
    return Regex(pattern, tree, compiled), None


def _regex_unsupported(tree, depth: int) -> str | None:
    if depth > MAX_NESTING:
        return "the regular expression is nested too deeply"
    for op, av in tree:
        if op in _UNSUPPORTED_OPS:
            return _UNSUPPORTED_OPS[op]
        if op is _sre.AT and av in (_sre.AT_BOUNDARY, _sre.AT_NON_BOUNDARY):
            return "word boundaries (\\b, \\B) are not supported"
        if op in REPEATS:
            lo, hi, sub = av
            if lo > MAX_COUNT or (hi is not _sre.MAXREPEAT and hi > MAX_COUNT):
                return (
                    f"repeat count {max(lo, hi if hi is not _sre.MAXREPEAT else 0)} is too large (at most {MAX_COUNT})"
                )
            subs = [sub]
        elif op is _sre.SUBPATTERN:
            subs = [av[-1]]
        elif op is _sre.BRANCH:
            subs = av[1]
        else:
            continue
        for sub in subs:
            problem = _regex_unsupported(sub, depth + 1)
            if problem is not None:
                return problem
    return None


def compile_regex(pattern: str, path: str = "") -> Regex:
    regex, problem = parse_regex(pattern)
    if problem is not None:
        raise SpecProblem(path, problem)
    return regex


# =========================================================================== JSON schema: the shared basics

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def resolve_ref(root: Any, ref: str, path: str = "") -> Any:
    """The schema a local $ref points at; SpecProblem if it is not local or does not resolve."""
    if not isinstance(ref, str):
        raise SpecProblem(path, f"'$ref' must be a string, got {show(ref)}")
    if ref == "#" or ref == "":
        return root
    if not ref.startswith("#/"):
        raise SpecProblem(
            path,
            f"'$ref' {ref!r} is not a local reference: only references into this schema "
            '("#", "#/$defs/Name", "#/definitions/Name") are supported',
        )
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SpecProblem(path, f"'$ref' {ref!r} does not resolve: there is no {part!r} in the schema")
    if not isinstance(node, (dict, bool)):
        raise SpecProblem(path, f"'$ref' {ref!r} points at {show(node)}, which is not a schema")
    return node


def is_type(v: Any, t: str) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "null":
        return v is None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return t == "number" or isinstance(v, int) or v.is_integer()
