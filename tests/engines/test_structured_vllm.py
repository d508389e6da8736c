"""The spec table (tests/structured_specs.py) against vLLM: each row's request sent to vLLM 0.32's own
server and to tokenmill in front of `tokenmill engine --backend vllm` (the session stack,
tests/vllm_stack.py), greedy. Both accept or both refuse; accepted ones give the same text and
finish reason (the bridge runs vLLM's own validation, so tokenmill's workers add no opinion of
their own beyond the documented engine-independent checks)."""

from __future__ import annotations

import pytest
from vllm_env import missing_reason

_why = missing_reason()
if _why:
    pytest.skip(_why, allow_module_level=True)

import vllm_stack  # noqa: E402
from conftest import http  # noqa: E402
from structured_specs import PATHOLOGICAL, REFUSED, ROWS, valid  # noqa: E402
from vllm_stack import NAME  # noqa: E402

start_early = vllm_stack.start_early
stack = vllm_stack.module_fixture()

CHAT = [{"role": "user", "content": "Hello!"}]
# vLLM 0.32 no longer defines the guided_* fields and ignores them (docs/api/request-fields.md); tokenmill honours them
VLLM_IGNORES = {r.id for r in ROWS if any(key.startswith("guided_") for key in r.body)}


def _ask(url: str, fields: dict) -> tuple[int, dict]:
    body = {"model": NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0, **fields}
    status, _, answer = http("POST", url + "/v1/chat/completions", body)
    return status, answer


@pytest.fixture(scope="module")
def answers(stack):
    vs = {row.id: _ask(stack.vllm.url, row.body) for row in ROWS}
    ts = {row.id: _ask(stack.front.url, row.body) for row in ROWS}
    return {key: (vs[key], ts[key]) for key in vs}


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_spec_as_vllm(answers, row):
    if row.id in VLLM_IGNORES:
        pytest.skip("vLLM 0.32 ignores guided_* fields")
    (vs, va), (ts, ta) = answers[row.id]
    assert (vs >= 400) == (ts >= 400), (row.id, vs, va, ts, ta)
    # the row's vllm column (docs/api/structured-outputs.md's table of differences) says what vLLM's server does
    assert (vs >= 400) == ((row.vllm or row.llguidance) == REFUSED), (row.id, vs, va)
    if vs >= 400:
        assert ts == 400 and ta["error"]["param"] == row.param, (row.id, ta)
        return
    v, t = va["choices"][0], ta["choices"][0]
    assert (v["message"]["content"], v["finish_reason"]) == (t["message"]["content"], t["finish_reason"]), row.id
    if t["finish_reason"] == "stop":  # complete: valid under the spec (a "length" answer is cut at max_tokens)
        assert valid(row.check, t["message"]["content"]), (row.id, t["message"]["content"])


@pytest.mark.parametrize("body", list(PATHOLOGICAL.values()), ids=list(PATHOLOGICAL))
def test_pathological_specs_are_refused_or_bounded(stack, body):
    """Through tokenmill in front of the vLLM bridge: a 400 naming the field, or an answer within max_tokens;
    then the engine still serves."""
    status, answer = _ask(stack.front.url, {**body, "max_tokens": 5})
    param = next(iter(body)) + "." + next(iter(next(iter(body.values()))))
    if status == 400:
        assert answer["error"]["param"] == param, answer
    else:
        assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    status, answer = _ask(stack.front.url, {"structured_outputs": {"choice": ["still", "on"]}})
    assert status == 200 and answer["choices"][0]["message"]["content"] in ("still", "on"), answer
