"""Scripted streaming requests and what a client received of them, joined per choice: the failover
tests (tests/serving/test_stream_failover.py, the remote worker's in test_remote_workers.py) run
them undisturbed and under a fault, and compare.

The simulated scheduler plays scripted replies (``write_replies``, for --sim-replies), long enough
(~150 tokens) that a fault lands mid-stream, with multi-byte UTF-8 cut across tokens, a stop string
late in the text, reasoning and a tool call whose arguments are being generated.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import anthropic
import openai
from faultutil import CHAT_MODEL, state, wait_until

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


ANTHROPIC_WEATHER = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def requests() -> list[tuple[str, dict]]:
    """32 seeded streaming requests: (endpoint, body) covering every kind of state a stream holds, on
    chat and completions and the agent APIs (Anthropic's /v1/messages, OpenAI's /v1/responses)."""
    out = []
    for i in range(32):
        kind = i % 10
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
        elif kind == 7:
            body = {"prompt": f"stop story number {i}", "seed": seed, "logprobs": 1, "stop": ["END-OF-PART"]}
            out.append(("completion", body))
        elif kind == 8:  # thinking blocks, a tool_use block, a stop sequence
            out.append(
                (
                    "messages",
                    [
                        {
                            "messages": msg("thinking story"),
                            "thinking": {"type": "enabled", "budget_tokens": 1024},
                            "max_tokens": 1100,
                        },
                        {"messages": msg("calling story"), "tools": [ANTHROPIC_WEATHER]},
                        {"messages": msg("stop story"), "stop_sequences": ["END-OF-PART"]},
                    ][i // 10 % 3],
                )
            )
        else:  # a function call, multi-byte text
            story = ["calling story", "utf8 story", "plain story"][i // 10 % 3]
            out.append(("responses", {"input": msg(story), "tools": [RESPONSES_WEATHER]}))
    return out


async def one(client, endpoint: str, body: dict, progress: list, model: str = CHAT_MODEL) -> dict:
    """Everything the client received, joined per choice; progress[0] counts chunks as they come."""
    got: dict = {}
    if endpoint == "messages":
        return await _messages(client, body, progress, model)
    if endpoint == "responses":
        return await _responses(client, body, progress, model)
    if endpoint == "chat":
        stream = await client.chat.completions.create(model=model, stream=True, **{"max_tokens": 400, **body})
    else:
        stream = await client.completions.create(model=model, stream=True, **{"max_tokens": 400, **body})
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
        if chunk.usage is not None:  # asked for (stream_options.include_usage)
            got["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return got


def _slot() -> dict:
    return {"content": "", "reasoning": "", "calls": {}, "logprobs": [], "finish": None}


async def _messages(client, body: dict, progress: list, model: str) -> dict:
    """An Anthropic stream joined: text, thinking (with its signature), tool_use blocks, stop_reason."""
    slot, calls = _slot(), {}
    stream = await client.messages.create(model=model, stream=True, **{"max_tokens": 400, **body})
    async for event in stream:
        progress[0] += 1
        if event.type == "content_block_start" and event.content_block.type == "tool_use":
            calls[event.index] = slot["calls"].setdefault(
                len(slot["calls"]), {"name": event.content_block.name, "arguments": ""}
            )
        elif event.type == "content_block_delta":
            delta = event.delta
            if delta.type == "text_delta":
                slot["content"] += delta.text
            elif delta.type == "thinking_delta":
                slot["reasoning"] += delta.thinking
            elif delta.type == "signature_delta":
                slot["logprobs"].append(delta.signature)  # (a SHA-256 of the thinking: the same both times)
            elif delta.type == "input_json_delta":
                calls[event.index]["arguments"] += delta.partial_json
        elif event.type == "message_delta":
            slot["finish"] = (event.delta.stop_reason, event.delta.stop_sequence, event.usage.output_tokens)
    return {0: slot}


async def _responses(client, body: dict, progress: list, model: str) -> dict:
    """A Responses stream joined: output text, reasoning text, function calls, final status and usage."""
    slot = _slot()
    stream = await client.responses.create(model=model, stream=True, **{"max_output_tokens": 400, **body})
    async for event in stream:
        progress[0] += 1
        if event.type == "response.output_text.delta":
            slot["content"] += event.delta
        elif event.type == "response.reasoning_text.delta":
            slot["reasoning"] += event.delta
        elif event.type == "response.output_item.added" and event.item.type == "function_call":
            slot["calls"][event.output_index] = {"name": event.item.name, "arguments": ""}
        elif event.type == "response.function_call_arguments.delta":
            slot["calls"][event.output_index]["arguments"] += event.delta
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            slot["finish"] = (event.response.status, event.response.usage.output_tokens)
    return {0: slot}


async def run(srv, requests, on_progress=None, model: str = CHAT_MODEL) -> list:
    """All requests at once; ``on_progress(progress)`` runs in a thread beside them (the fault)."""
    client = srv.async_client().with_options(timeout=40)
    agent = anthropic.AsyncAnthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=40)
    progress = [[0] for _ in requests]

    async def guarded(i, endpoint, body):
        try:
            return await one(agent if endpoint == "messages" else client, endpoint, body, progress[i], model)
        except (openai.APIError, anthropic.APIError) as exc:
            return {"error": f"{getattr(exc, 'code', None) or type(exc).__name__}: {exc}"}

    fault = asyncio.create_task(asyncio.to_thread(on_progress, progress)) if on_progress else None
    results = await asyncio.gather(*(guarded(i, e, b) for i, (e, b) in enumerate(requests)))
    if fault is not None:
        await fault
    return results


def kill_busiest(srv, progress, wait_chunks: int = 6) -> dict:
    """Once every stream has had a few chunks, kill -9 the worker detokenizing the most streams."""
    wait_until(lambda: all(p[0] >= wait_chunks for p in progress), 60, interval=0.01, what="every stream under way")
    victim = max((w for w in state(srv)["workers"] if w["alive"]), key=lambda w: w["streams"])
    assert victim["streams"] > 0, state(srv)
    os.kill(victim["pid"], signal.SIGKILL)
    return victim


def write_replies(path) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for match, text in REPLIES:
            f.write(json.dumps({"match": match, "text": text}, ensure_ascii=False) + "\n")
    return str(path)
