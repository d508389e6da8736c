#!/usr/bin/env python3
"""Streaming load client for scripts/gpu_engine_check.sh (standard library only).

Sends streaming chat completions (``ignore_eos``, fixed ``max_tokens``, temperature 0) to a
running ``tokenmill serve`` at several concurrencies, one level after another. Each level is
closed-loop: ``concurrency`` client threads each send their next request as soon as the last
one ended, until the level's request count is reached or its time budget is spent (requests
in flight then finish; none start). Every prompt is different from its first token on, so
the engine's prefix cache cannot share blocks between requests.

Per level it reports time to first token (first non-empty content delta; p50/p99), per-request
decode speed ((completion_tokens - 1) / (last content - first content)), and aggregate output
tokens/s (all completion tokens / the level's wall time). Prints a table; writes JSON.

    python3 scripts/gpu_load_client.py --url http://127.0.0.1:8000 --concurrencies "1 8 32 64" \
        --prompt-tokens 500 --max-tokens 128 --json /tmp/out.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import sys
import threading
import time
import urllib.parse

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "river garden window market letter music table paper light voice field rain summer winter bridge train"
).split()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _round(x, digits=1):
    return None if x is None else round(x, digits)


class Client:
    def __init__(self, url: str, timeout: float) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self.timeout = timeout

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def json_call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        conn = self.conn()
        try:
            payload = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, payload, {"Content-Type": "application/json"} if payload else {})
            resp = conn.getresponse()
            data = resp.read()
            try:
                return resp.status, json.loads(data)
            except ValueError:
                return resp.status, {"raw": data[:500].decode(errors="replace")}
        finally:
            conn.close()


def make_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def head(tag: str, i: int, rng: random.Random) -> str:
    """A unique start for every prompt: no two prompts share a first cache page."""
    return f"[{tag} request {i} nonce {rng.getrandbits(64):016x}] "


def count_tokens(client: Client, model: str, content: str) -> int:
    """Prompt tokens of a one-message chat (the chat template included): /tokenize, else a 1-token completion."""
    messages = [{"role": "user", "content": content}]
    status, data = client.json_call("POST", "/tokenize", {"model": model, "messages": messages})
    if status == 200 and data.get("count"):
        return int(data["count"])
    status, data = client.json_call(
        "POST", "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1}
    )
    if status != 200:
        raise RuntimeError(f"calibration request failed: HTTP {status}: {data}")
    return int(data["usage"]["prompt_tokens"])


def calibrate(client: Client, model: str, target_tokens: int) -> int:
    """How many filler words make a prompt of about ``target_tokens`` tokens."""
    probe_words = 400
    rng = random.Random(1)
    start = head("calibration", 0, rng)
    base = count_tokens(client, model, start)
    full = count_tokens(client, model, start + make_text(rng, probe_words))
    return max(1, round((target_tokens - base) * probe_words / max(1, full - base)))


def one_request(client: Client, body: bytes, deadline_s: float) -> dict:
    """One streaming chat completion; times measured with perf_counter."""
    out = {
        "ok": False,
        "error": None,
        "ttft": None,
        "first": None,
        "last": None,
        "completion_tokens": 0,
        "prompt_tokens": None,
        "events": 0,
    }
    conn = client.conn()
    t0 = time.perf_counter()
    out["start"] = t0
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return out
        finish = None
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(payload)
            if "error" in event:
                out["error"] = f"stream error: {event['error']}"
                return out
            for choice in event.get("choices") or ():
                if choice.get("delta", {}).get("content"):
                    out["events"] += 1
                    if out["first"] is None:
                        out["first"] = now
                    out["last"] = now
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            if event.get("usage"):
                out["completion_tokens"] = int(event["usage"]["completion_tokens"])
                out["prompt_tokens"] = int(event["usage"]["prompt_tokens"])
            if now - t0 > deadline_s:
                out["error"] = f"request took over {deadline_s:.0f} s"
                return out
        out["end"] = time.perf_counter()
        out["finish_reason"] = finish
        if out["first"] is None:
            out["error"] = f"no content in the stream (finish_reason {finish})"
            return out
        out["ttft"] = out["first"] - t0
        out["ok"] = True
        return out
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out["error"] = repr(exc)
        return out
    finally:
        conn.close()


def run_level(
    client: Client,
    model: str,
    concurrency: int,
    count: int,
    words: int,
    max_tokens: int,
    budget_s: float,
    request_timeout_s: float,
    tag: str,
    temperature: float,
) -> dict:
    lock = threading.Lock()
    counter = iter(range(count))
    results: list[dict] = []
    level_start = time.perf_counter()
    stop_at = level_start + budget_s

    def body_for(i: int) -> bytes:
        rng = random.Random(f"{tag}-{i}")
        content = head(tag, i, rng) + make_text(rng, words)
        return json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "temperature": temperature,
            }
        ).encode()

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None or time.perf_counter() > stop_at:
                return
            res = one_request(client, body_for(i), request_timeout_s)
            with lock:
                results.append(res)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(budget_s + request_timeout_s + 5)
    wall = time.perf_counter() - level_start
    ok = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    ttfts = [r["ttft"] * 1000 for r in ok]
    decode = [
        (r["completion_tokens"] - 1) / (r["last"] - r["first"])
        for r in ok
        if r["completion_tokens"] > 1 and r["last"] > r["first"]
    ]
    itl = [(r["last"] - r["first"]) * 1000 / (r["completion_tokens"] - 1) for r in ok if r["completion_tokens"] > 1]
    e2e = [(r["end"] - r["start"]) for r in ok]
    out_tokens = sum(r["completion_tokens"] for r in results)
    prompt_tokens = [r["prompt_tokens"] for r in ok if r["prompt_tokens"]]
    return {
        "concurrency": concurrency,
        "requests_planned": count,
        "requests_done": len(ok),
        "errors": len(errors),
        "error_samples": errors[:3],
        "budget_hit": len(results) < count,
        "wall_s": round(wall, 2),
        "mean_prompt_tokens": round(sum(prompt_tokens) / len(prompt_tokens)) if prompt_tokens else None,
        "completion_tokens_per_request": sorted({r["completion_tokens"] for r in ok}),
        "ttft_p50_ms": _round(pct(ttfts, 0.5)),
        "ttft_p99_ms": _round(pct(ttfts, 0.99)),
        "ttft_max_ms": _round(max(ttfts, default=None)),
        "decode_tok_s_per_req_p50": _round(pct(decode, 0.5)),
        "decode_tok_s_per_req_min": _round(min(decode, default=None)),
        "itl_p50_ms": _round(pct(itl, 0.5), 2),
        "e2e_p50_s": _round(pct(e2e, 0.5), 3),
        "output_tok_s": round(out_tokens / wall, 1) if wall > 0 else None,
        "output_tokens": out_tokens,
    }


COLUMNS = [
    ("concurrency", "conc"),
    ("requests_done", "done"),
    ("errors", "err"),
    ("mean_prompt_tokens", "prompt"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("decode_tok_s_per_req_p50", "dec tok/s/req p50"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("output_tok_s", "agg out tok/s"),
    ("wall_s", "wall s"),
]


def print_table(levels: list[dict], file=sys.stdout) -> None:
    widths = [max(len(h), 6) for _, h in COLUMNS]
    print("  ".join(h.rjust(w) for (_, h), w in zip(COLUMNS, widths)), file=file)
    for row in levels:
        cells = ["-" if row.get(k) is None else str(row.get(k)) for k, _ in COLUMNS]
        mark = " (budget hit)" if row.get("budget_hit") else ""
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)) + mark, file=file)
    for row in levels:
        if row.get("error_samples"):
            print(f"concurrency {row['concurrency']}: errors: {row['error_samples']}", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrencies", default="1 8 32 64", help="space- or comma-separated")
    p.add_argument("--requests-factor", type=float, default=2.0, help="requests per level = factor x concurrency")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup-requests", type=int, default=-1, help="default: the largest concurrency")
    p.add_argument("--warmup-max-tokens", type=int, default=16)
    p.add_argument("--total-budget-s", type=float, default=150.0, help="all levels together (warm-up included)")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--meta", metavar="FILE", help="a JSON object to include under 'meta'")
    args = p.parse_args(argv)

    levels_wanted = [int(x) for x in args.concurrencies.replace(",", " ").split()]
    client = Client(args.url, timeout=args.request_timeout_s)
    started = time.perf_counter()
    deadline = started + args.total_budget_s
    status, models = client.json_call("GET", "/v1/models")
    if status != 200:
        print(f"GET /v1/models: HTTP {status}: {models}", file=sys.stderr)
        return 1
    card = models["data"][0]
    model = card["id"]
    words = calibrate(client, model, args.prompt_tokens)
    print(
        f"model {model} (max_model_len {card.get('max_model_len')}); prompts of ~{args.prompt_tokens} tokens "
        f"({words} words), max_tokens {args.max_tokens}, ignore_eos, temperature {args.temperature}",
        flush=True,
    )

    report = {
        "workload": {
            "prompt_tokens_target": args.prompt_tokens,
            "prompt_words": words,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": True,
            "stream": True,
            "requests_factor": args.requests_factor,
            "min_requests": args.min_requests,
            "total_budget_s": args.total_budget_s,
        },
        "model": card,
        "levels": [],
        "skipped_levels": [],
    }
    if args.meta:
        with open(args.meta) as f:
            report["meta"] = json.load(f)

    warm_n = max(levels_wanted) if args.warmup_requests < 0 else args.warmup_requests
    if warm_n > 0:
        budget = max(5.0, min(0.25 * args.total_budget_s, deadline - time.perf_counter()))
        warm = run_level(
            client,
            model,
            warm_n,
            warm_n,
            words,
            args.warmup_max_tokens,
            budget,
            args.request_timeout_s,
            "warmup",
            args.temperature,
        )
        report["warmup"] = warm
        print(
            f"warm-up: {warm['requests_done']}/{warm_n} requests of {args.warmup_max_tokens} tokens in "
            f"{warm['wall_s']} s, errors {warm['errors']} {warm['error_samples'][:1]}",
            flush=True,
        )

    for n, conc in enumerate(levels_wanted):
        left = deadline - time.perf_counter()
        if left < 3:
            report["skipped_levels"].append(conc)
            print(f"concurrency {conc}: skipped, the total budget is spent", flush=True)
            continue

        # what is left, shared by the remaining levels in proportion to their waves of requests
        # (requests / concurrency); time a level leaves unused goes to the next ones
        def count_for(c: int) -> int:
            return max(args.min_requests, int(round(args.requests_factor * c)))

        share = left * math.ceil(count_for(conc) / conc) / sum(math.ceil(count_for(c) / c) for c in levels_wanted[n:])
        count = count_for(conc)
        row = run_level(
            client,
            model,
            conc,
            count,
            words,
            args.max_tokens,
            share,
            args.request_timeout_s,
            f"c{conc}",
            args.temperature,
        )
        report["levels"].append(row)
        print(
            f"concurrency {conc}: {row['requests_done']}/{count} requests, {row['errors']} errors, "
            f"TTFT p50 {row['ttft_p50_ms']} ms, {row['output_tok_s']} output tok/s, {row['wall_s']} s",
            flush=True,
        )

    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    status, ready = client.json_call("GET", "/ready")
    report["ready_after"] = ready
    print()
    print_table(report["levels"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = report["levels"] and all(r["requests_done"] > 0 and r["errors"] == 0 for r in report["levels"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
