"""``tokenmill bench multiturn``: what the segment tokenization cache saves an agent workload.

Agent conversations grow turn by turn (tool output and assistant text appended, the
whole history resent), replayed against tokenmill with the simulated scheduler and two
tokenizer workers, once per configuration in one run: cache off, cache on with
conversation affinity, cache on without affinity, and cache on with
--verify-tokenize-cache (every prompt also encoded whole and compared). Figures come
from the Server-Timing header each response carries (tokenization CPU seconds, worker
conversion time) and from x-tokenmill-cached-prompt-tokens.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import re
import statistics
import sys
import threading
import time

from tokenmill.bench.common import add_common_options, add_conversation_options, corpus, pct, write_json
from tokenmill.bench.servers import ServeProcess

CONFIGS = {
    "cache_off": ("--tokenize-cache-bytes", "0"),
    "cache_on": (),
    "affinity_off": ("--affinity", "false"),
    "verify": ("--verify-tokenize-cache",),
}
_TIMING = re.compile(r"([\w-]+);dur=([\d.]+)")


def add_arguments(parser) -> None:
    add_common_options(parser)
    add_conversation_options(
        parser, "16 conversations x 30 turns, 2000-8000 tokens appended per turn; quick 4 x 10, 1000-3000"
    )


def conversations(count: int, turns: int, min_tokens: int, max_tokens: int) -> list[list[dict]]:
    """Deterministic agent transcripts: per turn a tool output of min..max tokens, then an assistant note."""
    text = corpus(count * turns * max_tokens * 4 // 2 + 100_000)
    out, pos = [], 0
    for c in range(count):
        turns_out = []
        for t in range(turns):
            tokens = min_tokens + ((c * 7919 + t * 104729) % (max_tokens - min_tokens + 1))
            chars = tokens * 4
            chunk = text[pos : pos + chars] if pos + chars <= len(text) else text[:chars]
            pos = (pos + chars) % max(1, len(text) - chars)
            turns_out.append({"role": "user", "content": f"Tool output (step {t + 1}):\n{chunk}"})
            turns_out.append(
                {
                    "role": "assistant",
                    "content": f"Step {t + 1} done: I read the output above and will "
                    f"look at the next part of conversation {c}'s repository now.",
                }
            )
        out.append(turns_out)
    return out


def _replay(port: int, model: str, transcript: list[dict], system: str, results: list, lock) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    history = [{"role": "system", "content": system}]
    previous = 0  # prompt tokens of this conversation's previous turn
    for turn in range(0, len(transcript), 2):
        history.append(transcript[turn])
        body = json.dumps({"model": model, "messages": history, "max_tokens": 8})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        timing = {k: float(v) / 1000 for k, v in _TIMING.findall(resp.getheader("server-timing") or "")}
        prompt_tokens = data.get("usage", {}).get("prompt_tokens", 0)
        with lock:
            results.append(
                {
                    "turn": turn // 2,
                    "status": resp.status,
                    "prompt_tokens": prompt_tokens,
                    "new_tokens": max(0, prompt_tokens - previous),
                    "cached": int(resp.getheader("x-tokenmill-cached-prompt-tokens") or 0),
                    "cpu_s": timing.get("tokenize-cpu", 0.0),
                    "conversion_s": timing.get("render", 0.0) + timing.get("tokenize", 0.0),
                }
            )
        history.append(transcript[turn + 1])
        previous = prompt_tokens
    conn.close()


def _client(port: int, model: str, transcripts: list, out) -> None:
    results, lock = [], threading.Lock()
    system = "You are a coding agent working through a repository, one tool call at a time."
    threads = [threading.Thread(target=_replay, args=(port, model, t, system, results, lock)) for t in transcripts]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out.put((time.perf_counter() - t0, results))


def run_config(name: str, transcripts: list, turns: int) -> dict:
    server = ServeProcess("pool", 2, itl_ms=0, extra=CONFIGS[name])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        p = ctx.Process(target=_client, args=(server.port, server.model, transcripts, out))
        p.start()
        elapsed, results = out.get(timeout=3600)
        p.join(30)
        _, metrics = server.get("/metrics")
    finally:
        server.close()
    ok = [r for r in results if r["status"] == 200]
    late = [r for r in ok if r["turn"] >= turns - 5]
    mismatches = re.search(rb"tokenmill_tokenize_cache_mismatches_total\{[^}]*\} ([\d.]+)", metrics or b"")
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "elapsed_s": round(elapsed, 1),
        "tokenize_cpu_s": round(statistics.mean(r["cpu_s"] for r in ok), 5) if ok else None,
        "conversion_p50_ms": round(1000 * pct([r["conversion_s"] for r in ok], 0.5), 2) if ok else None,
        "conversion_p99_ms": round(1000 * pct([r["conversion_s"] for r in ok], 0.99), 2) if ok else None,
        "late_conversion_p50_ms": round(1000 * pct([r["conversion_s"] for r in late], 0.5), 2) if late else None,
        "late_conversion_p99_ms": round(1000 * pct([r["conversion_s"] for r in late], 0.99), 2) if late else None,
        "hit_rate": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else 0.0,
        # a cache that tokenized only what each turn added: its hit rate, and its cpu_ratio if CPU
        # were proportional to tokens tokenized
        "ideal_hit_rate": round(1 - sum(r["new_tokens"] for r in ok) / prompt, 4) if prompt else 0.0,
        "mean_prompt_tokens": round(prompt / len(ok)) if ok else 0,
        "max_prompt_tokens": max((r["prompt_tokens"] for r in ok), default=0),
        "mismatches": int(float(mismatches.group(1))) if mismatches else None,
    }


def run(args) -> int:
    quick = args.quick
    count = args.conversations or (4 if quick else 16)
    turns = args.turns or (10 if quick else 30)
    lo, hi = (int(x) for x in (args.append_tokens or ("1000-3000" if quick else "2000-8000")).split("-"))
    transcripts = conversations(count, turns, lo, hi)
    report = {
        "workload": f"{count} conversations x {turns} turns, {lo}-{hi} tokens appended per turn, 2 workers",
        "configs": {},
    }
    for name in CONFIGS:
        print(f"running {name} ...", flush=True, file=sys.stderr)
        report["configs"][name] = run_config(name, transcripts, turns)
    off, on = report["configs"]["cache_off"], report["configs"]["cache_on"]
    report.update(
        {
            "cache_off": {k: off[k] for k in ("tokenize_cpu_s", "conversion_p50_ms", "conversion_p99_ms")},
            "cache_on": {k: on[k] for k in ("tokenize_cpu_s", "conversion_p50_ms", "conversion_p99_ms")},
            "cpu_ratio": round(off["tokenize_cpu_s"] / on["tokenize_cpu_s"], 1) if on["tokenize_cpu_s"] else None,
            "late_turn_p50_ratio": round(off["late_conversion_p50_ms"] / on["late_conversion_p50_ms"], 1)
            if on["late_conversion_p50_ms"]
            else None,
            "hit_rate": on["hit_rate"],
            "ideal_cpu_ratio": round(1 / (1 - on["ideal_hit_rate"]), 1) if on["ideal_hit_rate"] < 1 else None,
            "mismatches": report["configs"]["verify"]["mismatches"],
        }
    )
    print_report(report)
    write_json(args.json, report)
    return 0


def print_report(report: dict) -> None:
    print(f"\ntokenmill bench multiturn: {report['workload']}")
    cols = [
        "tokenize_cpu_s",
        "conversion_p50_ms",
        "conversion_p99_ms",
        "late_conversion_p50_ms",
        "late_conversion_p99_ms",
        "hit_rate",
        "ideal_hit_rate",
        "mean_prompt_tokens",
        "max_prompt_tokens",
        "errors",
    ]
    heads = [
        "CPU s/req",
        "conv p50",
        "conv p99",
        "last5 p50",
        "last5 p99",
        "hit rate",
        "ideal hits",
        "mean prompt",
        "max prompt",
        "errors",
    ]
    print("  ".join(["config".rjust(12)] + [h.rjust(11) for h in heads]))
    for name, row in report["configs"].items():
        print("  ".join([name.rjust(12)] + [str(row.get(c)).rjust(11) for c in cols]))
    print(
        f"cpu_ratio (off/on): {report['cpu_ratio']}x; last-five-turn conversion p50: {report['late_turn_p50_ratio']}x lower; "
        f"hit rate {report['hit_rate']}; mismatches under --verify-tokenize-cache: {report['mismatches']}"
    )
    print(
        f"bound for this workload: a cache that tokenized only each turn's new tokens would serve "
        f"{report['configs']['cache_on']['ideal_hit_rate']} of prompt tokens from cache, a cpu_ratio of "
        f"{report['ideal_cpu_ratio']}x at the same CPU per fresh token"
    )
