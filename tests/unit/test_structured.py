"""scheduler_client.structured: spec validation (check) and instances (example).

Every instance is verified by independent means: JSON Schema instances with the
``jsonschema`` package, regex instances with ``re.fullmatch``, grammar instances with
``json.loads``, hand-written regexes or a small recognizer written here.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from scheduler_client import structured
from scheduler_client.protocol import Structured
from scheduler_client.structured import StructuredError, check
from scheduler_client.structured.generate import example

jsonschema = pytest.importorskip("jsonschema")

SEEDS = range(30)


def S(kind: str, spec: str = "", choices=()) -> Structured:
    return Structured(kind=kind, spec=spec, choices=list(choices))


def schema(value) -> Structured:
    return S("json_schema", json.dumps(value))


def refused(s: Structured, where: str | None = None) -> str:
    with pytest.raises(StructuredError) as info:
        check(s, where)
    return str(info.value)


# =========================================================================== check: refusals


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("{not json", "not valid JSON"),
        ("", "empty"),
        ("[1, 2]", "must be a JSON object"),
        ("false", "accepts nothing"),
        ({"type": 5}, "'type' must be a string or list of strings, got 5"),
        ({"type": "strnig"}, "'type' must be one of object, array"),
        ({"type": ["string", "strnig"]}, 'got "strnig"'),
        ({"properties": ["a", "b"]}, "'properties' must be an object"),
        (
            {"properties": {"age": {"type": "integer", "required": True}}},
            "json_schema.properties.age: 'required' must be a list of property names, got true",
        ),
        ({"required": ["a", 1]}, "'required' must be a list of property names (strings)"),
        ({"items": 5}, "json_schema.items: a schema must be an object or a boolean, got 5"),
        ({"enum": []}, "'enum' must be a non-empty list"),
        ({"anyOf": []}, "'anyOf' must be a non-empty list of schemas"),
        ({"oneOf": [{"type": "string"}, 3]}, "json_schema.oneOf[1]: a schema must be"),
        ({"minimum": "5"}, "'minimum' must be a number, got \"5\""),
        ({"multipleOf": 0}, "'multipleOf' must be greater than 0"),
        ({"minLength": -1}, "'minLength' must be a non-negative integer"),
        ({"minLength": 5, "maxLength": 3}, "'minLength' 5 is greater than 'maxLength' 3"),
        ({"minimum": 10, "maximum": 1}, "'minimum' 10 is greater than 'maximum' 1"),
        ({"type": "string", "pattern": "(?=a)b"}, "'pattern' '(?=a)b': lookahead"),
        ({"type": "string", "pattern": "[a-"}, "invalid regular expression"),
        ({"$ref": "https://example.com/schema.json"}, "is not a local reference"),
        ({"$ref": "#/$defs/Missing", "$defs": {"Other": {}}}, "does not resolve: there is no 'Missing'"),
        ({"$defs": {"A": {"type": "nope"}}, "$ref": "#/$defs/A"}, "json_schema.$defs.A: 'type' must be one of"),
        (
            {"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False},
            "required property 'b' is not in 'properties'",
        ),
        ({"type": "integer", "enum": ["a", "b"]}, "no value of 'enum' is of type 'integer'"),
        (
            {
                "type": "object",
                "properties": {
                    "list": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "flaot"}}}}
                },
            },
            "json_schema.properties.list.items.properties.x: 'type'",
        ),
        ({"format": 3}, "'format' must be a string"),
        ({"minItems": 10**7}, "too large"),
    ],
)
def test_bad_json_schemas(spec, expected):
    text = spec if isinstance(spec, str) else json.dumps(spec)
    message = refused(S("json_schema", text))
    assert expected in message, message


def test_message_names_the_request_field():
    message = refused(schema({"type": 5}), "response_format.json_schema.schema")
    assert message == "response_format.json_schema.schema: 'type' must be a string or list of strings, got 5"
    message = refused(schema({"properties": {"n": {"type": "int"}}}), "response_format.json_schema.schema")
    assert message.startswith("response_format.json_schema.schema.properties.n: 'type' must be one of")
    message = refused(S("regex", "(a)\\1"), "structured_outputs.regex")
    assert message.startswith("structured_outputs.regex: backreferences")
    with pytest.raises(StructuredError) as info:
        check(schema({"type": 5}), "x")
    assert isinstance(info.value, ValueError) and info.value.where == "x"


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("(a)\\1", "backreferences"),
        ("(?P<x>a)(?P=x)", "backreferences"),
        ("(?=abc)a", "lookahead"),
        ("a(?!b)", "negative lookahead"),
        ("(?<=a)b", "lookahead/lookbehind"),
        ("(a)?(?(1)b|c)", "conditional"),
        ("a++", "possessive"),
        ("(?>ab)", "atomic"),
        ("\\bword\\b", "word boundaries"),
        ("[a-", "invalid regular expression: unterminated character set"),
        ("a{2,1}", "invalid regular expression"),
        ("(ab", "invalid regular expression: missing )"),
        ("\\p{L}", "invalid regular expression: bad escape"),
        ("a{100001}", "too large"),
    ],
)
def test_bad_regexes(pattern, expected):
    message = refused(S("regex", pattern))
    assert message.startswith("regex: ") and expected in message, message


GRAMMAR_ERRORS = [
    ('x ::= "a"', "no rule named 'root'"),
    ("root ::= a\na ::= b", "line 2, column 7: rule 'b' is not defined"),
    ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule 'root' is defined twice (first on line 1)"),
    ('root ::= "abc\n', "line 1, column 10: unterminated string"),
    ('root ::= "\\q"', "line 1, column 11: invalid escape sequence \\q"),
    ('root ::= "a" .', "'.' (any character) is not supported"),
    ("root ::= 'a'", "double quotes"),
    ("root ::= [z-a]", "reversed"),
    ('root ::= "a"{3,2}', "lower bound is larger than the upper bound"),
    ('root ::= "a"{,3}', "expected a number"),
    ('root ::= "a"?*', "two repetition operators in a row"),
    ('root ::= ("a" | "b"', "expected ')' to close the '(' at line 1, column 10"),
    ('root ::= "a")', "unexpected ')'"),
    ('root ::= "a" | ', "expected an element"),
    ("root ::= [abc", "unterminated character class"),
    ('root ::= x\nx ::= x "a"', "can never finish"),
    ('root ::= "a" (= "b") "c"', "a lookahead (= ...) may only end a rule"),
    ("", "empty"),
    ("# only a comment\n", "expected rules"),
    ('root = "a"', "expected '::='"),
]


@pytest.mark.parametrize("grammar, expected", GRAMMAR_ERRORS)
def test_bad_grammars(grammar, expected):
    message = refused(S("grammar", grammar))
    assert expected in message, message


@pytest.mark.parametrize(
    "choices, expected",
    [([], "non-empty list of strings"), (["a", 1], "choice [1] must be a string")],
)
def test_bad_choices(choices, expected):
    assert expected in refused(S("choice", choices=choices))


TAG_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("not json", "not valid JSON"),
        ([1], "must be a JSON object"),
        ({"type": "structural_tag"}, "needs 'format'"),
        ({"type": "other", "format": {}}, "'type' must be \"structural_tag\""),
        (
            {"structures": [{"begin": "<b>", "schema": TAG_SCHEMA, "end": "</b>"}], "triggers": ["<f="]},
            "does not start with any of the triggers",
        ),
        (
            {"structures": [{"begin": "<f=x>", "schema": {"type": "objct"}, "end": "</f>"}], "triggers": ["<f="]},
            "structures[0].schema: 'type' must be one of",
        ),
        ({"structures": [{"begin": "<f=x>", "end": "</f>"}], "triggers": ["<f="]}, "needs 'schema'"),
        ({"format": {"type": "magic"}}, "format: 'type' must be one of"),
        (
            {
                "format": {
                    "type": "tag",
                    "begin": "<a>",
                    "end": "</a>",
                    "content": {"type": "json_schema", "json_schema": {"properties": {"n": {"minimum": "x"}}}},
                }
            },
            "format.content.json_schema.properties.n: 'minimum' must be a number",
        ),
        ({"format": {"type": "regex", "pattern": "(?<=a)"}}, "format.pattern: lookahead"),
        ({"format": {"type": "grammar", "grammar": 'x ::= "a"'}}, "format.grammar: there is no rule named 'root'"),
        ({"format": {"type": "sequence", "elements": []}}, "'elements' must be a non-empty list"),
        (
            {
                "format": {
                    "type": "triggered_tags",
                    "triggers": ["<t"],
                    "tags": [{"begin": "<x>", "content": {"type": "const_string", "value": "v"}, "end": "</x>"}],
                }
            },
            "format.tags[0]: 'begin' '<x>' does not start with any of the triggers",
        ),
    ],
)
def test_bad_structural_tags(spec, expected):
    message = refused(S("structural_tag", spec if isinstance(spec, str) else json.dumps(spec)))
    assert expected in message, message


def test_unknown_kind():
    assert "unknown kind" in refused(S("yaml", "a: 1"))


def test_good_specs_pass_and_are_memoized():
    specs = [
        schema(True),
        schema({}),
        schema({"type": ["string", "null"], "maxLength": 3}),
        schema({"$defs": {"a/b": {"type": "integer"}}, "$ref": "#/$defs/a~1b"}),
        S("json_object"),
        S("regex", r"^\d{3}(-\d{2})?$"),
        S("grammar", 'root ::= [a-z]+ (= "!")'),
        S("choice", choices=["x", ""]),
    ]
    for s in specs:
        check(s)
    before = structured.compile_spec.cache_info().hits
    for s in specs:
        check(s)
    assert structured.compile_spec.cache_info().hits >= before + len(specs) - 1  # choice is not cached


# =========================================================================== example: JSON schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["DE", "FR", "US"]},
            },
            "required": ["zip", "country"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "address"],
}

SCHEMAS = {
    "person": PERSON,
    "arrays": {
        "type": "object",
        "properties": {
            "unique": {"type": "array", "items": {"enum": [1, 2, 3, 4, 5]}, "uniqueItems": True, "minItems": 3},
            "exact": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
            "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
            "tuple": {
                "type": "array",
                "prefixItems": [{"type": "string"}, {"type": "integer"}],
                "items": False,
                "minItems": 2,
            },
            "has": {"type": "array", "contains": {"const": "needle"}, "items": {"type": "string"}},
        },
        "required": ["unique", "exact", "matrix", "tuple", "has"],
    },
    "enums_and_consts": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "mixed": {"enum": [1, "one", None, True, [1], {"k": 1}]},
            "version": {"const": 2},
            "kind": {"const": "fixed"},
        },
        "required": ["color", "mixed", "version", "kind"],
    },
    "any_one_of": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^id-[a-f0-9]{6}$"}]},
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "exclusiveMinimum": 0}},
                        "required": ["kind", "r"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1}},
                        "required": ["kind", "side"],
                        "additionalProperties": False,
                    },
                ]
            },
            "nullable": {"type": ["string", "null"]},
        },
        "required": ["id", "shape", "nullable"],
    },
    "defs_and_refs": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3},
                },
                "required": ["value", "children"],
            },
            "label": {"type": "string", "pattern": "^[a-z]+$"},
        },
        "type": "object",
        "properties": {"tree": {"$ref": "#/$defs/node"}, "label": {"$ref": "#/$defs/label"}},
        "required": ["tree", "label"],
    },
    "definitions_and_root_ref": {
        "definitions": {"leaf": {"type": "string", "minLength": 2, "maxLength": 2}},
        "type": "object",
        "properties": {"leaf": {"$ref": "#/definitions/leaf"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["leaf", "next"],
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},
            "hex": {"type": "string", "pattern": "^#?([0-9a-fA-F]{3}|[0-9a-fA-F]{6})$"},
            "loose": {"type": "string", "pattern": "ab+c"},
            "sized": {"type": "string", "minLength": 10, "maxLength": 12},
            "short": {"type": "string", "maxLength": 0},
            "when": {"type": "string", "format": "date-time"},
            "uuid": {"type": "string", "format": "uuid"},
        },
        "required": ["code", "hex", "loose", "sized", "short", "when", "uuid"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "small": {"type": "integer", "minimum": -3, "maximum": 3},
            "positive": {"type": "integer", "exclusiveMinimum": 0},
            "below": {"type": "number", "exclusiveMaximum": -1000.5},
            "between": {"type": "number", "minimum": 0.25, "maximum": 0.5},
            "half": {"type": "number", "multipleOf": 0.5, "minimum": 1, "maximum": 4},
            "sevens": {"type": "integer", "multipleOf": 7, "minimum": 100, "maximum": 200},
            "huge": {"type": "number", "minimum": 1e12},
            "one": {"type": "integer", "minimum": 5, "maximum": 5},
        },
        "required": ["small", "positive", "below", "between", "half", "sevens", "huge", "one"],
    },
    "all_of_and_not": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer", "minimum": 10}}, "required": ["a"]},
            {"properties": {"a": {"maximum": 12}, "b": {"type": "string"}}, "required": ["b"]},
        ],
        "properties": {"c": {"not": {"type": "string"}}},
        "required": ["c"],
    },
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^x-[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 2,
    },
    "additional": {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 3},
    "top_level_array": {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
        "minItems": 1,
    },
    "untyped": {"properties": {"anything": {}, "flag": True}, "required": ["anything", "flag"]},
    "true": True,
    "empty": {},
    "string": {"type": "string", "enum": ["only"]},
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_examples_validate(name):
    spec = SCHEMAS[name]
    s = schema(spec)
    check(s)
    validator = jsonschema.Draft202012Validator(spec)
    seen = set()
    for seed in SEEDS:
        text = example(s, random.Random(seed))
        value = json.loads(text)
        assert text == json.dumps(value)  # json.dumps' default separators
        errors = list(validator.iter_errors(value))
        assert not errors, f"seed {seed}: {text}\n{errors[0].message}"
        seen.add(text)
    if name not in ("string",):
        assert len(seen) > 1, "examples should vary with the seed"


def test_json_schema_examples_vary_optional_properties():
    present = set()
    for seed in SEEDS:
        present.update(json.loads(example(schema(PERSON), random.Random(seed))))
    assert {"email", "tags"} <= present  # optional properties appear in some instances
    required = set(PERSON["required"])
    for seed in SEEDS:
        assert required <= set(json.loads(example(schema(PERSON), random.Random(seed))))


def test_json_schema_formats():
    spec = SCHEMAS["patterns"]
    for seed in range(10):
        value = json.loads(example(schema(spec), random.Random(seed)))
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", value["when"])
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-a[0-9a-f]{3}-[0-9a-f]{12}", value["uuid"])


def test_example_is_deterministic_for_the_generator_state():
    for s in (schema(PERSON), S("regex", r"[a-z]{3,9}\d*"), S("grammar", ARITHMETIC), S("json_object")):
        assert example(s, random.Random(42)) == example(s, random.Random(42))


def test_recursive_schema_without_finite_instance():
    s = schema({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]})
    check(s)  # well-formed
    with pytest.raises(StructuredError, match="no finite instance"):
        example(s, random.Random(0))


def test_json_object_examples():
    for seed in SEEDS:
        value = json.loads(example(S("json_object"), random.Random(seed)))
        assert isinstance(value, dict) and value


# =========================================================================== example: regex

REGEXES = [
    r"[a-z]+@[a-z]+\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"(ab|cd)*e?",
    r"^[A-Z][a-z]{2,8}$",
    r"[^\s,]{1,5}(,[^\s,]{1,5}){0,3}",
    r"\w+\s\W\D\S",
    r"[α-ω]{2}é\u4e2d\U0001F600",
    r"(?i)hello [^a-z0-9]",
    r"\\\.\*\+\?\(\)\[\]\{\}\|\^\$",
    r"x{0}y{2}z{1,}",
    r"(a|b|)c",
    r".{3}",
    r"",
    r"[\x00-\x1f]+",
    r"(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?",
    r"(?P<year>\d{4})-(?P<month>0[1-9]|1[0-2])",
    r"a*?b+?c??",
    r"(?x) a b  # verbose",
    r"\Astart.*end\Z",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_examples_match(pattern):
    s = S("regex", pattern)
    check(s)
    compiled = re.compile(pattern)
    for seed in SEEDS:
        text = example(s, random.Random(seed))
        assert compiled.fullmatch(text), (seed, text)


def test_regex_unbounded_repeats_stay_short():
    for seed in SEEDS:
        assert len(example(S("regex", r"(a+b*)*c+"), random.Random(seed))) < 100


def test_regex_without_instance():
    with pytest.raises(StructuredError, match="no text matching"):
        example(S("regex", r"a^b"), random.Random(0))


# =========================================================================== example: grammar

JSON_GRAMMAR = r"""
# JSON, as xgrammar's built-in grammar has it (with bounded whitespace)
root ::= value
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( ws "," ws member )* )? ws "}"
member ::= string ws ":" ws value
array ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?
ws ::= [ \t\n]{0,2}
"""

ARITHMETIC = r"""
root ::= expr
expr ::= term (ws ("+" | "-") ws term)*
term ::= factor (ws ("*" | "/") ws factor)*
factor ::= number | "(" ws expr ws ")" | "-" factor
number ::= [0-9]+ ("." [0-9]{1,3})?
ws ::= [ \t]*
"""


class Arithmetic:
    """A recursive-descent recognizer for ARITHMETIC, written independently of the module."""

    def __init__(self, text: str) -> None:
        self.t, self.i = text, 0

    def accepts(self) -> bool:
        try:
            self.expr()
        except ValueError:
            return False
        return self.i == len(self.t)

    def peek(self) -> str:
        return self.t[self.i] if self.i < len(self.t) else ""

    def ws(self) -> None:
        while self.peek() in (" ", "\t") and self.peek():
            self.i += 1

    def op_follows(self, ops: str) -> bool:
        j = self.i
        while j < len(self.t) and self.t[j] in " \t":
            j += 1
        return j < len(self.t) and self.t[j] in ops

    def expr(self) -> None:
        self.term()
        while self.op_follows("+-"):
            self.ws()
            self.i += 1
            self.ws()
            self.term()

    def term(self) -> None:
        self.factor()
        while self.op_follows("*/"):
            self.ws()
            self.i += 1
            self.ws()
            self.factor()

    def factor(self) -> None:
        ch = self.peek()
        if ch == "(":
            self.i += 1
            self.ws()
            self.expr()
            self.ws()
            if self.peek() != ")":
                raise ValueError("expected )")
            self.i += 1
        elif ch == "-":
            self.i += 1
            self.factor()
        else:
            match = re.compile(r"[0-9]+(\.[0-9]{1,3})?").match(self.t, self.i)
            if not match:
                raise ValueError("expected a number")
            self.i = match.end()


def test_arithmetic_recognizer_itself():
    assert Arithmetic("1 + 2*(3 -\t-4.25)/5").accepts()
    assert not Arithmetic("1 +").accepts() and not Arithmetic("(1").accepts() and not Arithmetic("1.2345").accepts()


def test_grammar_json_examples_parse():
    s = S("grammar", JSON_GRAMMAR)
    check(s)
    kinds = set()
    for seed in range(60):
        text = example(s, random.Random(seed))
        value = json.loads(text)  # the independent check
        kinds.add(type(value).__name__)
        assert len(text) < 20_000
    assert len(kinds) >= 4  # alternatives are explored, not just the shortest


def test_grammar_arithmetic_examples_are_recognized():
    s = S("grammar", ARITHMETIC)
    check(s)
    texts = [example(s, random.Random(seed)) for seed in range(60)]
    for text in texts:
        assert Arithmetic(text).accepts(), text
    assert any("(" in t for t in texts) and any(op in "".join(texts) for op in "+-*/")


GRAMMARS_AS_REGEXES = [
    (
        '# greetings\nroot ::= greeting " " name ("!" | "?"){1,3}\n'
        'greeting ::= "hello"\n   | "hi"   # a rule across lines\nname ::= [A-Z] [a-z]{2,6} | "\\u00e9t\\u00e9"',
        r"(hello|hi) ([A-Z][a-z]{2,6}|été)[!?]{1,3}",
    ),
    ('root ::= [^a-z\\n]+ "\\t" [\\]\\-]?', r"[^a-z\n]+\t[\]\-]?"),
    ('root ::= item ("," item){2,}\nitem ::= [0-9]{2} | "x"', r"([0-9]{2}|x)(,([0-9]{2}|x)){2,}"),
    ('root ::= "" | "a" root "b"', r"(a*)(b*)"),  # checked for balance below
    ('root ::= ( ) "q" ("r"?)* [\\x41-\\x43]', r"q(r)*[A-C]"),
    ('root-rule ::= "z"\nroot ::= root-rule "." a.b\na.b ::= "\\"" (= "")', r'z\."'),
]


@pytest.mark.parametrize("grammar, regex", GRAMMARS_AS_REGEXES)
def test_grammar_examples_match_equivalent_regex(grammar, regex):
    s = S("grammar", grammar)
    check(s)
    for seed in SEEDS:
        text = example(s, random.Random(seed))
        match = re.fullmatch(regex, text)
        assert match, (seed, text)
        if regex == r"(a*)(b*)":
            assert len(match.group(1)) == len(match.group(2))


def test_grammar_recursion_is_bounded():
    s = S("grammar", 'root ::= list\nlist ::= "[" (list ("," list)*)? "]"')
    for seed in SEEDS:
        text = example(s, random.Random(seed))
        assert isinstance(json.loads(text), list) and len(text) < 5000


# =========================================================================== example: choice, structural tag


def test_choice_examples():
    s = S("choice", choices=["yes", "no", "maybe not"])
    check(s)
    got = {example(s, random.Random(seed)) for seed in SEEDS}
    assert got == {"yes", "no", "maybe not"}


LEGACY_TAG = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": TAG_SCHEMA, "end": "</function>"},
        {
            "begin": "<function=add>",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
            "end": "</function>",
        },
    ],
    "triggers": ["<function="],
}


def test_structural_tag_legacy_examples():
    s = S("structural_tag", json.dumps(LEGACY_TAG))
    check(s)
    schemas = {st["begin"]: st["schema"] for st in LEGACY_TAG["structures"]}
    tags = 0
    for seed in SEEDS:
        text = example(s, random.Random(seed))
        for begin, body in re.findall(r"(<function=[a-z_]+>)(.*?)</function>", text):
            jsonschema.validate(json.loads(body), schemas[begin])
            tags += 1
        outside = re.sub(r"<function=[a-z_]+>.*?</function>", "", text)
        assert "<function=" not in outside, text
    assert tags > 0


def test_structural_tag_format_examples():
    spec = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "ID:"},
                {"type": "regex", "pattern": "[0-9]{3}"},
                {"type": "optional", "content": {"type": "const_string", "value": "!"}},
                {
                    "type": "tag",
                    "begin": "<json>",
                    "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
                    "end": ["</json>", "</j>"],
                },
                {
                    "type": "or",
                    "elements": [
                        {"type": "grammar", "grammar": 'root ::= "x"{2}'},
                        {"type": "const_string", "value": "y"},
                    ],
                },
                {
                    "type": "triggered_tags",
                    "triggers": ["<t"],
                    "at_least_one": True,
                    "stop_after_first": True,
                    "tags": [{"begin": "<t>", "content": {"type": "any_text"}, "end": "</t>"}],
                },
            ],
        },
    }
    s = S("structural_tag", json.dumps(spec))
    check(s)
    for seed in SEEDS:
        text = example(s, random.Random(seed))
        match = re.fullmatch(r"ID:[0-9]{3}!?<json>(.*)</json>(xx|y)[^<]*<t>[^<]*</t>", text)
        assert match, text
        jsonschema.validate(json.loads(match.group(1)), TAG_SCHEMA)


# ---- protocol 1.2: the whitespace options -------------------------------------------------------------

NESTED = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 2}, "b": {"type": "string"}},
        "required": ["a", "b"],
    }
)


def _separators(value) -> int:
    """The commas between members and items in a JSON value (tabs never appear in its strings)."""
    if isinstance(value, dict):
        return max(len(value) - 1, 0) + sum(_separators(v) for v in value.values())
    if isinstance(value, list):
        return max(len(value) - 1, 0) + sum(_separators(v) for v in value)
    return 0


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_whitespace_options_shape_json_instances(kind):
    """The same instance for the same generator state: json.dumps' spaces by default, none with
    disable_any_whitespace, the pattern's text at every place JSON allows whitespace with
    whitespace_pattern (disable_any_whitespace wins over it)."""
    spec = NESTED if kind == "json_schema" else ""
    for seed in SEEDS:
        plain = example(Structured(kind, spec), random.Random(seed))
        value = json.loads(plain)
        assert plain == json.dumps(value)
        compact = example(Structured(kind, spec, disable_any_whitespace=True), random.Random(seed))
        assert compact == json.dumps(value, separators=(",", ":"))
        both = Structured(kind, spec, disable_any_whitespace=True, whitespace_pattern="\t+")
        assert example(both, random.Random(seed)) == compact
        tabs = example(Structured(kind, spec, whitespace_pattern=r"\t{1,3}"), random.Random(seed))
        assert json.loads(tabs) == value and tabs.replace("\t", "") == compact
        assert re.fullmatch(r"\{\t{1,3}\".*\t{1,3}\}", tabs, re.S) and "\t\t\t\t" not in tabs
        assert tabs.count("\t:\t") >= 1 and tabs.count("\t,\t") == _separators(value)
        empty = example(Structured(kind, spec, whitespace_pattern=""), random.Random(seed))
        assert empty == compact


def test_whitespace_options_leave_other_kinds_alone():
    for s in (S("regex", "a b"), S("choice", choices=["x y"]), S("grammar", 'root ::= "p q"')):
        shaped = Structured(s.kind, s.spec, list(s.choices), disable_any_whitespace=True, whitespace_pattern="\n")
        assert example(shaped, random.Random(0)) == example(s, random.Random(0))


def test_whitespace_pattern_is_checked_as_a_regex():
    for bad in ("(", r"(?= )", r"(a)\1", 5):
        assert structured.whitespace_problem(bad), bad
        with pytest.raises(StructuredError) as exc:
            check(Structured("json_object", whitespace_pattern=bad), "structured")
        assert exc.value.where == "whitespace_pattern"
    for good in ("", " ", r"[ \t\n]*", r"\s{0,4}"):
        assert structured.whitespace_problem(good) is None
        check(Structured("json_object", whitespace_pattern=good))
