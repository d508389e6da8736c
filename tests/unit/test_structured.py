"""tokenmill.scheduler_client.structured: the engine-independent checks the tokenizer workers run on a spec.

What a regex, grammar or schema means is the engine's to judge (tests/serving/test_structured_table.py);
here only what holds for every engine: known kind, valid JSON where JSON is required, a non-empty
list of string choices, and the size and nesting limits.
"""

import pytest

from tokenmill.scheduler_client.protocol import Structured
from tokenmill.scheduler_client.structured import MAX_CHOICES, MAX_NESTING, MAX_SPEC_CHARS, StructuredError, check


@pytest.mark.parametrize(
    "spec",
    [
        Structured("json_schema", '{"type": "object"}'),
        Structured("json_schema", "true"),
        # malformed by the JSON Schema spec, yet an engine may serve it: not the workers' call
        Structured("json_schema", '{"properties": {"a": {"type": "string", "required": true}}}'),
        Structured("json_schema", '{"type": "strnig"}'),
        Structured("json_object"),
        Structured("regex", r"(a)\1"),  # a backreference: the engine refuses it, not the workers
        Structured("regex", r"\p{L}{2,4}"),
        Structured("grammar", 'start: "yes" | "no"'),  # Lark
        Structured("grammar", 'root ::= "a" root'),  # never finishes: served up to max_tokens
        Structured("grammar", 'root ::= "(" [a-z]* ")"'),
        Structured("choice", choices=["yes", "no"]),
        Structured("structural_tag", '{"structures": [], "triggers": []}'),
        Structured("regex", "(" * MAX_NESTING + "a" + ")" * MAX_NESTING),
        Structured("json_schema", '{"pattern": "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((a"}'),
    ],
)
def test_engine_questions_pass(spec):
    check(spec, "f")


@pytest.mark.parametrize(
    "spec, words",
    [
        (Structured("yaml", "a: 1"), "unknown kind"),
        (Structured("json_schema", "{not json"), "not valid JSON"),
        (Structured("json_schema", "[1, 2]"), "object or a boolean"),
        (Structured("json_schema", ""), "empty"),
        (Structured("structural_tag", '"text"'), "JSON object"),
        (Structured("regex", ""), "empty"),
        (Structured("grammar", "   "), "empty"),
        (Structured("choice", choices=[]), "non-empty list"),
        (Structured("choice", choices=["a", 3]), "choice [1] must be a string"),
        (Structured("choice", choices=["a"] * (MAX_CHOICES + 1)), "at most"),
        (Structured("regex", "a" * (MAX_SPEC_CHARS + 1)), "at most"),
        (Structured("regex", "(" * (MAX_NESTING + 1) + "a" + ")" * (MAX_NESTING + 1)), "nests brackets"),
        (Structured("json_schema", '{"a": ' * 200 + "1" + "}" * 200), "nests brackets"),
        (Structured("json_schema", "[" * 100_000), "nests brackets"),  # never reaches json.loads' recursion
        (Structured("json_schema", '{"type": "object"}', whitespace_pattern="(" * 65), "nests brackets"),
    ],
)
def test_what_no_engine_could_use_is_refused(spec, words):
    with pytest.raises(StructuredError) as info:
        check(spec, "response_format")
    assert words in str(info.value)
    assert info.value.where in ("response_format", "whitespace_pattern")
