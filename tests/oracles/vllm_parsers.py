"""vLLM's own tool-call and reasoning parsers as a test oracle (run with the vLLM venv's Python).

Reads JSON lines on stdin, one case each:
    {"tool_parser": "hermes" | null, "reasoning_parser": "qwen3" | null, "tools": [...] | null,
     "text": "...model output...", "markers": ["<tool_call>", ...], "chat_template_kwargs": {...}}
and writes one JSON line per case: {"reasoning", "content", "tool_calls": [{"name", "arguments"}]}
(arguments parsed to JSON where they parse), or {"error": "..."}.

vLLM is chained as its server chains it (ParserManager.get_parser: reasoning first, then tool
calls on the rest). The tokenizer is the DeepSeek-V4 one with the case's markers added as
special tokens, so that parsers that look markers up in the vocabulary find them.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
logging.disable(logging.WARNING)

from tokenmill.bench.parsers_vllm import HarmonyDecoder, deepseek_tokenizer  # noqa: E402  (the same set-up as the bench)


def run(case: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    tok = deepseek_tokenizer(tuple(case.get("markers") or ()))
    kwargs = case.get("chat_template_kwargs") or {}
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=case.get("tools"),
        chat_template_kwargs=kwargs or None,
    )
    # gpt-oss: vLLM picks HarmonyParser by the model type (not the parser names) and parses
    # token ids of openai_harmony's own encoding (bundled with openai_harmony: works offline)
    harmony = case.get("tool_parser") == "openai" or case.get("reasoning_parser") == "openai_gptoss"
    cls = ParserManager.get_parser(
        tool_parser_name=case.get("tool_parser"),
        reasoning_parser_name=case.get("reasoning_parser"),
        enable_auto_tools=bool(case.get("tool_parser")),
        is_harmony=harmony,
    )
    parser = cls(tok, request.tools, chat_template_kwargs=kwargs)
    if harmony:
        from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

        parser.model_tokenizer = HarmonyDecoder(get_encoding())
        ids = get_encoding().encode(case["text"], allowed_special="all")
    else:
        ids = tok.encode(case["text"], add_special_tokens=False)
    reasoning, content, calls = parser.parse(case["text"], request, enable_auto_tools=True, model_output_token_ids=ids)
    out_calls = []
    for call in calls or []:
        try:
            arguments = json.loads(call.arguments)
        except (TypeError, ValueError):
            arguments = call.arguments
        out_calls.append({"name": call.name, "arguments": arguments})
    return {"reasoning": reasoning, "content": content, "tool_calls": out_calls}


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = run(json.loads(line))
        except Exception as exc:  # an oracle failure is reported per case, not fatal
            result = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
