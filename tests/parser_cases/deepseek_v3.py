from tests.parser_cases import TOOLS, Case

P = "deepseek_v3"
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def call(name: str, arguments: str) -> str:
    return f"{CB}function{S}{name}\n```json\n{arguments}\n```{CE}"


PARIS = call("get_weather", '{"city": "Paris"}')
TOKYO = call("get_weather", '{"city": "東京", "unit": "c"}')
NESTED = call("search", '{"query": "x\\\\y\\"z 😀", "limit": 2, "exact": false, "filters": {"a": [1, {"b": null}]}}')
Q = call("search", '{"query": "q"}')
PRETTY = call("get_weather", '{\n  "city": "Paris",\n  "unit": "f"\n}')
CASES = [
    Case("dsv3-plain", "No tools needed: 2 + 2 = 4. ```json\n{}\n```", P, tools=TOOLS),
    Case("dsv3-one", f"Let me check.\n{B}{PARIS}{E}", P, tools=TOOLS),
    Case("dsv3-two", f"{B}{TOKYO}\n{NESTED}{E}", P, tools=TOOLS),
    Case("dsv3-empty-object", f"{B}{call('search', '{}')}{E}", P, tools=TOOLS),
    Case(
        "dsv3-r1-thinking",
        f"plan it</think>Calling.{B}{Q}{E}",
        P,
        "deepseek_r1",
        tools=TOOLS,
        prompt="<｜Assistant｜><think>",
    ),
    Case(
        "dsv3-pretty-json",
        f"{B}{PRETTY}{E}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM's pattern matches one-line arguments only and loses a call whose JSON spans lines; "
        "tokenmill reads it",
        expect={
            "reasoning": None,
            "content": None,
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}],
        },
    ),
    Case(
        "dsv3-truncated",
        f'Hm.{B}{CB}function{S}get_weather\n```json\n{{"city": "Par',
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops an unfinished call's text; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": f'Hm.{CB}function{S}get_weather\n```json\n{{"city": "Par',
            "tool_calls": [],
        },
    ),
    Case(
        "dsv3-bad-json",
        f"{B}{call('get_weather', '{city: Paris}')}{E}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM passes arguments that are not JSON through as a call; tokenmill returns the call's "
        "text as content",
        expect={"reasoning": None, "content": call("get_weather", "{city: Paris}"), "tool_calls": []},
    ),
    Case(
        "dsv3-unknown-function",
        f"{B}{call('launch_rockets', '{}')}{E}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their text "
        "as content",
        expect={"reasoning": None, "content": call("launch_rockets", "{}"), "tool_calls": []},
    ),
    Case(
        "dsv3-text-after",
        f"{B}{Q}{E}\nDone.",
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops text that follows the calls; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": "\nDone.",
            "tool_calls": [{"name": "search", "arguments": {"query": "q"}}],
        },
    ),
]
