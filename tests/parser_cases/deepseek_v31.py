from tests.parser_cases import TOOLS, Case

P = "deepseek_v31"
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CASES = [
    Case("dsv31-plain", "No tools needed: 2 + 2 = 4.", P, tools=TOOLS),
    Case("dsv31-one", f'Checking.{B}{CB}get_weather{S}{{"city": "Paris"}}{CE}{E}', P, tools=TOOLS),
    Case(
        "dsv31-two",
        f'{B}{CB}get_weather{S}{{"city": "東京", "unit": "c"}}{CE}{CB}search{S}'
        f'{{"query": "x\\\\y\\"z", "limit": 2}}{CE}{E}',
        P,
        tools=TOOLS,
    ),
    Case("dsv31-empty-args", f"{B}{CB}search{S}{{}}{CE}{E}", P, tools=TOOLS),
    Case(
        "dsv31-truncated",
        f'Hm.{B}{CB}get_weather{S}{{"city": "Par',
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops an unfinished call's text; tokenmill returns it as content",
        expect={"reasoning": None, "content": f'Hm.{CB}get_weather{S}{{"city": "Par', "tool_calls": []},
    ),
    Case(
        "dsv31-bad-json",
        f"{B}{CB}get_weather{S}{{city}}{CE}{E}",
        P,
        tools=TOOLS,
        vllm_differs="vLLM passes arguments that are not JSON through as a call; tokenmill returns the call's "
        "text as content",
        expect={"reasoning": None, "content": f"{CB}get_weather{S}{{city}}{CE}", "tool_calls": []},
    ),
    Case(
        "dsv31-r1-thinking",
        f'plan it</think>Calling.{B}{CB}search{S}{{"query": "q"}}{CE}{E}',
        P,
        "deepseek_r1",
        tools=TOOLS,
        prompt="<｜Assistant｜><think>",
    ),
    Case(
        "dsv31-v3-thinking-off",
        f'Sure{B}{CB}search{S}{{"query": "q"}}{CE}{E}',
        P,
        "deepseek_v3",
        tools=TOOLS,
        prompt="<｜Assistant｜></think>",
    ),
    Case(
        "dsv31-v3-thinking-on",
        f'why not</think>ok{B}{CB}search{S}{{"query": "q"}}{CE}{E}',
        P,
        "deepseek_v3",
        tools=TOOLS,
        prompt="<｜Assistant｜><think>",
        chat_template_kwargs={"thinking": True},
    ),
]
