"""A table of structured-output specs, each with what tokenmill's simulator (llguidance) does with it.

One row: an id, the request fields that ask for the constraint, the request field a refusal names,
what llguidance does (``"ok"``, ``"endless"``: accepted but never complete, so it ends at max_tokens
or where the matcher gives up, or ``"refused"``), and a checker that judges an output independently (``jsonschema`` for schemas, the
``regex`` package's fullmatch for regexes and for grammars an equivalent regex, a function for the rest).
tests/serving/test_structured_table.py runs it through the simulator; where vLLM's default backend is
known to differ from llguidance, the row says so (``vllm``) and docs/api/structured-outputs.md lists it. Where SGLang's
default backend (xgrammar, with SGLang's own schema checks) differs from llguidance, the row says so
(``sglang``): tests/engines/test_structured_sglang.py holds the SGLang bridge's admission check to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
import regex

OK, ENDLESS, REFUSED = "ok", "endless", "refused"


@dataclass
class Row:
    id: str
    body: dict[str, Any]  # request fields
    param: str  # the field a 400 names
    llguidance: str  # OK, ENDLESS or REFUSED
    check: Any = None  # a JSON schema (dict/bool), a regex (str) or a function text -> bool
    vllm: str | None = None  # what vLLM 0.32's own server does (a 4xx or 5xx is REFUSED), where it differs
    sglang: str | None = None  # what SGLang 0.5.23's default backend (xgrammar) does, where it differs

    def sglang_refuses(self) -> bool:
        return (self.sglang or self.llguidance) == REFUSED


def so(key: str, value: Any) -> dict[str, Any]:
    return {"structured_outputs": {key: value}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def schema_row(id_: str, schema: Any, state: str = OK, **kw) -> Row:
    return Row(id_, so("json", schema), "structured_outputs.json", state, schema if state != REFUSED else None, **kw)


def regex_row(id_: str, pattern: str, state: str = OK, **kw) -> Row:
    return Row(
        id_, so("regex", pattern), "structured_outputs.regex", state, pattern if state != REFUSED else None, **kw
    )


def grammar_row(id_: str, grammar: str, state: str, check: str | None = None, **kw) -> Row:
    return Row(id_, so("grammar", grammar), "structured_outputs.grammar", state, check, **kw)


def _tagged(text: str) -> bool:
    """A structural tag's output: free text in which every [[f]]...[[/f]] holds an object with a string city."""
    rest = text
    while "[[f]]" in rest:
        _, _, after = rest.partition("[[f]]")
        inner, sep, rest = after.partition("[[/f]]")
        if not sep:
            return True  # cut by max_tokens inside a tag
        value = json.loads(inner)
        if not isinstance(value.get("city"), str):
            return False
    return True


_PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# (llguidance reads a trigger starting with "<" as a special token: these are plain text)
_TAG = {"structures": [{"begin": "[[f]]", "schema": _PLACE, "end": "[[/f]]"}], "triggers": ["[[f"]}

ROWS: list[Row] = [
    # ---- JSON schemas
    schema_row("issue-required-true", {"type": "object", "properties": {"a": {"type": "string", "required": True}}}),
    schema_row("object-required", _PLACE),
    schema_row(
        "ref-defs",
        {
            "type": "object",
            "properties": {"home": {"$ref": "#/$defs/place"}},
            "required": ["home"],
            "$defs": {"place": _PLACE},
        },
    ),
    schema_row("ref-definitions", {"$ref": "#/definitions/n", "definitions": {"n": {"type": "integer"}}}),
    schema_row("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}),
    schema_row("oneOf", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}),
    schema_row("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]}),
    schema_row("format-date", {"type": "string", "format": "date"}),
    schema_row("format-uuid", {"type": "string", "format": "uuid"}),
    schema_row("format-ipv4", {"type": "string", "format": "ipv4"}),
    schema_row("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    schema_row("pattern-unicode", {"type": "string", "pattern": "^[А-Я][а-я]{1,8}$"}),
    # llguidance implements no uniqueItems; vLLM's auto sends it to guidance, which refuses it, and SGLang's
    # own check refuses keywords xgrammar would ignore
    schema_row("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, REFUSED),
    schema_row("enum", {"enum": ["red", "green", 3, None]}),
    schema_row("const", {"const": {"k": [1, 2]}}),
    schema_row("array-bounds", {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}),
    schema_row("integer-range", {"type": "integer", "minimum": -5, "maximum": 5}),
    schema_row("number", {"type": "number", "exclusiveMinimum": 0, "maximum": 10}),
    schema_row("string-length", {"type": "string", "minLength": 2, "maxLength": 4}),
    schema_row(
        "closed-object", {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}
    ),
    schema_row(
        "nested",
        {"type": "object", "properties": {"a": {"type": "array", "items": _PLACE, "maxItems": 2}}, "required": ["a"]},
    ),
    schema_row(
        "prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False}
    ),
    schema_row("recursive", {"type": "object", "properties": {"next": {"$ref": "#"}}, "additionalProperties": False}),
    # llguidance (vLLM's conversion too) applies its whitespace options to an object schema only; vLLM's request
    # model refuses a boolean json; SGLang's xgrammar takes it
    schema_row("true", True, REFUSED, sglang=OK),
    schema_row("empty", {}),
    schema_row("bad-type", {"type": "strnig"}, REFUSED),
    schema_row("ref-missing", {"$ref": "#/$defs/missing"}, REFUSED),
    # llguidance fetches nothing and refuses it; xgrammar warns ("URI should either be '#' or start with
    # '#/'") and serves it, under vLLM (whose validation passes it, so auto keeps xgrammar) and SGLang
    # served where the backend leaves an unresolvable $ref open: any JSON (a checker that resolved it would fetch)
    Row(
        "ref-remote",
        so("json", {"$ref": "http://example.com/schema.json"}),
        "structured_outputs.json",
        REFUSED,
        _is_json,
        vllm=OK,
        sglang=OK,
    ),
    schema_row("pattern-backreference", {"type": "string", "pattern": "(a)\\1"}, REFUSED),
    schema_row("unsatisfiable", {"type": "integer", "minimum": 5, "maximum": 1}, REFUSED),
    Row(
        "false",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": False}}},
        "response_format.json_schema.schema",
        REFUSED,
    ),
    Row("not-json", so("json", "{not json"), "structured_outputs.json", REFUSED),
    Row("schema-array", so("json", "[1, 2]"), "structured_outputs.json", REFUSED),
    Row(
        "response_format",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": _PLACE}}},
        "response_format.json_schema.schema",
        OK,
        _PLACE,
    ),
    Row(
        "response_format-bad",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 7}}}},
        "response_format.json_schema.schema",
        REFUSED,
    ),
    Row("json_object", so("json_object", True), "structured_outputs.json_object", OK, {"type": "object"}),
    # ---- regexes
    regex_row("phone", r"[A-Z][a-z]{2,5} \d{3}-\d{4}"),
    # xgrammar has no Unicode classes: vLLM's validation passes them and its engine core then fails (vLLM's own
    # server answers 500, tokenmill's vLLM bridge 400); SGLang refuses them
    regex_row("unicode-letters", r"\p{L}{2,5}", vllm=REFUSED, sglang=REFUSED),
    regex_row("unicode-case", r"\p{Lu}\p{Ll}{1,6}", vllm=REFUSED, sglang=REFUSED),
    regex_row("cyrillic", r"[а-я]{3}"),
    regex_row("bounded-group", r"(ab|cd){2,4}e"),
    regex_row("email", r"\w{1,8}@\w{1,8}\.com"),
    regex_row("hex", r"[0-9a-f]{8}"),
    regex_row("thousands", r"\d{1,3}(,\d{3}){0,3}"),
    regex_row("optional", r"colou?r"),
    regex_row("negated-class", r"[^\s]{1,5}"),
    regex_row("dot", r".{3}"),
    regex_row("large-bound", r"x{1,1000}"),
    regex_row("backreference", r"(a)\1", REFUSED),
    regex_row("lookahead", r"(?=a)a", REFUSED),
    regex_row("unclosed", r"(unclosed", REFUSED),
    regex_row("reversed-bounds", r"a{5,2}", REFUSED),
    regex_row("reversed-range", r"[z-a]", REFUSED),
    # ---- grammars: Lark and GBNF
    # SGLang takes a grammar as its backend's EBNF (xgrammar's: no Lark)
    grammar_row("issue-lark", 'start: "yes" | "no"', OK, "yes|no", sglang=REFUSED),
    grammar_row("lark-terminal", "start: NUMBER\nNUMBER: /[0-9]{1,6}/", OK, "[0-9]{1,6}", sglang=REFUSED),
    grammar_row(
        "lark-list", 'start: item ("," item)*\nitem: /[a-z]{1,5}/', OK, "[a-z]{1,5}(,[a-z]{1,5})*", sglang=REFUSED
    ),
    grammar_row("lark-recursive", 'start: "(" start ")" | "x"', OK, r"(\()*x(\))*", sglang=REFUSED),
    # no finite derivation: served, never complete (xgrammar serves "a"s up to max_tokens)
    grammar_row("issue-endless", 'root ::= "a" root', ENDLESS, "a*"),
    grammar_row("gbnf-rules", 'root ::= answer " " [0-9]{1,3}\nanswer ::= "yes" | "no"', OK, "(yes|no) [0-9]{1,3}"),
    grammar_row("gbnf-class", 'root ::= [a-z]+ "."', OK, r"[a-z]+\."),
    grammar_row("gbnf-star", 'root ::= ("x" | "y")* "!"', OK, "[xy]*!"),
    grammar_row("gbnf-undefined", "root ::= missing_rule", REFUSED),
    grammar_row("gbnf-no-root", 'start ::= "a"', REFUSED),
    grammar_row("lark-empty-alternative", 'start: "a" |', OK, "a?", sglang=REFUSED),
    grammar_row("gbnf-unclosed", 'root ::= "a" (', REFUSED),
    # ---- choices
    Row("choice", so("choice", ["yes", "no"]), "structured_outputs.choice", OK, lambda t: t in ("yes", "no")),
    Row(
        "choice-unicode",
        so("choice", ["positive", "négatif", "中性"]),
        "structured_outputs.choice",
        OK,
        lambda t: t in ("positive", "négatif", "中性"),
    ),
    Row("choice-one", {"guided_choice": ["only"]}, "guided_choice", OK, lambda t: t == "only"),
    Row("choice-empty", so("choice", []), "structured_outputs.choice", REFUSED),
    Row("choice-number", so("choice", ["a", 1]), "structured_outputs.choice", REFUSED),
    # ---- structural tags
    Row("structural-tag", so("structural_tag", json.dumps(_TAG)), "structured_outputs.structural_tag", OK, _tagged),
    Row(
        "structural-tag-response_format",
        {"response_format": {"type": "structural_tag", **_TAG}},
        "response_format",
        OK,
        _tagged,
    ),
    Row(
        "structural-tag-no-trigger",
        so("structural_tag", json.dumps({**_TAG, "triggers": ["[[g"]})),
        "structured_outputs.structural_tag",
        REFUSED,
    ),
    Row(
        "structural-tag-xgrammar-format",
        so("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}})),
        "structured_outputs.structural_tag",
        REFUSED,
        "hi",
        vllm=OK,  # xgrammar (vLLM's default backend) takes its own format; llguidance only the older one
        sglang=OK,
    ),
    Row("structural-tag-not-json", so("structural_tag", "[[f]]"), "structured_outputs.structural_tag", REFUSED),
]

# Specs that could make a matcher blow up (repeats of repeats, huge bounds, nested stars, deep nesting, a
# wide grammar): each engine refuses them (a 400 naming the field) or serves them within max_tokens, and
# serves the next request as usual.
PATHOLOGICAL: dict[str, dict[str, Any]] = {
    "repeat-of-repeat": so("regex", "(a{1000}){1000}"),
    "huge-bounds": so("regex", "[a-z]{100000}[0-9]{100000}"),
    "nested-stars": so("regex", "((a|b)*)*((c|d)*)*(a|c){50}x"),
    "deep-groups": so("regex", "(" * 200 + "a" + ")" * 200),
    "schema-pattern": so("json", {"type": "string", "pattern": "(x{500}){500}"}),
    "deep-json": so("json", '{"a": ' * 500 + "1" + "}" * 500),
    "wide-grammar": so("grammar", "root ::= " + " | ".join(f'"w{i}" root' for i in range(5000)) + ' | "e"'),
}


def valid(check, text: str) -> bool:
    """Whether ``text`` is valid under a row's checker."""
    if isinstance(check, (dict, bool)):
        # not jsonschema.validate: it checks the schema against the metaschema first, and the table has
        # schemas an engine serves that the metaschema calls malformed
        try:
            jsonschema.Draft202012Validator(check, format_checker=jsonschema.FormatChecker()).validate(json.loads(text))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if isinstance(check, str):
        return regex.fullmatch(check, text) is not None
    return bool(check(text))
