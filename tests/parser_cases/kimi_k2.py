from tests.parser_cases import TOOLS, Case

P = "kimi_k2"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, CE, A = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def call(header: str, arguments: str) -> str:
    return f"{CB}{header}{A}{arguments}{CE}"


PARIS = call("functions.get_weather:0", '{"city": "Paris"}')
NESTED = call(
    "functions.search:1",
    '{"query": "x\\\\y\\"z 東京 😀", "limit": 2, "exact": false, "filters": {"a": [1, {"b": null}]}, "tags": []}',
)
NO_INDEX = call("functions.search", '{"query": "q"}')
CASES = [
    Case("kimi-plain", "Just an answer; <|tool_call_begin|> alone is no call.", P, tools=TOOLS),
    Case("kimi-one", f"Let me check.{SB}{PARIS}{SE}", P, tools=TOOLS),
    Case("kimi-two-spaced", f"Two calls:\n{SB}\n{PARIS}\n{NESTED}\n{SE}", P, tools=TOOLS),
    Case("kimi-header-without-prefix", f"{SB}{call('get_weather:3', '{}')}{SE}", P, tools=TOOLS),
    Case("kimi-reasoning-tools", f"<think>The user wants the weather.\n</think>\n\n{SB}{PARIS}{SE}", P, P, tools=TOOLS),
    Case(
        "kimi-reasoning-then-text",
        f"Weather in Paris? Check.  \n</think>Checking now.{SB}{PARIS}{SE}",
        P,
        P,
        tools=TOOLS,
    ),
    Case("kimi-reasoning-into-section", f"need the weather\n{SB}{PARIS}{SE}", P, P, tools=TOOLS),
    Case("kimi-reasoning-only", "<think>thinking <think>still  \n </think>\n\nThe answer is 4.", None, P),
    Case(
        "kimi-thinking-off",
        f"Sure.{SB}{PARIS}{SE}",
        P,
        P,
        tools=TOOLS,
        prompt="<|im_assistant|>assistant<|im_middle|><think></think>",
        chat_template_kwargs={"thinking": False},
    ),
    Case(
        "kimi-truncated",
        f'Hm.{SB}{CB}functions.get_weather:0{A}{{"city": "Par',
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns an unfinished call with its partial arguments (not JSON); tokenmill returns "
        "its text as content",
        expect={"reasoning": None, "content": f'Hm.{CB}functions.get_weather:0{A}{{"city": "Par', "tool_calls": []},
    ),
    Case(
        "kimi-bad-json",
        f"{SB}{call('functions.get_weather:0', '{city: Paris}')}{SE}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM passes arguments that are not JSON through as a call; tokenmill returns the call's "
        "text as content",
        expect={"reasoning": None, "content": call("functions.get_weather:0", "{city: Paris}"), "tool_calls": []},
    ),
    Case(
        "kimi-unknown-function",
        f"{SB}{call('functions.launch_rockets:0', '{}')}{SE}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their text "
        "as content",
        expect={"reasoning": None, "content": call("functions.launch_rockets:0", "{}"), "tool_calls": []},
    ),
    Case(
        "kimi-header-without-index",
        f"{SB}{NO_INDEX}{SE}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops a call whose header lacks its :INDEX; tokenmill reads the name (and makes an id)",
        expect={"reasoning": None, "content": None, "tool_calls": [{"name": "search", "arguments": {"query": "q"}}]},
    ),
    Case(
        "kimi-text-after",
        f"{SB}{PARIS}{SE}\nDone.",
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops text that follows the calls; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": "\nDone.",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
    ),
]
