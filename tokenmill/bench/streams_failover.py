"""``tokenmill bench streams --failover``: 256 streams while one tokenizer worker is killed.

Two rounds on one server (``--workers 2``, the echo scheduler, a token every 20 ms per stream): an
undisturbed baseline, then the same load with ``kill -9`` of the worker detokenizing the most streams
a few seconds in. Each stream asks for a fixed number of tokens, so the delivered ratio is exact
(tokens the clients counted / tokens asked). "Affected" streams are those with a read gap spanning
the kill: their largest gap is the failover's cost as a client sees it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time

from tokenmill.bench.common import pct, rnd
from tokenmill.bench.servers import ServeProcess
from tokenmill.bench.stream_load import EMISSION_MS, echo_word_id, serve_args, stream_client

STREAMS = 256
TOKENS = 400  # per stream: 8 s at 20 ms
KILL_AFTER_S = 3.0


def _round(server: ServeProcess, word_id: int, kill: bool) -> dict:
    body = json.dumps(
        {"model": server.model, "prompt": [word_id] * 16, "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    ).encode()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stop_at = ctx.RawValue("d", time.time() + 600)  # the streams end by themselves
    ramp = min(2.0, 0.002 * STREAMS)
    procs = []
    for _ in range(2):
        p = ctx.Process(target=stream_client, args=(server.port, STREAMS // 2, body, ramp, stop_at, 0.0, 0.0, out))
        p.start()
        procs.append(p)
    killed_at, victim = None, None
    if kill:
        time.sleep(ramp + KILL_AFTER_S)
        workers = server.get("/debug/state")[1]["workers"]
        victim = max((w for w in workers if w["alive"]), key=lambda w: w["streams"])
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
    results = []
    for _ in procs:
        results.extend(out.get(timeout=300)["streams"])
    for p in procs:
        p.join(30)
    delivered = sum(sum(r[1]) for r in results)
    gaps, affected = [], []
    for times, _counts, _events, _errors in results:
        worst = 0.0
        for a, b in zip(times, times[1:]):
            gaps.append((b - a) * 1000)
            if killed_at is not None and a <= killed_at < b:
                worst = max(worst, (b - a) * 1000)
        if worst:
            affected.append(worst)
    return {
        "round": "failover" if kill else "baseline",
        "streams": STREAMS,
        "killed_streams": victim["streams"] if victim else 0,
        "affected_streams": len(affected),
        "delivered_ratio": round(delivered / (STREAMS * TOKENS), 4),
        "gap_p99_ms": rnd(pct(gaps, 0.99)),
        "gap_max_ms": rnd(max(gaps, default=None)) if gaps else None,
        "affected_gap_p99_ms": rnd(pct(affected, 0.99)),
        "affected_gap_max_ms": rnd(max(affected)) if affected else None,
        "errors": [r[3] for r in results if r[3]][:3],
    }


def run_failover(args) -> dict:
    word_id = echo_word_id()
    server = ServeProcess("pool", 2, itl_ms=EMISSION_MS, extra=serve_args(STREAMS))
    try:
        rows = []
        for kill in (False, True):
            print(f"streams --failover: {'kill -9 of a worker' if kill else 'baseline'} ...", file=sys.stderr)
            rows.append(_round(server, word_id, kill))
    finally:
        server.close()
    report = {"emission_ms": EMISSION_MS, "tokens_per_stream": TOKENS, "rows": rows}
    print_failover(report)
    return report


def print_failover(report: dict) -> None:
    cols = [
        ("round", "round"),
        ("streams", "streams"),
        ("killed_streams", "on killed"),
        ("affected_streams", "affected"),
        ("delivered_ratio", "delivered"),
        ("gap_p99_ms", "gap p99"),
        ("gap_max_ms", "gap max"),
        ("affected_gap_p99_ms", "aff gap p99"),
        ("affected_gap_max_ms", "aff gap max"),
    ]
    print(
        f"\ntokenmill bench streams --failover: {report['rows'][0]['streams']} streams of "
        f"{report['tokens_per_stream']} tokens, {report['emission_ms']:g} ms a token, --workers 2; the worker "
        "with the most streams killed with SIGKILL mid-run; delivered = tokens read / tokens asked; "
        "aff gap = the read gap spanning the kill, per affected stream (ms)"
    )
    widths = [max(len(h), 8) for _, h in cols]
    print("  ".join(h.rjust(w) for (_, h), w in zip(cols, widths)))
    for row in report["rows"]:
        print("  ".join(("-" if row.get(k) is None else str(row[k])).rjust(w) for (k, _), w in zip(cols, widths)))
    base, fail = report["rows"]
    for row in report["rows"]:
        if row["errors"]:
            print(f"{row['round']}: errors: {row['errors']}")
    if base["gap_p99_ms"] and fail["gap_p99_ms"]:
        print(
            f"failover / baseline: delivered {fail['delivered_ratio'] / base['delivered_ratio']:.3f}x, "
            f"gap p99 {fail['gap_p99_ms'] / base['gap_p99_ms']:.2f}x, "
            f"gap max {fail['gap_max_ms'] / base['gap_max_ms']:.2f}x"
        )
