"""``tokenmill bench parsers``: what parsing tool calls and reasoning costs per output token.

tokenmill's parsers look at each character of the output a bounded number of times (see
``tokenizer_workers/output_parsers/base.py``), so their cost per token should not grow with
the output; vLLM's legacy parsers re-parse the whole text at every token (vLLM issues #44873
and #54453), so theirs grows with it. This measures both on the same texts.

Per format, a realistic output of N tokens: a line of content, then one call whose arguments
hold a long string (an agent writing a file; for reasoning formats, N tokens of thinking and
a short answer). The text is cut into one piece per token of the embedded DeepSeek-V4
tokenizer and fed piece by piece, as the tokenizer workers feed their parsers; ``feed`` for
every piece plus ``finish`` is timed, best of 3 runs. vLLM's parsers run in the vLLM venv
(``parsers_vllm.py``) on the same texts, one token per ``parse_delta``; there each
format's markers are single tokens (gpt-oss: Harmony's own encoding), so a text is a few
tokens shorter, and each side's figure is per token of its own tokenization.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tokenmill.bench.common import add_common_options, corpus, vllm_venv_default, write_json
from tokenmill.bench.servers import ROOT

SIZES = (1000, 4000, 16000)
QUICK_SIZES = (1000, 4000)
RUNS = 3
VLLM_CAP_S = 60.0  # a vLLM format whose run takes longer skips its larger sizes
VLLM_VENV = Path(vllm_venv_default())

WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a file in the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}
TOOLS = [WRITE_FILE]
PATH = "src/module.py"
LEAD = "I'll write the module now."
ANSWER = "The module is written and its tests pass."
NO_LEAD = {"llama3_json"}  # Llama 3 writes its calls alone (vLLM reads no calls after content)


def add_arguments(parser) -> None:
    add_common_options(parser)
    parser.add_argument("--sizes", help="Output lengths in tokens (default 1000,4000,16000; quick 1000,4000).")
    parser.add_argument("--formats", help="Comma-separated format names (default: every registered one).")
    parser.add_argument("--no-vllm", action="store_true", help="Skip vLLM's parsers.")


# ---- the outputs, one generator per format --------------------------------------------------
# A tool-call generator takes the call's arguments and returns the model's output; a reasoning
# one takes the thinking and returns the output. Each follows its parser module's docstring.


def file_args(content: str) -> dict:
    """The arguments of the benchmark's call: a file and what to write in it."""
    return {"path": PATH, "content": content}


def _args(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def _qwen3_coder(args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"{LEAD}\n\n<tool_call>\n<function=write_file>\n{params}</function>\n</tool_call>"


def _glm45(args: dict) -> str:
    params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"{LEAD}\n<tool_call>write_file\n{params}</tool_call>"


def _deepseek_v3(args: dict) -> str:
    call = f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>write_file\n```json\n{_args(args)}\n```<｜tool▁call▁end｜>"
    return f"{LEAD}<｜tool▁calls▁begin｜>{call}<｜tool▁calls▁end｜>"


def _deepseek_v31(args: dict) -> str:
    call = f"<｜tool▁call▁begin｜>write_file<｜tool▁sep｜>{_args(args)}<｜tool▁call▁end｜>"
    return f"{LEAD}<｜tool▁calls▁begin｜>{call}<｜tool▁calls▁end｜>"


def _deepseek_v4(args: dict) -> str:
    d = "｜DSML｜"
    params = "".join(f'<{d}parameter name="{k}" string="true">{v}</{d}parameter>\n' for k, v in args.items())
    return f'{LEAD}\n\n<{d}tool_calls>\n<{d}invoke name="write_file">\n{params}</{d}invoke>\n</{d}tool_calls>'


def _kimi_k2(args: dict) -> str:
    call = f"<|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>{_args(args)}<|tool_call_end|>"
    return f"{LEAD}<|tool_calls_section_begin|>{call}<|tool_calls_section_end|>"


def _harmony(args: dict) -> str:
    call = f"<|start|>assistant<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>{_args(args)}"
    return f"<|channel|>commentary<|message|>{LEAD}<|end|>{call}<|call|>"


TOOL_TEXTS: dict[str, Callable[[dict], str]] = {
    "hermes": lambda a: f"{LEAD}\n<tool_call>\n{_args({'name': 'write_file', 'arguments': a})}\n</tool_call>",
    "qwen3_coder": _qwen3_coder,
    "llama3_json": lambda a: f"<|python_tag|>{_args({'name': 'write_file', 'parameters': a})}",
    "mistral": lambda a: f"{LEAD}[TOOL_CALLS]write_file[ARGS]{_args(a)}",
    "deepseek_v3": _deepseek_v3,
    "deepseek_v31": _deepseek_v31,
    "deepseek_v4": _deepseek_v4,
    "kimi_k2": _kimi_k2,
    "glm45": _glm45,
    "openai": _harmony,
}

# name -> (generator, the end of the rendered prompt tokenmill reads, chat_template_kwargs vLLM reads)
REASONING_TEXTS: dict[str, tuple[Callable[[str], str], str, dict]] = {
    "deepseek_r1": (lambda r: f"{r}</think>\n\n{ANSWER}", "<｜Assistant｜><think>\n", {}),
    "deepseek_v3": (lambda r: f"{r}</think>\n\n{ANSWER}", "<｜Assistant｜><think>", {"thinking": True}),
    "qwen3": (lambda r: f"<think>\n{r}\n</think>\n\n{ANSWER}", "<|im_start|>assistant\n", {}),
    "glm45": (lambda r: f"<think>{r}</think>{ANSWER}", "<|assistant|>", {}),
    "kimi_k2": (lambda r: f"<think>{r}</think>{ANSWER}", "<|im_assistant|>assistant<|im_middle|>", {}),
    "openai_gptoss": (
        lambda r: (
            f"<|channel|>analysis<|message|>{r}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
        ),
        "<|start|>assistant",
        {},
    ),
    "granite": (lambda r: f"Here is my thought process:\n{r}\nHere is my response:\n{ANSWER}", "", {}),
}


@dataclass
class ParserCase:
    """One parser on one generated output, cut into the text each token adds, and what it must yield."""

    kind: str  # "tool" or "reasoning"
    name: str  # the parser's name in that registry
    size: int  # the nominal length in tokens
    text: str
    pieces: list[str]  # one text per token
    prompt: str
    kwargs: dict  # vLLM's chat_template_kwargs
    expect: object  # the call's arguments, or the thinking


def token_pieces(tokenizer, text: str) -> list[str]:
    """The text cut at the end of each token (a token inside a multi-byte character gets "")."""
    ends = [end for _, end in tokenizer.encode(text, add_special_tokens=False).offsets]
    ends[-1] = len(text)
    pieces = [text[a:b] for a, b in zip([0, *ends], ends)]
    assert "".join(pieces) == text, "token offsets do not cover the text"
    return pieces


def sized(build: Callable[[int], str], tokens: int, tokenizer) -> tuple[int, str, list[str]]:
    """``build(chars)`` with ``chars`` chosen so that the text is about ``tokens`` tokens long."""
    chars = tokens * 3
    for _ in range(6):
        text = build(chars)
        pieces = token_pieces(tokenizer, text)
        if abs(len(pieces) - tokens) <= tokens // 100:
            break
        chars = max(1, round(chars * tokens / len(pieces)))
    return chars, text, pieces


def parser_cases(formats: set[str] | None, sizes: list[int]) -> list[ParserCase]:
    from tokenmill.tokenizer_workers.model import load_model
    from tokenmill.tokenizer_workers.output_parsers import REASONING_PARSERS, TOOL_PARSERS

    tokenizer = load_model(None).tokenizer
    source = corpus(max(sizes) * 8 + 10_000)  # Python source: what an agent writes, and thinks about
    out = []
    for kind, registry, generators in (
        ("tool", TOOL_PARSERS, TOOL_TEXTS),
        ("reasoning", REASONING_PARSERS, REASONING_TEXTS),
    ):
        for name in registry:
            if formats and name not in formats:
                continue
            if name not in generators:
                raise SystemExit(f"bench parsers: no output generator for {kind} format {name!r}")
            for size in sizes:
                if kind == "tool":
                    chars, text, pieces = sized(
                        lambda n, name=name: TOOL_TEXTS[name](file_args(source[:n])), size, tokenizer
                    )
                    out.append(ParserCase(kind, name, size, text, pieces, "", {}, file_args(source[:chars])))
                else:
                    build, prompt, kwargs = REASONING_TEXTS[name]
                    chars, text, pieces = sized(lambda n, build=build: build(source[:n].strip()), size, tokenizer)
                    out.append(ParserCase(kind, name, size, text, pieces, prompt, kwargs, source[:chars].strip()))
    return out


# ---- tokenmill's side -----------------------------------------------------------------------


def make_parser(w: ParserCase):
    from tokenmill.tokenizer_workers.output_parsers import ParserChoice, reasoning_parser_class, tool_parser_class

    if w.kind == "tool":
        return ParserChoice(tool_parser_class(w.name), None).make(TOOLS, "")
    return ParserChoice(None, reasoning_parser_class(w.name)).make(None, w.prompt)


def check(w: ParserCase) -> None:
    """The parser must read the generated output as the generator meant it: a broken generator
    (or parser) would time a different path, so it fails the bench."""
    from tokenmill.tokenizer_workers.output_parsers import CALL, CONTENT, REASONING, join_pieces

    parser = make_parser(w)
    got = []
    for piece in w.pieces:
        got += parser.feed(piece)
    got = join_pieces(got + parser.finish())
    calls = [v for k, v in got if k == CALL]
    text = {kind: "".join(v for k, v in got if k == kind).strip() for kind in (CONTENT, REASONING)}
    where = f"bench parsers: {w.kind} format {w.name} at {w.size} tokens"
    if w.kind == "tool":
        assert len(calls) == 1, f"{where}: {len(calls)} calls, not 1"
        assert calls[0].name == "write_file" and json.loads(calls[0].arguments) == w.expect, f"{where}: wrong call"
        lead = "" if w.name in NO_LEAD else LEAD
        assert text[CONTENT] == lead and not text[REASONING], f"{where}: wrong content {text[CONTENT][:200]!r}"
    else:
        assert not calls and text[REASONING] == w.expect, f"{where}: wrong reasoning {text[REASONING][:200]!r}"
        assert text[CONTENT] == ANSWER, f"{where}: wrong content {text[CONTENT][:200]!r}"


def time_tokenmill(w: ParserCase) -> float:
    """Microseconds per token: ``feed`` of every piece plus ``finish``, best of RUNS."""
    best = float("inf")
    for _ in range(RUNS):
        parser = make_parser(w)
        feed = parser.feed
        start = time.perf_counter()
        for piece in w.pieces:
            feed(piece)
        parser.finish()
        best = min(best, time.perf_counter() - start)
    return best / len(w.pieces) * 1e6


# ---- vLLM's side ----------------------------------------------------------------------------


def run_vllm(cases: list[ParserCase]) -> tuple[str | None, dict]:
    """vLLM's version and {(kind, name, size): result} from parsers_vllm.py in the vLLM venv,
    or (None, {}) where there is no vLLM venv."""
    from tokenmill.tokenizer_workers.output_parsers import reasoning_parser_class, tool_parser_class

    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        print(f"no vLLM venv at {VLLM_VENV}: tokenmill only", file=sys.stderr)
        return None, {}
    cases = []
    for w in cases:
        cls = tool_parser_class(w.name) if w.kind == "tool" else reasoning_parser_class(w.name)
        cases.append(
            {
                "kind": w.kind,
                "name": w.name,
                "size": w.size,
                "text": w.text,
                "prompt": w.prompt,
                "markers": list(cls.markers),
                "chat_template_kwargs": w.kwargs,
            }
        )
    payload = json.dumps({"tools": TOOLS, "cases": cases, "cap_s": VLLM_CAP_S, "runs": RUNS}, ensure_ascii=False)
    # as a module from the checkout: run as a file, its folder would come first on sys.path and this
    # package's vllm.py would shadow vLLM
    proc = subprocess.run(
        [str(python), "-m", "tokenmill.bench.parsers_vllm"], input=payload, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines or "version" not in lines[0]:
        print(f"vLLM's side did not start (exit {proc.returncode}): tokenmill only", file=sys.stderr)
        return None, {}
    if proc.returncode != 0:  # what it finished is kept; the rest reads "no result"
        print(f"vLLM's side stopped early (exit {proc.returncode})", file=sys.stderr)
    return lines[0]["version"], {(r["kind"], r["name"], r["size"]): r for r in lines[1:]}


# ---- the report -----------------------------------------------------------------------------


def _cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def print_table(report: dict, notes: list[str]) -> None:
    sizes = report["tokens"]
    with_vllm = report["versions"]["vllm"] is not None
    head = [f"{'format':<24}"] + [f"{f'{n} tm':>9}" for n in sizes]
    if with_vllm:
        head += [f"{f'{n} vLLM':>10}" for n in sizes] + [f"{f'{n} ratio':>10}" for n in sizes]
    print(
        f"\ntokenmill bench parsers: µs per output token (tm: tokenmill {report['versions']['tokenmill']}"
        + (f", vLLM {report['versions']['vllm']}; ratio: vLLM ÷ tokenmill" if with_vllm else "")
        + ")"
    )
    print(" ".join(head))
    for kind in ("tool", "reasoning"):
        for name, row in report[kind].items():
            tm, vl = row["tokenmill_us_per_token"], row.get("vllm_us_per_token", {})
            cells = [f"{kind + ' ' + name:<24}"] + [f"{_cell(tm.get(str(n))):>9}" for n in sizes]
            if with_vllm:
                cells += [f"{_cell(vl.get(str(n))):>10}" for n in sizes]
                cells += [f"{_ratio(vl.get(str(n)), tm.get(str(n))):>10}" for n in sizes]
            print(" ".join(cells))
    for note in notes:
        print(note)


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.1f}x"


def run(args) -> int:
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    formats = {f for f in (args.formats or "").split(",") if f} or None
    started = time.perf_counter()
    cases = parser_cases(formats, sizes)
    if not cases:
        raise SystemExit(f"bench parsers: no format named {args.formats!r}")
    report: dict = {
        "tokens": sizes,
        "tool": {},
        "reasoning": {},
        "versions": {"tokenmill": importlib.metadata.version("tokenmill"), "vllm": None},
    }
    for w in cases:
        check(w)
        row = report[w.kind].setdefault(w.name, {"tokenmill_us_per_token": {}, "vllm_us_per_token": {}})
        row["tokenmill_us_per_token"][str(w.size)] = round(time_tokenmill(w), 3)
    print(f"tokenmill's parsers timed in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    notes = []
    if not args.no_vllm:
        report["versions"]["vllm"], results = run_vllm(cases)
    if report["versions"]["vllm"]:
        for w in cases:
            r = results.get((w.kind, w.name, w.size), {"error": "no result"})
            report[w.kind][w.name]["vllm_us_per_token"][str(w.size)] = r.get("us_per_token")
            why = r.get("error") or r.get("skipped") or r.get("note")
            if why:
                notes.append(f"vLLM {w.kind} {w.name} at {w.size}: {why}")
    print_table(report, notes)
    print(f"({time.perf_counter() - started:.0f} s in all)")
    write_json(args.json, report)
    return 0
