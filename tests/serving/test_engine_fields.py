"""vLLM's request fields that need the engine (scheduler protocol 1.2): priority, cache_salt,
allowed_token_ids, bad_words, prompt_logprobs, kv_transfer_params and vllm_xargs; structured_outputs'
disable_any_whitespace and whitespace_pattern (and guided_whitespace_pattern).

A real `tokenmill serve` in front of a real simulated scheduler process (over ZeroMQ), driven with the
official OpenAI client: the simulator honours each field visibly (its waiting queue ordered by
priority, its prefix cache keyed on the salt, random-mode tokens kept to the allowed IDs and off the
banned sequences). An engine that does not list a field's feature gets a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
from conftest import ROOT, Server, http

MODEL = "deepseek-v4"
CHAT = [{"role": "user", "content": "Tell me about the mill."}]


@pytest.fixture(scope="module")
def prio(tmp_path_factory):
    """A simulator that schedules by priority, runs one request at a time and models a prefix cache."""
    endpoint = f"ipc://{tmp_path_factory.mktemp('sched')}/sim.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenmill.engines.simulated",
            "--bind",
            endpoint,
            "--model",
            "default",
            "--scheduling",
            "priority",
            "--max-running",
            "1",
            "--inter-token-latency-ms",
            "2",
            "--prefix-cache-tokens",
            "65536",
            "--stats-interval-s",
            "0.05",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    srv = Server("--workers", "1", "--scheduler", endpoint)
    yield srv
    srv.stop()
    proc.terminate()
    proc.wait(10)


def _post(srv, body, path="/v1/chat/completions"):
    return http("POST", srv.url + path, {"model": MODEL, **body})


def _waiting(srv) -> float:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    match = re.search(r"^tokenmill_scheduler_num_requests_waiting(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---- priority ---------------------------------------------------------------------------------------


def test_priority_orders_the_waiting_queue(prio):
    """One request runs; four wait with priorities 5, 1, -3, 1 (sent in that order). When the running
    one ends, they run lowest priority first, FIFO among equals: -3, 1 (the first), 1, 5."""
    client = prio.client()
    blocker = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100_000, stream=True)
    next(iter(blocker))  # it runs: the one slot is taken
    order: list[str] = []
    lock = threading.Lock()

    def send(name: str, priority: int) -> None:
        # 300 tokens at 2 ms each: the answers end ~0.6 s apart, so that the order their threads see them in is
        # the order they ran (at 2 tokens a busy machine once woke the threads in another order)
        out = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=300, extra_body={"priority": priority, "ignore_eos": True}
        )
        assert out.choices[0].finish_reason == "length"
        with lock:
            order.append(name)

    threads = []
    for n, (name, priority) in enumerate([("B", 5), ("D", 1), ("C", -3), ("E", 1)], 1):
        threads.append(threading.Thread(target=send, args=(name, priority)))
        threads[-1].start()
        _wait_for(lambda n=n: _waiting(prio) >= n, f"{n} waiting requests")  # arrival order is fixed
    blocker.close()  # the running request is aborted; the waiting ones take the slot in turn
    for t in threads:
        t.join(60)
    assert order == ["C", "D", "E", "B"]


def test_priority_needs_an_engine_that_schedules_by_it(echo_server, prio):
    """vLLM 0.32 with its default FCFS policy takes a priority and ignores it; tokenmill's front end
    refuses it instead, with the code every missing engine feature gets. 0 needs nothing."""
    status, _, body = _post(echo_server, {"messages": CHAT, "max_tokens": 2, "priority": 3})
    assert status == 400 and body["error"]["param"] == "priority" and body["error"]["code"] == "unsupported", body
    status, _, body = _post(echo_server, {"messages": CHAT, "max_tokens": 2, "priority": 0})
    assert status == 200, body
    for bad in (2**63, -(2**63) - 1, "high", 1.5):
        status, _, body = _post(prio, {"messages": CHAT, "max_tokens": 2, "priority": bad})
        assert status == 400 and body["error"]["param"] == "priority", (bad, body)
    out = prio.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"priority": -(2**63)})
    assert out.choices[0].finish_reason == "length"


# ---- cache_salt -------------------------------------------------------------------------------------


def test_cache_salt_keeps_prefix_cache_entries_apart(prio):
    """The simulator's prefix cache reports cached prompt tokens (usage.prompt_tokens_details) for a
    prompt seen before, and only under the same salt."""
    client = prio.client()
    long_chat = [{"role": "user", "content": "The wheel of the old mill turns slowly. " * 20 + str(time.time())}]

    def cached(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        out = client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=1, extra_body=extra)
        details = out.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    assert cached("alice") == 0
    assert cached("alice") > 100  # the same salt shares the blocks
    assert cached("bob") == 0  # another salt does not
    assert cached(None) == 0  # nor does no salt
    assert cached(None) > 100
    assert cached("bob") > 100
    for bad in ("", "a/b", "x@y", "back\\slash", "nul\x00", "s" * 129, 123):
        status, _, body = _post(prio, {"messages": CHAT, "max_tokens": 1, "cache_salt": bad})
        assert status == 400 and body["error"]["param"] == "cache_salt", (bad, body)
    assert _post(prio, {"messages": CHAT, "max_tokens": 1, "cache_salt": "s" * 128})[0] == 200


# ---- allowed_token_ids, bad_words -------------------------------------------------------------------


def test_allowed_token_ids_are_all_random_mode_emits(server, default_tokenizer):
    (mill,) = default_tokenizer.encode(" mill", add_special_tokens=False).ids
    (river,) = default_tokenizer.encode(" river", add_special_tokens=False).ids
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=30, seed=4, extra_body={"allowed_token_ids": [mill, river]}
    )
    text = out.choices[0].text
    assert re.fullmatch(r"( mill| river)+", text) and " mill" in text and " river" in text, text
    assert out.choices[0].finish_reason == "length"  # EOS is not allowed either
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, extra_body={"allowed_token_ids": [mill]}
    )
    assert chat.choices[0].message.content == " mill" * 10
    vocab = default_tokenizer.get_vocab_size(with_added_tokens=True)
    for bad in ([], [vocab], [-1], ["x"]):
        status, _, body = _post(server, {"messages": CHAT, "max_tokens": 1, "allowed_token_ids": bad})
        assert status == 400 and body["error"]["param"].startswith("allowed_token_ids"), (bad, body)


def test_bad_words_are_never_generated(server):
    client = server.client()

    def text(**extra):
        out = client.completions.create(model=MODEL, prompt="Tell a story", max_tokens=400, seed=7, extra_body=extra)
        return out.choices[0].text

    plain = text()
    assert re.search(r"\bthe\b", plain) and "the mill" in plain and "river" in plain  # what the seed gives
    banned = text(bad_words=["the", "river"])
    assert not re.search(r"\bthe\b", banned) and "river" not in banned, banned
    # a word of two tokens: its last token is banned only after the first, so "the" stays
    two = text(bad_words=["the mill"])
    assert "the mill" not in two and re.search(r"\bthe\b", two), two
    for bad in ([""], ["  "], "the", [1]):
        status, _, body = _post(server, {"prompt": "x", "max_tokens": 1, "bad_words": bad}, "/v1/completions")
        assert status == 400 and body["error"]["param"].startswith("bad_words"), (bad, body)
    assert _post(server, {"prompt": "x", "max_tokens": 1, "bad_words": []}, "/v1/completions")[0] == 200


def test_bad_words_tokenize_as_vllm(default_tokenizer):
    """vLLM 0.32's SamplingParams.update_from_tokenizer: each word as it stands (leading space stripped)
    and, when that gives a different first token of the same count, after a space."""
    from tokenmill.tokenizer_workers.generation_params import bad_words_ids
    from tokenmill.tokenizer_workers.openai_requests import InvalidRequest

    def enc(text):
        return default_tokenizer.encode(text, add_special_tokens=False).ids

    vocab = default_tokenizer.get_vocab_size(with_added_tokens=True)
    assert enc("river") != enc(" river") and len(enc(" river")) == len(enc("river")) == 1
    assert bad_words_ids(["river", "  river", "river"], default_tokenizer, vocab) == [
        enc("river"),
        enc(" river"),
        enc("river"),
        enc(" river"),
    ]
    # "  river" is a different word (vLLM dedups before stripping) that strips to the same sequences
    long = "the mill wheel"
    expected = [enc(long)] + (
        [enc(" " + long)] if len(enc(" " + long)) == len(enc(long)) and enc(" " + long)[0] != enc(long)[0] else []
    )
    assert bad_words_ids([long], default_tokenizer, vocab) == expected
    with pytest.raises(InvalidRequest, match="Too many bad words"):
        bad_words_ids([f"w{i}" for i in range(130)], default_tokenizer, vocab)


# ---- prompt_logprobs -------------------------------------------------------------------------------


def _check_prompt_logprobs(plp, prompt_ids, top_n, tokenizer):
    """vLLM 0.32's shape: null, then per prompt position a map token ID -> {logprob, rank, decoded_token},
    the prompt token first (its own rank, its place kept when it is among the top), then the top N at
    ranks 1..N, descending."""
    assert plp[0] is None and len(plp) == len(prompt_ids), (len(plp), len(prompt_ids))
    for tid, entry in zip(prompt_ids[1:], plp[1:]):
        keys = list(entry)
        assert keys[0] == str(tid)
        own = entry[str(tid)]
        assert set(own) == {"logprob", "rank", "decoded_token"} and own["logprob"] < 0 and own["rank"] >= 1
        assert own["decoded_token"] == tokenizer.decode([tid], skip_special_tokens=False)
        tops = sorted((entry[k] for k in keys if not (k == str(tid) and own["rank"] > top_n)), key=lambda t: t["rank"])
        assert [t["rank"] for t in tops] == list(range(1, top_n + 1)), entry
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert len(entry) == top_n + (own["rank"] > top_n), entry


def test_prompt_logprobs_in_vllm_shape(server, default_tokenizer):
    prompt = "The wheel of the old mill turns"
    ids = default_tokenizer.encode(prompt, add_special_tokens=True).ids
    status, _, body = _post(
        server,
        {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3, "n": 2, "return_token_ids": True},
        "/v1/completions",
    )
    assert status == 200, body
    first, second = body["choices"]
    assert first["prompt_token_ids"] == ids
    _check_prompt_logprobs(first["prompt_logprobs"], ids, 3, default_tokenizer)
    assert second["prompt_logprobs"] == first["prompt_logprobs"]  # one prompt, n choices: the same
    again = _post(server, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 3}, "/v1/completions")[2]
    assert again["choices"][0]["prompt_logprobs"] == first["prompt_logprobs"]  # the simulator's are deterministic
    assert (
        "prompt_logprobs" not in _post(server, {"prompt": prompt, "max_tokens": 1}, "/v1/completions")[2]["choices"][0]
    )
    # two prompts: each choice its own prompt's; 0: the prompt tokens' own entries only
    status, _, body = _post(
        server, {"prompt": [prompt, "Hello there"], "max_tokens": 1, "prompt_logprobs": 0}, "/v1/completions"
    )
    assert status == 200, body
    for choice, text in zip(body["choices"], [prompt, "Hello there"]):
        p_ids = default_tokenizer.encode(text, add_special_tokens=True).ids
        _check_prompt_logprobs(choice["prompt_logprobs"], p_ids, 0, default_tokenizer)
    # chat: at the top level, for the rendered prompt
    status, _, body = _post(server, {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1, "return_token_ids": True})
    assert status == 200, body
    _check_prompt_logprobs(body["prompt_logprobs"], body["prompt_token_ids"], 1, default_tokenizer)
    assert "prompt_logprobs" not in body["choices"][0]
    # vLLM: chat's echo asks for them with top_logprobs (0 by default)
    status, _, body = _post(server, {"messages": CHAT, "max_tokens": 2, "echo": True, "return_token_ids": True})
    assert status == 200, body
    _check_prompt_logprobs(body["prompt_logprobs"], body["prompt_token_ids"], 0, default_tokenizer)


def test_prompt_logprobs_checked_as_vllm(server):
    for value, path, stream in (
        (-2, "/v1/completions", False),
        (-1, "/v1/completions", False),  # -1: the vocabulary
        (21, "/v1/chat/completions", False),
        (1, "/v1/chat/completions", True),
        (-1, "/v1/completions", True),
        ("2", "/v1/completions", False),
        (True, "/v1/chat/completions", False),
    ):
        body = {"messages": CHAT} if "chat" in path else {"prompt": "Hello"}
        status, _, out = _post(server, {**body, "max_tokens": 1, "prompt_logprobs": value, "stream": stream}, path)
        assert status == 400 and out["error"]["param"] == "prompt_logprobs", (value, path, out)
    # 0 with stream is allowed, as in vLLM, and shows nothing
    stream = server.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
    )
    chunks = [c.model_dump() for c in stream]
    assert chunks and not any("prompt_logprobs" in c for c in chunks)


# ---- kv_transfer_params, vllm_xargs ------------------------------------------------------------------


def test_kv_transfer_params_and_vllm_xargs_reach_the_engine(server):
    """The simulator (no KV connector) answers with what it was given, in the final output's
    kv_transfer_params, which the non-streamed response carries at the top level, as vLLM does."""
    kv = {"do_remote_decode": True, "remote_host": "10.0.0.2", "nested": {"block_ids": [1, 2]}}
    xargs = {"a": 1, "b": ["x", 2.5, -3], "flag": True}
    status, _, body = _post(server, {"messages": CHAT, "max_tokens": 2, "kv_transfer_params": kv, "vllm_xargs": xargs})
    assert status == 200, body
    assert body["kv_transfer_params"] == {
        "simulated": True,
        "kv_transfer_params": kv,
        "extra_args": {"a": 1, "b": ["x", 2.5, -3], "flag": 1},
    }
    status, _, body = _post(
        server, {"prompt": ["Hello", "Bye"], "max_tokens": 1, "vllm_xargs": {"k": "v"}}, "/v1/completions"
    )
    assert status == 200 and body["kv_transfer_params"] == {
        "simulated": True,
        "kv_transfer_params": None,
        "extra_args": {"k": "v"},
    }, body
    # empty ones are not passed on (vLLM's `if self.kv_transfer_params`); none: no such key
    for extra in ({"kv_transfer_params": {}, "vllm_xargs": {}}, {}):
        status, _, body = _post(server, {"messages": CHAT, "max_tokens": 1, **extra})
        assert status == 200 and "kv_transfer_params" not in body, body
    # streamed: vLLM's chunks do not carry it
    stream = server.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, stream=True, extra_body={"kv_transfer_params": kv}
    )
    assert not any("kv_transfer_params" in c.model_dump() for c in stream)
    for field, value, param in (
        ("kv_transfer_params", "x", "kv_transfer_params"),
        ("kv_transfer_params", [1], "kv_transfer_params"),
        ("vllm_xargs", [1], "vllm_xargs"),
        ("vllm_xargs", {"a": {"b": 1}}, "vllm_xargs.a"),
        ("vllm_xargs", {"a": [[1]]}, "vllm_xargs.a"),
        ("vllm_xargs", {"a": None}, "vllm_xargs.a"),
        ("vllm_xargs", {"a": 2**64}, "vllm_xargs.a"),
    ):
        status, _, body = _post(server, {"messages": CHAT, "max_tokens": 1, field: value})
        assert status == 400 and body["error"]["param"] == param, (field, value, body)


# ---- structured_outputs.disable_any_whitespace, whitespace_pattern ----------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "size": {"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"]},
    },
    "required": ["name", "tags", "size"],
}


def _compact(text: str) -> str:
    return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def _between_tokens(text: str) -> str:
    """The JSON text with its strings emptied: what is left of whitespace is the grammar's optional whitespace."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def test_whitespace_options_shape_the_json(server):
    """The simulator decodes under llguidance: JSON with its default flexible whitespace, none with
    disable_any_whitespace, and with whitespace_pattern (older vLLM's guided_whitespace_pattern too) only
    whitespace of the pattern's characters (llguidance's lexer may skip it more than once between two
    lexemes). Every output is valid under the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    client = server.client()

    def content(seed: int, **extra) -> str:
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=400, seed=seed, extra_body=extra)
        assert out.choices[0].finish_reason == "stop", out
        return out.choices[0].message.content

    for seed in range(3):
        plain = content(seed, structured_outputs={"json": SCHEMA})
        jsonschema.validate(json.loads(plain), SCHEMA)
        compact = content(seed, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
        jsonschema.validate(json.loads(compact), SCHEMA)
        assert compact == _compact(compact), compact
        obj = content(seed, structured_outputs={"json_object": True, "disable_any_whitespace": True})
        assert obj == _compact(obj) and isinstance(json.loads(obj), dict)
        for extra in (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": r"\n{1,2}"}},
            {"guided_json": SCHEMA, "guided_whitespace_pattern": r"\n{1,2}"},
        ):
            lines = content(seed, **extra)
            jsonschema.validate(json.loads(lines), SCHEMA)
            outside = _between_tokens(lines)
            assert not set(re.findall(r"\s", outside)) - {"\n"}, lines
    # the options with other constraints are accepted (they shape JSON only), false needs no feature
    out = content(0, structured_outputs={"choice": ["a b", "c"], "disable_any_whitespace": True})
    assert out in ("a b", "c")
    assert content(0, structured_outputs={"regex": "x y", "whitespace_pattern": " "}) == "x y"
    off = content(1, structured_outputs={"json": SCHEMA, "disable_any_whitespace": False, "whitespace_pattern": None})
    jsonschema.validate(json.loads(off), SCHEMA)
    # completions too, and a streamed answer is the same text
    done = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=400,
        seed=4,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    text = done.choices[0].text
    assert text == _compact(text)
    streamed = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=400,
        seed=4,
        stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_whitespace_options_checked_as_vllm(server):
    """vLLM's pydantic model takes a bool and a string (null is no bool); tokenmill also checks that the
    pattern is a regex an engine can compile. Each is a 400 naming the field."""
    base = {"messages": CHAT, "max_tokens": 2}
    for extra, param in (
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}}, "disable_any_whitespace"),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": 1}}, "disable_any_whitespace"),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": None}}, "disable_any_whitespace"),
        ({"structured_outputs": {"json_object": True, "whitespace_pattern": 5}}, "whitespace_pattern"),
        ({"structured_outputs": {"json_object": True, "whitespace_pattern": "(\\s"}}, "whitespace_pattern"),
        ({"structured_outputs": {"json_object": True, "whitespace_pattern": "(?= )"}}, "whitespace_pattern"),
        ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}}, None),
    ):
        param = f"structured_outputs.{param or 'disable_additional_properties'}"
        status, _, body = _post(server, {**base, **extra})
        assert status == 400 and body["error"]["param"] == param, (extra, body)
    for extra in (
        {"guided_json": SCHEMA, "guided_whitespace_pattern": ["\\s"]},
        {"guided_json": SCHEMA, "guided_whitespace_pattern": "[ "},
        {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}, "guided_whitespace_pattern": " "},
    ):
        status, _, body = _post(server, {**base, **extra})
        assert status == 400 and body["error"]["param"] == "guided_whitespace_pattern", (extra, body)
    # options alone are no constraint (vLLM's StructuredOutputsParams needs one); a guided pattern alone
    # shapes nothing and is dropped, as older vLLM dropped it
    status, _, body = _post(server, {**base, "structured_outputs": {"disable_any_whitespace": True}})
    assert status == 400 and body["error"]["param"] == "structured_outputs", body
    status, _, body = _post(server, {**base, "guided_whitespace_pattern": " "})
    assert status == 200, body


# ---- an engine without the features -----------------------------------------------------------------


_OLD = """
import asyncio, sys
from tokenmill.engines.simulated import SimulatedScheduler
from tokenmill.scheduler_client import protocol

class Old(SimulatedScheduler):
    features = frozenset(protocol.FEATURES) - frozenset(protocol.FEATURES_12)  # a 1.1 scheduler

async def main():
    sched = Old(model="default", inter_token_latency_s=0)
    task = asyncio.create_task(sched.serve(sys.argv[1]))
    await sched.wait_ready()
    print("ready", flush=True)
    await task

asyncio.run(main())
"""


def test_a_1_1_scheduler_gets_none_of_the_1_2_fields(tmp_path):
    endpoint = f"ipc://{tmp_path}/old.sock"
    proc = subprocess.Popen([sys.executable, "-c", _OLD, endpoint], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        srv = Server("--workers", "1", "--scheduler", endpoint)
        try:
            for field, value in (
                ("priority", 1),
                ("cache_salt", "s"),
                ("allowed_token_ids", [5]),
                ("bad_words", ["the"]),
                ("prompt_logprobs", 0),
                ("kv_transfer_params", {"a": 1}),
                ("vllm_xargs", {"a": 1}),
            ):
                status, _, body = _post(srv, {"messages": CHAT, "max_tokens": 2, field: value})
                assert status == 400, (field, body)
                assert body["error"]["param"] == field and body["error"]["code"] == "unsupported", (field, body)
            for so, param in (
                ({"json_object": True, "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace"),
                ({"regex": "a+", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
            ):
                status, _, body = _post(srv, {"messages": CHAT, "max_tokens": 2, "structured_outputs": so})
                assert status == 400, (so, body)
                assert body["error"]["param"] == param and body["error"]["code"] == "unsupported", (so, body)
            status, _, body = _post(
                srv, {"messages": CHAT, "max_tokens": 2, "guided_regex": "a+", "guided_whitespace_pattern": " "}
            )
            assert status == 400 and body["error"]["param"] == "guided_whitespace_pattern", body
            status, _, body = _post(  # a 1.1 constraint without the options still works
                srv,
                {
                    "messages": CHAT,
                    "max_tokens": 20,
                    "structured_outputs": {"regex": "a+", "disable_any_whitespace": False},
                },
            )
            assert status == 200 and re.fullmatch("a+", body["choices"][0]["message"]["content"]), body
            with pytest.raises(openai.BadRequestError):  # a 1.1 field still works, a 1.2 one does not
                srv.client().chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, extra_body={"cache_salt": "x"}
                )
            ok = srv.client().chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, extra_body={"priority": 0, "bad_words": []}
            )
            assert len(ok.choices[0].logprobs.content) == 2
            # chat's echo asks for the prompt's logprobs only of an engine that can give them (vLLM always does)
            status, _, body = _post(
                srv, {"messages": CHAT, "max_tokens": 2, "echo": True, "kv_transfer_params": {}, "vllm_xargs": {}}
            )
            assert status == 200 and "prompt_logprobs" not in body and "kv_transfer_params" not in body, body
        finally:
            srv.stop()
    finally:
        proc.terminate()
        proc.wait(10)
