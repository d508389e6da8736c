"""The SGLang flavour of the http bridge (engines/http_sglang.py) without a server: its events in SGLang
0.5.23's shapes (cumulative and incremental ``output_ids``, ``meta_info`` logprobs and finish objects), the
stop tokens SGLang ends a request at by itself, when a request goes with ``ignore_eos``, and the field an
SGLang refusal names. tests/serving/test_engine_url_sglang.py runs the same code through `tokenmill serve`."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import msgspec
import pytest

from tokenmill.engines.bridge import EngineRequest
from tokenmill.engines.http_sglang import (
    Mismatch,
    SGLangHTTPBackend,
    _Output,
    engine_stop_ids,
    message_of,
    param_of,
    to_chunk,
)
from tokenmill.scheduler_client.protocol import SamplingParams, Structured
from tokenmill.tokenizer_workers.model import default_model_dir, load_model

TOKENS = [11, 12, 13, 14, 15]
ROOT = Path(__file__).resolve().parents[2]
#: SGLang 0.5.23's generated JSON contract of its HTTP API (./scripts/test.sh installs the wheel there)
API_TYPES = Path(os.environ.get("TOKENMILL_SGLANG_OVERLAY", ROOT / ".sglang-overlay")) / "sglang/api/v1/api_types.py"


def _event(output_ids, completion, finish=None, logprobs=None, tops=None) -> _Output:
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 4, "completion_tokens": completion, "cached_tokens": 2}
    if logprobs is not None:
        meta["output_token_logprobs"] = logprobs
    if tops is not None:
        meta["output_top_logprobs"] = tops
    return msgspec.json.decode(json.dumps({"text": "", "output_ids": output_ids, "meta_info": meta}), type=_Output)


def _entries(tokens):
    return [[-0.25 * t, t, None] for t in tokens]


def _tops(tokens):
    return [[[-0.25 * t, t, None], [None, t + 100, None]] for t in tokens]  # null: SGLang's JSON for -inf


def _run(events, incremental=False, top_n=None):
    sent, chunks = 0, []
    for event in events:
        chunk = to_chunk(event, sent, top_n, incremental)
        sent += len(chunk.token_ids)
        chunks.append(chunk)
    return chunks


def test_cumulative_and_incremental_events_give_the_same_new_tokens_and_logprobs():
    cuts = [(0, 2), (2, 3), (3, 5)]  # three events: two tokens, one, two
    finish = {"type": "stop", "matched": 15}
    cumulative = [
        _event(TOKENS[:b], b, finish if b == 5 else None, _entries(TOKENS[:b]), _tops(TOKENS[:b])) for _, b in cuts
    ]
    incremental = [
        _event(TOKENS[a:b], b, finish if b == 5 else None, _entries(TOKENS[a:b]), _tops(TOKENS[a:b])) for a, b in cuts
    ]
    got = []
    for events, mode in ((cumulative, False), (incremental, True), (cumulative, True)):  # the counts decide, not mode
        chunks = _run(events, incremental=mode, top_n=2)
        got.append(
            [(list(c.token_ids), c.finish, c.logprobs, c.top_ids, c.top_logprobs, c.cached_tokens) for c in chunks]
        )
    assert got[0] == got[1] == got[2]
    assert [ids for ids, *_ in got[0]] == [[11, 12], [13], [14, 15]]
    assert got[0][-1][1] == "stop" and got[0][0][1] is None
    assert got[0][0][2] == [-2.75, -3.0] and got[0][0][3] == [11, 111, 12, 112]
    assert got[0][0][4] == [-2.75, float("-inf"), -3.0, float("-inf")]


def test_without_completion_tokens_the_servers_setting_says_which_ids_are_new():
    events = [_Output(output_ids=TOKENS[:2]), _Output(output_ids=TOKENS[:4])]
    assert [list(c.token_ids) for c in _run(events)] == [[11, 12], [13, 14]]
    events = [_Output(output_ids=TOKENS[:2]), _Output(output_ids=TOKENS[2:4])]
    assert [list(c.token_ids) for c in _run(events, incremental=True)] == [[11, 12], [13, 14]]


def test_finish_objects_and_counts_that_do_not_add_up():
    assert to_chunk(_event([1, 2], 2, {"type": "length", "length": 2}), 0, None, False).finish == "length"
    abort = to_chunk(
        _event([1], 1, {"type": "abort", "message": "Aborted by AbortReq.", "status_code": None}), 0, None, False
    )
    assert (abort.finish, abort.error) == ("abort", "Aborted by AbortReq.")
    odd = to_chunk(_event([1], 1, {"type": "paused"}), 0, None, False)
    assert odd.finish == "error" and "paused" in odd.error
    with pytest.raises(Mismatch):
        to_chunk(_event([1, 2], 5), 0, None, False)  # counts five, holds two
    with pytest.raises(Mismatch):
        to_chunk(_event([1, 2], 2), 3, None, False)  # three were sent already


def _request(stop_token_ids, ignore_eos=False, **sampling) -> EngineRequest:
    return EngineRequest(
        rid="tm1-1",
        prompt=[1, 2, 3],
        max_new_tokens=16,
        sampling=SamplingParams(**sampling),
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    )


def test_sglang_ends_a_request_itself_only_where_its_stop_tokens_are_among_the_requests(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).symlink_to(default_model_dir() / name)
    eos = load_model(None).eos_token_ids
    assert engine_stop_ids(load_model(None)) == frozenset(eos)
    (model / "config.json").write_text(json.dumps({"eos_token_id": [*eos, 7]}))  # one more EOS in config.json
    stops = engine_stop_ids(load_model(str(model)))
    assert stops == frozenset([*eos, 7])

    backend = SGLangHTTPBackend("http://127.0.0.1:9")
    backend.engine_stops = stops
    assert "ignore_eos" not in backend.sampling_params(_request([*eos, 7, 9]))
    assert backend.sampling_params(_request(eos))["ignore_eos"] is True  # SGLang would stop at 7: the bridge does
    assert backend.sampling_params(_request([*eos, 7], ignore_eos=True))["ignore_eos"] is True
    params = backend.sampling_params(_request(eos, temperature=0.0, top_k=0, seed=3, min_tokens=40))
    assert params["top_k"] == -1 and params["min_new_tokens"] == 16 and "sampling_seed" not in params  # greedy
    params = backend.sampling_params(_request(eos, temperature=0.8, seed=3))
    assert params["sampling_seed"] == 3
    choice = _request(eos)
    choice.structured = Structured(kind="choice", choices=["yes", "no"])
    assert backend.sampling_params(choice)["ebnf"] == 'root ::= "yes" | "no"'


def test_an_sglang_refusal_names_the_field_behind_it():
    request = _request([1])
    assert param_of("top_p must be in (0, 1], got 1.5.", request) == "sampling.top_p"
    assert param_of("min_new_tokens=3 is unavailable when skip_tokenizer_init=True", request) == "sampling.min_tokens"
    assert param_of("sampling_seed must be an integer, got str.", request) == "sampling.seed"
    assert param_of("The input (9 tokens) is longer than the model's context length (8 tokens).", request) is None
    request.structured = Structured(kind="regex", spec="(")
    assert param_of("Failed to compile the regex grammar", request) == "structured"
    assert message_of(b'{"error": "unknown field `seed`, expected one of `max_new_tokens`"}').startswith("unknown")
    assert message_of(b'{"error": {"message": "Aborted", "code": 400}}') == "Aborted"
    assert "Field required" in message_of(b'{"detail": [{"msg": "Field required"}]}')
    assert message_of(b"Internal Server Error") == "Internal Server Error"


@pytest.mark.skipif(not API_TYPES.is_file(), reason=f"no SGLang wheel at {API_TYPES} (./scripts/test.sh)")
def test_the_bodies_pass_sglangs_own_json_contract_and_its_answers_decode():
    """SGLang's /generate refuses a body its generated contract refuses (an unknown sampling key among
    them): every shape of request the bridge builds passes it, and an answer it encodes decodes here."""
    spec = importlib.util.spec_from_file_location("sglang_api_types", API_TYPES)
    api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api)  # msgspec only: not SGLang's package, whose import needs its GPU stack
    backend = SGLangHTTPBackend("http://127.0.0.1:9")
    backend.engine_stops, backend.priority_sign = frozenset([1]), -1
    full = _request([1, 2], ignore_eos=True, temperature=0.7, top_p=0.9, top_k=5, seed=3, presence_penalty=0.1)
    full.sampling.min_p, full.sampling.min_tokens, full.sampling.logit_bias = 0.1, 2, {5: 1.5}
    full.logprobs, full.cache_salt, full.priority, full.adapter = 3, "tenant-a", 4, "sql"
    requests = [_request([1]), full]
    for kind in ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag"):
        constrained = _request([1])
        constrained.structured = Structured(
            kind=kind, spec="{}" if "json" in kind or "tag" in kind else "a+", choices=["a"]
        )
        requests.append(constrained)
    for request in requests:
        body = json.loads(backend.body(request))
        api.GenerateRequest.from_json_value(body)  # raises JsonContractError where SGLang answers 400
    with pytest.raises(api.JsonContractError, match="unknown field `max_tokens`"):
        api.GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    answer = api.GenerateResponse.from_json_value(
        {
            "output_ids": [5, 6],
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "stop", "matched": 6},
                "completion_tokens": 2,
                "output_token_logprobs": [[-0.1, 5, None], [None, 6, None]],
                "output_top_logprobs": [[[-0.1, 5, None]], [[None, 6, None]]],
            },
        }
    )
    chunk = to_chunk(msgspec.json.decode(json.dumps(answer.to_json_value()), type=_Output), 0, 1, False)
    assert (list(chunk.token_ids), chunk.finish, chunk.logprobs) == ([5, 6], "stop", [-0.1, float("-inf")])
    assert (chunk.top_ids, chunk.top_logprobs) == ([5, 6], [-0.1, float("-inf")])
