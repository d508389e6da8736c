from tests.parser_cases import TOOLS, Case

P = "hermes"
CASES = [
    Case("hermes-plain", "Just text, no calls. <tool ok", P, tools=TOOLS),
    Case(
        "hermes-one",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        P,
        tools=TOOLS,
    ),
    Case(
        "hermes-only-call",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"old\\" 東京 😀"}}\n</tool_call>',
        P,
        tools=TOOLS,
    ),
    Case(
        "hermes-two",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "a<b>c", "limit": 3, "exact": true, '
        '"score": 0.5, "filters": {"x": [1, {"y": null}]}, "tags": []}}\n</tool_call>',
        P,
        tools=TOOLS,
    ),
    Case("hermes-no-args", '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>', P, tools=TOOLS),
    Case(
        "hermes-unclosed-whole", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', P, tools=TOOLS
    ),
    Case("hermes-truncated", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', P, tools=TOOLS),
    Case(
        "hermes-invalid-json",
        '<tool_call>\n{"name": "get_weather", "arguments": {city: Oslo}}\n</tool_call>',
        P,
        tools=TOOLS,
    ),
    Case(
        "hermes-one-bad-of-two",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n<tool_call>\n{"name": \n</tool_call>',
        P,
        tools=TOOLS,
        vllm_differs="vLLM turns every call into content when any one of them is broken; tokenmill keeps the "
        "valid call and returns only the broken one's text as content",
        expect={
            "reasoning": None,
            "content": '<tool_call>\n{"name": \n</tool_call>',
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}],
        },
    ),
    Case(
        "hermes-unknown-function",
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their text "
        "as content",
        expect={
            "reasoning": None,
            "content": '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
            "tool_calls": [],
        },
    ),
    Case(
        "hermes-text-after",
        'A<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>\nDone.',
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops text that follows a call; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": "A\nDone.",
            "tool_calls": [{"name": "search", "arguments": {"query": "q"}}],
        },
    ),
    Case(
        "hermes-with-qwen3-reasoning",
        '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>',
        P,
        "qwen3",
        tools=TOOLS,
        prompt="<|im_start|>assistant\n",
    ),
]
CASES.append(
    Case(
        "hermes-nan-argument",
        '<tool_call>\n{"name": "search", "arguments": {"score": NaN}}\n</tool_call>',
        P,
        tools=TOOLS,
        vllm_differs="vLLM passes NaN through, and its arguments string is then not JSON; tokenmill returns the "
        "call's text as content",
        expect={
            "reasoning": None,
            "content": '<tool_call>\n{"name": "search", "arguments": {"score": NaN}}\n</tool_call>',
            "tool_calls": [],
        },
    )
)
