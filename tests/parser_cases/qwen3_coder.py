from tests.parser_cases import TOOLS, Case

P = "qwen3_coder"


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = call("get_weather", city="Paris")
TRUNCATED = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
MALFORMED = "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
UNKNOWN = call("launch_rockets", count="3")
UNCLOSED_PARAM = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</function>\n</tool_call>"

CASES = [
    Case("qwen3coder-plain", "Just text: a < b, <function without a sign, <tool ok.\n", P, tools=TOOLS),
    Case("qwen3coder-one", "I'll check the weather in Paris.\n\n" + WEATHER, P, tools=TOOLS),
    Case(
        "qwen3coder-typed",
        call(
            "search",
            query='line 1\n  a<b> & "quoted" 東京 😀\nline 3',
            limit="3",
            exact="True",
            score="0.25",
            filters='{"x": [1, {"y": null}]}',
            tags='["a", "b"]',
            extra="5",
        ),
        P,
        tools=TOOLS,
    ),
    Case(
        "qwen3coder-uncoercible",
        call("search", limit="three", exact="maybe", score="1.5e400", tags="not json"),
        P,
        tools=TOOLS,
    ),
    Case("qwen3coder-two", WEATHER + "\n" + call("get_weather", city="Rome", unit="c") + "\n", P, tools=TOOLS),
    Case(
        "qwen3coder-two-in-one",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n<function=search>\n<parameter=query>\nfjords\n</parameter>\n</function>\n</tool_call>",
        P,
        tools=TOOLS,
    ),
    Case(
        "qwen3coder-lenient-tags",
        "Let me look.\n<function=get_weather>\n<parameter=city>\nBern\n<parameter=unit>\nc</parameter>\n</function>",
        P,
        tools=TOOLS,
    ),
    Case("qwen3coder-unclosed-whole", "<tool_call>\n<function=search>\n</function>", P, tools=TOOLS),
    Case(
        "qwen3coder-truncated",
        "Sure.\n" + TRUNCATED,
        P,
        tools=TOOLS,
        vllm_differs="vLLM makes a call of a call cut off by max_tokens, without the unfinished parameter; "
        "tokenmill returns its text as content",
        expect={"reasoning": None, "content": "Sure.\n" + TRUNCATED, "tool_calls": []},
    ),
    Case(
        "qwen3coder-malformed",
        MALFORMED,
        P,
        tools=TOOLS,
        vllm_differs="vLLM takes a <function= tag missing its '>' as a call whose name runs into the next tag; "
        "tokenmill returns the call's text as content",
        expect={"reasoning": None, "content": MALFORMED, "tool_calls": []},
    ),
    Case(
        "qwen3coder-unknown-function",
        UNKNOWN,
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their text "
        "as content",
        expect={"reasoning": None, "content": UNKNOWN, "tool_calls": []},
    ),
    Case(
        "qwen3coder-unclosed-parameter",
        UNCLOSED_PARAM,
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops a parameter whose </parameter> is missing at the end of the function; "
        "tokenmill ends its value at </function>",
        expect={
            "reasoning": None,
            "content": None,
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}],
        },
    ),
    Case(
        "qwen3coder-text-after",
        "A\n" + WEATHER + "\nDone.",
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops text that follows a call; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": "A\nDone.",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
    ),
    Case(
        "qwen3coder-with-qwen3-reasoning",
        "<think>\nThe user wants the weather.\n</think>\n\n" + WEATHER,
        P,
        "qwen3",
        tools=TOOLS,
        prompt="<|im_start|>assistant\n",
    ),
    Case(
        "qwen3coder-reasoning-then-text",
        "<think>\nplan\n</think>\n\nChecking.\n" + WEATHER,
        P,
        "qwen3",
        tools=TOOLS,
        prompt="<|im_start|>assistant\n",
        vllm_differs="vLLM strips the whole content when a call is made, here the newlines after </think> that it "
        "keeps when no call follows; tokenmill drops only the whitespace next to a call, so content "
        "does not depend on what comes later",
        expect={
            "reasoning": "\nplan\n",
            "content": "\n\nChecking.",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
    ),
]
