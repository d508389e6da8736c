from tests.parser_cases import TOOLS, Case

P = "llama3_json"
T = "<|python_tag|>"
CASES = [
    Case("llama3-plain", 'No call needed. A config looks like {"debug": true}; keep it.', P, tools=TOOLS),
    Case("llama3-json-not-call", '{"answer": 42, "unit": "km"}', P, tools=TOOLS),
    Case("llama3-one", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', P, tools=TOOLS),
    Case(
        "llama3-python-tag",
        f'{T}{{"name": "search", "parameters": {{"query": "Zürich \\"old\\" 東京 😀 \\\\ \\u00e9", '
        '"filters": {"x": [1, {"y": null}]}, "exact": true, "score": 0.5, "tags": []}}',
        P,
        tools=TOOLS,
    ),
    Case(
        "llama3-two",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "search", "arguments": {"query": "a; {b}", "limit": 3}}',
        P,
        tools=TOOLS,
    ),
    Case("llama3-truncated", '{"name": "get_weather", "parameters": {"city": "Os', P, tools=TOOLS),
    Case("llama3-invalid-json", '{"name": "get_weather", "parameters": {city: Oslo}}', P, tools=TOOLS),
    Case(
        "llama3-unknown-function",
        '{"name": "launch_rockets", "parameters": {}}',
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their text "
        "as content",
        expect={"reasoning": None, "content": '{"name": "launch_rockets", "parameters": {}}', "tool_calls": []},
    ),
    Case(
        "llama3-text-then-json",
        'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
        P,
        tools=TOOLS,
        vllm_differs="vLLM takes a call-shaped JSON object anywhere in the text as a call and drops the text "
        "around it; tokenmill takes calls only where the output starts with them (as vLLM's streaming "
        "parser does) or after <|python_tag|>",
        expect={
            "reasoning": None,
            "content": 'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
            "tool_calls": [],
        },
    ),
    Case(
        "llama3-text-then-tag",
        f'Let me look that up.\n{T}{{"name": "search", "parameters": {{"query": "q"}}}}',
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops the text before the calls; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": "Let me look that up.",
            "tool_calls": [{"name": "search", "arguments": {"query": "q"}}],
        },
    ),
    Case(
        "llama3-one-bad-of-two",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "search", "parameters": {"query": ',
        P,
        tools=TOOLS,
        vllm_differs="vLLM turns every call into content when any one of them is broken; tokenmill keeps the "
        "valid call and returns only the broken one's text as content",
        expect={
            "reasoning": None,
            "content": '{"name": "search", "parameters": {"query": ',
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}],
        },
    ),
    Case(
        "llama3-text-after",
        '{"name": "search", "parameters": {"query": "q"}}\n\nThis looks q up.',
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops text that follows the calls; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": "\n\nThis looks q up.",
            "tool_calls": [{"name": "search", "arguments": {"query": "q"}}],
        },
    ),
]
