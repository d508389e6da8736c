"""Tool-call and reasoning parsers on their own, no process started: stated answers, chunking-invariant,
token-stream safe, auto-detection from templates, hostile input. (Their comparison with vLLM's parsers,
which needs vLLM's venv, is tests/engines/test_output_parsers_vs_vllm.py.)

* ``test_chunking_invariant``: cutting the text anywhere (hypothesis) gives the same pieces.
* ``test_token_stream_through_the_detokenizer``: token IDs in frames of any size, through the worker's
  detokenizer, give what a parse of the decoded text gives.
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.parse_case import make_parser, parse_chunks, summary
from tests.parser_cases import Case, all_cases
from tokenmill.tokenizer_workers.output_parsers import CALL, CONTENT, join_pieces

CASES = all_cases()


STATED = [c for c in CASES if c.expect is not None]


@pytest.mark.parametrize("case", STATED, ids=[c.id for c in STATED])
def test_stated_answers(case: Case) -> None:
    """Documented differences from vLLM are checked even where vLLM is not installed."""
    assert summary(parse_chunks(case, [case.text])) == case.expect


@st.composite
def cut_case(draw):
    case = draw(st.sampled_from(CASES))
    n = len(case.text)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=min(40, n)))))
    bounds = [0, *cuts, n]
    return case, [case.text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut_case())
def test_chunking_invariant(example) -> None:
    case, chunks = example
    assert parse_chunks(case, chunks) == parse_chunks(case, [case.text])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_one_character_at_a_time(case: Case) -> None:
    assert parse_chunks(case, list(case.text)) == parse_chunks(case, [case.text])


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.tokenizer_workers.model import load_model

    return load_model(None).tokenizer


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(case=st.sampled_from(CASES), data=st.data())
def test_token_stream_through_the_detokenizer(tokenizer, case, data) -> None:
    """The worker's path: token IDs in frames of any size (cuts inside multi-byte characters too),
    DecodeStream, the parser; the joined pieces equal a parse of the decoded text."""
    from tokenmill.scheduler_client.protocol import ids_to_frame
    from tokenmill.tokenizer_workers.conversion.plan import DetokSpec
    from tokenmill.tokenizer_workers.detokenizer import Detokenizer
    from tokenmill.tokenizer_workers.messages import DetokItem

    ids = tokenizer.encode(case.text, add_special_tokens=False).ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    sizes = data.draw(st.lists(st.integers(1, 8), min_size=len(ids), max_size=len(ids)))
    detok = Detokenizer(tokenizer)
    parser = make_parser(case)
    detok.open(
        DetokSpec(
            "r",
            [],
            skip_special_tokens=True,
            parser=parser,
            include_reasoning=True,
            tool_parser_name=case.tool_parser or "",
        )
    )
    pieces, start = [], 0
    for size in sizes:
        if start >= len(ids):
            break
        frame = ids_to_frame(ids[start : start + size])
        start += size
        [delta] = detok.step([DetokItem("r", frame, start >= len(ids))])
        pieces += [(p.kind, (p.name, json.loads(p.text)) if p.kind == CALL else p.text) for p in delta.pieces]
    if start == 0:  # an empty output: the scheduler's final frame carries no token
        [delta] = detok.step([DetokItem("r", b"", True)])
        pieces += [(p.kind, p.text) for p in delta.pieces]
    assert join_pieces(pieces) == parse_chunks(case, [text])


AUTO = {  # template -> (tool-call parser, reasoning parser) that --*-parser auto must pick
    "deepseek-r1.jinja": ("deepseek_v3", "deepseek_r1"),
    "deepseek-v3.jinja": ("deepseek_v3", None),
    "deepseek-v3.2.jinja": ("deepseek_v4", "deepseek_r1"),
    "glm-4.5.jinja": ("glm45", "glm45"),
    "granite-3.3-2b-instruct.jinja": (None, "granite"),
    "hermes-2-pro-llama-3-8b-tool_use.jinja": ("hermes", None),
    "kimi-k2-instruct.jinja": ("kimi_k2", None),
    "llama-3.1-8b-instruct.jinja": ("llama3_json", None),
    "llama-3.3-70b-instruct.jinja": ("llama3_json", None),
    "mistral-7b-instruct-v0.3.jinja": ("mistral", None),
    "mistral-nemo-instruct-2407.jinja": ("mistral", None),
    "qwen2.5-7b-instruct.jinja": ("hermes", None),
    "qwen3-0.6b.jinja": ("hermes", "qwen3"),
    "qwen3-coder-30b-a3b-instruct.jinja": ("qwen3_coder", None),
    "qwq-32b.jinja": ("hermes", "qwen3"),
    "llama-2-7b-chat.jinja": (None, None),
    "gemma-3-it.jinja": (None, None),
}


@pytest.mark.parametrize("name", sorted(AUTO))
def test_auto_picks_the_format_from_the_template(name):
    from conftest import require_shared

    from tokenmill.tokenizer_workers.output_parsers import choose_parsers

    template = (require_shared() / "chat_templates" / name).read_text(encoding="utf-8")
    chosen = choose_parsers("auto", "auto", template)
    assert (chosen.tool_name or None, chosen.reasoning_name or None) == AUTO[name]


def test_auto_on_the_embedded_model():
    from tokenmill.tokenizer_workers.model import _DEFAULT_TEMPLATE
    from tokenmill.tokenizer_workers.output_parsers import choose_parsers

    chosen = choose_parsers("auto", "auto", _DEFAULT_TEMPLATE.read_text(encoding="utf-8"))
    assert (chosen.tool_name, chosen.reasoning_name) == ("deepseek_v31", "deepseek_r1")


DEEP = '{"query": ' + "[" * 100_000 + "]" * 100_000 + "}"
DEEP_CALLS = {
    "hermes": f'<tool_call>\n{{"name": "search", "arguments": {DEEP}}}\n</tool_call>',
    "deepseek_v31": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{DEEP}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
    f"{DEEP}<|tool_call_end|><|tool_calls_section_end|>",
    "llama3_json": f'{{"name": "search", "parameters": {DEEP}}}',
    "mistral": f"[TOOL_CALLS]search[ARGS]{DEEP}",
}


@pytest.mark.parametrize("name", sorted(DEEP_CALLS))
def test_arguments_nested_too_deeply_come_back_as_content(name):
    """json.loads recurses: 100,000 brackets must not crash the worker's parser."""
    from tests.parser_cases import SEARCH

    case = Case(name, DEEP_CALLS[name], name, tools=[SEARCH])
    [(kind, text)] = parse_chunks(case, [case.text])
    assert kind == CONTENT and DEEP in text  # the call's own text; a section's markers around it are dropped


def test_every_difference_from_vllm_is_documented():
    doc = (ROOT / "docs" / "api" / "tool-calls.md").read_text(encoding="utf-8")
    missing = [c.id for c in CASES if c.vllm_differs and f"`{c.id}`" not in doc]
    assert not missing, f"add these to docs/api/tool-calls.md: {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_single_cut(case: Case) -> None:
    """Two chunks, cut at every place: inside each marker, each JSON escape, each word."""
    whole = parse_chunks(case, [case.text])
    for at in range(1, len(case.text)):
        assert parse_chunks(case, [case.text[:at], case.text[at:]]) == whole, at
