"""Structured-output specs (protocol 1.1 ``Generate.structured``): validation, and instances.

Shared by the tokenizer workers, which refuse a bad spec with an HTTP 400 before anything
reaches an engine, and by the simulated scheduler, which "generates" a text the spec accepts.

* :func:`check` raises :class:`StructuredError` for a spec an engine would refuse or could
  never satisfy, with a message meant for the API user. It is not a full metaschema or
  engine-grammar validator; it catches what users actually get wrong (a misspelt type, a
  ``required: true`` inside a property, an unresolvable ``$ref``, a lookahead in a regex, an
  undefined grammar rule, ...). Results are memoized per (kind, spec) in a small LRU.
* :func:`example` returns a text the spec accepts, drawn with the given ``random.Random``
  (deterministic for its state). Best effort where the spec language is richer than the
  generator (JSON Schema ``format``s, ``not``, grammar lookaheads), exact for the common cases.

The kinds (``protocol.STRUCTURED_KINDS``):

* ``json_schema``: ``spec`` is a JSON Schema as JSON text (an object, or ``true``);
  references must be local (``#``, ``#/$defs/...``, ``#/definitions/...``, any JSON pointer
  into the document).
* ``json_object``: any JSON object; ``spec`` is ignored.
* ``regex``: Python ``re`` syntax without what constrained-decoding backends cannot do:
  backreferences, lookarounds, conditionals, atomic groups / possessive quantifiers and
  word boundaries are refused. The whole output matches (``re.fullmatch``).
* ``grammar``: the GBNF/xgrammar EBNF dialect: rules ``name ::= expr`` (names of letters,
  digits, ``_``, ``-`` and ``.``; a rule may span lines, a new one starts where ``name ::=``
  appears), double-quoted strings with escapes (``\\n \\t \\r \\\\ \\" \\' \\xHH \\uHHHH
  \\UHHHHHHHH`` ...), character classes ``[a-z]`` / ``[^...]``, rule references, ``( )``,
  ``|``, postfix ``*`` ``+`` ``?`` ``{m}`` ``{m,}`` ``{m,n}`` (one per element), ``#``
  comments, and a lookahead ``(= ...)`` ending a rule. A ``root`` rule is required, every
  referenced rule must be defined, and root must be able to finish. ``.`` and single-quoted
  strings are not part of this dialect and are refused with a hint.
* ``choice``: ``choices`` is a non-empty list of strings; the output is one of them.
* ``structural_tag``: JSON text in vLLM's structural-tag format, either
  ``{"type": "structural_tag", "format": {...}}`` (xgrammar's formats: ``const_string``,
  ``json_schema``, ``any_text``, ``regex``, ``grammar``, ``sequence``, ``or``, ``tag``,
  ``triggered_tags``, ``tags_with_separator``, ``optional``, ``plus``, ``star``, ``repeat``,
  ...) or the older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``.
  Nested schemas, regexes and grammars are checked like the kinds above.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import re
import string
from re import _constants as _sre
from re import _parser as _sre_parse
from typing import Any
from urllib.parse import unquote

from scheduler_client.protocol import STRUCTURED_KINDS, Structured

__all__ = ["StructuredError", "check", "example"]

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


class _Bad(Exception):
    """Internal: a problem at a path inside the spec."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message

    def detail(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class _NoInstance(Exception):
    """Internal: the generator found nothing the spec accepts."""


def _show(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if key.replace("_", "").replace("$", "").replace("-", "").isalnum() else f"{path}[{json.dumps(key)}]"


# =========================================================================== public API


def check(s: Structured, where: str | None = None) -> None:
    """Raise :class:`StructuredError` if ``s`` is not a usable spec.

    ``where`` prefixes the message with the request field the spec came from, e.g.
    ``"response_format.json_schema.schema"``; by default the kind.
    """
    kind = s.kind
    if kind == "choice":
        problem = _choice_problem(s.choices)
    elif kind not in STRUCTURED_KINDS:
        problem = f"unknown kind {kind!r}; expected one of {', '.join(STRUCTURED_KINDS)}"
    else:
        problem = _compile(kind, s.spec)[1]
    if problem is not None:
        raise StructuredError(problem, kind if where is None else where)


def example(s: Structured, rng: random.Random) -> str:
    """A text that ``s`` accepts (raises :class:`StructuredError` for a bad or unsatisfiable spec)."""
    kind = s.kind
    if kind == "choice":
        problem = _choice_problem(s.choices)
        if problem is not None:
            raise StructuredError(problem, kind)
        return s.choices[rng.randrange(len(s.choices))]
    if kind not in STRUCTURED_KINDS:
        raise StructuredError(f"unknown kind {kind!r}", kind)
    compiled, problem = _compile(kind, s.spec)
    if problem is not None:
        raise StructuredError(problem, kind)
    try:
        if kind == "json_schema":
            return json.dumps(_SchemaGen(compiled, rng).instance())
        if kind == "json_object":
            return json.dumps(_small_object(rng))
        if kind == "regex":
            return _regex_example(compiled, rng)
        if kind == "grammar":
            return compiled.example(rng)
        return _TagGen(rng).text(compiled)
    except _NoInstance as exc:
        raise StructuredError(str(exc) or "the spec accepts no text the simulator can find", kind) from None
    except RecursionError:
        raise StructuredError("the spec is nested too deeply to write an instance", kind) from None


def _choice_problem(choices) -> str | None:
    if not isinstance(choices, list) or not choices:
        return "needs a non-empty list of strings to choose from"
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            return f"choice [{i}] must be a string, got {_show(c)}"
    return None


@functools.lru_cache(maxsize=256)
def _compile(kind: str, spec: str) -> tuple[Any, str | None]:
    """(the parsed spec, None) or (None, problem detail). Memoized: it runs per request."""
    try:
        if kind == "json_schema":
            schema = _load_json(spec)
            if schema is False:
                raise _Bad("", "the schema false accepts nothing")
            if not isinstance(schema, (dict, bool)):
                raise _Bad("", f"the schema must be a JSON object, got {_show(schema)}")
            _SchemaChecker(schema).check(schema, "", 0)
            return schema, None
        if kind == "json_object":
            return None, None
        if kind == "regex":
            if not isinstance(spec, str):
                raise _Bad("", "the pattern must be a string")
            return _compile_regex(spec), None
        if kind == "grammar":
            return _Grammar(spec), None
        if kind == "structural_tag":
            tag = _load_json(spec)
            _check_structural_tag(tag)
            return tag, None
    except _Bad as exc:
        return None, exc.detail()
    except RecursionError:
        return None, "nested too deeply"
    return None, f"unknown kind {kind!r}"


def _load_json(spec: str) -> Any:
    if not isinstance(spec, str) or not spec.strip():
        raise _Bad("", "is empty; expected JSON text")
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise _Bad("", f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise _Bad("", "the JSON is nested too deeply") from None


# =========================================================================== regular expressions

_UNSUPPORTED_OPS = {
    _sre.GROUPREF: "backreferences (\\1, (?P=name)) are not supported: constrained decoding needs a regular language",
    _sre.GROUPREF_EXISTS: "conditional groups (?(1)yes|no) are not supported",
    _sre.ASSERT: "lookahead/lookbehind assertions ((?=...), (?<=...)) are not supported",
    _sre.ASSERT_NOT: "negative lookahead/lookbehind assertions ((?!...), (?<!...)) are not supported",
    _sre.ATOMIC_GROUP: "atomic groups (?>...) are not supported",
    _sre.POSSESSIVE_REPEAT: "possessive quantifiers (*+, ++, ?+, {m,n}+) are not supported",
}
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT)


class _Regex:
    __slots__ = ("pattern", "tree", "compiled")

    def __init__(self, pattern: str, tree, compiled: re.Pattern) -> None:
        self.pattern = pattern
        self.tree = tree
        self.compiled = compiled


def _regex_problem_tree(pattern: str):
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
    return _Regex(pattern, tree, compiled), None


def _regex_unsupported(tree, depth: int) -> str | None:
    if depth > MAX_NESTING:
        return "the regular expression is nested too deeply"
    for op, av in tree:
        if op in _UNSUPPORTED_OPS:
            return _UNSUPPORTED_OPS[op]
        if op is _sre.AT and av in (_sre.AT_BOUNDARY, _sre.AT_NON_BOUNDARY):
            return "word boundaries (\\b, \\B) are not supported"
        if op in _REPEATS:
            lo, hi, sub = av
            if lo > MAX_COUNT or (hi is not _sre.MAXREPEAT and hi > MAX_COUNT):
                return f"repeat count {max(lo, hi if hi is not _sre.MAXREPEAT else 0)} is too large (at most {MAX_COUNT})"
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


def _compile_regex(pattern: str, path: str = "") -> _Regex:
    regex, problem = _regex_problem_tree(pattern)
    if problem is not None:
        raise _Bad(path, problem)
    return regex


# Characters examples are drawn from where a class leaves the choice open.
_POOL = string.ascii_letters + string.digits + " _-.,:;!?@#/+=*()<>'\"" + "éßπ中"
_CATEGORY_CHARS = {
    _sre.CATEGORY_DIGIT: string.digits,
    _sre.CATEGORY_NOT_DIGIT: string.ascii_letters + " _-",
    _sre.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    _sre.CATEGORY_NOT_WORD: " -.,!?:/",
    _sre.CATEGORY_SPACE: " ",
    _sre.CATEGORY_NOT_SPACE: string.ascii_letters + string.digits + "-_.",
}
_CATEGORY_TEST = {
    _sre.CATEGORY_DIGIT: str.isdecimal,
    _sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdecimal(),
    _sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    _sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
    _sre.CATEGORY_SPACE: str.isspace,
    _sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
}


def _in_items(ch: str, items) -> bool:
    code = ord(ch)
    for op, av in items:
        if op is _sre.LITERAL:
            if code == av:
                return True
        elif op is _sre.RANGE:
            if av[0] <= code <= av[1]:
                return True
        elif op is _sre.CATEGORY:
            test = _CATEGORY_TEST.get(av)
            if test is not None and test(ch):
                return True
    return False


def _pick_in_range(lo: int, hi: int, rng: random.Random) -> str:
    # prefer printable ASCII where the range has some
    plo, phi = max(lo, 0x21), min(hi, 0x7E)
    if plo <= phi and (rng.random() < 0.9 or lo == hi):
        return chr(rng.randint(plo, phi))
    code = rng.randint(lo, hi)
    if 0xD800 <= code <= 0xDFFF:  # surrogates cannot be encoded
        code = lo if not 0xD800 <= lo <= 0xDFFF else 0xE000
    return chr(code)


def _class_char(items, rng: random.Random) -> str:
    if items and items[0][0] is _sre.NEGATE:
        rest = items[1:]
        candidates = [c for c in _POOL if not _in_items(c, rest)]
        if candidates:
            return rng.choice(candidates)
        for code in range(0x20, 0x3000):
            if not _in_items(chr(code), rest):
                return chr(code)
        raise _NoInstance("a negated character class leaves nothing to match")
    op, av = items[rng.randrange(len(items))]
    if op is _sre.LITERAL:
        return chr(av)
    if op is _sre.RANGE:
        return _pick_in_range(av[0], av[1], rng)
    if op is _sre.CATEGORY:
        return rng.choice(_CATEGORY_CHARS.get(av, "a"))
    raise _NoInstance(f"unsupported class item {op}")


def _regex_gen(tree, rng: random.Random, out: list[str], depth: int) -> None:
    for op, av in tree:
        if op is _sre.LITERAL:
            out.append(chr(av))
        elif op is _sre.NOT_LITERAL:
            out.append(rng.choice([c for c in _POOL if ord(c) != av]))
        elif op is _sre.ANY:
            out.append(rng.choice(_POOL))
        elif op is _sre.IN:
            out.append(_class_char(av, rng))
        elif op is _sre.BRANCH:
            _regex_gen(av[1][rng.randrange(len(av[1]))], rng, out, depth + 1)
        elif op is _sre.SUBPATTERN:
            _regex_gen(av[-1], rng, out, depth + 1)
        elif op in _REPEATS:
            lo, hi, sub = av
            top = lo + 3 if hi is _sre.MAXREPEAT else min(hi, lo + 3)
            for _ in range(rng.randint(lo, top)):
                _regex_gen(sub, rng, out, depth + 1)
        elif op is _sre.AT:
            pass  # anchors: the example is the whole text
        else:
            raise _NoInstance(f"cannot write an instance of regex construct {op}")


def _regex_example(regex: _Regex, rng: random.Random, tries: int = 24) -> str:
    for _ in range(tries):
        out: list[str] = []
        _regex_gen(regex.tree, rng, out, 0)
        text = "".join(out)
        if regex.compiled.fullmatch(text):
            return text
    raise _NoInstance(f"found no text matching the regular expression {regex.pattern!r}")


# =========================================================================== JSON schema: checking

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SCHEMA_KEYS = ("additionalProperties", "items", "additionalItems", "contains", "not", "propertyNames", "if",
                "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
               "minContains", "maxContains")
_MIN_MAX = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
            ("minimum", "maximum"), ("minContains", "maxContains"))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _resolve(root: Any, ref: str, path: str = "") -> Any:
    """The schema a local $ref points at; _Bad if it is not local or does not resolve."""
    if not isinstance(ref, str):
        raise _Bad(path, f"'$ref' must be a string, got {_show(ref)}")
    if ref == "#" or ref == "":
        return root
    if not ref.startswith("#/"):
        raise _Bad(path, f"'$ref' {ref!r} is not a local reference: only references into this schema "
                         "(\"#\", \"#/$defs/Name\", \"#/definitions/Name\") are supported")
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise _Bad(path, f"'$ref' {ref!r} does not resolve: there is no {part!r} in the schema")
    if not isinstance(node, (dict, bool)):
        raise _Bad(path, f"'$ref' {ref!r} points at {_show(node)}, which is not a schema")
    return node


class _SchemaChecker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def check(self, node: Any, path: str, depth: int) -> None:
        if depth > MAX_NESTING:
            raise _Bad(path, f"the schema is nested more than {MAX_NESTING} levels deep")
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise _Bad(path, f"a schema must be an object or a boolean, got {_show(node)}")
        t = node.get("type")
        if "type" in node:
            if isinstance(t, str):
                if t not in _TYPES:
                    raise _Bad(path, f"'type' must be one of {', '.join(_TYPES)}, got {_show(t)}")
            elif isinstance(t, list) and t and all(isinstance(x, str) for x in t):
                for x in t:
                    if x not in _TYPES:
                        raise _Bad(path, f"'type' must list names among {', '.join(_TYPES)}, got {_show(x)}")
                if len(set(t)) != len(t):
                    raise _Bad(path, f"'type' lists a type twice: {_show(t)}")
            else:
                raise _Bad(path, f"'type' must be a string or list of strings, got {_show(t)}")
        for key in _SCHEMA_MAPS:
            if key in node:
                value = node[key]
                if not isinstance(value, dict):
                    raise _Bad(path, f"'{key}' must be an object mapping names to schemas, got {_show(value)}")
                for name, sub in value.items():
                    self.check(sub, _key_path(f"{path}.{key}", name), depth + 1)
        if "patternProperties" in node:
            value = node["patternProperties"]
            if not isinstance(value, dict):
                raise _Bad(path, f"'patternProperties' must be an object mapping regexes to schemas, got {_show(value)}")
            for pattern, sub in value.items():
                _, problem = _regex_problem_tree(pattern)
                if problem is not None:
                    raise _Bad(path, f"'patternProperties' key {pattern!r}: {problem}")
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
                raise _Bad(path, f"'prefixItems' must be a list of schemas, got {_show(value)}")
            for i, sub in enumerate(value):
                self.check(sub, f"{path}.prefixItems[{i}]", depth + 1)
        for key in _SCHEMA_LISTS:
            if key in node:
                value = node[key]
                if not isinstance(value, list) or not value:
                    raise _Bad(path, f"'{key}' must be a non-empty list of schemas, got {_show(value)}")
                for i, sub in enumerate(value):
                    self.check(sub, f"{path}.{key}[{i}]", depth + 1)
        if "required" in node:
            value = node["required"]
            if isinstance(value, bool):
                raise _Bad(path, f"'required' must be a list of property names, got {_show(value)}; it belongs to "
                                 "the object schema, e.g. {\"type\": \"object\", \"required\": [\"name\"]}")
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise _Bad(path, f"'required' must be a list of property names (strings), got {_show(value)}")
        if "enum" in node:
            value = node["enum"]
            if not isinstance(value, list) or not value:
                raise _Bad(path, f"'enum' must be a non-empty list of values, got {_show(value)}")
        for key in _NUMBER_KEYS:
            if key in node:
                value = node[key]
                if key.startswith("exclusive") and isinstance(value, bool):
                    continue  # draft 4
                if not _is_number(value):
                    raise _Bad(path, f"'{key}' must be a number, got {_show(value)}")
                if key == "multipleOf" and value <= 0:
                    raise _Bad(path, f"'multipleOf' must be greater than 0, got {_show(value)}")
        for key in _COUNT_KEYS:
            if key in node:
                value = node[key]
                if not (_is_number(value) and float(value).is_integer() and value >= 0):
                    raise _Bad(path, f"'{key}' must be a non-negative integer, got {_show(value)}")
                if key.startswith("min") and value > MAX_COUNT:
                    raise _Bad(path, f"'{key}' {value} is too large (at most {MAX_COUNT})")
        for low, high in _MIN_MAX:
            lo, hi = node.get(low), node.get(high)
            if _is_number(lo) and _is_number(hi) and lo > hi:
                raise _Bad(path, f"'{low}' {_show(lo)} is greater than '{high}' {_show(hi)}: nothing can satisfy both")
        lo, hi = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
        if _is_number(lo) and _is_number(hi) and lo >= hi:
            raise _Bad(path, f"'exclusiveMinimum' {_show(lo)} is not below 'exclusiveMaximum' {_show(hi)}")
        if "pattern" in node:
            value = node["pattern"]
            if not isinstance(value, str):
                raise _Bad(path, f"'pattern' must be a string, got {_show(value)}")
            _, problem = _regex_problem_tree(value)
            if problem is not None:
                raise _Bad(path, f"'pattern' {value!r}: {problem}")
        if "format" in node and not isinstance(node["format"], str):
            raise _Bad(path, f"'format' must be a string, got {_show(node['format'])}")
        if "uniqueItems" in node and not isinstance(node["uniqueItems"], bool):
            raise _Bad(path, f"'uniqueItems' must be true or false, got {_show(node['uniqueItems'])}")
        if "$ref" in node:
            _resolve(self.root, node["$ref"], path)
        props = node.get("properties")
        if node.get("additionalProperties") is False and isinstance(node.get("required"), list) \
                and not node.get("patternProperties"):  # fmt: skip
            for name in node["required"]:
                if not isinstance(props, dict) or name not in props:
                    raise _Bad(path, f"required property {name!r} is not in 'properties' and additionalProperties is "
                                     "false, so no object can satisfy the schema")
        if isinstance(t, str) and "enum" in node:
            if not any(_is_type(v, t) for v in node["enum"]):
                raise _Bad(path, f"no value of 'enum' is of type {t!r}")


# =========================================================================== JSON schema: instances


def _is_type(v: Any, t: str) -> bool:
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


def _json_eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_eq(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _bounds(s: dict) -> tuple[float | None, bool, float | None, bool]:
    """(lower, lower exclusive, upper, upper exclusive) of a number schema."""
    lo, hi = s.get("minimum"), s.get("maximum")
    lo = lo if _is_number(lo) else None
    hi = hi if _is_number(hi) else None
    lo_ex = hi_ex = False
    emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if emin is True and lo is not None:
        lo_ex = True
    elif _is_number(emin) and (lo is None or emin >= lo):
        lo, lo_ex = emin, True
    if emax is True and hi is not None:
        hi_ex = True
    elif _is_number(emax) and (hi is None or emax <= hi):
        hi, hi_ex = emax, True
    return lo, lo_ex, hi, hi_ex


def _multiple_ok(v: float, m: float) -> bool:
    if isinstance(m, float) or isinstance(v, float):
        q = v / m
        return math.isfinite(q) and int(q) == q
    return v % m == 0


def _valid(v: Any, s: Any, root: Any, depth: int = 0) -> bool:
    """Whether v is an instance of schema s (the keywords this module generates for)."""
    if s is True or depth > 200:
        return True
    if s is False:
        return False
    if not isinstance(s, dict):
        return True
    if "$ref" in s:
        try:
            target = _resolve(root, s["$ref"])
        except _Bad:
            return False
        if not _valid(v, target, root, depth + 1):
            return False
    t = s.get("type")
    if t is not None:
        if not any(_is_type(v, x) for x in ([t] if isinstance(t, str) else t)):
            return False
    if "enum" in s and not any(_json_eq(v, e) for e in s["enum"]):
        return False
    if "const" in s and not _json_eq(v, s["const"]):
        return False
    if _is_type(v, "number"):
        lo, lo_ex, hi, hi_ex = _bounds(s)
        if lo is not None and (v < lo or (lo_ex and v == lo)):
            return False
        if hi is not None and (v > hi or (hi_ex and v == hi)):
            return False
        m = s.get("multipleOf")
        if _is_number(m) and m > 0 and not _multiple_ok(v, m):
            return False
    elif isinstance(v, str):
        if len(v) < s.get("minLength", 0) or ("maxLength" in s and len(v) > s["maxLength"]):
            return False
        if "pattern" in s:
            try:
                if re.search(s["pattern"], v) is None:
                    return False
            except re.error:
                return False
    elif isinstance(v, list):
        if len(v) < s.get("minItems", 0) or ("maxItems" in s and len(v) > s["maxItems"]):
            return False
        if s.get("uniqueItems"):
            for i in range(len(v)):
                for j in range(i):
                    if _json_eq(v[i], v[j]):
                        return False
        items = s.get("items")
        prefix = s.get("prefixItems")
        rest_schema = items
        if isinstance(items, list):
            prefix, rest_schema = items, s.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        for i, x in enumerate(v):
            sub = prefix[i] if i < len(prefix) else rest_schema
            if sub is not None and not _valid(x, sub, root, depth + 1):
                return False
        if "contains" in s:
            hits = sum(1 for x in v if _valid(x, s["contains"], root, depth + 1))
            if hits < s.get("minContains", 1) or ("maxContains" in s and hits > s["maxContains"]):
                return False
    elif isinstance(v, dict):
        if len(v) < s.get("minProperties", 0) or ("maxProperties" in s and len(v) > s["maxProperties"]):
            return False
        required = s.get("required")
        if isinstance(required, list) and any(r not in v for r in required):
            return False
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        patterns = s.get("patternProperties") if isinstance(s.get("patternProperties"), dict) else {}
        extra = s.get("additionalProperties", True)
        names = s.get("propertyNames")
        for key, x in v.items():
            if names is not None and not _valid(key, names, root, depth + 1):
                return False
            matched = False
            if key in props:
                matched = True
                if not _valid(x, props[key], root, depth + 1):
                    return False
            for pattern, sub in patterns.items():
                if re.search(pattern, key):
                    matched = True
                    if not _valid(x, sub, root, depth + 1):
                        return False
            if not matched and not _valid(x, extra, root, depth + 1):
                return False
    if "allOf" in s and not all(_valid(v, sub, root, depth + 1) for sub in s["allOf"]):
        return False
    if "anyOf" in s and not any(_valid(v, sub, root, depth + 1) for sub in s["anyOf"]):
        return False
    if "oneOf" in s and sum(1 for sub in s["oneOf"] if _valid(v, sub, root, depth + 1)) != 1:
        return False
    if "not" in s and _valid(v, s["not"], root, depth + 1):
        return False
    if "if" in s:
        branch = s.get("then", True) if _valid(v, s["if"], root, depth + 1) else s.get("else", True)
        if not _valid(v, branch, root, depth + 1):
            return False
    return True


_WORDS = ("alpha", "river", "stone", "light", "amber", "north", "quiet", "cedar", "delta", "ember", "field",
          "harbor", "island", "meadow", "orbit", "pixel", "signal", "timber", "velvet", "willow")
_LOWER_KEYS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER_KEYS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf", "not", "if", "then", "else")


def _type_list(t: Any) -> list[str] | None:
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return list(t)
    return None


def _merge(a: Any, b: Any) -> Any:
    """A schema (roughly) accepting what both a and b accept; False when they clearly conflict."""
    if a is False or b is False:
        return False
    if a is True:
        return dict(b) if isinstance(b, dict) else {}
    if b is True:
        return dict(a)
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
            continue
        old = out[key]
        if key == "properties" and isinstance(old, dict) and isinstance(value, dict):
            merged = dict(old)
            for name, sub in value.items():
                merged[name] = {"allOf": [old[name], sub]} if name in old else sub
            out[key] = merged
        elif key == "required" and isinstance(old, list) and isinstance(value, list):
            out[key] = list(dict.fromkeys([*old, *value]))
        elif key == "type":
            ta, tb = _type_list(old) or list(_TYPES), _type_list(value) or list(_TYPES)
            both = [t for t in ta if t in tb]
            if "integer" not in both and (("integer" in ta and "number" in tb) or ("number" in ta and "integer" in tb)):
                both.append("integer")
            if not both:
                return False
            out[key] = both
        elif key in _LOWER_KEYS and _is_number(old) and _is_number(value):
            out[key] = max(old, value)
        elif key in _UPPER_KEYS and _is_number(old) and _is_number(value):
            out[key] = min(old, value)
        elif key == "enum" and isinstance(old, list) and isinstance(value, list):
            kept = [x for x in old if any(_json_eq(x, y) for y in value)]
            if not kept:
                return False
            out[key] = kept
        elif key in ("items", "additionalProperties", "contains", "propertyNames") and old != value:
            out[key] = {"allOf": [old, value]}
        else:
            out[key] = value
    return out


def _mentions_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_mentions_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_ref(v) for v in node)
    return False


class _SchemaGen:
    SOFT_DEPTH = 5  # past this nesting: required properties only, minimal arrays, non-recursive branches
    HARD_DEPTH = 48
    MAX_VALUES = 5000

    def __init__(self, root: Any, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.size = 0  # values written so far (a budget, like the depth)

    def instance(self) -> Any:
        last = None
        for _ in range(16):
            self.size = 0
            try:
                value = self.value(self.root, 0)
            except _NoInstance as exc:
                last = exc
                continue
            if _valid(value, self.root, self.root):
                return value
            last = value
        if isinstance(last, _NoInstance):
            raise last
        return last  # best effort

    def minimal(self, depth: int) -> bool:
        return depth > self.SOFT_DEPTH or self.size > 200

    def flatten(self, s: Any, depth: int) -> Any:
        """s without $ref / allOf / anyOf / oneOf: references followed, a branch picked."""
        if depth > self.HARD_DEPTH:
            raise _NoInstance("the schema has no finite instance (its references recurse without end)")
        if s is True:
            return {}
        if s is False:
            return False
        out: Any = {k: v for k, v in s.items() if k not in ("$ref", "allOf", "anyOf", "oneOf", "$defs", "definitions")}
        if "$ref" in s:
            target = self.flatten(_resolve(self.root, s["$ref"]), depth + 1)
            out = _merge(target, out)
        for sub in s.get("allOf") or ():
            out = _merge(out, self.flatten(sub, depth + 1))
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if branches:
                out = _merge(out, self.flatten(self.pick_branch(branches, depth), depth + 1))
        return out

    def pick_branch(self, branches: list, depth: int) -> Any:
        if self.minimal(depth):
            plain = [b for b in branches if not _mentions_ref(b)]
            if plain:
                return plain[self.rng.randrange(len(plain))]
        return branches[self.rng.randrange(len(branches))]

    def value(self, s: Any, depth: int) -> Any:
        if depth > self.HARD_DEPTH:
            raise _NoInstance("the schema has no finite instance (it requires values nested without end)")
        self.size += 1
        if self.size > self.MAX_VALUES:
            raise _NoInstance(f"every instance of the schema has more than {self.MAX_VALUES} values")
        checked = isinstance(s, dict) and any(k in s for k in _COMBINATORS)
        tries = 8 if checked else 1
        value = None
        for attempt in range(tries):
            flat = self.flatten(s, depth)
            if flat is False:
                if attempt + 1 < tries:
                    continue
                raise _NoInstance("the schema accepts no value here (its parts contradict each other)")
            value = self.flat_value(flat, depth)
            if not checked or _valid(value, s, self.root):
                return value
        return value

    def flat_value(self, s: dict, depth: int) -> Any:
        rng = self.rng
        if "const" in s:
            return copy.deepcopy(s["const"])
        if "enum" in s and s["enum"]:
            options = s["enum"]
            types = _type_list(s.get("type"))
            if types:
                options = [v for v in options if any(_is_type(v, t) for t in types)] or options
            return copy.deepcopy(options[rng.randrange(len(options))])
        types = _type_list(s.get("type"))
        if types:
            t = self.pick_type(types, depth)
        elif any(k in s for k in ("properties", "required", "additionalProperties", "patternProperties",
                                  "minProperties")):  # fmt: skip
            t = "object"
        elif any(k in s for k in ("items", "prefixItems", "minItems", "maxItems", "contains")):
            t = "array"
        elif any(k in s for k in ("pattern", "minLength", "maxLength", "format")):
            t = "string"
        elif any(k in s for k in _NUMBER_KEYS):
            t = "number"
        else:
            t = rng.choice(("string", "integer", "boolean") if self.minimal(depth) else
                           ("string", "integer", "boolean", "number", "object", "array"))
        return getattr(self, "gen_" + t)(s, depth)

    def pick_type(self, types: list[str], depth: int) -> str:
        if len(types) == 1:
            return types[0]
        if self.minimal(depth):
            for t in ("null", "boolean", "integer", "number", "string"):
                if t in types:
                    return t
        non_null = [t for t in types if t != "null"]
        if non_null and (len(non_null) == len(types) or self.rng.random() < 0.8):
            return non_null[self.rng.randrange(len(non_null))]
        return types[self.rng.randrange(len(types))]

    # ---------------------------------------------------------------- scalars

    def gen_null(self, s: dict, depth: int) -> None:
        return None

    def gen_boolean(self, s: dict, depth: int) -> bool:
        return self.rng.random() < 0.5

    def gen_integer(self, s: dict, depth: int) -> int:
        rng = self.rng
        lo, lo_ex, hi, hi_ex = _bounds(s)
        ilo = None if lo is None else (math.floor(lo) + 1 if lo_ex and float(lo).is_integer() else math.ceil(lo))
        ihi = None if hi is None else (math.ceil(hi) - 1 if hi_ex and float(hi).is_integer() else math.floor(hi))
        if ilo is None and ihi is None:
            ilo, ihi = 0, 100
        elif ilo is None:
            ilo = ihi - 100
        elif ihi is None:
            ihi = ilo + 100
        if ilo > ihi:
            raise _NoInstance("no integer lies within minimum/maximum")
        m = s.get("multipleOf")
        if _is_number(m) and m > 0:
            if float(m).is_integer():
                m = int(m)
                kmin, kmax = -((-ilo) // m), ihi // m
                if kmin > kmax:
                    raise _NoInstance("no multiple of 'multipleOf' lies within minimum/maximum")
                return rng.randint(kmin, min(kmax, kmin + 50)) * m
            for _ in range(50):
                v = rng.randint(ilo, min(ihi, ilo + 1000))
                if _multiple_ok(v, m):
                    return v
        return rng.randint(ilo, ihi)

    def gen_number(self, s: dict, depth: int) -> float | int:
        rng = self.rng
        m = s.get("multipleOf")
        if rng.random() < 0.4 or (_is_number(m) and float(m).is_integer()):
            try:
                return self.gen_integer(s, depth)
            except _NoInstance:
                pass
        lo, lo_ex, hi, hi_ex = _bounds(s)
        if lo is None and hi is None:
            lo, hi = -100.0, 100.0
        elif lo is None:
            lo = hi - 100.0
        elif hi is None:
            hi = lo + 100.0
        if _is_number(m) and m > 0:
            kmin, kmax = math.ceil(lo / m), math.floor(hi / m)
            for _ in range(50):
                k = rng.randint(kmin, max(kmin, min(kmax, kmin + 50)))
                v = round(k * m, 10)
                if _valid(v, {**s, "type": "number"}, self.root):
                    return v
            raise _NoInstance("no multiple of 'multipleOf' lies within minimum/maximum")
        for _ in range(20):
            v = round(rng.uniform(lo, hi), 2)
            if (lo < v or (v == lo and not lo_ex)) and (v < hi or (v == hi and not hi_ex)):
                return v
        mid = (lo + hi) / 2
        if lo < mid < hi or (mid == lo == hi and not lo_ex and not hi_ex):
            return mid
        raise _NoInstance("no number lies within minimum/maximum")

    def gen_string(self, s: dict, depth: int) -> str:
        rng = self.rng
        lo = int(s.get("minLength", 0))
        hi = s.get("maxLength")
        hi = int(hi) if _is_number(hi) else None
        pattern = s.get("pattern")
        if isinstance(pattern, str):
            regex = _compile_regex(pattern)
            text = ""
            for _ in range(12):
                text = _regex_example(regex, rng)
                if len(text) >= lo and (hi is None or len(text) <= hi):
                    return text
            return text
        fmt = s.get("format")
        if isinstance(fmt, str):
            text = self.formatted(fmt)
            if text is not None and len(text) >= lo and (hi is None or len(text) <= hi):
                return text
        top = hi if hi is not None else max(lo, 1) + 24
        target = rng.randint(lo, max(lo, min(top, lo + 24)))
        words = []
        while sum(len(w) + 1 for w in words) < target + 1:
            words.append(_WORDS[rng.randrange(len(_WORDS))])
        text = " ".join(words)[:target]
        if text.endswith(" "):
            text = text[:-1] + "s"
        return text

    def formatted(self, fmt: str) -> str | None:
        rng = self.rng
        y, mo, d = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28)
        h, mi, sec = rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)
        if fmt == "date-time":
            return f"{y:04d}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{sec:02d}Z"
        if fmt == "date":
            return f"{y:04d}-{mo:02d}-{d:02d}"
        if fmt == "time":
            return f"{h:02d}:{mi:02d}:{sec:02d}Z"
        if fmt == "duration":
            return f"P{rng.randint(1, 30)}DT{h}H"
        if fmt in ("email", "idn-email"):
            return f"{rng.choice(_WORDS)}.{rng.choice(_WORDS)}@example.com"
        if fmt in ("hostname", "idn-hostname"):
            return f"{rng.choice(_WORDS)}.example.com"
        if fmt in ("uri", "url", "iri", "uri-reference", "iri-reference"):
            return f"https://example.com/{rng.choice(_WORDS)}/{rng.randint(1, 999)}"
        if fmt == "uuid":
            h32 = "%032x" % rng.getrandbits(128)
            return f"{h32[:8]}-{h32[8:12]}-4{h32[13:16]}-a{h32[17:20]}-{h32[20:]}"
        if fmt == "ipv4":
            return ".".join(str(rng.randint(1, 254)) for _ in range(4))
        if fmt == "ipv6":
            return ":".join("%x" % rng.randint(1, 0xFFFF) for _ in range(8))
        return None

    # ---------------------------------------------------------------- containers

    def gen_array(self, s: dict, depth: int) -> list:
        rng = self.rng
        items = s.get("items")
        prefix = s.get("prefixItems")
        rest: Any = items if items is not None else True
        if isinstance(items, list):
            prefix, rest = items, s.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        lo = int(s.get("minItems", 0))
        contains = s.get("contains")
        if contains is not None:
            lo = max(lo, int(s.get("minContains", 1)))
        hi = s.get("maxItems")
        hi = int(hi) if _is_number(hi) else None
        if rest is False:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if self.minimal(depth):
            n = lo
        else:
            top = lo + 3 if hi is None else min(hi, lo + 3)
            n = rng.randint(lo, max(lo, top))
        if hi is not None:
            n = min(n, hi)
        unique = s.get("uniqueItems") is True
        out: list = []
        for i in range(n):
            sub = prefix[i] if i < len(prefix) else rest
            if contains is not None and i < int(s.get("minContains", 1)):
                sub = {"allOf": [sub, contains]}
            value = self.value(sub, depth + 1)
            if unique:
                for _ in range(12):
                    if not any(_json_eq(value, x) for x in out):
                        break
                    value = self.value(sub, depth + 1)
            out.append(value)
        return out

    def gen_object(self, s: dict, depth: int) -> dict:
        rng = self.rng
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        required = [r for r in s.get("required") or () if isinstance(r, str)]
        patterns = s.get("patternProperties") if isinstance(s.get("patternProperties"), dict) else {}
        extra = s.get("additionalProperties", True)
        hi = s.get("maxProperties")
        hi = int(hi) if _is_number(hi) else None
        lo = int(s.get("minProperties", 0))
        minimal = self.minimal(depth)
        room = None if hi is None else hi - len(set(required))
        out: dict = {}
        for name, sub in props.items():
            if name in required:
                out[name] = self.value(sub, depth + 1)
            elif not minimal and (room is None or room > 0) and rng.random() < 0.5:
                out[name] = self.value(sub, depth + 1)
                if room is not None:
                    room -= 1
        for name in required:
            if name not in out:
                out[name] = self.value(self.schema_for(name, patterns, extra), depth + 1)
        i = 0
        while len(out) < lo and i < lo + 20:
            i += 1
            for name, sub in props.items():  # optional properties first
                if name not in out:
                    out[name] = self.value(sub, depth + 1)
                    break
            else:
                if patterns:
                    pattern = list(patterns)[i % len(patterns)]
                    name = _regex_example(_compile_regex(pattern), rng)
                    sub = patterns[pattern]
                elif extra is not False:
                    name, sub = f"key{i}", extra
                else:
                    raise _NoInstance("'minProperties' needs more properties than the schema allows")
                if name not in out:
                    out[name] = self.value(sub, depth + 1)
        return out

    @staticmethod
    def schema_for(name: str, patterns: dict, extra: Any) -> Any:
        for pattern, sub in patterns.items():
            if re.search(pattern, name):
                return sub
        return extra if extra is not False else True


def _small_object(rng: random.Random) -> dict:
    """json_object: a small object of a few simple values."""
    out: dict = {}
    for key in rng.sample(("answer", "name", "count", "ok", "tags", "score"), rng.randint(1, 4)):
        if key in ("answer", "name"):
            out[key] = f"{rng.choice(_WORDS)} {rng.choice(_WORDS)}"
        elif key == "count":
            out[key] = rng.randint(0, 100)
        elif key == "ok":
            out[key] = rng.random() < 0.5
        elif key == "tags":
            out[key] = [rng.choice(_WORDS) for _ in range(rng.randint(0, 3))]
        else:
            out[key] = round(rng.uniform(0, 1), 3)
    return out


# =========================================================================== grammars (GBNF / xgrammar EBNF)

_INF = float("inf")
_NAME_START = set(string.ascii_letters + "_")
_NAME_CHARS = set(string.ascii_letters + string.digits + "_-.")
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "b": "\b", "f": "\f",
                   "v": "\v", "a": "\a", "e": "\x1b", "0": "\0"}
_CLASS_ESCAPES = {**_SIMPLE_ESCAPES, "[": "[", "]": "]", "-": "-", "^": "^", "/": "/"}
_HEX_ESCAPES = {"x": (1, 2), "u": (4, 4), "U": (8, 8)}

# Nodes: ("lit", text) ("cls", negated, ((lo, hi), ...)) ("ref", name, pos) ("seq", [nodes])
#        ("alt", [nodes]) ("rep", node, lo, hi or None)


class _Grammar:
    """A parsed EBNF grammar: rules, their shortest derivation heights, and an example writer."""

    SOFT_DEPTH = 6
    BUDGET = 300  # characters, after which derivations take the shortest way out

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise _Bad("", "the grammar is empty; expected rules such as root ::= \"yes\" | \"no\"")
        self.text = text
        self.i = 0
        self.rules: dict[str, Any] = {}
        self.rule_lines: dict[str, int] = {}
        self.refs: list[tuple[str, int]] = []
        self.parse()
        self.heights = self.compute_heights()
        self.alt_heights: dict[int, list[float]] = {}  # per alternation node: its options' heights
        if self.heights["root"] == _INF:
            raise _Bad("", "the root rule can never finish: every way through it needs a rule that recurses "
                           "without end (or an empty character class)")

    # ---------------------------------------------------------------- parsing

    def where(self, pos: int) -> str:
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return f"line {line}, column {col}"

    def fail(self, message: str, pos: int | None = None):
        raise _Bad("", f"{self.where(self.i if pos is None else pos)}: {message}")

    def skip(self) -> None:
        text, n = self.text, len(self.text)
        while self.i < n:
            ch = text[self.i]
            if ch in " \t\r\n":
                self.i += 1
            elif ch == "#":
                end = text.find("\n", self.i)
                self.i = n if end < 0 else end + 1
            else:
                break

    def name_at(self, pos: int) -> str | None:
        text = self.text
        if pos >= len(text) or text[pos] not in _NAME_START:
            return None
        end = pos + 1
        while end < len(text) and text[end] in _NAME_CHARS:
            end += 1
        return text[pos:end]

    def starts_rule(self, pos: int) -> bool:
        """Whether a definition ``name ::=`` starts at pos."""
        name = self.name_at(pos)
        if name is None:
            return False
        j = pos + len(name)
        while j < len(self.text) and self.text[j] in " \t":
            j += 1
        return self.text.startswith("::=", j)

    def parse(self) -> None:
        text = self.text
        self.skip()
        while self.i < len(text):
            start = self.i
            name = self.name_at(start)
            if name is None:
                self.fail(f"expected a rule definition such as root ::= ..., found {text[start]!r}")
            self.i += len(name)
            while self.i < len(text) and text[self.i] in " \t":
                self.i += 1
            if not text.startswith("::=", self.i):
                self.fail(f"expected '::=' after the rule name {name!r}")
            self.i += 3
            if name in self.rules:
                self.fail(f"rule {name!r} is defined twice (first on line {self.rule_lines[name]})", start)
            self.rule_lines[name] = text.count("\n", 0, start) + 1
            self.rules[name] = self.alternatives(0, top=True)
            self.skip()
            if self.i < len(text) and not self.starts_rule(self.i):
                ch = text[self.i]
                self.fail(f"unexpected {ch!r}" + (" (no '(' to close)" if ch == ")" else ""))
        if not self.rules:
            raise _Bad("", "the grammar holds only comments; expected rules such as root ::= \"yes\" | \"no\"")
        if "root" not in self.rules:
            raise _Bad("", "there is no rule named 'root' (the grammar starts at root ::= ...)")
        for name, pos in self.refs:
            if name not in self.rules:
                self.fail(f"rule {name!r} is not defined", pos)

    def alternatives(self, depth: int, top: bool = False) -> Any:
        if depth > MAX_NESTING:
            self.fail(f"parentheses nested more than {MAX_NESTING} deep")
        options = [self.sequence(depth, top)]
        while True:
            self.skip()
            if self.i < len(self.text) and self.text[self.i] == "|":
                self.i += 1
                options.append(self.sequence(depth, top))
            else:
                break
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self, depth: int, top: bool) -> Any:
        text = self.text
        items = []
        while True:
            self.skip()
            if self.i >= len(text) or text[self.i] in "|)" or self.starts_rule(self.i):
                break
            if text.startswith("(=", self.i) or (text[self.i] == "(" and text[self.i + 1:].lstrip(" \t").startswith("=")):
                start = self.i
                if not top or depth:
                    self.fail("a lookahead (= ...) may only end a rule", start)
                self.i = text.index("=", self.i) + 1
                self.sequence(depth + 1, False)  # checked, not used by the example writer
                self.skip()
                if self.i < len(text) and text[self.i] == "|":
                    self.fail("a lookahead (= ...) cannot hold alternatives '|'")
                if self.i >= len(text) or text[self.i] != ")":
                    self.fail("expected ')' to close the lookahead", self.i)
                self.i += 1
                self.skip()
                if self.i < len(text) and not self.starts_rule(self.i):
                    self.fail("a lookahead (= ...) may only end a rule", start)
                break
            items.append(self.postfix(self.element(depth)))
        if not items:
            found = "the end of the grammar" if self.i >= len(text) else repr(text[self.i])
            if self.i < len(text) and self.starts_rule(self.i):
                found = "the next rule"
            self.fail(f"expected an element (a string, a character class, a rule name or '('), found {found}"
                      + ("; write \"\" for the empty string" if self.i >= len(text) or text[self.i] in "|)" else ""))
        return items[0] if len(items) == 1 else ("seq", items)

    def element(self, depth: int) -> Any:
        text = self.text
        ch = text[self.i]
        if ch == '"':
            return ("lit", self.string())
        if ch == "[":
            return self.char_class()
        if ch == "(":
            open_at = self.i
            self.i += 1
            self.skip()
            if self.i < len(text) and text[self.i] == ")":
                self.i += 1
                return ("lit", "")
            node = self.alternatives(depth + 1)
            self.skip()
            if self.i >= len(text) or text[self.i] != ")":
                self.fail(f"expected ')' to close the '(' at {self.where(open_at)}")
            self.i += 1
            return node
        name = self.name_at(self.i)
        if name is not None:
            self.refs.append((name, self.i))
            self.i += len(name)
            return ("ref", name)
        if ch == ".":
            self.fail("'.' (any character) is not supported in this grammar dialect; use a character class "
                      "such as [^\\n]")
        if ch == "'":
            self.fail("strings are written in double quotes (\"...\")")
        if ch in "*+?{":
            self.fail(f"{ch!r} must follow an element (to repeat a repetition, add parentheses)")
        self.fail(f"unexpected character {ch!r}")

    def postfix(self, node: Any) -> Any:
        text = self.text
        self.skip()
        if self.i >= len(text) or text[self.i] not in "*+?{":
            return node
        op = text[self.i]
        op_at = self.i
        self.i += 1
        if op == "*":
            node = ("rep", node, 0, None)
        elif op == "+":
            node = ("rep", node, 1, None)
        elif op == "?":
            node = ("rep", node, 0, 1)
        else:
            lo = self.integer()
            hi: int | None = lo
            self.skip()
            if self.i < len(text) and text[self.i] == ",":
                self.i += 1
                self.skip()
                hi = None if self.i < len(text) and text[self.i] == "}" else self.integer()
            self.skip()
            if self.i >= len(text) or text[self.i] != "}":
                self.fail("expected '}' to close the repetition {m,n}")
            self.i += 1
            if lo > MAX_COUNT or (hi is not None and hi > MAX_COUNT):
                self.fail(f"repetition count is too large (at most {MAX_COUNT})", op_at)
            if hi is not None and lo > hi:
                self.fail(f"repetition {{{lo},{hi}}}: the lower bound is larger than the upper bound", op_at)
            node = ("rep", node, lo, hi)
        self.skip()
        if self.i < len(text) and text[self.i] in "*+?{":
            self.fail("two repetition operators in a row; add parentheses, e.g. (x?)*")
        return node

    def integer(self) -> int:
        self.skip()
        start = self.i
        while self.i < len(self.text) and self.text[self.i].isdigit():
            self.i += 1
        if start == self.i:
            self.fail("expected a number in the repetition {m,n} (write {0,n} for 'at most n')")
        return int(self.text[start:self.i])

    def escape(self, table: dict[str, str]) -> str:
        text = self.text
        start = self.i
        self.i += 1  # the backslash
        if self.i >= len(text):
            self.fail("the grammar ends inside an escape sequence", start)
        ch = text[self.i]
        if ch in table:
            self.i += 1
            return table[ch]
        if ch in _HEX_ESCAPES:
            lo, hi = _HEX_ESCAPES[ch]
            j = self.i + 1
            while j < len(text) and j - self.i - 1 < hi and text[j] in string.hexdigits:
                j += 1
            digits = text[self.i + 1:j]
            if len(digits) < lo:
                self.fail(f"\\{ch} needs {lo} hex digit{'s' if lo > 1 else ''}", start)
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                self.fail(f"\\{ch}{digits} is not a valid character", start)
            self.i = j
            return chr(code)
        self.fail(f"invalid escape sequence \\{ch}", start)

    def string(self) -> str:
        text = self.text
        start = self.i
        self.i += 1
        out = []
        while True:
            if self.i >= len(text) or text[self.i] == "\n":
                self.fail("unterminated string (a string must close on its line)", start)
            ch = text[self.i]
            if ch == '"':
                self.i += 1
                return "".join(out)
            if ch == "\\":
                out.append(self.escape(_SIMPLE_ESCAPES))
            else:
                out.append(ch)
                self.i += 1

    def char_class(self) -> Any:
        text = self.text
        start = self.i
        self.i += 1
        negated = False
        if self.i < len(text) and text[self.i] == "^":
            negated = True
            self.i += 1
        ranges = []

        def one() -> str:
            if self.i >= len(text) or text[self.i] == "\n":
                self.fail("unterminated character class", start)
            if text[self.i] == "\\":
                return self.escape(_CLASS_ESCAPES)
            ch = text[self.i]
            self.i += 1
            return ch

        while True:
            if self.i >= len(text) or text[self.i] == "\n":
                self.fail("unterminated character class", start)
            if text[self.i] == "]":
                self.i += 1
                break
            lo = one()
            if self.i + 1 < len(text) and text[self.i] == "-" and text[self.i + 1] != "]":
                range_at = self.i
                self.i += 1
                hi = one()
                if ord(lo) > ord(hi):
                    self.fail(f"character range {lo!r}-{hi!r} is reversed", range_at)
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        return ("cls", negated, tuple(ranges))

    # ---------------------------------------------------------------- heights

    def compute_heights(self) -> dict[str, float]:
        """Per rule: 1 + the least nesting of rule expansions that derives a finite string (inf: none)."""
        heights = {name: _INF for name in self.rules}
        changed = True
        while changed:
            changed = False
            for name, body in self.rules.items():
                h = 1 + self.height(body, heights)
                if h < heights[name]:
                    heights[name] = h
                    changed = True
        return heights

    def height(self, node: Any, heights: dict[str, float]) -> float:
        kind = node[0]
        if kind == "lit":
            return 0
        if kind == "cls":
            return 0 if (node[1] or node[2]) else _INF
        if kind == "ref":
            return heights[node[1]]
        if kind == "seq":
            return max((self.height(x, heights) for x in node[1]), default=0)
        if kind == "alt":
            return min(self.height(x, heights) for x in node[1])
        if node[2] == 0:  # rep that may be empty
            return 0
        return self.height(node[1], heights)

    # ---------------------------------------------------------------- examples

    def example(self, rng: random.Random) -> str:
        out: list[str] = []
        self.count = 0
        self.gen(self.rules["root"], 0, rng, out)
        return "".join(out)

    def gen(self, node: Any, depth: int, rng: random.Random, out: list[str]) -> None:
        kind = node[0]
        if kind == "lit":
            out.append(node[1])
            self.count += len(node[1])
        elif kind == "cls":
            out.append(self.class_char(node[1], node[2], rng))
            self.count += 1
        elif kind == "ref":
            self.gen(self.rules[node[1]], depth + 1, rng, out)
        elif kind == "seq":
            for item in node[1]:
                self.gen(item, depth, rng, out)
        elif kind == "alt":
            heights = self.alt_heights.get(id(node))
            if heights is None:
                heights = self.alt_heights[id(node)] = [self.height(x, self.heights) for x in node[1]]
            if depth > self.SOFT_DEPTH or self.count > self.BUDGET:
                best = min(heights)
                options = [x for x, h in zip(node[1], heights) if h == best]
            else:
                options = [x for x, h in zip(node[1], heights) if h < _INF]
            self.gen(options[rng.randrange(len(options))], depth, rng, out)
        else:
            _, sub, lo, hi = node
            if lo == 0 and self.height(sub, self.heights) == _INF:
                return  # lo is 0 here, or this node would not have been chosen
            if depth > self.SOFT_DEPTH or self.count > self.BUDGET:
                n = lo
            else:
                n = rng.randint(lo, lo + 2 if hi is None else min(hi, lo + 2))
            for _ in range(n):
                self.gen(sub, depth, rng, out)

    @staticmethod
    def class_char(negated: bool, ranges: tuple, rng: random.Random) -> str:
        if not negated:
            lo, hi = ranges[rng.randrange(len(ranges))]
            return _pick_in_range(lo, hi, rng)
        candidates = [c for c in _POOL if not any(lo <= ord(c) <= hi for lo, hi in ranges)]
        if candidates:
            return candidates[rng.randrange(len(candidates))]
        for code in range(0x20, 0x110000):
            if not 0xD800 <= code <= 0xDFFF and not any(lo <= code <= hi for lo, hi in ranges):
                return chr(code)
        raise _NoInstance("a negated character class leaves nothing to match")


# =========================================================================== structural tags

_FORMAT_TYPES = ("const_string", "json_schema", "any_text", "grammar", "regex", "qwen_xml_parameter", "sequence",
                 "or", "tag", "triggered_tags", "token_triggered_tags", "tags_with_separator", "optional", "plus",
                 "star", "token", "exclude_token", "any_tokens", "repeat", "dispatch", "token_dispatch")


def _need(node: dict, key: str, path: str, what: str, test) -> Any:
    if key not in node:
        raise _Bad(path, f"needs '{key}' ({what})")
    value = node[key]
    if not test(value):
        raise _Bad(path, f"'{key}' must be {what}, got {_show(value)}")
    return value


def _is_str_list(v: Any, nonempty: bool = False) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v) and (bool(v) or not nonempty)


def _is_token(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or isinstance(v, str)


def _check_structural_tag(tag: Any) -> None:
    if not isinstance(tag, dict):
        raise _Bad("", f"must be a JSON object, got {_show(tag)}")
    if "type" in tag and tag["type"] != "structural_tag":
        raise _Bad("", f"'type' must be \"structural_tag\", got {_show(tag['type'])}")
    if "format" in tag:
        _check_format(tag["format"], "format", 0)
        return
    if "structures" not in tag:
        raise _Bad("", "needs 'format' (or the older 'structures' with 'triggers')")
    structures = _need(tag, "structures", "", "a non-empty list of {begin, schema, end}",
                       lambda v: isinstance(v, list) and bool(v))
    triggers = _need(tag, "triggers", "", "a non-empty list of strings",
                     lambda v: _is_str_list(v, True) and all(v))
    for i, item in enumerate(structures):
        path = f"structures[{i}]"
        if not isinstance(item, dict):
            raise _Bad(path, f"must be an object with begin, schema and end, got {_show(item)}")
        begin = _need(item, "begin", path, "a string", lambda v: isinstance(v, str))
        _need(item, "end", path, "a string", lambda v: isinstance(v, str))
        schema = _need(item, "schema", path, "a JSON schema", lambda v: isinstance(v, (dict, bool)))
        _SchemaChecker(schema).check(schema, f"{path}.schema", 0)
        if not any(begin.startswith(t) for t in triggers):
            raise _Bad(path, f"'begin' {begin!r} does not start with any of the triggers {_show(triggers)}")


def _check_format(node: Any, path: str, depth: int) -> None:
    if depth > MAX_NESTING:
        raise _Bad(path, f"formats nested more than {MAX_NESTING} deep")
    if not isinstance(node, dict):
        raise _Bad(path, f"a format must be an object with a 'type', got {_show(node)}")
    kind = node.get("type")
    if kind not in _FORMAT_TYPES:
        raise _Bad(path, f"'type' must be one of {', '.join(_FORMAT_TYPES)}, got {_show(kind)}")
    _check_format_body(node, kind, path, depth)


def _check_tag(node: Any, path: str, depth: int) -> None:
    if not isinstance(node, dict):
        raise _Bad(path, f"a tag must be an object with begin, content and end, got {_show(node)}")
    if node.get("type", "tag") != "tag":
        raise _Bad(path, f"'type' must be \"tag\", got {_show(node.get('type'))}")
    _check_format_body(node, "tag", path, depth)


def _check_format_body(node: dict, kind: str, path: str, depth: int) -> None:
    if kind == "const_string":
        _need(node, "value", path, "a string", lambda v: isinstance(v, str))
    elif kind in ("json_schema", "qwen_xml_parameter"):
        schema = _need(node, "json_schema", path, "a JSON schema", lambda v: isinstance(v, (dict, bool)))
        _SchemaChecker(schema).check(schema, f"{path}.json_schema", 0)
        if "style" in node and not isinstance(node["style"], str):
            raise _Bad(path, f"'style' must be a string, got {_show(node['style'])}")
    elif kind == "any_text":
        if "excludes" in node and not _is_str_list(node["excludes"]):
            raise _Bad(path, f"'excludes' must be a list of strings, got {_show(node['excludes'])}")
    elif kind == "grammar":
        grammar = _need(node, "grammar", path, "an EBNF grammar (a string)", lambda v: isinstance(v, str))
        try:
            _Grammar(grammar)
        except _Bad as exc:
            raise _Bad(f"{path}.grammar", exc.message) from None
    elif kind == "regex":
        pattern = _need(node, "pattern", path, "a regular expression (a string)", lambda v: isinstance(v, str))
        _compile_regex(pattern, f"{path}.pattern")
    elif kind in ("sequence", "or"):
        elements = _need(node, "elements", path, "a non-empty list of formats",
                         lambda v: isinstance(v, list) and bool(v))
        for i, sub in enumerate(elements):
            _check_format(sub, f"{path}.elements[{i}]", depth + 1)
    elif kind == "tag":
        _need(node, "begin", path, "a string or a token format",
              lambda v: isinstance(v, str) or (isinstance(v, dict) and v.get("type") == "token"))
        _need(node, "end", path, "a string, a list of strings or a token format",
              lambda v: isinstance(v, str) or _is_str_list(v, True) or (isinstance(v, dict) and v.get("type") == "token"))
        _need(node, "content", path, "a format", lambda v: isinstance(v, dict))
        _check_format(node["content"], f"{path}.content", depth + 1)
    elif kind in ("triggered_tags", "token_triggered_tags", "tags_with_separator"):
        tags = _need(node, "tags", path, "a non-empty list of tags", lambda v: isinstance(v, list) and bool(v))
        for i, sub in enumerate(tags):
            _check_tag(sub, f"{path}.tags[{i}]", depth + 1)
        if kind == "triggered_tags":
            triggers = _need(node, "triggers", path, "a non-empty list of strings",
                             lambda v: _is_str_list(v, True) and all(v))
            for i, sub in enumerate(tags):
                begin = sub["begin"]
                if isinstance(begin, str) and not any(begin.startswith(t) for t in triggers):
                    raise _Bad(f"{path}.tags[{i}]", f"'begin' {begin!r} does not start with any of the triggers "
                                                    f"{_show(triggers)}")
        elif kind == "token_triggered_tags":
            _need(node, "trigger_tokens", path, "a non-empty list of token IDs or strings",
                  lambda v: isinstance(v, list) and bool(v) and all(_is_token(x) for x in v))
        else:
            _need(node, "separator", path, "a string", lambda v: isinstance(v, str))
    elif kind in ("optional", "plus", "star"):
        _need(node, "content", path, "a format", lambda v: isinstance(v, dict))
        _check_format(node["content"], f"{path}.content", depth + 1)
    elif kind == "repeat":
        lo = _need(node, "min", path, "a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT)
        _need(node, "max", path, "an integer >= min, or -1 for no limit",
              lambda v: isinstance(v, int) and not isinstance(v, bool) and (v == -1 or lo <= v))
        _need(node, "content", path, "a format", lambda v: isinstance(v, dict))
        _check_format(node["content"], f"{path}.content", depth + 1)
    elif kind == "token":
        _need(node, "token", path, "a token ID or string", _is_token)
    elif kind in ("exclude_token", "any_tokens"):
        if "exclude_tokens" in node and not (isinstance(node["exclude_tokens"], list)
                                             and all(_is_token(x) for x in node["exclude_tokens"])):  # fmt: skip
            raise _Bad(path, f"'exclude_tokens' must be a list of token IDs or strings, got {_show(node['exclude_tokens'])}")
    elif kind in ("dispatch", "token_dispatch"):
        rules = _need(node, "rules", path, "a list of [pattern, format] pairs", lambda v: isinstance(v, list))
        for i, rule in enumerate(rules):
            if not (isinstance(rule, list) and len(rule) == 2 and _is_token(rule[0])):
                raise _Bad(f"{path}.rules[{i}]", f"must be a [pattern, format] pair, got {_show(rule)}")
            _check_format(rule[1], f"{path}.rules[{i}][1]", depth + 1)


_FILLER = ("Sure.", "Let me check.", "Here it is:", "One moment.", "Done.", "Okay, looking that up now.")


class _TagGen:
    """Texts for structural tags: free text around begin/content/end structures."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self, tag: dict) -> str:
        if "format" in tag:
            return self.fmt(tag["format"], 0)
        tags = [{"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
                for s in tag["structures"]]
        return self.fmt({"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}, 0)

    def filler(self, avoid: list[str]) -> str:
        options = [f for f in _FILLER if not any(a and a in f for a in avoid)]
        return options[self.rng.randrange(len(options))] if options else ""

    def tag(self, node: dict, depth: int) -> str:
        begin, end = node["begin"], node["end"]
        begin = begin if isinstance(begin, str) else self.token(begin)
        end = end if isinstance(end, str) else end[0] if isinstance(end, list) else self.token(end)
        return begin + self.fmt(node["content"], depth + 1) + end

    @staticmethod
    def token(node: dict) -> str:
        value = node.get("token")
        return value if isinstance(value, str) else ""

    def fmt(self, node: dict, depth: int) -> str:
        rng = self.rng
        if depth > MAX_NESTING:
            raise _NoInstance("structural tag nested too deeply")
        kind = node.get("type", "tag")
        if kind == "const_string":
            return node["value"]
        if kind in ("json_schema", "qwen_xml_parameter"):
            return json.dumps(_SchemaGen(node["json_schema"], rng).instance())  # JSON whatever the style
        if kind == "any_text":
            return self.filler(node.get("excludes") or [])
        if kind == "grammar":
            return _Grammar(node["grammar"]).example(rng)
        if kind == "regex":
            return _regex_example(_compile_regex(node["pattern"]), rng)
        if kind == "sequence":
            return "".join(self.fmt(x, depth + 1) for x in node["elements"])
        if kind == "or":
            elements = node["elements"]
            return self.fmt(elements[rng.randrange(len(elements))], depth + 1)
        if kind == "tag":
            return self.tag(node, depth)
        if kind in ("triggered_tags", "token_triggered_tags"):
            tags = node["tags"]
            avoid = [*node.get("triggers", []), *(t for t in node.get("trigger_tokens", []) if isinstance(t, str)),
                     *node.get("excludes", [])]
            count = 1 if node.get("stop_after_first") else rng.randint(0, 2)
            if node.get("at_least_one"):
                count = max(count, 1)
            parts = []
            if not node.get("at_least_one") or rng.random() < 0.5:
                parts.append(self.filler(avoid))
            for _ in range(count):
                parts.append(self.tag(tags[rng.randrange(len(tags))], depth))
            return "".join(parts)
        if kind == "tags_with_separator":
            tags = node["tags"]
            count = 1 if node.get("stop_after_first") else rng.randint(1 if node.get("at_least_one") else 0, 2)
            return node["separator"].join(self.tag(tags[rng.randrange(len(tags))], depth) for _ in range(count))
        if kind in ("optional", "plus", "star", "repeat"):
            lo, hi = {"optional": (0, 1), "plus": (1, 2), "star": (0, 2)}.get(kind, (0, 0))
            if kind == "repeat":
                lo = node["min"]
                hi = lo + 2 if node["max"] == -1 else min(node["max"], lo + 2)
            return "".join(self.fmt(node["content"], depth + 1) for _ in range(rng.randint(lo, hi)))
        if kind == "token":
            return self.token(node)
        if kind in ("exclude_token", "any_tokens"):
            return self.filler([t for t in node.get("exclude_tokens", []) if isinstance(t, str)])
        if kind in ("dispatch", "token_dispatch"):
            rules = node["rules"]
            if not rules:
                return self.filler(node.get("excludes") or [])
            pattern, content = rules[rng.randrange(len(rules))]
            avoid = [r[0] for r in rules if isinstance(r[0], str)] + list(node.get("excludes") or [])
            return self.filler(avoid) + (pattern if isinstance(pattern, str) else "") + self.fmt(content, depth + 1)
        raise _NoInstance(f"cannot write an instance of format {kind!r}")
