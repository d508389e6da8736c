"""``tokenmill bench vllm``'s agent scenario over Anthropic's Messages API.

A Claude-Code-shaped conversation: a long system prompt (~20k tokens, as blocks with
``cache_control``) and tool schemas, a task, then per turn an assistant ``tool_use`` and a user
``tool_result`` holding a fresh tool output, so the body grows turn by turn. Each turn is sent whole
to ``/v1/messages/count_tokens`` (both servers convert and render the whole conversation, the engine
has nothing to do), at a fixed pace, while a prober GETs ``/health`` every 10 ms; the late turns'
conversion time and the probe's p99 are the figures. Then the front process's CPU per request: the same short
conversation as ``/v1/messages`` and as ``/v1/chat/completions`` (one output token), the server
process's user+system CPU over the requests divided by their number.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

from tokenmill.bench.common import pct, probe_health, request, rnd, try_get

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


def agent_messages(
    port: int, pid: int, model: str, tag: str, system: str, pieces: list[list[str]], period_s: float = 0.4
) -> dict:
    """``pid``: the front process. Conversations one after the other, one per list of ``pieces``, each growing by its pieces (a fresh
    tool output per turn), each turn counted whole; they share the system prompt, as an agent's sessions do. Turns start every ``period_s`` (or when the previous one is answered,
    if later): the same offered load on both servers, so the prober samples the same stretch of time
    (sent as fast as answered, the faster server was probed over a third of the time, mostly its first
    turn, and its p99 was one of a few dozen samples)."""
    ctx = mp.get_context("spawn")
    out, stop, started = ctx.Queue(), ctx.Event(), ctx.Event()
    prober = ctx.Process(target=_prober, args=(port, stop, out, started))
    prober.start()
    started.wait(60)
    try_get(port, "/debug/loop-lag?reset=1", 5)  # tokenmill's gateway: its loop's lag over the turns below
    cpu0, wait0, wall0 = *_sched(pid), time.perf_counter()
    first, late, tokens, errors = [], [], [], []
    due = time.perf_counter()
    for c, outputs in enumerate(pieces):
        body = {"model": model, **_history(f"{tag} conversation {c}", system)}
        times = []
        for turn, piece in enumerate(outputs):
            _turn(body, turn, piece)
            raw = json.dumps(body).encode()
            time.sleep(max(0.0, due - time.perf_counter()))
            t0 = time.perf_counter()
            due = t0 + period_s
            status, data = request(port, "POST", "/v1/messages/count_tokens", raw, timeout=600)
            times.append((time.perf_counter() - t0) * 1000)
            if status == 200:
                tokens.append(json.loads(data)["input_tokens"])
            else:
                errors.append(f"{status}: {data[:200]!r}")
        first.append(times[0])
        late += times[-3:]
    time.sleep(max(0.0, due - time.perf_counter()))
    cpu, wait = _sched(pid)
    cpu, wait, wall = cpu - cpu0, wait - wait0, time.perf_counter() - wall0
    stop.set()
    health, prober_wait = out.get(timeout=120)
    prober.join(30)
    status, lag = try_get(port, "/debug/loop-lag", 5)
    return {
        "first_turn_ms": rnd(pct(first, 0.5), 2),
        "late_turn_p50_ms": rnd(pct(late, 0.5), 2),
        "late_turn_max_ms": rnd(max(late, default=None), 2),
        "health_p50_ms": rnd(pct(health, 0.5), 2),
        "health_p99_ms": rnd(pct(health, 0.99), 2),
        "health_probes": len(health),
        # vLLM has no such route: None there
        "loop_lag_p99_ms": rnd(json.loads(lag)["p99_ms"], 2) if status == 200 else None,
        # the front process (tokenmill: the gateway; vLLM: its API server) per second of the run: CPU used,
        # and time its threads were ready to run but waited for a core; the prober's wait likewise
        "front_cpu_ms_per_s": rnd(cpu * 1000 / wall, 1),
        "front_runq_wait_ms_per_s": rnd(wait * 1000 / wall, 1),
        "prober_runq_wait_ms_per_s": rnd(prober_wait * 1000 / wall, 1),
        "final_prompt_tokens": max(tokens, default=0),
        "errors": errors[:3],
    }


def _sched(pid: int) -> tuple[float, float]:
    """(CPU time, time spent runnable but waiting for a core) of the process so far, all its threads, in
    seconds, from the scheduler's nanosecond counts (/proc/PID/task/TID/schedstat; the 10 ms ticks of
    /proc/PID/stat were too coarse here). A thread that ends drops out of the sum."""
    cpu = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        cpu, wait = cpu + int(fields[0]), wait + int(fields[1])
    return cpu / 1e9, wait / 1e9


def _cpu_s(pid: int) -> float:
    return _sched(pid)[0]


def _prober(port: int, stop, out, started) -> None:
    """health_prober, also saying how long this process waited for a core (its own share of the latency)."""
    latencies: list[float] = []
    probe_health(port, stop, latencies, started=started)
    out.put((latencies, _sched(os.getpid())[1]))


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
    spent, errors = dict.fromkeys(bodies, 0.0), []
    for path, body in bodies.values():
        request(port, "POST", path, json.dumps(body).encode(), timeout=120)  # warm
    for name in ("messages", "chat", "chat", "messages"):  # ABBA: a drift of the machine counts on both alike
        path, body = bodies[name]
        raw = json.dumps(body).encode()
        cpu0 = _cpu_s(pid)
        for _ in range(requests // 2):
            status, data = request(port, "POST", path, raw, timeout=120)
            if status != 200:
                errors.append(f"{path} {status}: {data[:200]!r}")
        spent[name] += _cpu_s(pid) - cpu0
    out = {f"{name}_cpu_ms_per_request": rnd(spent[name] * 1000 / (requests // 2 * 2), 3) for name in bodies}
    out["errors"] = errors[:3]
    return out
