from tests.parser_cases import TOOLS, Case, tool

P = "deepseek_v4"
D = "｜DSML｜"
B, E = f"<{D}tool_calls>", f"</{D}tool_calls>"


def param(name: str, value: str, string: str | None = "true") -> str:
    attr = f' string="{string}"' if string is not None else ""
    return f'<{D}parameter name="{name}"{attr}>{value}</{D}parameter>\n'


def invoke(name: str, *params: str) -> str:
    return f'<{D}invoke name="{name}">\n' + "".join(params) + f"</{D}invoke>\n"


def section(*invokes: str) -> str:
    return f"{B}\n" + "".join(invokes) + E


PARIS = invoke("get_weather", param("city", "Paris"))
TYPED = invoke(
    "search",
    param("query", 'a<b>c & "q"\n  東京 😀 \\n'),
    param("limit", "3", "false"),
    param("exact", "true", "false"),
    param("score", "0.5", "false"),
    param("filters", '{"x": [1, {"y": null}]}', "false"),
    param("tags", '["a", "b"]', "false"),
)
UNTYPED = invoke(
    "search", param("limit", "7", "true"), param("exact", "false", None), param("query", "[not json", None)
)
EVENT = tool(
    "create_event",
    {
        "title": {"type": "string"},
        "attendees": {"type": "integer"},
        "when": {"type": ["string", "null"]},
        "meta": {"type": "object"},
    },
)
CASES = [
    Case("dsv4-plain", 'Plain text with a tag-like <invoke name="x"> in it.', P, tools=TOOLS),
    Case("dsv4-one", f"Let me check.\n\n{section(PARIS)}", P, tools=TOOLS),
    Case("dsv4-typed", section(PARIS, TYPED), P, tools=TOOLS),
    Case("dsv4-schema-typed", section(UNTYPED), P, tools=TOOLS),
    Case(
        "dsv4-schema-types",
        section(
            invoke(
                "create_event",
                param("title", "42", "false"),
                param("attendees", "12"),
                param("when", "null", "false"),
                param("meta", '{"room": "B"}', "true"),
            )
        ),
        P,
        tools=[EVENT],
    ),
    Case("dsv4-no-params", section(invoke("search")), P, tools=TOOLS),
    Case(
        "dsv4-wrapped-arguments",
        section(invoke("search", param("arguments", '{"query": "z", "limit": 2}', "false"))),
        P,
        tools=TOOLS,
    ),
    Case(
        "dsv4-v32-section",
        f"<{D}function_calls>\n{PARIS}</{D}function_calls>",
        P,
        tools=TOOLS,
        vllm_differs="vLLM's deepseek_v4 knows only the tool_calls section and returns V3.2's function_calls "
        "markup as content; tokenmill reads both",
        expect={
            "reasoning": None,
            "content": None,
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
    ),
    Case(
        "dsv4-truncated",
        f'Sure.{B}\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par',
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns an unfinished call with the parameters it has (here none); tokenmill returns "
        "its text as content",
        expect={
            "reasoning": None,
            "content": f'Sure.<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par',
            "tool_calls": [],
        },
    ),
    Case(
        "dsv4-unclosed-parameter",
        section(
            f'<{D}invoke name="search">\n<{D}parameter name="query" string="true">a\n'
            f"{param('limit', '2', 'false')}</{D}invoke>\n"
        ),
        P,
        tools=TOOLS,
        vllm_differs="vLLM ends an unclosed parameter at the next one; tokenmill returns the broken invoke as content",
        expect={
            "reasoning": None,
            "content": f'<{D}invoke name="search">\n<{D}parameter name="query" '
            f'string="true">a\n{param("limit", "2", "false")}</{D}invoke>',
            "tool_calls": [],
        },
    ),
    Case(
        "dsv4-unknown-function",
        section(invoke("launch_rockets", param("when", "now"))),
        P,
        tools=TOOLS,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their text "
        "as content",
        expect={
            "reasoning": None,
            "content": invoke("launch_rockets", param("when", "now")).rstrip("\n"),
            "tool_calls": [],
        },
    ),
    Case(
        "dsv4-text-after",
        f"{section(PARIS)}\nAnything else?",
        P,
        tools=TOOLS,
        vllm_differs="vLLM drops text that follows the calls; tokenmill returns it as content",
        expect={
            "reasoning": None,
            "content": "\nAnything else?",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
    ),
]
