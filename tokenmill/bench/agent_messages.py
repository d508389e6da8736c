"""``tokenmill bench vllm``'s agent scenario over Anthropic's Messages API (issue 31).

A Claude-Code-shaped conversation: a long system prompt (~20k tokens, as blocks with
``cache_control``) and tool schemas, a task, then per turn an assistant ``tool_use`` and a user
``tool_result`` holding a fresh tool output, so the body grows turn by turn. Each turn is sent whole
to ``/v1/messages/count_tokens`` (both servers convert and render the whole conversation, the engine
has nothing to do) while a prober GETs ``/health`` every 10 ms; the late turns' conversion time
and the probe's p99 are the figures. Then the front process's CPU per request: the same short
conversation as ``/v1/messages`` and as ``/v1/chat/completions`` (one output token), the server
process's user+system CPU over the requests divided by their number.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

from tokenmill.bench.common import health_prober, pct, request, rnd

TOOLS = [
    {
        "name": f"tool_{i}",
        "description": f"Tool number {i}: reads, edits or runs things in the repository. " * 4,
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "text": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["path"],
        },
    }
    for i in range(16)
]


def _history(tag: str, system: str) -> dict:
    return {
        "system": [
            {"type": "text", "text": f"[{tag}] You are a coding agent."},
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": TOOLS,
        # Claude Code sends auto; vLLM refuses auto without --enable-auto-tool-choice, and "none" keeps the
        # tools in the rendered prompt on both sides (the same conversion work)
        "tool_choice": {"type": "none"},
        "messages": [{"role": "user", "content": "Read the repository and fix the failing test."}],
    }


def _turn(body: dict, turn: int, piece: str) -> None:
    call = f"toolu_{turn:04d}"
    body["messages"] += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": f"Reading part {turn}."},
                {"type": "tool_use", "id": call, "name": "tool_0", "input": {"path": f"src/part{turn}.py"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": piece}]},
    ]


def agent_messages(port: int, model: str, tag: str, system: str, pieces: list[str]) -> dict:
    """One conversation, growing by ``pieces`` (a tool output per turn), each turn counted whole."""
    ctx = mp.get_context("spawn")
    out, stop, started = ctx.Queue(), ctx.Event(), ctx.Event()
    prober = ctx.Process(target=health_prober, args=(port, stop, out, started))
    prober.start()
    started.wait(60)
    body = {"model": model, **_history(tag, system)}
    times, tokens, errors = [], [], []
    for turn, piece in enumerate(pieces):
        _turn(body, turn, piece)
        t0 = time.perf_counter()
        status, data = request(port, "POST", "/v1/messages/count_tokens", json.dumps(body).encode(), timeout=600)
        times.append((time.perf_counter() - t0) * 1000)
        if status == 200:
            tokens.append(json.loads(data)["input_tokens"])
        else:
            errors.append(f"{status}: {data[:200]!r}")
    stop.set()
    health = out.get(timeout=120)[1]
    prober.join(30)
    late = times[-3:]
    return {
        "first_turn_ms": rnd(times[0], 2) if times else None,
        "late_turn_p50_ms": rnd(pct(late, 0.5), 2),
        "late_turn_max_ms": rnd(max(late, default=None), 2),
        "health_p99_ms": rnd(pct(health, 0.99), 2),
        "final_prompt_tokens": max(tokens, default=0),
        "errors": errors[:3],
    }


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_cpu(port: int, pid: int, model: str, requests: int) -> dict:
    """The front process's CPU per request (ms): /v1/messages against /v1/chat/completions, the same
    conversation, one output token each, one at a time."""
    text = "Explain what this function does: def f(x): return x * 2. " * 20
    bodies = {
        "messages": (
            "/v1/messages",
            {
                "model": model,
                "max_tokens": 1,
                "system": "You are terse.",
                "messages": [{"role": "user", "content": text}],
            },
        ),
        "chat": (
            "/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 1,
                "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            },
        ),
    }
    out, errors = {}, []
    for name, (path, body) in bodies.items():
        raw = json.dumps(body).encode()
        request(port, "POST", path, raw, timeout=120)  # warm
        cpu0 = _cpu_s(pid)
        for _ in range(requests):
            status, data = request(port, "POST", path, raw, timeout=120)
            if status != 200:
                errors.append(f"{path} {status}: {data[:200]!r}")
        out[f"{name}_cpu_ms_per_request"] = rnd((_cpu_s(pid) - cpu0) * 1000 / requests, 3)
    out["errors"] = errors[:3]
    return out
