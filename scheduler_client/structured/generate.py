"""Texts that structured-output specs accept, for the simulated scheduler: :func:`example`.

Drawn with the given ``random.Random`` (deterministic for its state). Best effort where the spec
language is richer than the generator (JSON Schema ``format``s, ``not``, grammar lookaheads),
exact for the common cases. A spec is validated first (:func:`~scheduler_client.structured.
validate.compile_spec`), so a bad one raises the :class:`StructuredError` the workers would.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import string
from re import _constants as _sre
from typing import Any

from scheduler_client.protocol import STRUCTURED_KINDS, Structured
from scheduler_client.structured.grammar import INF, Grammar
from scheduler_client.structured.spec import (
    JSON_TYPES,
    MAX_NESTING,
    NUMBER_KEYS,
    REPEATS,
    Regex,
    SpecProblem,
    StructuredError,
    compile_regex,
    is_number,
    is_type,
    resolve_ref,
)
from scheduler_client.structured.validate import choice_problem, compile_spec

__all__ = ["example"]


class _NoInstance(Exception):
    """The generator found nothing the spec accepts (an unsatisfiable spec, or one past its reach)."""


def example(s: Structured, rng: random.Random) -> str:
    """A text that ``s`` accepts (raises :class:`StructuredError` for a bad or unsatisfiable spec)."""
    kind = s.kind
    if kind == "choice":
        problem = choice_problem(s.choices)
        if problem is not None:
            raise StructuredError(problem, kind)
        return s.choices[rng.randrange(len(s.choices))]
    if kind not in STRUCTURED_KINDS:
        raise StructuredError(f"unknown kind {kind!r}", kind)
    compiled, problem = compile_spec(kind, s.spec)
    if problem is not None:
        raise StructuredError(problem, kind)
    try:
        if kind == "json_schema":
            return _dump(_SchemaGen(compiled, rng).instance(), s, rng)
        if kind == "json_object":
            return _dump(_small_object(rng), s, rng)
        if kind == "regex":
            return _regex_example(compiled, rng)
        if kind == "grammar":
            return _GrammarWriter(compiled, rng).text()
        return _TagGen(rng).text(compiled)
    except _NoInstance as exc:
        raise StructuredError(str(exc) or "the spec accepts no text the simulator can find", kind) from None
    except RecursionError:
        raise StructuredError("the spec is nested too deeply to write an instance", kind) from None


# =========================================================================== JSON text


def _dump(value: Any, s: Structured, rng: random.Random) -> str:
    """A JSON instance as text, with the optional whitespace the spec's options allow (protocol 1.2):
    none with ``disable_any_whitespace``; with ``whitespace_pattern``, a text drawn from that regex at
    every place JSON allows whitespace (inside brackets and braces that hold something, on both sides
    of each ``,`` and ``:``), the text before the first and after the last value excepted; otherwise a
    space after each ``,`` and ``:`` (json.dumps' default)."""
    if s.disable_any_whitespace:
        return json.dumps(value, separators=(",", ":"))
    if s.whitespace_pattern is None:
        return json.dumps(value)
    pattern, problem = compile_spec("regex", s.whitespace_pattern)
    if problem is not None:
        raise StructuredError(problem, "whitespace_pattern")
    out: list[str] = []
    _write_json(value, lambda: _regex_example(pattern, rng), out)
    return "".join(out)


def _write_json(value: Any, ws, out: list[str]) -> None:
    if isinstance(value, dict) and value:
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.extend((ws(), "," if i else "", ws() if i else "", json.dumps(key), ws(), ":", ws()))
            _write_json(item, ws, out)
        out.extend((ws(), "}"))
    elif isinstance(value, list) and value:
        out.append("[")
        for i, item in enumerate(value):
            out.extend((ws(), ",", ws()) if i else (ws(),))
            _write_json(item, ws, out)
        out.extend((ws(), "]"))
    else:
        out.append(json.dumps(value))


# =========================================================================== regular expressions

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
        elif op in REPEATS:
            lo, hi, sub = av
            top = lo + 3 if hi is _sre.MAXREPEAT else min(hi, lo + 3)
            for _ in range(rng.randint(lo, top)):
                _regex_gen(sub, rng, out, depth + 1)
        elif op is _sre.AT:
            pass  # anchors: the example is the whole text
        else:
            raise _NoInstance(f"cannot write an instance of regex construct {op}")


def _regex_example(regex: Regex, rng: random.Random, tries: int = 24) -> str:
    for _ in range(tries):
        out: list[str] = []
        _regex_gen(regex.tree, rng, out, 0)
        text = "".join(out)
        if regex.compiled.fullmatch(text):
            return text
    raise _NoInstance(f"found no text matching the regular expression {regex.pattern!r}")


# =========================================================================== JSON schema: instances


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
    lo = lo if is_number(lo) else None
    hi = hi if is_number(hi) else None
    lo_ex = hi_ex = False
    emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if emin is True and lo is not None:
        lo_ex = True
    elif is_number(emin) and (lo is None or emin >= lo):
        lo, lo_ex = emin, True
    if emax is True and hi is not None:
        hi_ex = True
    elif is_number(emax) and (hi is None or emax <= hi):
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
            target = resolve_ref(root, s["$ref"])
        except SpecProblem:
            return False
        if not _valid(v, target, root, depth + 1):
            return False
    t = s.get("type")
    if t is not None:
        if not any(is_type(v, x) for x in ([t] if isinstance(t, str) else t)):
            return False
    if "enum" in s and not any(_json_eq(v, e) for e in s["enum"]):
        return False
    if "const" in s and not _json_eq(v, s["const"]):
        return False
    if is_type(v, "number"):
        lo, lo_ex, hi, hi_ex = _bounds(s)
        if lo is not None and (v < lo or (lo_ex and v == lo)):
            return False
        if hi is not None and (v > hi or (hi_ex and v == hi)):
            return False
        m = s.get("multipleOf")
        if is_number(m) and m > 0 and not _multiple_ok(v, m):
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


_WORDS = (
    "alpha",
    "river",
    "stone",
    "light",
    "amber",
    "north",
    "quiet",
    "cedar",
    "delta",
    "ember",
    "field",
    "harbor",
    "island",
    "meadow",
    "orbit",
    "pixel",
    "signal",
    "timber",
    "velvet",
    "willow",
)
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
            ta, tb = _type_list(old) or list(JSON_TYPES), _type_list(value) or list(JSON_TYPES)
            both = [t for t in ta if t in tb]
            if "integer" not in both and (("integer" in ta and "number" in tb) or ("number" in ta and "integer" in tb)):
                both.append("integer")
            if not both:
                return False
            out[key] = both
        elif key in _LOWER_KEYS and is_number(old) and is_number(value):
            out[key] = max(old, value)
        elif key in _UPPER_KEYS and is_number(old) and is_number(value):
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
            target = self.flatten(resolve_ref(self.root, s["$ref"]), depth + 1)
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
                options = [v for v in options if any(is_type(v, t) for t in types)] or options
            return copy.deepcopy(options[rng.randrange(len(options))])
        types = _type_list(s.get("type"))
        if types:
            t = self.pick_type(types, depth)
        elif any(
            k in s for k in ("properties", "required", "additionalProperties", "patternProperties", "minProperties")
        ):
            t = "object"
        elif any(k in s for k in ("items", "prefixItems", "minItems", "maxItems", "contains")):
            t = "array"
        elif any(k in s for k in ("pattern", "minLength", "maxLength", "format")):
            t = "string"
        elif any(k in s for k in NUMBER_KEYS):
            t = "number"
        else:
            t = rng.choice(
                ("string", "integer", "boolean")
                if self.minimal(depth)
                else ("string", "integer", "boolean", "number", "object", "array")
            )
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
        if is_number(m) and m > 0:
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
        if rng.random() < 0.4 or (is_number(m) and float(m).is_integer()):
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
        if is_number(m) and m > 0:
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
        hi = int(hi) if is_number(hi) else None
        pattern = s.get("pattern")
        if isinstance(pattern, str):
            regex = compile_regex(pattern)
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
        hi = int(hi) if is_number(hi) else None
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
        hi = int(hi) if is_number(hi) else None
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
                    name = _regex_example(compile_regex(pattern), rng)
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


# =========================================================================== grammars


class _GrammarWriter:
    """Texts a :class:`Grammar` derives: random choices, the shortest way out past a depth or a size."""

    SOFT_DEPTH = 6
    BUDGET = 300  # characters, after which derivations take the shortest way out

    def __init__(self, grammar: Grammar, rng: random.Random) -> None:
        self.grammar = grammar
        self.rng = rng
        self.count = 0  # characters written so far

    def text(self) -> str:
        out: list[str] = []
        self.gen(self.grammar.rules["root"], 0, self.rng, out)
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
            self.gen(self.grammar.rules[node[1]], depth + 1, rng, out)
        elif kind == "seq":
            for item in node[1]:
                self.gen(item, depth, rng, out)
        elif kind == "alt":
            heights = self.grammar.option_heights(node)
            if depth > self.SOFT_DEPTH or self.count > self.BUDGET:
                best = min(heights)
                options = [x for x, h in zip(node[1], heights) if h == best]
            else:
                options = [x for x, h in zip(node[1], heights) if h < INF]
            self.gen(options[rng.randrange(len(options))], depth, rng, out)
        else:
            _, sub, lo, hi = node
            if lo == 0 and self.grammar.height(sub, self.grammar.heights) == INF:
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

_FILLER = ("Sure.", "Let me check.", "Here it is:", "One moment.", "Done.", "Okay, looking that up now.")


class _TagGen:
    """Texts for structural tags: free text around begin/content/end structures."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self, tag: dict) -> str:
        if "format" in tag:
            return self.fmt(tag["format"], 0)
        tags = [
            {"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
            for s in tag["structures"]
        ]
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
            return _GrammarWriter(Grammar(node["grammar"]), rng).text()
        if kind == "regex":
            return _regex_example(compile_regex(node["pattern"]), rng)
        if kind == "sequence":
            return "".join(self.fmt(x, depth + 1) for x in node["elements"])
        if kind == "or":
            elements = node["elements"]
            return self.fmt(elements[rng.randrange(len(elements))], depth + 1)
        if kind == "tag":
            return self.tag(node, depth)
        if kind in ("triggered_tags", "token_triggered_tags"):
            tags = node["tags"]
            avoid = [
                *node.get("triggers", []),
                *(t for t in node.get("trigger_tokens", []) if isinstance(t, str)),
                *node.get("excludes", []),
            ]
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
