"""The spec table (tests/structured_specs.py) through tokenmill on the simulated scheduler, which decodes
under llguidance: every accepted spec's output is valid under an independent checker, every refused one
is a 400 naming its field; and specs that would make a matcher blow up are refused or bounded, after
which the simulator still serves."""

from __future__ import annotations

import pytest
from conftest import Server, http
from structured_specs import ENDLESS, OK, PATHOLOGICAL, REFUSED, ROWS, valid

CHAT = [{"role": "user", "content": "Answer in the required shape."}]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def srv():
    s = Server("--workers", "1", "--sim-inter-token-latency-ms", "0")
    yield s
    s.stop()


def _post(srv, body):
    return http("POST", srv.url + "/v1/chat/completions", {"model": "deepseek-v4", "messages": CHAT, **body})


def test_the_table_is_large_and_covers_every_kind():
    assert len(ROWS) >= 60
    kinds = {next(iter(r.body.get("structured_outputs", {"rf": 0}))) for r in ROWS}
    assert {"json", "regex", "grammar", "choice", "structural_tag", "json_object"} <= kinds
    assert {OK, REFUSED} <= {r.llguidance for r in ROWS}


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_simulator_output_is_valid_or_refused(srv, row):
    for seed in (0, 1):
        status, _, body = _post(srv, {**row.body, "seed": seed, "max_tokens": MAX_TOKENS})
        if row.llguidance == REFUSED:
            assert status == 400, body
            assert body["error"]["param"] == row.param, body
            assert body["error"]["type"] == "BadRequestError", body
            return
        assert status == 200, body
        choice = body["choices"][0]
        text = choice["message"]["content"]
        if row.llguidance == ENDLESS:
            assert choice["finish_reason"] in ("length", "stop"), body
        else:
            assert choice["finish_reason"] == "stop", (row.id, text)
        assert valid(row.check, text), (row.id, text)


@pytest.mark.parametrize("body", list(PATHOLOGICAL.values()), ids=list(PATHOLOGICAL))
def test_pathological_specs_are_refused_or_bounded(srv, body):
    status, _, answer = _post(srv, {**body, "max_tokens": 20})
    param = next(iter(body)) + "." + next(iter(next(iter(body.values()))))
    if status == 400:
        assert answer["error"]["param"] == param, answer
    else:  # accepted: it ends, within max_tokens
        assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    status, _, answer = _post(srv, {"structured_outputs": {"choice": ["still", "serving"]}, "max_tokens": 5})
    assert status == 200 and answer["choices"][0]["message"]["content"] in ("still", "serving"), answer
