"""IBM Granite: vLLM's ``granite`` reasoning parser (Granite 3.2's phrases; 3.3's tags are ours)."""

from tests.parser_cases import Case

R = "granite"
PROMPT = "<|start_of_role|>assistant<|end_of_role|>"

CASES = [
    Case(
        "granite-think-respond",
        "Here is my thought process:\nThe user wants 2+2.\nHere is my response:\n2 + 2 = 4.",
        None,
        R,
        prompt=PROMPT,
    ),
    Case(
        "granite-heres-variants",
        "Here's my thought process: short: really: yes. Here is my response: Fine: done.",
        None,
        R,
        prompt=PROMPT,
    ),
    Case(
        "granite-mixed-variants",
        "  Here is my thought process:Hmm, here's my idea.Here's my response:Answer.",
        None,
        R,
        prompt=PROMPT,
    ),
    Case("granite-plain", "Just an answer: no thinking. Here is my response: nope", None, R, prompt=PROMPT),
    Case(
        "granite-empty-response", "Here is my thought process: only this. Here is my response:", None, R, prompt=PROMPT
    ),
    Case(
        "granite-cut-while-thinking",
        "Here is my thought process: still going",
        None,
        R,
        prompt=PROMPT,
        vllm_differs="vLLM's non-streamed granite parser returns an output without a response phrase as content "
        "(its streamed one yields reasoning); tokenmill yields reasoning as it arrives",
        expect={"reasoning": " still going", "content": None, "tool_calls": []},
    ),
    Case(
        "granite-phrase-not-at-start",
        "Sure. Here is my thought process: x Here is my response: y",
        None,
        R,
        prompt=PROMPT,
        vllm_differs="vLLM finds the phrases anywhere and drops the text before them; tokenmill takes reasoning "
        "only where the output opens with it and returns this output as content",
        expect={
            "reasoning": None,
            "content": "Sure. Here is my thought process: x Here is my response: y",
            "tool_calls": [],
        },
    ),
    Case(
        "granite-3.3-tags",
        "<think>The user greets me.</think><response>Hello! How can I help?</response>",
        None,
        R,
        prompt=PROMPT,
        vllm_differs="vLLM's granite parser knows only Granite 3.2's phrases; tokenmill also reads Granite "
        "3.3's <think>/<response> tags (what the 3.3 template asks for)",
        expect={"reasoning": "The user greets me.", "content": "Hello! How can I help?", "tool_calls": []},
    ),
]
