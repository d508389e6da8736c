"""A tokenizer worker's death costs no stream (issue 33): kill -9 of the worker detokenizing 32 streams,
and every stream ends with exactly the text, reasoning, tool calls and logprobs of an undisturbed run of
the same seeded requests; the gateway's token history is freed afterwards; a stream that cannot move
(over --stream-history-bytes, or no live worker left) ends with a clear 503 worker_died, never a hang.

The simulated scheduler plays scripted replies (--sim-replies), long enough (~150 tokens at 15 ms) that
the kill lands mid-stream, with multi-byte UTF-8 cut across tokens, a stop string late in the text,
reasoning and a tool call whose arguments are being generated. Waits are bounded; nothing asserts a
duration.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import openai
import pytest
from conftest import Server
from faultutil import CHAT_MODEL, metric, state, wait_until

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
PARAGRAPH = (
    "The mill wheel turned slowly in the river while the miller counted sacks of grain, one by one, "
    "and wrote each number in a ledger that had been in his family for three generations. "
)
UTF8 = "Zürich 😀 東京 naïve — ß 🤖 ñandú 🙂 Köln 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 "
REPLIES = [
    ("plain story", PARAGRAPH * 4),
    ("utf8 story", UTF8 * 12),
    ("stop story", PARAGRAPH * 2 + "The miller said END-OF-PART and went home. " + PARAGRAPH),
    ("thinking story", PARAGRAPH * 2 + "</think>" + PARAGRAPH),
    (
        "calling story",
        "Checking the weather."
        + B
        + CB
        + "get_weather"
        + S
        + json.dumps({"city": "Paris", "note": PARAGRAPH * 2})
        + CE
        + E,
    ),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "note": {"type": "string"}}},
    },
}


def _requests() -> list[tuple[str, dict]]:
    """32 seeded streaming requests: (endpoint, body) covering every kind of state a stream holds."""
    out = []
    for i in range(32):
        kind = i % 8
        seed = 1000 + i

        def msg(text: str, i: int = i) -> list[dict]:
            return [{"role": "user", "content": f"{text} number {i}"}]

        if kind == 0:
            out.append(("chat", {"messages": msg("plain story"), "seed": seed}))
        elif kind == 1:
            out.append(("chat", {"messages": msg("utf8 story"), "seed": seed}))
        elif kind == 2:
            out.append(("chat", {"messages": msg("stop story"), "seed": seed, "stop": ["END-OF-PART", "qqqq"]}))
        elif kind == 3:
            extra = {"chat_template_kwargs": {"enable_thinking": True}}
            out.append(("chat", {"messages": msg("thinking story"), "seed": seed, "extra_body": extra}))
        elif kind == 4:
            out.append(("chat", {"messages": msg("calling story"), "seed": seed, "tools": [WEATHER]}))
        elif kind == 5:
            body = {"messages": msg("utf8 story"), "seed": seed, "logprobs": True, "top_logprobs": 2}
            out.append(("chat", body))
        elif kind == 6:
            out.append(("chat", {"messages": msg("plain story"), "seed": seed, "n": 2}))
        else:
            body = {"prompt": f"stop story number {i}", "seed": seed, "logprobs": 1, "stop": ["END-OF-PART"]}
            out.append(("completion", body))
    return out


async def _one(client, endpoint: str, body: dict, progress: list) -> dict:
    """Everything the client received, joined per choice; progress[0] counts chunks as they come."""
    got: dict = {}
    if endpoint == "chat":
        stream = await client.chat.completions.create(model=CHAT_MODEL, max_tokens=400, stream=True, **body)
    else:
        stream = await client.completions.create(model=CHAT_MODEL, max_tokens=400, stream=True, **body)
    async for chunk in stream:
        progress[0] += 1
        for c in chunk.choices:
            slot = got.setdefault(
                c.index, {"content": "", "reasoning": "", "calls": {}, "logprobs": [], "finish": None}
            )
            if endpoint == "chat":
                delta = c.delta
                slot["content"] += delta.content or ""
                slot["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
                for item in delta.tool_calls or []:
                    call = slot["calls"].setdefault(item.index, {"name": "", "arguments": ""})
                    call["name"] += (item.function and item.function.name) or ""
                    call["arguments"] += (item.function and item.function.arguments) or ""
                if c.logprobs and c.logprobs.content:
                    slot["logprobs"] += [
                        (e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in c.logprobs.content
                    ]
            else:
                slot["content"] += c.text or ""
                if c.logprobs and c.logprobs.tokens:
                    slot["logprobs"] += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset))
            slot["finish"] = c.finish_reason or slot["finish"]
    return got


async def _run(srv, requests, on_progress=None) -> list:
    """All requests at once; ``on_progress(progress)`` runs in a thread beside them (the fault)."""
    client = srv.async_client().with_options(timeout=40)
    progress = [[0] for _ in requests]

    async def guarded(i, endpoint, body):
        try:
            return await _one(client, endpoint, body, progress[i])
        except openai.APIError as exc:
            return {"error": f"{getattr(exc, 'code', None) or type(exc).__name__}: {exc}"}

    fault = asyncio.create_task(asyncio.to_thread(on_progress, progress)) if on_progress else None
    results = await asyncio.gather(*(guarded(i, e, b) for i, (e, b) in enumerate(requests)))
    if fault is not None:
        await fault
    return results


def _kill_busiest(srv, progress, wait_chunks: int = 6) -> dict:
    """Once every stream has had a few chunks, kill -9 the worker detokenizing the most streams."""
    wait_until(lambda: all(p[0] >= wait_chunks for p in progress), 60, interval=0.01, what="every stream under way")
    victim = max((w for w in state(srv)["workers"] if w["alive"]), key=lambda w: w["streams"])
    assert victim["streams"] > 0, state(srv)
    os.kill(victim["pid"], signal.SIGKILL)
    return victim


@pytest.fixture(scope="module")
def failover_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("replies") / "replies.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for match, text in REPLIES:
            f.write(json.dumps({"match": match, "text": text}, ensure_ascii=False) + "\n")
    srv = Server("--workers", "2", "--sim-inter-token-latency-ms", "15", "--sim-replies", str(path))
    yield srv
    srv.stop()


def test_kill9_of_a_worker_mid_stream_loses_and_repeats_nothing(failover_server):
    srv = failover_server
    requests = _requests()
    baseline = asyncio.run(_run(srv, requests))
    for got in baseline:
        assert "error" not in got, got
    # the requests cover what they should: a stop string, reasoning, a call, logprobs, multi-byte text
    assert baseline[2][0]["finish"] == "stop" and "END-OF-PART" not in baseline[2][0]["content"]
    assert baseline[3][0]["reasoning"] and baseline[3][0]["content"]
    assert baseline[4][0]["calls"] and baseline[4][0]["finish"] == "tool_calls"
    assert baseline[5][0]["logprobs"] and "😀" in baseline[5][0]["content"]
    assert len(baseline[6]) == 2 and baseline[7][0]["logprobs"]

    resumed_before = metric(srv, "tokenmill_stream_failovers_total", reason="resumed")
    killed = {}
    disturbed = asyncio.run(_run(srv, requests, lambda p: killed.update(_kill_busiest(srv, p))))
    print(f"killed worker {killed['index']} (pid {killed['pid']}) holding {killed['streams']} streams")
    differ = [i for i, (want, got) in enumerate(zip(baseline, disturbed)) if got != want]
    for i in differ:
        print(f"request {i} {requests[i]}:\n  undisturbed {baseline[i]}\n  with failover {disturbed[i]}")
    if differ:
        print(srv.read_output()[-6000:])
    assert not differ, f"requests {differ} differ after the failover"
    resumed = metric(srv, "tokenmill_stream_failovers_total", reason="resumed") - resumed_before
    assert resumed >= 1, "no stream moved"
    # nothing is kept for finished requests
    wait_until(lambda: metric(srv, "tokenmill_stream_history_bytes") == 0, 30, what="token history freed")
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="the killed worker replaced")


def test_killing_the_replacement_too_ends_in_a_clear_error(failover_server):
    """Both workers killed, one after the other, while streams run: each stream either completes
    exactly or ends with a worker_died error; none hangs."""
    srv = failover_server
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="both workers alive")
    requests = _requests()[:8]
    baseline = asyncio.run(_run(srv, requests))

    def kill_both(progress):
        first = _kill_busiest(srv, progress, wait_chunks=3)
        others = [w for w in state(srv)["workers"] if w["index"] != first["index"] and w["alive"]]
        for w in others:
            os.kill(w["pid"], signal.SIGKILL)

    before = metric(srv, "tokenmill_stream_failovers_total", reason="no_worker")
    results = asyncio.run(_run(srv, requests, kill_both))
    errors = [r["error"] for r in results if "error" in r]
    for want, got in zip(baseline, results):
        assert "error" in got or got == want
    assert errors, "every stream survived both workers dying"
    for err in errors:
        assert "worker_died" in err or "died" in err, err
    assert metric(srv, "tokenmill_stream_failovers_total", reason="no_worker") > before
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="both workers replaced")
    wait_until(lambda: metric(srv, "tokenmill_stream_history_bytes") == 0, 30, what="token history freed")


def test_a_stream_over_the_history_cap_is_not_resumed(tmp_path):
    path = tmp_path / "replies.jsonl"
    path.write_text(json.dumps({"match": "plain story", "text": PARAGRAPH * 4}) + "\n")
    srv = Server(
        "--workers", "2", "--sim-inter-token-latency-ms", "15", "--sim-replies", str(path),
        "--stream-history-bytes", "64",
    )  # fmt: skip
    try:
        requests = [("chat", {"messages": [{"role": "user", "content": f"plain story {i}"}]}) for i in range(4)]
        results = asyncio.run(_run(srv, requests, lambda p: _kill_busiest(srv, p, wait_chunks=30)))
        errors = [r["error"] for r in results if "error" in r]
        assert errors and all("--stream-history-bytes" in e for e in errors), results
        assert metric(srv, "tokenmill_stream_failovers_total", reason="not_resumable") >= 1
    finally:
        srv.stop()
