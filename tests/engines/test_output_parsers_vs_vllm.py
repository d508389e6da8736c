"""Tool-call and reasoning parsers exact against vLLM's: every case's non-streamed result equals vLLM's
parser on the same text (names, parsed arguments, content, reasoning), or differs exactly as the case
documents. vLLM's parsers run in its own venv (tests/oracles/vllm_parsers.py); the checks that need no
process are tests/unit/test_output_parsers.py.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import threading

import pytest

from tests import vllm_env
from tests.parse_case import markers, parse_chunks, summary
from tests.parser_cases import Case, all_cases

CASES = all_cases()


class _Oracle:
    """vLLM's parsers over every case, in the vLLM venv, in one process. Importing vLLM there takes
    half a minute, so conftest starts it as soon as collection shows test_matches_vllm will run: it
    loads beside the tests that run first instead of holding up this module."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.out = ("", "")

    def start(self) -> None:
        if self.proc is not None or vllm_env.missing_reason():
            return
        lines = [
            json.dumps(
                {
                    "tool_parser": c.tool_parser,
                    "reasoning_parser": c.reasoning_parser,
                    "tools": c.tools,
                    "text": c.text,
                    "markers": markers(c),
                    "chat_template_kwargs": c.chat_template_kwargs,
                },
                ensure_ascii=False,
            )
            for c in CASES
        ]
        self.proc = subprocess.Popen(
            [str(vllm_env.VLLM_PYTHON), str(vllm_env.ROOT / "tests" / "oracles" / "vllm_parsers.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        atexit.register(self.proc.kill)  # a session that ends early leaves no oracle behind

        def talk() -> None:
            self.out = self.proc.communicate("\n".join(lines) + "\n", timeout=600)

        self.thread = threading.Thread(target=talk, name="vllm-parser-oracle", daemon=True)
        self.thread.start()

    def results(self) -> list[dict]:
        self.start()
        self.thread.join(660)
        stdout, stderr = self.out
        assert self.proc.returncode == 0, stderr[-3000:]
        results = [json.loads(line) for line in stdout.splitlines() if line.strip()]
        assert len(results) == len(CASES), stderr[-3000:]
        return results


ORACLE = _Oracle()


def start_early(items) -> None:
    """Called by conftest once collection is done (see _Oracle)."""
    if any(item.name.startswith("test_matches_vllm") for item in items):
        ORACLE.start()


@pytest.fixture(scope="module")
def vllm_results() -> dict:
    reason = vllm_env.missing_reason()
    if reason:
        pytest.skip(reason)
    return {c.id: r for c, r in zip(CASES, ORACLE.results())}


def _normalized(result: dict) -> dict:
    return {
        "reasoning": result.get("reasoning") or None,
        "content": result.get("content") or None,
        "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in result.get("tool_calls") or []],
    }


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_vllm(case: Case, vllm_results: dict) -> None:
    ours = summary(parse_chunks(case, [case.text]))
    theirs = vllm_results[case.id]
    assert "error" not in theirs, f"vLLM's parser failed on {case.id}: {theirs['error']}"
    theirs = _normalized(theirs)
    if case.vllm_differs:
        assert ours == case.expect, f"tokenmill's answer changed for {case.id}"
        assert theirs != ours, f"vLLM now agrees on {case.id}; drop the documented difference: {case.vllm_differs}"
    else:
        assert ours == theirs
