"""The spec table (tests/structured_specs.py) through the SGLang bridge's admission check, judged by
SGLang 0.5.23's own grammar backends (sglang/srt/constrained: xgrammar, its default, and llguidance)
over the served model's vocabulary. No GPU and no SGLang engine: tests/sglang_grammar_driver.py
prepares the bridge on a stand-in engine carrying SGLang's ServerArgs and the tokenizer, in .venv-vllm
with SGLang's wheel on PYTHONPATH (scripts/test.sh installs it, without its CUDA dependencies, into
.sglang-overlay). Each spec the tokenizer workers pass is refused (a 400 naming ``structured``, with
SGLang's message) or reaches the engine as SGLang's sampling params, as the table says SGLang does."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from structured_specs import PATHOLOGICAL, REFUSED, ROWS
from vllm_env import VLLM_PYTHON, missing_reason

from tokenmill.scheduler_client.protocol import STRUCTURED_FEATURES
from tokenmill.tokenizer_workers.generation_params import Engine, InvalidRequest, structured
from tokenmill.tokenizer_workers.openai_requests import parse

OVERLAY = Path(os.environ.get("TOKENMILL_SGLANG_OVERLAY", Path(ROOT) / ".sglang-overlay"))
_why = missing_reason() or (
    None if (OVERLAY / "sglang").is_dir() else f"no SGLang overlay at {OVERLAY} (./scripts/test.sh)"
)
if _why:
    pytest.skip(_why, allow_module_level=True)

BACKENDS = ("xgrammar", "llguidance")  # SGLang's default, and the one vLLM's guidance and the simulator share
SGLANG_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
SLOW = {"id": "slow", "kind": "json_schema", "spec": json.dumps({"type": "string", "maxLength": 300000})}
AFTER = {"id": "after", "kind": "regex", "spec": "[0-9]{3}"}


def _spec(fields: dict):
    """The Generate.structured the tokenizer workers build for these request fields, or their InvalidRequest."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    try:
        return structured(parse("chat", json.dumps(body).encode()), Engine(list(STRUCTURED_FEATURES)))[0]
    except InvalidRequest as exc:
        return exc


SPECS = {row.id: _spec(row.body) for row in ROWS} | {f"bad:{k}": _spec(body) for k, body in PATHOLOGICAL.items()}


@pytest.fixture(scope="module")
def verdicts():
    job = {
        "backends": BACKENDS,
        "specs": [
            {"id": rid, "kind": s.kind, "spec": s.spec, "choices": s.choices}
            for rid, s in SPECS.items()
            if not isinstance(s, InvalidRequest)
        ],
        "slow": {**SLOW, "timeout_s": 0.5},
        "after_slow": AFTER,
    }
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{OVERLAY}", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(VLLM_PYTHON), str(Path(ROOT) / "tests" / "sglang_grammar_driver.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_bridge_checks_with_the_engines_configured_backend(verdicts):
    assert {name: verdicts[name]["check"] for name in BACKENDS} == {
        "xgrammar": "XGrammarGrammarBackend",
        "llguidance": "GuidanceBackend",
    }
    for name in BACKENDS:
        assert set(STRUCTURED_FEATURES) <= set(verdicts[name]["features"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_spec_as_sglang(verdicts, backend, row):
    spec = SPECS[row.id]
    refuses = row.sglang_refuses() if backend == "xgrammar" else row.llguidance == REFUSED
    if isinstance(spec, InvalidRequest):  # refused by the engine-independent checks, before any engine
        assert refuses and spec.param == row.param, (row.id, spec)
        return
    got = verdicts[backend]["specs"][row.id]
    if refuses:
        assert got["refused"] is not None and got["reached"] is None, (row.id, got)
        assert got["param"] == "structured" and got["refused"].startswith("Failed to compile "), got
        return
    assert got["refused"] is None, (row.id, got["refused"])
    sent = {key: got["reached"][key] for key in SGLANG_KEYS if key in got["reached"]}
    assert len(sent) == 1, got["reached"]
    if spec.kind in ("json_schema", "regex", "structural_tag", "grammar"):
        assert list(sent.values()) == [spec.spec]


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_pathological_specs_are_refused_or_bounded(verdicts, name):
    """Refused by the workers' limits, or judged by SGLang's xgrammar within the check's timeout (all of
    these compile in under a second there); the specs after them are judged as usual."""
    spec, body = SPECS[f"bad:{name}"], PATHOLOGICAL[name]
    if isinstance(spec, InvalidRequest):
        assert spec.param == next(iter(body)) + "." + next(iter(next(iter(body.values())))), spec
        return
    got = verdicts[BACKENDS[0]]["specs"][f"bad:{name}"]
    assert (got["refused"] is None) != (got["reached"] is None), got
    assert got["refused"] is None or (got["param"] == "structured" and "timed out" not in got["refused"]), got


def test_a_compile_past_the_timeout_is_refused_and_the_check_goes_on(verdicts):
    """A string schema with maxLength 300,000 takes xgrammar seconds to compile (about 14 s at 1,000,000 on
    the 2-core machine); past the check's timeout (0.5 s here, 50 s by default, as SGLang's scheduler
    waits) it is refused, and the next spec is judged as usual."""
    slow = verdicts[BACKENDS[0]]["slow"]
    assert slow["slow"]["param"] == "structured" and "timed out" in slow["slow"]["refused"]
    assert slow["slow"]["reached"] is None
    assert slow["after"] == {"refused": None, "param": None, "reached": slow["after"]["reached"]}
    assert slow["after"]["reached"]["regex"] == AFTER["spec"]
