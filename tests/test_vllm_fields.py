"""vLLM's request fields that the front end honours as vLLM 0.32's OpenAI server does (issue 29):
stream_options.continuous_usage_stats, ...

A real `tokenmill serve` on the simulated scheduler in echo mode (the output repeats the prompt's
tokens, so what a response must hold is known in advance), driven with the official OpenAI client
and, where the exact bytes matter, plain HTTP.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import http

MODEL = "deepseek-v4"
WORDS = "the mill grinds the grain into fine white flour every single morning"


def _sse(server, path: str, body: dict) -> list[dict]:
    """The data events of a streamed response, parsed ([DONE] left out)."""
    req = urllib.request.Request(server.url + path, json.dumps({"model": MODEL, **body}).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


# ---- stream_options.continuous_usage_stats ------------------------------------------------------


def test_continuous_usage_counts_every_chat_chunk_as_vllm(echo_server):
    """Every chunk carries usage: the prompt's tokens and the choice's tokens generated so far (0 in
    the role chunk), total their sum; the last chunk still sums the choices (vLLM's serving_chat)."""
    client = echo_server.client()
    chat = [{"role": "user", "content": WORDS}]
    stream = client.chat.completions.create(model=MODEL, messages=chat, n=2, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
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
    events = _sse(echo_server, "/v1/completions", {
        "prompt": [first, second], "max_tokens": 12, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
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
        "prompt_tokens": len(first) + len(second), "completion_tokens": 24, "total_tokens": len(first) + len(second) + 24}


def test_continuous_usage_needs_include_usage_as_in_vllm(echo_server):
    """continuous_usage_stats alone gives no usage (vLLM reads it only with include_usage); a request
    that is not streamed just answers."""
    events = _sse(echo_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": WORDS}], "max_tokens": 4, "stream": True,
        "stream_options": {"continuous_usage_stats": True}})  # fmt: skip
    assert events and all("usage" not in e for e in events), events
    events = _sse(echo_server, "/v1/completions", {
        "prompt": WORDS, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False}})  # fmt: skip
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 4
    status, _, body = http("POST", echo_server.url + "/v1/completions", {
        "model": MODEL, "prompt": WORDS, "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    status, _, body = http("POST", echo_server.url + "/v1/completions", {
        "model": MODEL, "prompt": WORDS, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}})
    assert status == 400 and body["error"]["param"] == "stream_options.continuous_usage_stats", body


# ---- include_stop_str_in_output ---------------------------------------------------------------


@pytest.mark.parametrize("stop, expected", [
    (["gamma"], "alpha beta gamma"),
    (["a gam"], "alpha beta gam"),  # across two tokens, and inside one: the text ends where the stop string does
    (["delta", "beta g"], "alpha beta g"),  # the one that ends first, as vLLM's check_stop_strings
    (["nowhere"], "alpha beta gamma delta epsilon"),
])
def test_include_stop_str_in_output_keeps_the_stop_string(echo_server, default_tokenizer, stop, expected):
    ids = default_tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False).ids
    client = echo_server.client()
    extra = {"include_stop_str_in_output": True}
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop, extra_body=extra)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == ("length" if stop == ["nowhere"] else "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop, stream=True,
                                            extra_body=extra))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == expected
    # false (the default) cuts it, as before
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), stop=stop,
                                    extra_body={"include_stop_str_in_output": False})  # fmt: skip
    assert cut.choices[0].text == (expected if stop == ["nowhere"] else expected[: expected.rindex(
        "gamma" if stop == ["gamma"] else ("a gam" if stop == ["a gam"] else "beta g"))])


def test_include_stop_str_in_output_on_chat_and_bad_values(echo_server):
    client = echo_server.client()
    chat = [{"role": "user", "content": "alpha beta gamma delta"}]
    out = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=60, stop=["beta"],
                                         extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert out.choices[0].message.content.endswith("alpha beta") and out.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=60, stop=["beta"], stream=True,
                                              extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content
    status, _, body = http("POST", echo_server.url + "/v1/completions",
                           {"model": MODEL, "prompt": "x", "include_stop_str_in_output": "yes"})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "include_stop_str_in_output", body


# ---- request_id ---------------------------------------------------------------------------------


def test_request_id_names_the_response_as_vllm(echo_server):
    """chatcmpl-{request_id} / cmpl-{request_id}, streamed and not; an X-Request-Id header wins, as in
    vLLM's _base_request_id; two requests with the same id at once both complete."""
    import concurrent.futures

    client = echo_server.client()
    chat = [{"role": "user", "content": WORDS}]
    out = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3, extra_body={"request_id": "abc-1"})
    assert out.id == "chatcmpl-abc-1"
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"request_id": "abc-2"}))  # fmt: skip
    assert {c.id for c in chunks} == {"chatcmpl-abc-2"}
    out = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=3, extra_body={"request_id": "xyz"})
    assert out.id == "cmpl-xyz"
    out = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=3, extra_body={"request_id": "xyz"},
                                    extra_headers={"X-Request-Id": "from-header"})  # fmt: skip
    assert out.id == "cmpl-from-header"
    out = client.completions.create(model=MODEL, prompt=WORDS, max_tokens=3)
    assert out.id.startswith("cmpl-") and len(out.id) == len("cmpl-") + 32
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the same id, at once: the scheduler's ids differ
        outs = list(pool.map(lambda _: client.completions.create(model=MODEL, prompt=WORDS, max_tokens=20,
                                                                 extra_body={"request_id": "same"}), range(4)))
    assert {o.id for o in outs} == {"cmpl-same"} and all(o.usage.completion_tokens == 20 for o in outs)
    status, _, body = http("POST", echo_server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "request_id": 5})
    assert status == 400 and body["error"]["param"] == "request_id", body


# ---- truncate_prompt_tokens ---------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(echo_server, default_tokenizer):
    """The echo model repeats its prompt: what it says is the prompt the engine got."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False).ids
    client = echo_server.client()
    for prompt in (ids, WORDS):  # token IDs, and text (tokenized with BOS, then cut)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                        extra_body={"truncate_prompt_tokens": 4})  # fmt: skip
        assert out.usage.prompt_tokens == 4 and out.choices[0].text == default_tokenizer.decode(ids[-4:])
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=3,
                                    extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right"})  # fmt: skip
    assert out.usage.prompt_tokens == 3 and out.choices[0].text == default_tokenizer.decode(ids[:3])
    # several prompts: each is cut; a shorter one stays whole; -1 cuts nothing that fits
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 5})  # fmt: skip
    assert out.usage.prompt_tokens == 7 and [c.text for c in out.choices] == [
        default_tokenizer.decode(ids[-5:-3]), default_tokenizer.decode(ids[:2])]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert out.usage.prompt_tokens == len(ids)
    # chat: the rendered prompt's last tokens
    chat = [{"role": "user", "content": WORDS}]
    whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)
    out = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3,
                                         extra_body={"truncate_prompt_tokens": 3})  # fmt: skip
    assert whole.usage.prompt_tokens > 3 and out.usage.prompt_tokens == 3


def test_truncate_prompt_tokens_makes_a_long_prompt_fit(server, default_tokenizer):
    """--max-model-len 8192: a 9,000-token prompt is a 400 as it is, and fits once cut; more than the
    context, below -1 or 0 is a 400 naming the field."""
    long_prompt = [100] * 9000
    status, _, body = http("POST", server.url + "/v1/completions",
                           {"model": MODEL, "prompt": long_prompt, "max_tokens": 2})  # fmt: skip
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    for keep, expected in ((8000, 8000), (-1, 8191)):
        status, _, body = http("POST", server.url + "/v1/completions", {
            "model": MODEL, "prompt": long_prompt, "max_tokens": 1, "truncate_prompt_tokens": keep})  # fmt: skip
        assert status == 200 and body["usage"]["prompt_tokens"] == expected, body
    for bad in (8193, -2, 0, "ten", 1.5):
        for path, extra in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            status, _, body = http("POST", server.url + path, {"model": MODEL, "max_tokens": 2,
                                                               "truncate_prompt_tokens": bad, **extra})  # fmt: skip
            assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens", (bad, body)
    status, _, body = http("POST", server.url + "/v1/completions", {
        "model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 2, "truncation_side": "middle"})  # fmt: skip
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
    assert all(names[k] in top and all(key.startswith("token_id:") for key in top) for k, top in enumerate(lp.top_logprobs))
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, logprobs=2, seed=1)
    assert out.choices[0].text == plain.choices[0].text
    assert lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    # chat, streamed and not: the chosen token's bytes stay its text's (as vLLM's), top entries' are the names'
    chat = [{"role": "user", "content": WORDS}]
    whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=5, logprobs=True, top_logprobs=2,
                                           seed=1, extra_body=extra)  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=5, logprobs=True, top_logprobs=2,
                                           seed=1)  # fmt: skip
    for named, texted in zip(whole.choices[0].logprobs.content, plain.choices[0].logprobs.content, strict=True):
        assert named.token.startswith("token_id:") and named.bytes == texted.bytes
        assert named.logprob == texted.logprob
        assert named.top_logprobs[0].token == named.token
        assert all(t.bytes == list(t.token.encode()) and t.token.startswith("token_id:") for t in named.top_logprobs)
    streamed = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=5, logprobs=True, top_logprobs=2,
                                              seed=1, stream=True, extra_body=extra)  # fmt: skip
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in whole.choices[0].logprobs.content]
    status, _, body = http("POST", echo_server.url + "/v1/completions",
                           {"model": MODEL, "prompt": "x", "return_tokens_as_token_ids": "yes"})  # fmt: skip
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
    assert texts == [WORDS + generated] * 2 + [default_tokenizer.decode(ids[:3]) * 2 + default_tokenizer.decode(ids[:1])] * 2
    chunks = list(client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, echo=True, n=2,
                                            stream=True))  # fmt: skip
    got = ["", "", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == texts
    # stop strings are looked for in the generated text only (the prompt holds "mill")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True, stop=["grinds"])
    assert out.choices[0].text == WORDS + "the mill " and out.choices[0].finish_reason == "stop"
    # truncation cuts what the engine sees, not the echo (vLLM detokenizes before truncating)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True,
                                    extra_body={"truncate_prompt_tokens": 3})  # fmt: skip
    assert out.choices[0].text == WORDS + default_tokenizer.decode(ids[-3:-1]) and out.usage.prompt_tokens == 3
    for body in ({"echo": True, "logprobs": 1}, {"echo": "yes"}):
        status, _, err = http("POST", echo_server.url + "/v1/completions", {"model": MODEL, "prompt": "x", **body})
        assert status == 400 and err["error"]["param"] == "echo", err


def test_chat_echo_repeats_the_last_assistant_message(echo_server):
    """vLLM's chat echo: the last message's content first when its role is the answer's."""
    client = echo_server.client()
    chat = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Well, "}]
    plain = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4)
    out = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4, extra_body={"echo": True})
    assert out.choices[0].message.content == "Well, " + plain.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4, stream=True,
                                              extra_body={"echo": True})  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content
    parts = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=2, extra_body={"echo": True})
    assert out.choices[0].message.content.startswith("a\nb")
    # the last message is the user's: nothing to echo
    user_last = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=4)
    out = client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=4, extra_body={"echo": True})
    assert out.choices[0].message.content == plain.choices[0].message.content
    status, _, err = http("POST", echo_server.url + "/v1/chat/completions",
                          {"model": MODEL, "messages": user_last, "echo": 3})  # fmt: skip
    assert status == 400 and err["error"]["param"] == "echo", err
