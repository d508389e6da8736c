from tests.parser_cases import TOOLS, Case

P = "mistral"
B, A = "[TOOL_CALLS]", "[ARGS]"
# The oracle's tokenizer has [ARGS] (a marker here), so vLLM parses as for a v11+ tokenizer, which reads the
# pre-v11 array as one call named "[". The array cases' answers are what vLLM gives with a pre-v11 tokenizer.
PRE_V11 = (
    "vLLM with a v11+ tokenizer (one that has [ARGS], as the oracle's) reads the pre-v11 JSON array as a "
    "call named '['; tokenmill reads both forms whatever the tokenizer"
)
# vLLM reads the older JSON-array form only in its pre-v11 mode: no [ARGS] in the vocabulary
PRE_V11_MARKERS = ("[TOOL_CALLS]",)
CASES = [
    Case("mistral-plain", "Sunny in Paris. Use {x} or [ARGS] freely.", P, tools=TOOLS),
    Case("mistral-one", f'Let me check.\n\n{B}get_weather{A}{{"city": "Paris"}}', P, tools=TOOLS),
    Case(
        "mistral-two",
        f'{B}get_weather{A}{{"city": "東京", "unit": "c"}}{B}search{A}{{"query": "a \\"b\\" \\\\ c 😀 '
        '\\u00e9", "filters": {"x": [1, {"y": null}]}, "limit": 3, "exact": false}',
        P,
        tools=TOOLS,
    ),
    Case("mistral-args-dropped", f'{B}search{{"query": "q"}}', P, tools=TOOLS),
    Case(
        "mistral-truncated",
        f'Checking.{B}get_weather{A}{{"city": "Os',
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns an unfinished call with its arguments cut off (not JSON); tokenmill returns "
        "its text as content",
        expect={"reasoning": None, "content": f'Checking.{B}get_weather{A}{{"city": "Os', "tool_calls": []},
    ),
    Case(
        "mistral-invalid-json",
        f"{B}get_weather{A}{{city: Oslo}}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM passes arguments that are not JSON through as a call; tokenmill returns the call's "
        "text as content",
        expect={"reasoning": None, "content": f"{B}get_weather{A}{{city: Oslo}}", "tool_calls": []},
    ),
    Case(
        "mistral-unknown-function",
        f"{B}launch_rockets{A}{{}}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their text "
        "as content",
        expect={"reasoning": None, "content": f"{B}launch_rockets{A}{{}}", "tool_calls": []},
    ),
    Case(
        "mistral-text-after",
        f'{B}search{A}{{"query": "q"}} I searched.',
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops text that follows a call's arguments; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": " I searched.",
            "tool_calls": [{"name": "search", "arguments": {"query": "q"}}],
        },
    ),
    Case(
        "mistral-array-one",
        f'{B} [{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}]',
        P,
        tools=TOOLS,
        vllm_markers=PRE_V11_MARKERS,
    ),
    Case(
        "mistral-array-two",
        f'Sure.{B}[{{"name": "get_weather", "arguments": {{"city": "Zürich"}}}}, '
        '{"name": "search", "arguments": {"query": "x", "tags": []}}]',
        P,
        tools=TOOLS,
        vllm_markers=PRE_V11_MARKERS,
    ),
    Case(
        "mistral-array-truncated",
        f'Hm.{B}[{{"name": "get_weather", "arguments": {{"city": "Os',
        P,
        tools=TOOLS,
        vllm_differs=PRE_V11 + "; with a pre-v11 tokenizer vLLM returns the text after [TOOL_CALLS] only, "
        "tokenmill the whole output word for word",
        expect={
            "reasoning": None,
            "content": f'Hm.{B}[{{"name": "get_weather", "arguments": {{"city": "Os',
            "tool_calls": [],
        },
    ),
    Case(
        "mistral-array-unknown-of-two",
        f'{B}[{{"name": "launch_rockets", "arguments": {{}}}}, {{"name": "search", "arguments": {{"query": "q"}}}}]',
        P,
        tools=TOOLS,
        vllm_differs=PRE_V11 + "; vLLM (any tokenizer) returns calls to functions the request did not declare, "
        "tokenmill returns that entry's text as content",
        expect={
            "reasoning": None,
            "content": '{"name": "launch_rockets", "arguments": {}}',
            "tool_calls": [{"name": "search", "arguments": {"query": "q"}}],
        },
    ),
]
