"""Validation of structured-output specs, for the tokenizer workers: :func:`check`.

The workers refuse a bad spec with an HTTP 400 before anything reaches an engine; the message is
meant for the API user. This is not a full metaschema or engine-grammar validator: it catches
what users actually get wrong (a misspelt type, a ``required: true`` inside a property, an
unresolvable ``$ref``, a lookahead in a regex, an undefined grammar rule, ...).
:func:`compile_spec` parses and checks a (kind, spec) once, memoized in a small LRU, and hands
the parsed spec to whoever writes instances of it (:mod:`scheduler_client.structured.generate`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from scheduler_client.protocol import STRUCTURED_KINDS, Structured
from scheduler_client.structured.grammar import Grammar
from scheduler_client.structured.spec import (
    JSON_TYPES,
    MAX_COUNT,
    MAX_NESTING,
    NUMBER_KEYS,
    SpecProblem,
    StructuredError,
    compile_regex,
    is_number,
    is_type,
    parse_regex,
    resolve_ref,
    show,
)

__all__ = ["check", "choice_problem", "compile_spec"]


def check(s: Structured, where: str | None = None) -> None:
    """Raise :class:`StructuredError` if ``s`` is not a usable spec.

    ``where`` prefixes the message with the request field the spec came from, e.g.
    ``"response_format.json_schema.schema"``; by default the kind.
    """
    kind = s.kind
    if kind == "choice":
        problem = choice_problem(s.choices)
    elif kind not in STRUCTURED_KINDS:
        problem = f"unknown kind {kind!r}; expected one of {', '.join(STRUCTURED_KINDS)}"
    else:
        problem = compile_spec(kind, s.spec)[1]
    if problem is not None:
        raise StructuredError(problem, kind if where is None else where)
    if s.whitespace_pattern is not None:
        problem = whitespace_problem(s.whitespace_pattern)
        if problem is not None:
            raise StructuredError(problem, "whitespace_pattern")


def whitespace_problem(pattern) -> str | None:
    """What is wrong with a whitespace pattern (protocol 1.2's ``Structured.whitespace_pattern``), or None:
    it must be a regex of the dialect ``regex`` specs use, which an engine compiles into its JSON grammar."""
    if not isinstance(pattern, str):
        return f"must be a string, got {show(pattern)}"
    return parse_regex(pattern)[1]


def choice_problem(choices) -> str | None:
    """What is wrong with a ``choice`` spec's list, or None."""
    if not isinstance(choices, list) or not choices:
        return "needs a non-empty list of strings to choose from"
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            return f"choice [{i}] must be a string, got {show(c)}"
    return None


@functools.lru_cache(maxsize=256)
def compile_spec(kind: str, spec: str) -> tuple[Any, str | None]:
    """(the parsed spec, None) or (None, problem detail). Memoized: it runs per request.

    The parsed spec: a JSON schema's document, a :class:`Regex`, a :class:`Grammar`, a structural
    tag's document (None for ``json_object``).
    """
    try:
        if kind == "json_schema":
            schema = _load_json(spec)
            if schema is False:
                raise SpecProblem("", "the schema false accepts nothing")
            if not isinstance(schema, (dict, bool)):
                raise SpecProblem("", f"the schema must be a JSON object, got {show(schema)}")
            _SchemaChecker(schema).check(schema, "", 0)
            return schema, None
        if kind == "json_object":
            return None, None
        if kind == "regex":
            if not isinstance(spec, str):
                raise SpecProblem("", "the pattern must be a string")
            return compile_regex(spec), None
        if kind == "grammar":
            return Grammar(spec), None
        if kind == "structural_tag":
            tag = _load_json(spec)
            _check_structural_tag(tag)
            return tag, None
    except SpecProblem as exc:
        return None, exc.detail()
    except RecursionError:
        return None, "nested too deeply"
    return None, f"unknown kind {kind!r}"


# =========================================================================== JSON text


def _load_json(spec: str) -> Any:
    if not isinstance(spec, str) or not spec.strip():
        raise SpecProblem("", "is empty; expected JSON text")
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise SpecProblem("", f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise SpecProblem("", "the JSON is nested too deeply") from None


# =========================================================================== JSON schema

_SCHEMA_KEYS = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "propertyNames",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_COUNT_KEYS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
_MIN_MAX = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
    ("minimum", "maximum"),
    ("minContains", "maxContains"),
)


def _key_path(path: str, key: str) -> str:
    return (
        f"{path}.{key}"
        if key.replace("_", "").replace("$", "").replace("-", "").isalnum()
        else f"{path}[{json.dumps(key)}]"
    )


class _SchemaChecker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def check(self, node: Any, path: str, depth: int) -> None:
        if depth > MAX_NESTING:
            raise SpecProblem(path, f"the schema is nested more than {MAX_NESTING} levels deep")
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise SpecProblem(path, f"a schema must be an object or a boolean, got {show(node)}")
        t = node.get("type")
        if "type" in node:
            if isinstance(t, str):
                if t not in JSON_TYPES:
                    raise SpecProblem(path, f"'type' must be one of {', '.join(JSON_TYPES)}, got {show(t)}")
            elif isinstance(t, list) and t and all(isinstance(x, str) for x in t):
                for x in t:
                    if x not in JSON_TYPES:
                        raise SpecProblem(path, f"'type' must list names among {', '.join(JSON_TYPES)}, got {show(x)}")
                if len(set(t)) != len(t):
                    raise SpecProblem(path, f"'type' lists a type twice: {show(t)}")
            else:
                raise SpecProblem(path, f"'type' must be a string or list of strings, got {show(t)}")
        for key in _SCHEMA_MAPS:
            if key in node:
                value = node[key]
                if not isinstance(value, dict):
                    raise SpecProblem(path, f"'{key}' must be an object mapping names to schemas, got {show(value)}")
                for name, sub in value.items():
                    self.check(sub, _key_path(f"{path}.{key}", name), depth + 1)
        if "patternProperties" in node:
            value = node["patternProperties"]
            if not isinstance(value, dict):
                raise SpecProblem(
                    path, f"'patternProperties' must be an object mapping regexes to schemas, got {show(value)}"
                )
            for pattern, sub in value.items():
                _, problem = parse_regex(pattern)
                if problem is not None:
                    raise SpecProblem(path, f"'patternProperties' key {pattern!r}: {problem}")
                self.check(sub, _key_path(f"{path}.patternProperties", pattern), depth + 1)
        for key in _SCHEMA_KEYS:
            if key in node:
                value = node[key]
                if key in ("items", "additionalItems") and isinstance(value, list):  # draft 4-2019 tuple form
                    for i, sub in enumerate(value):
                        self.check(sub, f"{path}.{key}[{i}]", depth + 1)
                else:
                    self.check(value, f"{path}.{key}", depth + 1)
        if "prefixItems" in node:
            value = node["prefixItems"]
            if not isinstance(value, list):
                raise SpecProblem(path, f"'prefixItems' must be a list of schemas, got {show(value)}")
            for i, sub in enumerate(value):
                self.check(sub, f"{path}.prefixItems[{i}]", depth + 1)
        for key in _SCHEMA_LISTS:
            if key in node:
                value = node[key]
                if not isinstance(value, list) or not value:
                    raise SpecProblem(path, f"'{key}' must be a non-empty list of schemas, got {show(value)}")
                for i, sub in enumerate(value):
                    self.check(sub, f"{path}.{key}[{i}]", depth + 1)
        if "required" in node:
            value = node["required"]
            if isinstance(value, bool):
                raise SpecProblem(
                    path,
                    f"'required' must be a list of property names, got {show(value)}; it belongs to "
                    'the object schema, e.g. {"type": "object", "required": ["name"]}',
                )
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise SpecProblem(path, f"'required' must be a list of property names (strings), got {show(value)}")
        if "enum" in node:
            value = node["enum"]
            if not isinstance(value, list) or not value:
                raise SpecProblem(path, f"'enum' must be a non-empty list of values, got {show(value)}")
        for key in NUMBER_KEYS:
            if key in node:
                value = node[key]
                if key.startswith("exclusive") and isinstance(value, bool):
                    continue  # draft 4
                if not is_number(value):
                    raise SpecProblem(path, f"'{key}' must be a number, got {show(value)}")
                if key == "multipleOf" and value <= 0:
                    raise SpecProblem(path, f"'multipleOf' must be greater than 0, got {show(value)}")
        for key in _COUNT_KEYS:
            if key in node:
                value = node[key]
                if not (is_number(value) and float(value).is_integer() and value >= 0):
                    raise SpecProblem(path, f"'{key}' must be a non-negative integer, got {show(value)}")
                if key.startswith("min") and value > MAX_COUNT:
                    raise SpecProblem(path, f"'{key}' {value} is too large (at most {MAX_COUNT})")
        for low, high in _MIN_MAX:
            lo, hi = node.get(low), node.get(high)
            if is_number(lo) and is_number(hi) and lo > hi:
                raise SpecProblem(
                    path, f"'{low}' {show(lo)} is greater than '{high}' {show(hi)}: nothing can satisfy both"
                )
        lo, hi = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
        if is_number(lo) and is_number(hi) and lo >= hi:
            raise SpecProblem(path, f"'exclusiveMinimum' {show(lo)} is not below 'exclusiveMaximum' {show(hi)}")
        if "pattern" in node:
            value = node["pattern"]
            if not isinstance(value, str):
                raise SpecProblem(path, f"'pattern' must be a string, got {show(value)}")
            _, problem = parse_regex(value)
            if problem is not None:
                raise SpecProblem(path, f"'pattern' {value!r}: {problem}")
        if "format" in node and not isinstance(node["format"], str):
            raise SpecProblem(path, f"'format' must be a string, got {show(node['format'])}")
        if "uniqueItems" in node and not isinstance(node["uniqueItems"], bool):
            raise SpecProblem(path, f"'uniqueItems' must be true or false, got {show(node['uniqueItems'])}")
        if "$ref" in node:
            resolve_ref(self.root, node["$ref"], path)
        props = node.get("properties")
        if (
            node.get("additionalProperties") is False
            and isinstance(node.get("required"), list)
            and not node.get("patternProperties")
        ):
            for name in node["required"]:
                if not isinstance(props, dict) or name not in props:
                    raise SpecProblem(
                        path,
                        f"required property {name!r} is not in 'properties' and additionalProperties is "
                        "false, so no object can satisfy the schema",
                    )
        if isinstance(t, str) and "enum" in node:
            if not any(is_type(v, t) for v in node["enum"]):
                raise SpecProblem(path, f"no value of 'enum' is of type {t!r}")


# =========================================================================== structural tags

_FORMAT_TYPES = (
    "const_string",
    "json_schema",
    "any_text",
    "grammar",
    "regex",
    "qwen_xml_parameter",
    "sequence",
    "or",
    "tag",
    "triggered_tags",
    "token_triggered_tags",
    "tags_with_separator",
    "optional",
    "plus",
    "star",
    "token",
    "exclude_token",
    "any_tokens",
    "repeat",
    "dispatch",
    "token_dispatch",
)


def _need(node: dict, key: str, path: str, what: str, test) -> Any:
    if key not in node:
        raise SpecProblem(path, f"needs '{key}' ({what})")
    value = node[key]
    if not test(value):
        raise SpecProblem(path, f"'{key}' must be {what}, got {show(value)}")
    return value


def _is_str_list(v: Any, nonempty: bool = False) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v) and (bool(v) or not nonempty)


def _is_token(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or isinstance(v, str)


def _check_structural_tag(tag: Any) -> None:
    if not isinstance(tag, dict):
        raise SpecProblem("", f"must be a JSON object, got {show(tag)}")
    if "type" in tag and tag["type"] != "structural_tag":
        raise SpecProblem("", f"'type' must be \"structural_tag\", got {show(tag['type'])}")
    if "format" in tag:
        _check_format(tag["format"], "format", 0)
        return
    if "structures" not in tag:
        raise SpecProblem("", "needs 'format' (or the older 'structures' with 'triggers')")
    structures = _need(
        tag, "structures", "", "a non-empty list of {begin, schema, end}", lambda v: isinstance(v, list) and bool(v)
    )
    triggers = _need(tag, "triggers", "", "a non-empty list of strings", lambda v: _is_str_list(v, True) and all(v))
    for i, item in enumerate(structures):
        path = f"structures[{i}]"
        if not isinstance(item, dict):
            raise SpecProblem(path, f"must be an object with begin, schema and end, got {show(item)}")
        begin = _need(item, "begin", path, "a string", lambda v: isinstance(v, str))
        _need(item, "end", path, "a string", lambda v: isinstance(v, str))
        schema = _need(item, "schema", path, "a JSON schema", lambda v: isinstance(v, (dict, bool)))
        _SchemaChecker(schema).check(schema, f"{path}.schema", 0)
        if not any(begin.startswith(t) for t in triggers):
            raise SpecProblem(path, f"'begin' {begin!r} does not start with any of the triggers {show(triggers)}")


def _check_format(node: Any, path: str, depth: int) -> None:
    if depth > MAX_NESTING:
        raise SpecProblem(path, f"formats nested more than {MAX_NESTING} deep")
    if not isinstance(node, dict):
        raise SpecProblem(path, f"a format must be an object with a 'type', got {show(node)}")
    kind = node.get("type")
    if kind not in _FORMAT_TYPES:
        raise SpecProblem(path, f"'type' must be one of {', '.join(_FORMAT_TYPES)}, got {show(kind)}")
    _check_format_body(node, kind, path, depth)


def _check_tag(node: Any, path: str, depth: int) -> None:
    if not isinstance(node, dict):
        raise SpecProblem(path, f"a tag must be an object with begin, content and end, got {show(node)}")
    if node.get("type", "tag") != "tag":
        raise SpecProblem(path, f"'type' must be \"tag\", got {show(node.get('type'))}")
    _check_format_body(node, "tag", path, depth)


def _check_format_body(node: dict, kind: str, path: str, depth: int) -> None:
    if kind == "const_string":
        _need(node, "value", path, "a string", lambda v: isinstance(v, str))
    elif kind in ("json_schema", "qwen_xml_parameter"):
        schema = _need(node, "json_schema", path, "a JSON schema", lambda v: isinstance(v, (dict, bool)))
        _SchemaChecker(schema).check(schema, f"{path}.json_schema", 0)
        if "style" in node and not isinstance(node["style"], str):
            raise SpecProblem(path, f"'style' must be a string, got {show(node['style'])}")
    elif kind == "any_text":
        if "excludes" in node and not _is_str_list(node["excludes"]):
            raise SpecProblem(path, f"'excludes' must be a list of strings, got {show(node['excludes'])}")
    elif kind == "grammar":
        grammar = _need(node, "grammar", path, "an EBNF grammar (a string)", lambda v: isinstance(v, str))
        try:
            Grammar(grammar)
        except SpecProblem as exc:
            raise SpecProblem(f"{path}.grammar", exc.message) from None
    elif kind == "regex":
        pattern = _need(node, "pattern", path, "a regular expression (a string)", lambda v: isinstance(v, str))
        compile_regex(pattern, f"{path}.pattern")
    elif kind in ("sequence", "or"):
        elements = _need(
            node, "elements", path, "a non-empty list of formats", lambda v: isinstance(v, list) and bool(v)
        )
        for i, sub in enumerate(elements):
            _check_format(sub, f"{path}.elements[{i}]", depth + 1)
    elif kind == "tag":
        _need(
            node,
            "begin",
            path,
            "a string or a token format",
            lambda v: isinstance(v, str) or (isinstance(v, dict) and v.get("type") == "token"),
        )
        _need(
            node,
            "end",
            path,
            "a string, a list of strings or a token format",
            lambda v: isinstance(v, str) or _is_str_list(v, True) or (isinstance(v, dict) and v.get("type") == "token"),
        )
        _need(node, "content", path, "a format", lambda v: isinstance(v, dict))
        _check_format(node["content"], f"{path}.content", depth + 1)
    elif kind in ("triggered_tags", "token_triggered_tags", "tags_with_separator"):
        tags = _need(node, "tags", path, "a non-empty list of tags", lambda v: isinstance(v, list) and bool(v))
        for i, sub in enumerate(tags):
            _check_tag(sub, f"{path}.tags[{i}]", depth + 1)
        if kind == "triggered_tags":
            triggers = _need(
                node, "triggers", path, "a non-empty list of strings", lambda v: _is_str_list(v, True) and all(v)
            )
            for i, sub in enumerate(tags):
                begin = sub["begin"]
                if isinstance(begin, str) and not any(begin.startswith(t) for t in triggers):
                    raise SpecProblem(
                        f"{path}.tags[{i}]",
                        f"'begin' {begin!r} does not start with any of the triggers {show(triggers)}",
                    )
        elif kind == "token_triggered_tags":
            _need(
                node,
                "trigger_tokens",
                path,
                "a non-empty list of token IDs or strings",
                lambda v: isinstance(v, list) and bool(v) and all(_is_token(x) for x in v),
            )
        else:
            _need(node, "separator", path, "a string", lambda v: isinstance(v, str))
    elif kind in ("optional", "plus", "star"):
        _need(node, "content", path, "a format", lambda v: isinstance(v, dict))
        _check_format(node["content"], f"{path}.content", depth + 1)
    elif kind == "repeat":
        lo = _need(
            node,
            "min",
            path,
            "a non-negative integer",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT,
        )
        _need(
            node,
            "max",
            path,
            "an integer >= min, or -1 for no limit",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and (v == -1 or lo <= v),
        )
        _need(node, "content", path, "a format", lambda v: isinstance(v, dict))
        _check_format(node["content"], f"{path}.content", depth + 1)
    elif kind == "token":
        _need(node, "token", path, "a token ID or string", _is_token)
    elif kind in ("exclude_token", "any_tokens"):
        if "exclude_tokens" in node and not (
            isinstance(node["exclude_tokens"], list) and all(_is_token(x) for x in node["exclude_tokens"])
        ):
            raise SpecProblem(
                path, f"'exclude_tokens' must be a list of token IDs or strings, got {show(node['exclude_tokens'])}"
            )
    elif kind in ("dispatch", "token_dispatch"):
        rules = _need(node, "rules", path, "a list of [pattern, format] pairs", lambda v: isinstance(v, list))
        for i, rule in enumerate(rules):
            if not (isinstance(rule, list) and len(rule) == 2 and _is_token(rule[0])):
                raise SpecProblem(f"{path}.rules[{i}]", f"must be a [pattern, format] pair, got {show(rule)}")
            _check_format(rule[1], f"{path}.rules[{i}][1]", depth + 1)
