from tests.parser_cases import TOOLS, Case

P = "glm45"


def call(name: str, sep: str = "\n", **args: str) -> str:
    """A call as GLM-4.6 writes it (sep="\\n") or GLM-4.5 (sep="")."""
    body = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in args.items())
    return f"<tool_call>{name}{sep}{body}</tool_call>"


WEATHER = call("get_weather", city="Paris")
TRUNCATED = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"
NO_VALUE = "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>"
UNKNOWN = call("launch_rockets", count="3")

CASES = [
    Case("glm45-plain", "No tools needed: 2 < 3 and <tool is not a tag.", P, tools=TOOLS),
    Case("glm45-one", "I'll look that up.\n" + WEATHER, P, tools=TOOLS),
    Case(
        "glm45-typed",
        call(
            "search",
            sep="",
            query='line 1\n a<b> & "quoted" 東京 😀 ',
            limit="3",
            exact="true",
            score="0.5",
            filters='{"x": [1, {"y": null}]}',
            tags='["a", "b"]',
            extra="5",
        ),
        P,
        tools=TOOLS,
    ),
    Case("glm45-two", WEATHER + "\n" + call("get_weather", city="Rome", unit="c") + "\n", P, tools=TOOLS),
    Case("glm45-no-args", "<tool_call>search</tool_call>", P, tools=TOOLS),
    Case(
        "glm45-unclosed-whole",
        "<tool_call>get_weather\n<arg_key> city </arg_key>\n<arg_value>Oslo</arg_value>\n",
        P,
        tools=TOOLS,
    ),
    Case(
        "glm45-truncated",
        "Sure.\n" + TRUNCATED,
        P,
        tools=TOOLS,
        vllm_differs="vLLM makes a call of a call cut off by max_tokens, without the unfinished argument; "
        "tokenmill returns its text as content",
        expect={"reasoning": None, "content": "Sure.\n" + TRUNCATED, "tool_calls": []},
    ),
    Case(
        "glm45-missing-value-tag",
        NO_VALUE,
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops an argument written without <arg_value> and makes the call without it; tokenmill "
        "returns the call's text as content",
        expect={"reasoning": None, "content": NO_VALUE, "tool_calls": []},
    ),
    Case(
        "glm45-unknown-function",
        "Launching.\n" + UNKNOWN,
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops a call to a function the request did not declare, text and all; tokenmill returns "
        "its text as content",
        expect={"reasoning": None, "content": "Launching.\n" + UNKNOWN, "tool_calls": []},
    ),
    Case(
        "glm45-text-after",
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
        "glm45-with-reasoning",
        "<think>The user wants the weather.</think>\n" + WEATHER,
        P,
        "glm45",
        tools=TOOLS,
        prompt="<|assistant|>",
    ),
    Case(
        "glm45-thinking-off",
        "Checking.\n" + WEATHER,
        P,
        "glm45",
        tools=TOOLS,
        prompt="<|assistant|>\n<think></think>",
        chat_template_kwargs={"enable_thinking": False},
    ),
]
