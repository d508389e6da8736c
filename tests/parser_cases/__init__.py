"""Model outputs for the parser tests, one module per format (tests/unit/test_output_parsers.py and tests/engines/test_output_parsers_vs_vllm.py run them).

Each module defines ``CASES``: a list of :class:`Case`. A case is checked three ways: against
vLLM's own parser (the oracle), for chunking invariance (every cut of its text gives the same
result), and through the worker's detokenizer token by token.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    id: str
    text: str  # the model's output, markers included
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    tools: list[dict] | None = None
    prompt: str = ""  # the end of the rendered prompt (reasoning parsers read whether it opened thinking)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # what vLLM's parsers read instead
    # Where vLLM is wrong (or differs by design): why, and what tokenmill answers instead, as
    # {"reasoning": str|None, "content": str|None, "tool_calls": [{"name", "arguments": {...}}]}.
    vllm_differs: str | None = None
    expect: dict | None = None
    # the markers vLLM's tokenizer gets, where they pick its mode (default: the parsers' markers);
    # e.g. mistral without [ARGS] in the vocabulary is vLLM's pre-v11 mode
    vllm_markers: tuple[str, ...] | None = None


def tool(name: str, properties: dict | None = None, required: list[str] | None = None) -> dict:
    """An OpenAI tools entry."""
    params: dict = {"type": "object", "properties": properties or {}}
    if required:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": params}}


WEATHER = tool("get_weather", {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, ["city"])
SEARCH = tool(
    "search",
    {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "exact": {"type": "boolean"},
        "score": {"type": "number"},
        "filters": {"type": "object"},
        "tags": {"type": "array"},
    },
)
TOOLS = [WEATHER, SEARCH]


def all_cases() -> list[Case]:
    """Every module's cases; TOKENMILL_PARSER_CASES=mod1,mod2 limits them (while writing a format)."""
    only = {m for m in os.environ.get("TOKENMILL_PARSER_CASES", "").split(",") if m}
    cases = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if only and info.name not in only:
            continue
        cases += importlib.import_module(f"{__name__}.{info.name}").CASES
    return cases
