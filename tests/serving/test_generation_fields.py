"""n, logprobs, structured outputs, forced tool calls and the 1.1 sampling fields, end to end.

A real `tokenmill serve` on the simulated scheduler (which honours every protocol 1.1 feature:
it generates a valid instance of a constraint and deterministic logprobs), driven with the
official OpenAI client. Then the engine side of "never silently ignored": a scheduler that lists
no 1.1 features gets none of these fields (the client gets a 400 naming each), and a scheduler
that refuses a field with ``unsupported`` turns into a 400 naming the request's field.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time

import openai
import pytest
from conftest import ROOT, Server, http

CHAT = [{"role": "user", "content": "Tell me about the mill."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1}},
            "required": ["query"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"$ref": "#/$defs/address"},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        }
    },
}


@pytest.fixture(scope="module")
def srv():
    s = Server("--workers", "1", "--sim-inter-token-latency-ms", "0", "--max-n", "8")
    yield s
    s.stop()


def _post(srv, path, body):
    return http("POST", srv.url + path, {"model": "deepseek-v4", **body})


# ---- n --------------------------------------------------------------------------------------


def test_n_choices_follow_vllms_seeds_and_usage(srv):
    client = srv.client()
    many = client.chat.completions.create(
        model="deepseek-v4", messages=CHAT, n=3, seed=11, max_tokens=12, temperature=1
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.message.content for c in many.choices]
    assert len(set(texts)) > 1  # different seeds, different samples
    one = client.chat.completions.create(model="deepseek-v4", messages=CHAT, seed=11, max_tokens=12, temperature=1)
    # usage: the prompt once, the completions summed (as OpenAI and vLLM count)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == sum(12 for _ in texts) == 36
    # choice i is sampled with seed + i, as vLLM's parallel sampling does
    for i, text in enumerate(texts):
        alone = client.chat.completions.create(
            model="deepseek-v4", messages=CHAT, seed=11 + i, max_tokens=12, temperature=1
        )
        assert alone.choices[0].message.content == text
    # streamed: interleaved chunks, each choice's text the same as in the whole response
    got = {0: "", 1: "", 2: ""}
    finishes = {}
    stream = client.chat.completions.create(
        model="deepseek-v4",
        messages=CHAT,
        n=3,
        seed=11,
        max_tokens=12,
        temperature=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [got[i] for i in range(3)] == texts
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == many.usage.prompt_tokens and usage.completion_tokens == 36


def test_n_on_completions_numbers_choices_prompt_by_prompt(srv):
    client = srv.client()
    out = client.completions.create(model="deepseek-v4", prompt=["One", "Two words"], n=2, seed=3, max_tokens=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    single = [
        client.completions.create(model="deepseek-v4", prompt=p, seed=3, max_tokens=5) for p in ("One", "Two words")
    ]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert out.choices[0].text == single[0].choices[0].text and out.choices[2].text == single[1].choices[0].text


@pytest.mark.parametrize("n", [0, 9, -1])
def test_n_out_of_range_is_a_400(srv, n):
    status, _, body = _post(srv, "/v1/chat/completions", {"messages": CHAT, "n": n})
    assert status == 400 and body["error"]["param"] == "n" and "8" in body["error"]["message"], body


def test_a_client_leaving_aborts_every_choice(srv):
    from http.client import HTTPConnection

    before = _aborts(srv)
    conn = HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": "deepseek-v4", "messages": CHAT, "n": 4, "max_tokens": 100000, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    seen = set()
    while len(seen) < 4:  # every choice is streaming
        line = resp.fp.readline().decode()
        if '"content":"' in line and '"content":""' not in line:
            seen.add(json.loads(line[len("data: ") :])["choices"][0]["index"])
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _aborts(srv) == before:
        time.sleep(0.05)
    assert _aborts(srv) == before + 1  # one request, aborted once
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, _, state = http("GET", srv.url + "/debug/state")
        if state["generations"] == 0 and state["scheduler_requests"] == 0:
            break
        time.sleep(0.05)
    assert state["generations"] == 0 and state["scheduler_requests"] == 0, state


def _aborts(srv) -> float:
    _, _, text = http("GET", srv.url + "/metrics")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return sum(
        float(v)
        for v in re.findall(r'^tokenmill_aborts_total\{[^}]*reason="client_disconnect"[^}]*\} (\S+)$', text, re.M)
    )


# ---- logprobs --------------------------------------------------------------------------------


def test_chat_logprobs_in_openais_shape_streamed_and_not(srv):
    client = srv.client()
    whole = client.chat.completions.create(
        model="deepseek-v4", messages=CHAT, logprobs=True, top_logprobs=3, seed=5, max_tokens=10, temperature=1
    )
    choice = whole.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 10
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    streamed = []
    for chunk in client.chat.completions.create(
        model="deepseek-v4",
        messages=CHAT,
        logprobs=True,
        top_logprobs=3,
        seed=5,
        max_tokens=10,
        temperature=1,
        stream=True,
    ):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed += c.logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    # without top_logprobs: the chosen tokens only, top_logprobs empty (as vLLM answers)
    plain = client.chat.completions.create(model="deepseek-v4", messages=CHAT, logprobs=True, seed=5, max_tokens=4)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * 4
    none = client.chat.completions.create(model="deepseek-v4", messages=CHAT, max_tokens=2)
    assert none.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(srv):
    client = srv.client()
    out = client.completions.create(model="deepseek-v4", prompt="The river", logprobs=2, seed=9, max_tokens=8)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and 1 <= len(top) <= 3
    chunks = list(
        client.completions.create(
            model="deepseek-v4", prompt="The river", logprobs=2, seed=9, max_tokens=8, stream=True
        )
    )
    tokens, offsets = [], []
    for chunk in chunks:
        for c in chunk.choices:
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ],
)
def test_logprobs_out_of_range_is_a_400(srv, body, param):
    status, _, out = _post(srv, "/v1/chat/completions", {"messages": CHAT, **body})
    assert status == 400 and out["error"]["param"] == param, out
    status, _, out = _post(srv, "/v1/completions", {"prompt": "x", "logprobs": 21})
    assert status == 400 and out["error"]["param"] == "logprobs", out


# ---- structured outputs ------------------------------------------------------------------------


def _valid(schema, value):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, schema)
    return True


def test_response_format_json_schema_and_json_object(srv):
    client = srv.client()
    for seed in range(3):
        out = client.chat.completions.create(
            model="deepseek-v4",
            messages=CHAT,
            seed=seed,
            max_tokens=400,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
        )
        assert out.choices[0].finish_reason == "stop", out
        assert _valid(SCHEMA, json.loads(out.choices[0].message.content))
    out = client.chat.completions.create(
        model="deepseek-v4", messages=CHAT, max_tokens=200, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    # completions take it too
    text = (
        client.completions.create(
            model="deepseek-v4",
            prompt="JSON:",
            max_tokens=400,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
        )
        .choices[0]
        .text
    )
    assert _valid(SCHEMA, json.loads(text))


@pytest.mark.parametrize(
    "extra, check",
    [
        (
            {"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} \d{3}-\d{4}"}},
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} \d{3}-\d{4}", t),
        ),
        (
            {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
            lambda t: t in ("positive", "negative", "neutral"),
        ),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": "(ab|cd)+e"}, lambda t: re.fullmatch("(ab|cd)+e", t)),
        (
            {"structured_outputs": {"grammar": 'root ::= "The answer is " digit+ "."\ndigit ::= [0-9]'}},
            lambda t: re.fullmatch(r"The answer is [0-9]+\.", t),
        ),
        (
            {
                "structured_outputs": {
                    "json": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}
                }
            },
            lambda t: [type(x) for x in json.loads(t)] == [bool, bool],
        ),
    ],
)
def test_structured_outputs_constrain_the_output(srv, extra, check):
    client = srv.client()
    for seed in range(3):
        out = client.chat.completions.create(
            model="deepseek-v4", messages=CHAT, seed=seed, max_tokens=200, extra_body=extra
        )
        text = out.choices[0].message.content
        assert check(text), (extra, text)


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": r"(a)\1"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ],
)
def test_invalid_constraints_are_400s_naming_the_field(srv, extra, param):
    status, _, body = _post(srv, "/v1/chat/completions", {"messages": CHAT, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert body["error"]["type"] == "BadRequestError"


# ---- forced tool calls -------------------------------------------------------------------------


def test_tool_choice_required_returns_calls(srv):
    client = srv.client()
    for seed in range(3):
        out = client.chat.completions.create(
            model="deepseek-v4",
            messages=CHAT,
            tools=[WEATHER, SEARCH],
            tool_choice="required",
            seed=seed,
            max_tokens=400,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and choice.message.content == ""
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            schema = {"get_weather": WEATHER, "search": SEARCH}[call.function.name]["function"]["parameters"]
            assert _valid(schema, json.loads(call.function.arguments))
    one = client.chat.completions.create(
        model="deepseek-v4",
        messages=CHAT,
        tools=[WEATHER, SEARCH],
        tool_choice="required",
        parallel_tool_calls=False,
        seed=1,
        max_tokens=400,
    )
    assert len(one.choices[0].message.tool_calls) == 1


def test_named_tool_choice_calls_that_function(srv):
    client = srv.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="deepseek-v4", messages=CHAT, tools=[WEATHER, SEARCH], tool_choice=named, seed=2, max_tokens=400
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's answer to a named function, and vLLM's
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert _valid(WEATHER["function"]["parameters"], json.loads(call.function.arguments))
    calls, finish = [], None
    for chunk in client.chat.completions.create(
        model="deepseek-v4",
        messages=CHAT,
        tools=[WEATHER, SEARCH],
        tool_choice=named,
        seed=2,
        max_tokens=400,
        stream=True,
    ):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "stop"
    args = "".join(c.function.arguments or "" for c in calls)
    assert json.loads(args) == json.loads(call.function.arguments)


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
        {"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}},
        {"tool_choice": "sometimes", "tools": [WEATHER]},
    ],
)
def test_bad_tool_choice_is_a_400(srv, extra):
    status, _, body = _post(srv, "/v1/chat/completions", {"messages": CHAT, **extra})
    assert status == 400 and body["error"]["param"] == "tool_choice", body


# ---- sampling fields ---------------------------------------------------------------------------


def test_sampling_fields_reach_the_engine_and_are_checked(srv):
    client = srv.client()
    out = client.chat.completions.create(
        model="deepseek-v4",
        messages=CHAT,
        max_tokens=5,
        extra_body={"min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2},
        logit_bias={"100": -100, "200": 5},
    )
    assert out.choices[0].finish_reason == "length"
    for extra, param in [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ]:
        status, _, body = _post(srv, "/v1/chat/completions", {"messages": CHAT, **extra})
        assert status == 400 and body["error"]["param"] == param, (extra, body)


# ---- engines that cannot ------------------------------------------------------------------------

_SCHEDULER = textwrap.dedent("""
    import asyncio, sys
    from tokenmill.engines.simulated import SimulatedScheduler
    from tokenmill.scheduler_client.scheduler_side import Rejected, ERR_UNSUPPORTED
    from tokenmill.scheduler_client import protocol

    class Old(SimulatedScheduler):
        features = frozenset()  # what a 1.0 scheduler announces: nothing

    class Picky(SimulatedScheduler):
        # lists everything, then refuses min_p itself, as an engine whose backend lacks it would
        features = frozenset(protocol.FEATURES)
        def check(self, gen):
            if gen.sampling.min_p:
                raise Rejected("this engine cannot do min_p", ERR_UNSUPPORTED, "sampling.min_p")

    async def main():
        cls = Old if sys.argv[1] == "old" else Picky
        sched = cls(model="default", inter_token_latency_s=0)
        task = asyncio.create_task(sched.serve(sys.argv[2]))
        await sched.wait_ready()
        print("ready", flush=True)
        await task

    asyncio.run(main())
""")


@pytest.fixture
def scheduler_kind(request, tmp_path):
    endpoint = f"ipc://{tmp_path}/sched.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCHEDULER, request.param, endpoint], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    srv = Server("--workers", "1", "--scheduler", endpoint)
    yield srv
    srv.stop()
    proc.terminate()
    proc.wait(10)


@pytest.mark.parametrize("scheduler_kind", ["old"], indirect=True)
def test_a_scheduler_without_features_gets_none_of_them(scheduler_kind):
    srv = scheduler_kind
    cases = [
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"min_p": 0.1}, "min_p"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"min_tokens": 1}, "min_tokens"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"tool_choice": "required", "tools": [WEATHER]}, "tool_choice"),
    ]
    for extra, param in cases:
        status, _, body = _post(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, **extra})
        assert status == 400, (extra, body)
        assert body["error"]["param"] == param and body["error"]["code"] == "unsupported", (extra, body)
    # what needs no feature still works: n, defaults of every field
    status, _, body = _post(
        srv,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 3, "n": 2, "min_p": 0, "logit_bias": {}, "response_format": {"type": "text"}},
    )
    assert status == 200 and len(body["choices"]) == 2, body


@pytest.mark.parametrize("scheduler_kind", ["picky"], indirect=True)
def test_a_field_the_scheduler_refuses_is_a_400_naming_it(scheduler_kind):
    client = scheduler_kind.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="deepseek-v4", messages=CHAT, max_tokens=3, extra_body={"min_p": 0.2})
    assert err.value.body["param"] == "min_p" and err.value.body["code"] == "unsupported"
    ok = client.chat.completions.create(model="deepseek-v4", messages=CHAT, max_tokens=3, logprobs=True)
    assert len(ok.choices[0].logprobs.content) == 3


# ---- the worker's pieces, on their own ---------------------------------------------------------


def test_logprob_entries_follow_vllms_rules(default_tokenizer):
    from tokenmill.scheduler_client.protocol import floats_to_bytes, ids_to_frame
    from tokenmill.tokenizer_workers.logprobs import TokenTexts, chat_entries, completion_lists

    texts = TokenTexts(default_tokenizer)
    hello, world, comma = default_tokenizer.encode("Hello world,", add_special_tokens=False).ids
    # the chosen token (world) is not the best: vLLM lists it first, then the top ones, each once
    arrays = (
        ids_to_frame([world]),
        floats_to_bytes([-1.0]),
        ids_to_frame([hello, world, comma]),
        floats_to_bytes([-0.5, -1.0, float("-inf")]),
    )
    [entry] = json.loads(b"[" + chat_entries(texts, 3, *arrays) + b"]")
    assert entry["token"] == " world" and entry["logprob"] == -1.0
    assert [t["token"] for t in entry["top_logprobs"]] == [" world", "Hello", ","]
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-1.0, -0.5, -9999.0]  # -inf shown as -9999
    [short] = json.loads(b"[" + chat_entries(texts, 2, *arrays) + b"]")
    assert [t["token"] for t in short["top_logprobs"]] == [" world", "Hello"]
    parts, offset = completion_lists(texts, 3, 7, *arrays)
    lists = [json.loads(b"[" + p + b"]") for p in parts]
    assert lists[0] == [7] and offset == 7 + len(" world") and lists[2] == [" world"]
    assert list(lists[3][0]) == [" world", "Hello", ","]  # N + 1 entries at most: here the chosen is among them
    # a token that is half of a character is U+FFFD's bytes, as vLLM shows it
    partial = default_tokenizer.encode("😀", add_special_tokens=False).ids
    if len(partial) > 1:
        assert texts(partial[0]) == "\ufffd"


def test_sentencepiece_tokens_keep_their_leading_space(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    from tokenmill.tokenizer_workers.logprobs import TokenTexts

    texts = TokenTexts(tok)
    assert tok.decode([2]) == "world"  # the decoder strips a leading marker
    assert texts(2) == " world"  # vLLM puts it back


def test_forced_call_parser_reads_constrained_json():
    from tokenmill.tokenizer_workers.output_parsers import CALL, CONTENT
    from tokenmill.tokenizer_workers.output_parsers.forced import ForcedCallParser

    required = ForcedCallParser([WEATHER, SEARCH], None)
    text = '[{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}, {"name": "search", "parameters": {"query": "q"}}]'
    pieces = [p for i in range(0, len(text), 7) for p in required.feed(text[i : i + 7])] + required.finish()
    assert [(k, v.name, json.loads(v.arguments)) for k, v in pieces] == [
        (CALL, "get_weather", {"city": "Zürich", "days": 2}),
        (CALL, "search", {"query": "q"}),
    ]
    assert '"Zürich"' in pieces[0][1].arguments  # ensure_ascii=False, as vLLM writes arguments
    named = ForcedCallParser([WEATHER], "get_weather")
    named.feed('{"city": "Paris", "days": 1}')
    [(kind, call)] = named.finish()
    assert kind == CALL and call.name == "get_weather"
    cut = ForcedCallParser([WEATHER], None)
    cut.feed('[{"name": "get_weather", "param')
    assert cut.finish() == [(CONTENT, '[{"name": "get_weather", "param')] and cut.failures == 1
