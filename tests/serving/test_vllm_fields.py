"""vLLM's request fields that the front end honours as vLLM 0.32's OpenAI server does:
stream_options.continuous_usage_stats, ...

A real `tokenmill serve` on the simulated scheduler in echo mode (the output repeats the prompt's
tokens, so what a response must hold is known in advance), driven with the official OpenAI client
and, where the exact bytes matter, plain HTTP.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, Server, http

MODEL = "deepseek-v4"
WORDS = "the mill grinds the grain into fine white flour every single morning"


def _sse(server, path: str, body: dict) -> list[dict]:
    """The data events of a streamed response, parsed ([DONE] left out)."""
    req = urllib.request.Request(
        server.url + path, json.dumps({"model": MODEL, **body}).encode(), {"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


# ---- stream_options.continuous_usage_stats ------------------------------------------------------


def test_continuous_usage_counts_every_chat_chunk_as_vllm(echo_server):
    """Every chunk carries usage: the prompt's tokens and the choice's tokens generated so far (0 in
    the role chunk), total their sum; the last chunk still sums the choices (vLLM's serving_chat)."""
    client = echo_server.client()
    chat = [{"role": "user", "content": WORDS}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        n=2,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    prompt = chunks[0].usage.prompt_tokens
    assert prompt > 9
    seen = {0: [], 1: []}
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is not None, chunk
        choice = chunk.choices[0]
        usage = chunk.usage
        assert usage.prompt_tokens == prompt and usage.total_tokens == prompt + usage.completion_tokens
        if choice.delta.role:
            assert usage.completion_tokens == 0
        text[choice.index] += choice.delta.content or ""
        seen[choice.index].append((usage.completion_tokens, text[choice.index], choice.finish_reason))
    for index in (0, 1):
        counts = [c for c, _, _ in seen[index]]
        assert counts == sorted(counts) and counts[-1] == 9 and seen[index][-1][2] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == prompt and last.usage.completion_tokens == 18


def test_continuous_usage_counts_tokens_behind_the_text(echo_server, default_tokenizer):
    """A completions stream of a token-ID prompt, echoed: at every chunk, the text so far is the
    decode of exactly completion_tokens of the prompt's tokens, and prompt_tokens is that prompt's
    own count (two prompts of different lengths)."""
    first = default_tokenizer.encode(WORDS, add_special_tokens=False).ids
    second = first[:5]
    events = _sse(
        echo_server,
        "/v1/completions",
        {
            "prompt": [first, second],
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    texts = {0: "", 1: ""}
    prompts = {0: first, 1: second}
    finished = set()
    for event in events[:-1]:
        (choice,) = event["choices"]
        usage = event["usage"]
        i = choice["index"]
        assert usage["prompt_tokens"] == len(prompts[i])
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        texts[i] += choice["text"]
        echoed = (prompts[i] * 3)[: usage["completion_tokens"]]
        assert texts[i] == default_tokenizer.decode(echoed), (i, usage, texts[i])
        if choice["finish_reason"]:
            finished.add(i)
            assert usage["completion_tokens"] == 12
    assert finished == {0, 1}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {
        "prompt_tokens": len(first) + len(second),
        "completion_tokens": 24,
        "total_tokens": len(first) + len(second) + 24,
    }


def test_continuous_usage_needs_include_usage_as_in_vllm(echo_server):
    """continuous_usage_stats alone gives no usage (vLLM reads it only with include_usage); stream_options
    on a request that is not streamed is a 400 naming it, as vLLM (and OpenAI) answer."""
    events = _sse(
        echo_server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": WORDS}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
    )
    assert events and all("usage" not in e for e in events), events
    events = _sse(
        echo_server,
        "/v1/completions",
        {
            "prompt": WORDS,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        },
    )
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 4
    status, _, body = http(
        "POST",
        echo_server.url + "/v1/completions",
        {
            "model": MODEL,
            "prompt": WORDS,
            "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    assert status == 400 and body["error"]["param"] == "stream_options", body
    status, _, body = http(
        "POST",
        echo_server.url + "/v1/completions",
        {"model": MODEL, "prompt": WORDS, "max_tokens": 2, "stream_options": None},
    )  # null is as absent
    assert status == 200, body
    status, _, body = http(
        "POST",
        echo_server.url + "/v1/completions",
        {"model": MODEL, "prompt": WORDS, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
    )
    assert status == 400 and body["error"]["param"] == "stream_options.continuous_usage_stats", body


# ---- include_stop_str_in_output ---------------------------------------------------------------


@pytest.mark.parametrize(
    "stop, expected",
    [
        (["gamma"], "alpha beta gamma"),
        (["a gam"], "alpha beta gam"),  # across two tokens, and inside one: the text ends where the stop string does
        (["delta", "beta g"], "alpha beta g"),  # the one that ends first, as vLLM's check_stop_strings
        (["nowhere"], "alpha beta gamma delta epsilon"),
    ],
)
def test_include_stop_str_in_output_keeps_the_stop_string(echo_server, default_tokenizer, stop, expected):
    ids = default_tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False).ids
    client = echo_server.client()
    extra = {"include_stop_str_in_output": True}
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop, extra_body=extra)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == ("length" if stop == ["nowhere"] else "stop")
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop, stream=True, extra_body=extra
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    # false (the default) cuts it, as before
    cut = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop, extra_body={"include_stop_str_in_output": False}
    )
    assert cut.choices[0].text == (
        expected
        if stop == ["nowhere"]
        else expected[: expected.rindex("gamma" if stop == ["gamma"] else ("a gam" if stop == ["a gam"] else "beta g"))]
    )


def test_include_stop_str_in_output_on_chat_and_bad_values(echo_server):
    client = echo_server.client()
    chat = [{"role": "user", "content": "alpha beta gamma delta"}]
    out = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=60, stop=["beta"], extra_body={"include_stop_str_in_output": True}
    )
    assert out.choices[0].message.content.endswith("alpha beta") and out.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_tokens=60,
        stop=["beta"],
        stream=True,
        extra_body={"include_stop_str_in_output": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content
    status, _, body = http(
        "POST",
        echo_server.url + "/v1/completions",
        {"model": MODEL, "prompt": "x", "include_stop_str_in_output": "yes"},
    )
    assert status == 400 and body["error"]["param"] == "include_stop_str_in_output", body


def test_usage_counts_tokens_up_to_the_stop_string_as_vllm(echo_server, default_tokenizer):
    """A stop string ends the choice at the token that completes it: usage counts the tokens up to that
    one, as vLLM does, not those the scheduler generated before the abort reached it (the echo
    scheduler, at no latency, has generated them all by then)."""
    ids = default_tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta", add_special_tokens=False).ids
    upto = next(k for k in range(1, len(ids)) if "beta" in default_tokenizer.decode(ids[:k]))
    client = echo_server.client()
    for include in (False, True):
        extra = {"include_stop_str_in_output": include}
        whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=["beta"], extra_body=extra)
        assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens == upto, whole
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=ids,
                max_tokens=len(ids),
                stop=["beta"],
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
        )
        assert chunks[-1].usage.completion_tokens == upto


def test_stop_reason_names_what_stopped_the_choice_as_vllm(echo_server, default_tokenizer):
    """vLLM's stop_reason: the stop string that matched, or the stop_token_ids entry that ended the
    choice; not written when the choice ran to max_tokens (vLLM writes null there)."""
    ids = default_tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta", add_special_tokens=False).ids
    client = echo_server.client()
    cases = ((["gamma", "zeta"], None, "gamma"), (None, [ids[3]], ids[3]), (["nowhere"], None, None))
    for stop, stop_ids, expected in cases:
        extra = {"stop_token_ids": stop_ids} if stop_ids else {}
        whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop, extra_body=extra)
        choice = whole.choices[0].model_dump()
        assert choice.get("stop_reason") == expected and whole.choices[0].finish_reason == (
            "stop" if expected else "length"
        ), choice
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop, stream=True, extra_body=extra
            )
        )
        reasons = [c.choices[0].model_dump().get("stop_reason") for c in chunks]
        assert reasons[-1] == expected and not any(reasons[:-1]), reasons
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "alpha beta gamma"}],
            max_tokens=40,
            stop=stop,
            extra_body=extra,
        )
        if stop:
            assert chat.choices[0].model_dump().get("stop_reason") == expected


# ---- request_id ---------------------------------------------------------------------------------


def test_request_id_names_the_response_as_vllm(echo_server):
    """chatcmpl-{request_id} / cmpl-{request_id}, streamed and not; an X-Request-Id header wins, as in
    vLLM's _base_request_id; two requests with the same id at once both complete."""
    import concurrent.futures

    client = echo_server.client()
    chat = [{"role": "user", "content": WORDS}]
    out = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3, extra_body={"request_id": "abc-1"})
    assert out.id == "chatcmpl-abc-1"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=chat,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"request_id": "abc-2"},
        )
    )
    assert {c.id for c in chunks} == {"chatcmpl-abc-2"}
    out = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=3, extra_body={"request_id": "xyz"})
    assert out.id == "cmpl-xyz"
    out = client.completions.create(
        model=MODEL,
        prompt=WORDS,
        max_tokens=3,
        extra_body={"request_id": "xyz"},
        extra_headers={"X-Request-Id": "from-header"},
    )
    assert out.id == "cmpl-from-header"
    out = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=3)
    assert out.id.startswith("cmpl-") and len(out.id) == len("cmpl-") + 32
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the same id, at once: the scheduler's ids differ
        outs = list(
            pool.map(
                lambda _: client.completions.create(
                    model=MODEL, prompt=WORDS, max_tokens=20, extra_body={"request_id": "same"}
                ),
                range(4),
            )
        )
    assert {o.id for o in outs} == {"cmpl-same"} and all(o.usage.completion_tokens == 20 for o in outs)
    status, _, body = http(
        "POST", echo_server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "request_id": 5}
    )
    assert status == 400 and body["error"]["param"] == "request_id", body


# ---- truncate_prompt_tokens ---------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(echo_server, default_tokenizer):
    """The echo model repeats its prompt: what it says is the prompt the engine got."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False).ids
    client = echo_server.client()
    for prompt in (ids, WORDS):  # token IDs, and text (tokenized with BOS, then cut)
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, extra_body={"truncate_prompt_tokens": 4}
        )
        assert out.usage.prompt_tokens == 4 and out.choices[0].text == default_tokenizer.decode(ids[-4:])
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right"}
    )
    assert out.usage.prompt_tokens == 3 and out.choices[0].text == default_tokenizer.decode(ids[:3])
    # several prompts: each is cut; a shorter one stays whole; -1 cuts nothing that fits
    out = client.completions.create(
        model=MODEL, prompt=[ids, ids[:2]], max_tokens=2, extra_body={"truncate_prompt_tokens": 5}
    )
    assert out.usage.prompt_tokens == 7 and [c.text for c in out.choices] == [
        default_tokenizer.decode(ids[-5:-3]),
        default_tokenizer.decode(ids[:2]),
    ]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert out.usage.prompt_tokens == len(ids)
    # chat: the rendered prompt's last tokens
    chat = [{"role": "user", "content": WORDS}]
    whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)
    out = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=3, extra_body={"truncate_prompt_tokens": 3}
    )
    assert whole.usage.prompt_tokens > 3 and out.usage.prompt_tokens == 3


def test_truncate_prompt_tokens_makes_a_long_prompt_fit(server, default_tokenizer):
    """--max-model-len 8192: a 9,000-token prompt is a 400 as it is, and fits once cut; more than the
    context, below -1 or 0 is a 400 naming the field."""
    long_prompt = [100] * 9000
    status, _, body = http(
        "POST", server.url + "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 2}
    )
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    for keep, expected in ((8000, 8000), (-1, 8191)):
        status, _, body = http(
            "POST",
            server.url + "/v1/completions",
            {"model": MODEL, "prompt": long_prompt, "max_tokens": 1, "truncate_prompt_tokens": keep},
        )
        assert status == 200 and body["usage"]["prompt_tokens"] == expected, body
    for bad in (8193, -2, 0, "ten", 1.5):
        for path, extra in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            status, _, body = http(
                "POST", server.url + path, {"model": MODEL, "max_tokens": 2, "truncate_prompt_tokens": bad, **extra}
            )
            assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens", (bad, body)
    status, _, body = http(
        "POST",
        server.url + "/v1/completions",
        {"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 2, "truncation_side": "middle"},
    )
    assert status == 400 and body["error"]["param"] == "truncation_side", body


# ---- return_tokens_as_token_ids -----------------------------------------------------------------


def test_return_tokens_as_token_ids_names_logprob_tokens(echo_server, default_tokenizer):
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False).ids
    client = echo_server.client()
    extra = {"return_tokens_as_token_ids": True}
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, logprobs=2, seed=1, extra_body=extra)
    lp = out.choices[0].logprobs
    names = [f"token_id:{t}" for t in ids[:6]]
    assert lp.tokens == names
    assert lp.text_offset == [sum(len(n) for n in names[:k]) for k in range(6)]  # vLLM counts the names' lengths
    assert all(
        names[k] in top and all(key.startswith("token_id:") for key in top) for k, top in enumerate(lp.top_logprobs)
    )
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, logprobs=2, seed=1)
    assert out.choices[0].text == plain.choices[0].text
    assert lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    # chat, streamed and not: the chosen token's bytes stay its text's (as vLLM's), top entries' are the names'
    chat = [{"role": "user", "content": WORDS}]
    whole = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=5, logprobs=True, top_logprobs=2, seed=1, extra_body=extra
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=5, logprobs=True, top_logprobs=2, seed=1
    )
    for named, texted in zip(whole.choices[0].logprobs.content, plain.choices[0].logprobs.content, strict=True):
        assert named.token.startswith("token_id:") and named.bytes == texted.bytes
        assert named.logprob == texted.logprob
        assert named.top_logprobs[0].token == named.token
        assert all(t.bytes == list(t.token.encode()) and t.token.startswith("token_id:") for t in named.top_logprobs)
    streamed = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=5, logprobs=True, top_logprobs=2, seed=1, stream=True, extra_body=extra
    )
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in whole.choices[0].logprobs.content]
    status, _, body = http(
        "POST",
        echo_server.url + "/v1/completions",
        {"model": MODEL, "prompt": "x", "return_tokens_as_token_ids": "yes"},
    )
    assert status == 400 and body["error"]["param"] == "return_tokens_as_token_ids", body


# ---- echo (completions) -------------------------------------------------------------------------


def test_completions_echo_puts_the_prompt_first(echo_server, default_tokenizer):
    client = echo_server.client()
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False).ids
    generated = default_tokenizer.decode(ids[:4])
    out = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=5, echo=True)
    # the text prompt is echoed as given; the model (echo mode) repeats the prompt's tokens, BOS first
    with_bos = default_tokenizer.encode(WORDS).ids
    assert out.choices[0].text == WORDS + default_tokenizer.decode(with_bos[:5])
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens == len(with_bos)
    # token IDs: decoded; n and several prompts: every choice; streamed: the same text
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, echo=True, n=2)
    texts = [c.text for c in out.choices]
    assert (
        texts
        == [WORDS + generated] * 2 + [default_tokenizer.decode(ids[:3]) * 2 + default_tokenizer.decode(ids[:1])] * 2
    )
    chunks = list(
        client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, echo=True, n=2, stream=True)
    )
    got = ["", "", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == texts
    # stop strings are looked for in the generated text only (the prompt holds "mill")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True, stop=["grinds"])
    assert out.choices[0].text == WORDS + "the mill " and out.choices[0].finish_reason == "stop"
    # truncation cuts what the engine sees, not the echo (vLLM detokenizes before truncating)
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, echo=True, extra_body={"truncate_prompt_tokens": 3}
    )
    assert out.choices[0].text == WORDS + default_tokenizer.decode(ids[-3:-1]) and out.usage.prompt_tokens == 3
    status, _, err = http("POST", echo_server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "echo": "yes"})
    assert status == 400 and err["error"]["param"] == "echo", err


def _legacy(choice) -> dict:
    lp = choice.logprobs
    return {
        "text_offset": lp.text_offset,
        "token_logprobs": lp.token_logprobs,
        "tokens": lp.tokens,
        "top_logprobs": lp.top_logprobs,
    }


def _expected_prompt_part(plp, prompt_ids, top_n, tokenizer) -> dict:
    """vLLM's legacy logprobs of the prompt from its prompt_logprobs: the first token decoded alone with
    null logprob and top list, then each prompt token's logprob and its map's first top_n + 1 entries
    by decoded token."""
    tokens = [tokenizer.decode([tid], skip_special_tokens=False) for tid in prompt_ids]
    lps, tops = [None], [None]
    for tid, entry in zip(prompt_ids[1:], plp[1:], strict=True):
        lps.append(entry[str(tid)]["logprob"])
        tops.append({e["decoded_token"]: e["logprob"] for e in list(entry.values())[: top_n + 1]})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops}


def test_completions_echo_with_logprobs_puts_the_prompts_logprobs_first(echo_server, default_tokenizer):
    """vLLM's echo with logprobs (its prompt_logprobs default to logprobs): each choice's legacy logprobs
    hold the prompt's tokens, then the generated ones; text_offset runs on across both."""
    client = echo_server.client()
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False).ids
    common = {"model": MODEL, "prompt": ids, "max_tokens": 4, "logprobs": 2, "n": 2, "seed": 7}
    plain = client.completions.create(**common)
    out = client.completions.create(**common, echo=True)
    assert len(out.choices) == 2 and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 8
    prompt_text = default_tokenizer.decode(ids)
    prompt_len = sum(len(default_tokenizer.decode([t], skip_special_tokens=False)) for t in ids)
    whole = []
    for choice, alone in zip(out.choices, plain.choices, strict=True):
        got, gen = _legacy(choice), _legacy(alone)
        assert choice.text == prompt_text + alone.text
        # as vLLM: the response's prompt_logprobs too (echo asked for them), each choice its prompt's
        plp = choice.model_extra["prompt_logprobs"]
        expected = _expected_prompt_part(plp, ids, 2, default_tokenizer)
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert got[key] == expected[key] + gen[key], key
        assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:k]) for k in range(len(got["tokens"]))]
        assert got["text_offset"][len(ids) :] == [prompt_len + o for o in gen["text_offset"]]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert all(isinstance(lp, float) for lp in got["token_logprobs"][1:])
        whole.append(got)
    assert whole[0]["tokens"][: len(ids)] == whole[1]["tokens"][: len(ids)]
    # streamed: the prompt's part goes out with each choice's first chunk, with the echoed text
    chunks = list(client.completions.create(**common, echo=True, stream=True))
    streamed = [
        {"text": "", "text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []} for _ in range(2)
    ]
    for chunk in chunks:
        for c in chunk.choices:
            acc = streamed[c.index]
            if not acc["tokens"] and c.logprobs is not None and c.logprobs.tokens:
                assert len(c.logprobs.tokens) > len(ids) and c.text.startswith(prompt_text), c
            acc["text"] += c.text
            if c.logprobs is not None:
                for key, value in _legacy(c).items():
                    acc[key] += value
    for acc, choice, got in zip(streamed, out.choices, whole, strict=True):
        assert acc.pop("text") == choice.text
        assert acc == got
    # several prompts: each choice its own prompt's; a text prompt's first token is the BOS, decoded alone
    with_bos = default_tokenizer.encode(WORDS).ids
    several = client.completions.create(
        model=MODEL, prompt=[ids[:3], ids[3:7]], max_tokens=2, logprobs=0, echo=True, seed=1
    )
    text = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=2, logprobs=0, echo=True, seed=1)
    for choice, p_ids in zip([*several.choices, *text.choices], [ids[:3], ids[3:7], with_bos], strict=True):
        expected = _expected_prompt_part(choice.model_extra["prompt_logprobs"], p_ids, 0, default_tokenizer)
        got = _legacy(choice)
        assert got["tokens"][: len(p_ids)] == expected["tokens"] and len(got["tokens"]) == len(p_ids) + 2
        assert got["top_logprobs"][: len(p_ids)] == expected["top_logprobs"]
    assert text.choices[0].logprobs.tokens[0] == default_tokenizer.decode([with_bos[0]], skip_special_tokens=False)
    # return_tokens_as_token_ids names the prompt's tokens too, the first one included
    out = client.completions.create(
        model=MODEL,
        prompt=ids[:3],
        max_tokens=2,
        logprobs=1,
        echo=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids[:3] + ids[:2]]
    # max_tokens 0 (vLLM's echo of the prompt alone) is still refused
    status, _, err = http(
        "POST",
        echo_server.url + "/v1/completions",
        {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0},
    )
    assert status == 400, err


_NO_PROMPT_LOGPROBS = """
import asyncio, sys
from tokenmill.engines.simulated import SimulatedScheduler
from tokenmill.scheduler_client import protocol

class NoPromptLogprobs(SimulatedScheduler):
    features = frozenset(protocol.FEATURES) - {protocol.FEATURE_PROMPT_LOGPROBS}

async def main():
    sched = NoPromptLogprobs(model="default", inter_token_latency_s=0)
    task = asyncio.create_task(sched.serve(sys.argv[1]))
    await sched.wait_ready()
    print("ready", flush=True)
    await task

asyncio.run(main())
"""


def test_completions_echo_with_logprobs_needs_an_engine_with_prompt_logprobs(tmp_path):
    endpoint = f"ipc://{tmp_path}/sim.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", _NO_PROMPT_LOGPROBS, endpoint], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        srv = Server("--workers", "1", "--scheduler", endpoint)
        try:
            for stream in (False, True):
                status, _, body = http(
                    "POST",
                    srv.url + "/v1/completions",
                    {"model": MODEL, "prompt": "x", "max_tokens": 2, "echo": True, "logprobs": 1, "stream": stream},
                )
                assert status == 400, body
                assert body["error"]["param"] == "echo" and body["error"]["code"] == "unsupported", body
            # echo alone, and logprobs alone, need no prompt logprobs
            out = srv.client().completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True)
            assert out.choices[0].text.startswith("x")
            out = srv.client().completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=1)
            assert len(out.choices[0].logprobs.tokens) == 2
        finally:
            srv.stop()
    finally:
        proc.terminate()
        proc.wait(10)


def test_chat_echo_repeats_the_last_assistant_message(echo_server):
    """vLLM's chat echo: the last message's content first when its role is the answer's."""
    client = echo_server.client()
    chat = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Well, "}]
    plain = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4)
    out = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4, extra_body={"echo": True})
    assert out.choices[0].message.content == "Well, " + plain.choices[0].message.content
    streamed = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=4, stream=True, extra_body={"echo": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content
    parts = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    out = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=2, extra_body={"echo": True})
    assert out.choices[0].message.content.startswith("a\nb")
    # the last message is the user's: nothing to echo
    user_last = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=4)
    out = client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=4, extra_body={"echo": True})
    assert out.choices[0].message.content == plain.choices[0].message.content
    status, _, err = http(
        "POST", echo_server.url + "/v1/chat/completions", {"model": MODEL, "messages": user_last, "echo": 3}
    )
    assert status == 400 and err["error"]["param"] == "echo", err


def test_answer_role_without_a_generation_prompt_as_vllm(echo_server):
    """With add_generation_prompt false the model goes on writing the last message, and the answer
    carries that message's role, as vLLM 0.32 names it (get_chat_request_role); the assistant's
    otherwise."""
    client = echo_server.client()
    for messages, extra, role in (
        ([{"role": "user", "content": "Say"}], {"add_generation_prompt": False}, "user"),
        ([{"role": "user", "content": "Say"}], {}, "assistant"),
        (
            [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Well"}],
            {"add_generation_prompt": False, "continue_final_message": True},
            "assistant",
        ),
    ):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
        assert out.choices[0].message.role == role, (extra, out)
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True, extra_body=extra)
        )
        assert chunks[0].choices[0].delta.role == role and not any(c.choices[0].delta.role for c in chunks[1:])


def test_continue_final_message_needs_add_generation_prompt_false_as_vllm(echo_server):
    """continue_final_message with add_generation_prompt true (its default) is a 400 naming it, as vLLM
    0.32 (and transformers' apply_chat_template) refuse it; with add_generation_prompt false it continues."""
    messages = [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Well"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "continue_final_message": True}
    for path in ("/v1/chat/completions", "/tokenize"):
        status, _, err = http("POST", echo_server.url + path, body)
        assert status == 400 and err["error"]["param"] == "continue_final_message", (path, err)
        status, _, out = http("POST", echo_server.url + path, {**body, "add_generation_prompt": False})
        assert status == 200, (path, out)


# ---- return_token_ids ---------------------------------------------------------------------------


def test_return_token_ids_on_completions_as_vllm(echo_server, default_tokenizer):
    """Every choice carries its prompt's IDs (as the engine got them) and its generated IDs, streamed
    and not; streamed, the prompt's IDs come with each choice's first chunk only, and each chunk's
    token_ids are the tokens behind it, those whose text is still held back included."""
    client = echo_server.client()
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False).ids
    extra = {"return_token_ids": True}
    out = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=5, extra_body=extra)
    with_bos = default_tokenizer.encode(WORDS).ids
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == with_bos and choice["token_ids"] == with_bos[:5]
    # several prompts, n, truncation: each choice its own prompt's (kept) IDs
    out = client.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, n=2, extra_body={**extra, "truncate_prompt_tokens": 6}
    )
    got = [(c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]) for c in out.choices]
    assert got == [(ids[-6:], ids[-6:-2])] * 2 + [(ids[:3], (ids[:3] * 2)[:4])] * 2
    chunks = [
        c.model_dump()
        for c in client.completions.create(
            model=MODEL,
            prompt=[ids, ids[:3]],
            max_tokens=4,
            n=2,
            stream=True,
            extra_body={**extra, "truncate_prompt_tokens": 6},
        )
    ]
    streamed = {i: [] for i in range(4)}
    for chunk in chunks:
        (c,) = chunk["choices"]
        if not streamed[c["index"]]:
            assert c["prompt_token_ids"] == got[c["index"]][0], c  # the choice's first chunk
        else:
            assert "prompt_token_ids" not in c, c
        streamed[c["index"]].append(c["token_ids"])
    assert [sum(streamed[i], []) for i in range(4)] == [g[1] for g in got]
    # a stop string holds text back: the tokens behind it still come, in chunks of their own, as in vLLM
    text, sent = "", []
    for chunk in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=len(ids), stop=["grain into"], stream=True, extra_body=extra
    ):
        c = chunk.choices[0]
        text += c.text
        sent += c.model_extra["token_ids"]
        assert default_tokenizer.decode(sent).startswith(text)
    assert text == "the mill grinds the " and c.finish_reason == "stop"
    assert sent == ids[: ids.index(default_tokenizer.encode(" into", add_special_tokens=False).ids[0]) + 1]
    # the request's stop token is the last ID (vLLM keeps it in token_ids)
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, extra_body={**extra, "stop_token_ids": [ids[3]]}
    )
    assert out.choices[0].model_extra["token_ids"] == ids[:4] and out.choices[0].finish_reason == "stop"
    # echo: vLLM returns the prompt's IDs instead of its text
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True, extra_body=extra)
    assert out.choices[0].text == default_tokenizer.decode(ids[:2])
    # not asked: no IDs anywhere
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra and "prompt_token_ids" not in plain.choices[0].model_extra
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        status, _, err = http("POST", echo_server.url + path, {"model": MODEL, "return_token_ids": "yes", **body})
        assert status == 400 and err["error"]["param"] == "return_token_ids", err


def test_return_token_ids_on_chat_as_vllm(echo_server, default_tokenizer):
    """prompt_token_ids at the response's top level (streamed: in every choice's role chunk, and no
    other), each choice's token_ids (streamed: each chunk's own, the finish chunk's empty)."""
    client = echo_server.client()
    chat = [{"role": "user", "content": WORDS}]
    status, _, rendered = http("POST", echo_server.url + "/tokenize", {"model": MODEL, "messages": chat})
    prompt = rendered["tokens"]
    out = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=6, n=2, extra_body={"return_token_ids": True}
    )
    assert out.model_extra["prompt_token_ids"] == prompt
    assert [c.model_extra["token_ids"] for c in out.choices] == [prompt[:6]] * 2
    events = _sse(
        echo_server,
        "/v1/chat/completions",
        {"messages": chat, "max_tokens": 6, "n": 2, "stream": True, "return_token_ids": True, "logprobs": True},
    )
    ids = {0: [], 1: []}
    content = {0: "", 1: ""}
    for event in events:
        (c,) = event["choices"]
        if c["delta"].get("role"):
            assert event["prompt_token_ids"] == prompt and "token_ids" not in c
            continue
        assert "prompt_token_ids" not in event
        ids[c["index"]] += c["token_ids"]
        content[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            assert c["token_ids"] == [] and c["finish_reason"] == "length"
        else:  # one chunk per token here: its logprobs entry is its token's
            assert len(c["token_ids"]) == 1 and len(c["logprobs"]["content"]) == 1
    assert ids == {0: prompt[:6], 1: prompt[:6]}
    assert content[0] == out.choices[0].message.content
    assert sum(1 for e in events if "prompt_token_ids" in e) == 2


THINK = "The user asks for a sum; 2 + 2 = 4.</think>The answer is 4."
SAYS = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
CALL = (
    'Let me look that up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """Scripted replies, four tokens per decode step (as speculative decoding emits them); the embedded
    model's parsers are on (think-tag reasoning, its tool calls)."""
    replies = Path(tmp_path_factory.mktemp("replies")) / "replies.jsonl"
    replies.write_text(
        "\n".join(
            json.dumps({"match": m, "text": t}, ensure_ascii=False)
            for m, t in (("think first", THINK), ("say the words", SAYS), ("weather in Paris", CALL))
        )
        + "\n"
    )
    srv = Server(
        "--workers",
        "1",
        "--sim-inter-token-latency-ms",
        "0",
        "--sim-replies",
        str(replies),
        "--sim-tokens-per-step",
        "4",
    )
    yield srv
    srv.stop()


def test_return_token_ids_stop_at_the_token_that_completes_a_stop_string(scripted, default_tokenizer):
    """Four tokens a step: vLLM drops those generated after the one completing the stop string."""
    words = default_tokenizer.encode(SAYS, add_special_tokens=False).ids
    gamma = words.index(default_tokenizer.encode(" gamma", add_special_tokens=False).ids[0])
    client = scripted.client()
    for stop, include in ((["gam"], False), (["a gamma"], True), (["mma d"], False)):
        end = gamma + 1 if stop != ["mma d"] else gamma + 2
        extra = {"return_token_ids": True, "include_stop_str_in_output": include}
        out = client.completions.create(model=MODEL, prompt="say the words", max_tokens=20, stop=stop, extra_body=extra)
        assert out.choices[0].model_extra["token_ids"] == words[:end], stop
        assert out.choices[0].finish_reason == "stop"
        chunks = list(
            client.completions.create(
                model=MODEL, prompt="say the words", max_tokens=20, stop=stop, stream=True, extra_body=extra
            )
        )
        assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == words[:end]
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_return_token_ids_with_reasoning_as_vllm(scripted, default_tokenizer):
    """Reasoning deltas carry their IDs; with include_reasoning false vLLM hides the generated IDs
    (they would tell the reasoning) and still gives the prompt's."""
    client = scripted.client()
    chat = [{"role": "user", "content": "think first"}]
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    out = client.chat.completions.create(model=MODEL, messages=chat, extra_body={"return_token_ids": True, **thinking})
    reply = default_tokenizer.encode(THINK, add_special_tokens=False).ids
    ids = out.choices[0].model_extra["token_ids"]
    assert ids[: len(reply)] == reply and len(ids) == out.usage.completion_tokens  # the EOS too
    assert out.choices[0].message.content == "The answer is 4."
    assert len(out.model_extra["prompt_token_ids"]) == out.usage.prompt_tokens
    events = _sse(
        scripted, "/v1/chat/completions", {"messages": chat, "stream": True, "return_token_ids": True, **thinking}
    )
    streamed = [e["choices"][0] for e in events[1:]]
    assert sum((c["token_ids"] for c in streamed), []) == ids
    assert any(c["delta"].get("reasoning") and c["token_ids"] for c in streamed)
    assert "".join(c["delta"].get("content") or "" for c in streamed) == "The answer is 4."
    hidden = client.chat.completions.create(
        model=MODEL, messages=chat, extra_body={"return_token_ids": True, "include_reasoning": False, **thinking}
    )
    assert hidden.choices[0].model_extra["token_ids"] is None and hidden.model_extra["prompt_token_ids"]
    events = _sse(
        scripted,
        "/v1/chat/completions",
        {"messages": chat, "stream": True, "return_token_ids": True, "include_reasoning": False, **thinking},
    )
    assert events[0]["prompt_token_ids"] and not any("token_ids" in e["choices"][0] for e in events)


# ---- spaces_between_special_tokens --------------------------------------------------------------


def _wordpiece_model(directory: Path) -> Path:
    """A tokenizer whose decoder (WordPiece) puts a space before every token that is not a ##piece,
    added tokens included: where spaces_between_special_tokens shows."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3, "mill": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(
        [AddedToken("<a>", special=True), AddedToken("<b>", special=True), AddedToken("</s>", special=True)]
    )
    tok.add_tokens(["plainadd"])  # an added token that is not special: vLLM treats it alike
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m.content }} {% endfor %}"})
    )
    (directory / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return directory


def test_spaces_between_special_tokens_as_vllm(tmp_path):
    """vLLM's FastIncrementalDetokenizer: with skip_special_tokens false and spaces_between false, an
    added token after an added token is its bare content; the rest is the decoder's text. (Its output
    for these IDs, worked out by running vLLM 0.32's decode_next: 'hello', ' <a>', '<b>', ' world',
    's', ' <b>', '<a>', 'plainadd', 'plainadd', ' mill'.)"""
    model = _wordpiece_model(tmp_path / "wordpiece")
    srv = Server(
        "--workers",
        "1",
        "--model",
        str(model),
        "--sim-mode",
        "echo",
        "--sim-inter-token-latency-ms",
        "0",
        "--tool-call-parser",
        "none",
        "--reasoning-parser",
        "none",
    )
    try:
        client = srv.client()
        ids = [1, 5, 6, 2, 3, 6, 5, 8, 8, 4]
        kept = "hello <a><b> worlds <b><a>plainaddplainadd mill"
        for extra, expected in (
            ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, kept),
            ({"skip_special_tokens": False}, "hello <a> <b> worlds <b> <a> plainadd plainadd mill"),
            ({"spaces_between_special_tokens": False}, "hello worlds plainadd plainadd mill"),
        ):
            out = client.completions.create(model="wordpiece", prompt=ids, max_tokens=len(ids), extra_body=extra)
            assert out.choices[0].text == expected, extra
            chunks = list(
                client.completions.create(
                    model="wordpiece", prompt=ids, max_tokens=len(ids), stream=True, extra_body=extra
                )
            )
            assert "".join(c.choices[0].text for c in chunks) == expected, extra
        out = client.chat.completions.create(
            model="wordpiece",
            messages=[{"role": "user", "content": "<a> <b> mill"}],
            max_tokens=3,
            extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False},
        )
        assert out.choices[0].message.content == "<a><b> mill"
        status, _, err = http(
            "POST",
            srv.url + "/v1/completions",
            {"model": "wordpiece", "prompt": ids, "spaces_between_special_tokens": "no"},
        )
        assert status == 400 and err["error"]["param"] == "spaces_between_special_tokens", err
    finally:
        srv.stop()


# ---- functions / function_call (OpenAI's deprecated forms of tools / tool_choice) ---------------

WEATHER_FN = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_functions_answer_in_openais_legacy_shape(scripted):
    """vLLM 0.32 ignores functions and function_call; tokenmill maps them as OpenAI does and answers
    with message.function_call and finish_reason "function_call" (streamed: delta.function_call)."""
    client = scripted.client()
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "weather in Paris"}], "functions": [WEATHER_FN]}
    out = client.chat.completions.create(**ask)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "function_call" and message.tool_calls is None
    assert message.function_call.name == "get_weather" and json.loads(message.function_call.arguments) == {
        "city": "Paris"
    }
    assert message.content == "Let me look that up."
    name, args, finish, content = None, "", None, ""
    for chunk in client.chat.completions.create(stream=True, **ask):
        delta = chunk.choices[0].delta
        assert delta.tool_calls is None
        content += delta.content or ""
        if delta.function_call:
            name = delta.function_call.name or name
            args += delta.function_call.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish, content) == (
        "get_weather",
        {"city": "Paris"},
        "function_call",
        message.content,
    )
    # function_call "auto" is the default; "none" parses no call; a name forces that function ("stop", as OpenAI)
    assert client.chat.completions.create(function_call="auto", **ask).choices[0].finish_reason == "function_call"
    none = client.chat.completions.create(function_call="none", **ask)
    assert none.choices[0].message.function_call is None and none.choices[0].finish_reason == "stop"
    named = client.chat.completions.create(function_call={"name": "get_weather"}, **ask)
    assert named.choices[0].message.function_call.name == "get_weather" and named.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(named.choices[0].message.function_call.arguments), dict)
    chat = [{"role": "user", "content": "weather in Paris"}]
    for bad, param in (
        ({"functions": [WEATHER_FN], "tools": [{"type": "function", "function": WEATHER_FN}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"functions": [WEATHER_FN], "function_call": {"name": "nope"}}, "function_call"),
        ({"functions": [WEATHER_FN], "function_call": "required"}, "function_call"),
        ({"functions": [WEATHER_FN], "function_call": "auto", "tool_choice": "auto"}, "function_call"),
        ({"functions": "get_weather"}, "functions"),
        ({"functions": [{"parameters": {}}]}, "functions"),
        ({"functions": []}, "functions"),
    ):
        status, _, err = http("POST", scripted.url + "/v1/chat/completions", {"model": MODEL, "messages": chat, **bad})
        assert status == 400 and err["error"]["param"] == param, (bad, err)


def test_docs_list_functions_among_the_differences_from_vllm():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api" / "request-fields.md").read_text()
    differences = doc.split("### Where tokenmill still differs from vLLM 0.32", 1)[1]
    assert "`functions`" in differences and "`function_call`" in differences and "ignores" in differences


def test_suffix_fills_in_the_middle_as_vllm_renders_it_for_deepseek():
    """vLLM 0.32 renders a completions suffix as DeepSeek's FIM prompt (renderers/deepseek_v4.py):
    begin, prompt, hole, suffix, end; the default model's vocabulary has those markers."""
    from conftest import Server, http

    server = Server("--sim-mode", "echo", "--sim-inter-token-latency-ms", "1")
    try:
        url = server.url + "/v1/completions"
        fim = "<｜fim▁begin｜>def add(a, b):<｜fim▁hole｜>    return c<｜fim▁end｜>"
        status, _, plain = http("POST", server.url + "/tokenize", {"model": "deepseek-v4", "prompt": fim})
        assert status == 200, plain
        status, _, body = http(
            "POST", url, {"model": "deepseek-v4", "prompt": "def add(a, b):", "suffix": "    return c", "max_tokens": 1}
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == plain["count"]
        status, _, body = http(
            "POST",
            url,
            {"model": "deepseek-v4", "prompt": "x", "suffix": "", "max_tokens": 200, "return_token_ids": True},
        )
        assert status == 200 and body["choices"][0]["prompt_token_ids"][-1] == 128802  # <｜fim▁end｜>
        for extra, words in (
            ({"echo": True}, "Echo is unsupported"),
            ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
            ({"prompt": [1, 2, 3]}, "text prompt"),
        ):
            status, _, err = http(
                "POST", url, {"model": "deepseek-v4", "prompt": "x", "suffix": "y", "max_tokens": 1, **extra}
            )
            assert status == 400 and err["error"]["param"] == "suffix" and words in err["error"]["message"], err
    finally:
        server.stop()
