from tests.parser_cases import Case

CASES = [
    Case(
        "r1-prompt-opened",
        "Let me think.\nOK.</think>\n\nThe answer is 4.",
        None,
        "deepseek_r1",
        prompt="<｜Assistant｜><think>\n",
    ),
    Case("r1-output-opens", "<think>Let me think.</think>The answer is 4.", None, "deepseek_r1"),
    Case("r1-never-closed", "Still thinking about it", None, "deepseek_r1", prompt="<｜Assistant｜><think>\n"),
    Case(
        "r1-thinking-off",
        "The answer is 4.",
        None,
        "deepseek_r1",
        prompt="<｜Assistant｜></think>",
        vllm_differs="vLLM's deepseek_r1 takes output without </think> as all reasoning even when the prompt "
        "closed thinking; tokenmill reads the prompt and returns it as content",
        expect={"reasoning": None, "content": "The answer is 4.", "tool_calls": []},
    ),
    Case("qwen3-thinking", "<think>\nHmm, 2+2.\n</think>\n\n4", None, "qwen3", prompt="<|im_start|>assistant\n"),
    Case("qwen3-empty-think", "<think>\n\n</think>\n\n4", None, "qwen3", prompt="<|im_start|>assistant\n"),
    Case(
        "qwen3-no-think",
        "Plain answer.",
        None,
        "qwen3",
        prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n",
        chat_template_kwargs={"enable_thinking": False},
    ),
    Case("glm45-thinking", "<think>a plan</think>Result.", None, "glm45", prompt="<|assistant|>"),
    Case(
        "v3-thinking-off",
        "Just an answer </think> with a stray tag.",
        None,
        "deepseek_v3",
        prompt="<｜Assistant｜></think>",
    ),
]
