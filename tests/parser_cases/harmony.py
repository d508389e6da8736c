"""gpt-oss Harmony: vLLM's ``openai`` tool parser with its ``openai_gptoss`` reasoning parser.

vLLM parses Harmony from token ids with openai_harmony's encoding (``HarmonyParser``, chosen by
the model type, not by the parser names); the oracle must run that path for these cases.
The texts begin after the generation prompt ``<|start|>assistant``.
"""

from tests.parser_cases import TOOLS, Case

T, R = "openai", "openai_gptoss"
PROMPT = "<|start|>user<|message|>Weather in SF?<|end|><|start|>assistant"
CALL_SF = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

CASES = [
    Case(
        "harmony-reasoning-answer",
        "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
    ),
    Case(
        "harmony-messages-joined",
        "<|channel|>analysis<|message|>First thought.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me think more.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Second thought.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done:\n  **4**<|return|>",
        None,
        R,
        prompt=PROMPT,
    ),
    Case(
        "harmony-one-call",
        "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        + CALL_SF
        + '{"city":"San Francisco","unit":"c"}<|call|>',
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
    ),
    Case(
        "harmony-recipient-first-no-stop-token",
        ' to=functions.search<|channel|>commentary json<|message|>{"query": "harmony", "limit": 2}',
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
    ),
    Case(
        "harmony-preamble-two-calls",
        "<|channel|>analysis<|message|>Two lookups.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
        + CALL_SF
        + '{"city": "Zürich \\"old\\" 東京 😀\\n", "unit": "f"}<|call|>'
        "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>"
        '{"query": "a<b>c \\\\ \\u00e9", "filters": {"x": [1, {"y": null}]}, "exact": true}<|call|>',
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
    ),
    Case(
        "harmony-builtin-tool-in-analysis",
        "<|channel|>analysis<|message|>Search first.<|end|>"
        '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "SF weather"}<|call|>',
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
    ),
    Case(
        "harmony-cut-in-header",
        "<|channel|>analysis<|message|>Answering now.<|end|><|start|>assistant<|channel|>fin",
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
    ),
    Case(
        "harmony-truncated-call",
        "<|channel|>analysis<|message|>Call it.<|end|>" + CALL_SF + '{"city": "Os',
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
        vllm_differs="vLLM returns a call cut off by max_tokens with its partial arguments; tokenmill returns "
        "the message's text as content",
        expect={"reasoning": "Call it.", "content": CALL_SF + '{"city": "Os', "tool_calls": []},
    ),
    Case(
        "harmony-invalid-arguments",
        CALL_SF + "{city: Oslo}<|call|>",
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
        vllm_differs="vLLM returns a call whose arguments are not JSON, as they are; tokenmill returns the "
        "message's text as content",
        expect={"reasoning": None, "content": CALL_SF + "{city: Oslo}<|call|>", "tool_calls": []},
    ),
    Case(
        "harmony-unknown-function",
        "<|channel|>analysis<|message|>Launch.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.launch_rockets <|constrain|>json<|message|>{}<|call|>",
        T,
        R,
        tools=TOOLS,
        prompt=PROMPT,
        vllm_differs="vLLM returns calls to functions the request did not declare; tokenmill returns their "
        "text as content",
        expect={
            "reasoning": "Launch.",
            "content": "<|start|>assistant<|channel|>commentary to=functions.launch_rockets "
            "<|constrain|>json<|message|>{}<|call|>",
            "tool_calls": [],
        },
    ),
    Case(
        "harmony-tool-parser-alone",
        "<|channel|>analysis<|message|>Need weather.<|end|>" + CALL_SF + '{"city": "Lima"}<|call|>',
        T,
        None,
        tools=TOOLS,
        prompt=PROMPT,
        vllm_differs="without a reasoning parser vLLM drops the analysis channel; tokenmill's Harmony tool "
        "parser parses the whole output and returns it as reasoning",
        expect={
            "reasoning": "Need weather.",
            "content": None,
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}],
        },
    ),
    Case(
        "harmony-reasoning-parser-alone-call",
        "<|channel|>analysis<|message|>Need weather.<|end|>" + CALL_SF + '{"city": "Lima"}<|call|>',
        None,
        R,
        prompt=PROMPT,
        vllm_differs="without a tool parser vLLM drops call messages; tokenmill returns their text as content",
        expect={"reasoning": "Need weather.", "content": CALL_SF + '{"city": "Lima"}<|call|>', "tool_calls": []},
    ),
]
