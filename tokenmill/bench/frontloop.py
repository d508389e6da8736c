"""``tokenmill bench`` (``frontloop``, the default scenario): does the front loop stay responsive under long-context load?

One run, three conversion modes through the same gateway code, each against a fresh
``tokenmill serve`` with the simulated scheduler (all three up at once, taking turns round by
round):
  inline  conversion on the gateway's event loop (SGLang before PR #39771)
  thread  conversion in loop.run_in_executor (that PR)
  pool    tokenmill's tokenizer worker processes
While K long chats (about 250k tokens each with the default model, text from Python's
standard library) are sent together, round after round, a prober GETs /health every
10 ms and an unrelated streaming chat receives a token every 20 ms. Each load role runs
in its own client process, so the client's own GIL does not blur what it measures.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time

from tokenmill.bench.common import (
    add_common_options,
    add_long_prompt_options,
    add_server_options,
    corpus,
    health_prober,
    long_bodies,
    pct,
    ratio_text,
    rnd,
    stream_gaps,
    write_json,
)
from tokenmill.bench.servers import ServeProcess

MODES = ("inline", "thread", "pool")
KEYS = (
    "health_p99_ms",
    "health_max_ms",
    "stream_gap_p99_ms",
    "stream_gap_max_ms",
    "loop_lag_p99_ms",
    "loop_lag_max_ms",
    "requests_per_s",
    "prompt_tokens_per_s",
)


def add_arguments(parser) -> None:
    add_common_options(parser)
    add_server_options(parser, MODES)
    add_long_prompt_options(parser, requests=(8, 4), tokens=(250_000, 80_000))
    parser.add_argument(
        "--small-requests", type=int, help="Small requests per mode at each concurrency (default 4000; quick 800)."
    )


# ---- client processes ------------------------------------------------------------------------


def stream_body(model: str) -> str:
    """The unrelated stream: as long as the simulated scheduler lets it be."""
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Stream to me."}],
            "max_tokens": 1_000_000 - 100,
            "stream": True,
            "ignore_eos": True,
        }
    )


def _send_long(port: int, rounds_of_bodies: list[list[bytes]], out) -> None:
    results, errors = [], []

    def one(body: bytes) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = json.loads(resp.read())
            if resp.status == 200:
                results.append(data["usage"]["prompt_tokens"])
            else:
                errors.append(f"{resp.status}: {data}")
        except Exception as exc:  # reported in the table
            errors.append(repr(exc))
        finally:
            conn.close()

    t0 = time.perf_counter()
    for bodies in rounds_of_bodies:
        threads = [threading.Thread(target=one, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    out.put(("long", {"elapsed": time.perf_counter() - t0, "prompt_tokens": results, "errors": errors}))


def small_body(model: str) -> bytes:
    """A ~50-token chat."""
    return json.dumps(
        {
            "model": model,
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": "Summarize the plot of a short story about a lighthouse keeper and a storm, "
                    "in one sentence, please, for a child.",
                }
            ],
        }
    ).encode()


def medium_body(model: str) -> bytes:
    """A 16 KB chat (~4k tokens): 12 KB of system prompt and a 4 KB question. Sent over and over, its
    prompt is cached after the first time, as an agent's next turn mostly is."""
    text = corpus(16_000)
    return json.dumps(
        {
            "model": model,
            "max_tokens": 1,
            "messages": [{"role": "system", "content": text[:12_000]}, {"role": "user", "content": text[12_000:]}],
        }
    ).encode()


def _short_requests(port: int, body: bytes, count: int, concurrency: int, out) -> None:
    from tokenmill.bench.load_client import post_many

    out.put(("short", post_many(port, "/v1/chat/completions", body, count, concurrency)))


# ---- one mode ------------------------------------------------------------------------------


def run_pass(modes: list[str], rounds_of_bodies: list[list[bytes]], workers: int | None, reverse: bool) -> dict:
    """One pass of the long-prompt load: a fresh server per mode, all up at once, the modes taking
    turns round by round in an order that reverses every round (and starts reversed when reverse
    is set). This machine's speed drifts by tens of percent within a minute; a mode's rounds are
    then seconds apart from the other modes' same rounds, not a whole pass. Returns each mode's
    raw samples over the pass (summarize() them); an idle server costs well under 1% of a core."""
    servers: dict[str, ServeProcess] = {}
    try:
        for mode in modes:
            servers[mode] = ServeProcess(mode, workers, itl_ms=20)
        samples = {
            mode: {"long": {"elapsed": 0.0, "prompt_tokens": [], "errors": []}, "health": [], "gaps": [], "lag": {}}
            for mode in modes
        }
        for r, bodies in enumerate(rounds_of_bodies):
            for mode in modes[::-1] if (r % 2 == 1) != reverse else modes:
                print(f"  {mode}, round {r + 1} of {len(rounds_of_bodies)} ...", file=sys.stderr, flush=True)
                got, into = measure_round(servers[mode], bodies), samples[mode]
                into["long"]["elapsed"] += got["long"]["elapsed"]
                into["long"]["prompt_tokens"] += got["long"]["prompt_tokens"]
                into["long"]["errors"] += got["long"]["errors"]
                into["health"] += got["health"]
                into["gaps"] += got["gaps"]
                for key in ("p99_ms", "max_ms"):
                    into["lag"][key] = max(into["lag"].get(key) or 0, got["lag"].get(key) or 0)
        return samples
    finally:
        for server in servers.values():
            server.close()


def measure_round(server: ServeProcess, bodies: list[bytes]) -> dict:
    """One round of long chats sent together to a running server, while a stream runs and a prober
    GETs /health, each in a client process of its own: the raw samples."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    started = ctx.Event()
    procs = []
    try:
        stream = ctx.Process(target=stream_gaps, args=(server.port, stream_body(server.model), started, stop, out))
        stream.start()
        procs.append(stream)
        started.wait(30)
        prober = ctx.Process(target=health_prober, args=(server.port, stop, out))
        prober.start()
        procs.append(prober)
        time.sleep(0.3)
        server.get("/debug/loop-lag?reset=1")
        sender = ctx.Process(target=_send_long, args=(server.port, [bodies], out))
        sender.start()
        procs.append(sender)
        got = {}
        got.update([out.get(timeout=3600)])  # the long requests finish first
        lag = server.get("/debug/loop-lag")[1] or {}
        stop.set()
        for _ in range(2):
            got.update([out.get(timeout=120)])
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"long": got["long"], "health": got["health"], "gaps": got["stream"], "lag": lag}


def summarize(passes: list[dict]) -> dict:
    """The figures of one mode over its passes: samples pooled, throughput over the summed time."""
    health = [x for p in passes for x in p["health"]]
    gaps = [x for p in passes for x in p["gaps"]]
    lag = {key: max((p["lag"].get(key) or 0 for p in passes), default=None) for key in ("p99_ms", "max_ms")}
    long = {
        "prompt_tokens": [x for p in passes for x in p["long"]["prompt_tokens"]],
        "errors": [x for p in passes for x in p["long"]["errors"]],
    }
    elapsed = sum(p["long"]["elapsed"] for p in passes)
    return {
        "health_p50_ms": rnd(pct(health, 0.5), 2),
        "health_p99_ms": rnd(pct(health, 0.99), 2),
        "health_max_ms": rnd(max(health, default=None), 2),
        "stream_gap_p99_ms": rnd(pct(gaps, 0.99)),
        "stream_gap_max_ms": rnd(max(gaps, default=None)),
        "loop_lag_p99_ms": rnd(lag.get("p99_ms"), 2),
        "loop_lag_max_ms": rnd(lag.get("max_ms"), 2),
        "requests_per_s": round(len(long["prompt_tokens"]) / elapsed, 3),
        "prompt_tokens_per_s": round(sum(long["prompt_tokens"]) / elapsed),
        "long_requests": len(long["prompt_tokens"]),
        "mean_prompt_tokens": round(statistics.mean(long["prompt_tokens"])) if long["prompt_tokens"] else 0,
        "errors": long["errors"][:5],
        "health_probes": len(health),
        "stream_events": len(gaps) + len(passes),
        "passes": len(passes),
    }


def run_small(modes: list[str], count: int, concurrencies: tuple, workers: int | None, rounds: int = 4) -> dict:
    """Small chats through one fresh server per mode (zero-latency scheduler), the modes taking turns.

    This machine's speed drifts by tens of percent over a minute (other tenants, frequency), so
    running one mode after the other would compare two moments as much as two designs. Both
    servers stay up (an idle one costs nothing measurable) and each concurrency level is split
    into rounds, the modes taking turns in an order that reverses every round. After the small
    chats, the same for 16 KB chats whose prompt is cached (MEDIUM_KEY): {mode: {clients: row}}."""
    servers = {}
    try:
        for mode in modes:
            servers[mode] = ServeProcess(mode, workers, itl_ms=0)
        for server in servers.values():
            _short_run(server, 50, 2)  # warm: first requests load caches and code paths
        per_round = max(1, count // rounds)
        medium = [(MEDIUM_KEY, MEDIUM_CLIENTS, medium_body(servers[modes[0]].model))] if modes else []
        levels = [(str(c), c, None) for c in concurrencies] + medium
        parts: dict = {mode: {key: [] for key, _, _ in levels} for mode in modes}
        for key, clients, body in levels:
            for r in range(rounds):
                for mode, server in servers.items() if r % 2 == 0 else reversed(servers.items()):
                    parts[mode][key].append(
                        _short_run(server, per_round if body is None else per_round // 2, clients, body)
                    )
        return {mode: {c: _short_row(runs) for c, runs in by_clients.items()} for mode, by_clients in parts.items()}
    finally:
        for server in servers.values():
            server.close()


def _short_run(server: ServeProcess, count: int, clients: int, body: bytes | None = None) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    body = small_body(server.model) if body is None else body
    p = ctx.Process(target=_short_requests, args=(server.port, body, count, clients, out))
    p.start()
    _, res = out.get(timeout=600)
    p.join(30)
    return res


def _short_row(runs: list[dict]) -> dict:
    latencies = [x for run in runs for x in run["latencies"]]
    errors = [e for run in runs for e in run["errors"]]
    return {
        "requests_per_s": round(len(latencies) / sum(run["elapsed"] for run in runs), 1),
        "latency_p50_ms": rnd(pct(latencies, 0.5), 2),
        "errors": len(errors),
        "error_samples": errors[:3],
        # the load client's own CPU per answer: it shares the machine with the server it measures
        "client_cpu_us": rnd(sum(run["cpu_s"] for run in runs) / max(1, len(latencies) + len(errors)) * 1e6, 0),
    }


def short_rows(server: ServeProcess, count: int, concurrencies: tuple) -> dict:
    """Small chats through a running server at each concurrency: {clients: {requests_per_s, latency_p50_ms, errors}}."""
    _short_run(server, 50, 2)  # warm
    return {str(clients): _short_row([_short_run(server, count, clients)]) for clients in concurrencies}


SMALL_CLIENTS = (8, 64)
MEDIUM_CLIENTS = 16
MEDIUM_KEY = f"medium-{MEDIUM_CLIENTS}"  # the medium chats' row among the small ones


def small_summary(small: dict) -> dict:
    """The pool against inline conversion at each concurrency, as --json reports it."""
    out = {}
    for clients in (*map(str, SMALL_CLIENTS), MEDIUM_KEY):
        if "pool" in small and "inline" in small:
            pool, inline = small["pool"][clients], small["inline"][clients]
            out[clients] = {
                "pool_req_s": pool["requests_per_s"],
                "inline_req_s": inline["requests_per_s"],
                "pool_p50_ms": pool["latency_p50_ms"],
                "inline_p50_ms": inline["latency_p50_ms"],
            }
    return out


def worker_efficiency(bodies: list[bytes], pool: dict, workers: int) -> tuple[float, float]:
    """Pool prompt tokens/s per worker, against one encode_batch call over the same prompts in this
    plain process (which spreads them over all cores, as a worker spreads one prompt's pieces)."""
    from tokenmill.tokenizer_workers.converter import Converter
    from tokenmill.tokenizer_workers.settings import ConverterSettings

    converter = Converter(ConverterSettings())
    prompts = [converter.render(json.loads(body)["messages"], _Req()) for body in bodies]
    t0 = time.perf_counter()
    tokens = sum(len(e.ids) for e in converter.tokenizer.encode_batch(prompts, add_special_tokens=False))
    plain = tokens / (time.perf_counter() - t0)
    return round(pool["prompt_tokens_per_s"] / workers / plain, 3), round(plain)


class _Req:
    """Request defaults for rendering outside a request (the efficiency baseline)."""

    chat_template = None
    tools = None
    documents = None
    add_generation_prompt = True
    continue_final_message = False
    chat_template_kwargs = None


# ---- report ----------------------------------------------------------------------------------


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:,.0f}" if isinstance(x, (int, float)) and abs(x) >= 1000 else f"{x:g}")


def print_report(report: dict) -> None:
    modes = report["modes"]
    cols = [
        "health_p50_ms",
        "health_p99_ms",
        "health_max_ms",
        "stream_gap_p99_ms",
        "stream_gap_max_ms",
        "loop_lag_p99_ms",
        "loop_lag_max_ms",
        "requests_per_s",
        "prompt_tokens_per_s",
    ]
    heads = [
        "health p50",
        "health p99",
        "health max",
        "gap p99",
        "gap max",
        "lag p99",
        "lag max",
        "req/s",
        "prompt tok/s",
    ]
    m = report["machine"]
    print(f"\ntokenmill bench: {report['workload']}")
    print(f"machine: {m['cores']} cores, Python {m['python']}, tokenizers {m['tokenizers']}, {m['platform']}")
    print(
        "latencies in ms; health = GET /health every 10 ms; gap = SSE inter-event gap (20 ms emission); "
        "lag = gateway event-loop lag"
    )
    width = [8] + [max(len(h), 9) for h in heads]
    print("  ".join(h.rjust(w) for h, w in zip(["mode"] + heads, width)))
    for mode, row in modes.items():
        print("  ".join([mode.rjust(width[0])] + [_fmt(row.get(c)).rjust(w) for c, w in zip(cols, width[1:])]))
    for base in ("inline", "thread"):
        if base in modes and "pool" in modes:
            ratios = [ratio_text(modes["pool"].get(c), modes[base].get(c)) for c in cols]
            print("  ".join([f"pool/{base}".rjust(width[0])] + [r.rjust(w) for r, w in zip(ratios, width[1:])]))
    for mode, row in modes.items():
        if row.get("errors"):
            print(f"{mode}: errors: {row['errors']}")
    if "worker_efficiency" in report:
        print(
            f"worker efficiency: {report['worker_efficiency']} (pool prompt tokens/s per worker vs encode_batch in "
            f"one plain process: {_fmt(report['plain_encode_tokens_per_s'])} tokens/s)"
        )
    if report.get("small_requests"):
        s = report["small_requests"]
        print(
            "small requests (~50-token chats, max_tokens 1, zero-latency scheduler; inline and pool take turns, 4 rounds;\n"
            f"  {MEDIUM_KEY}: a 16 KB chat, its prompt cached, at {MEDIUM_CLIENTS} clients):"
        )
        for mode, rows in s.items():
            for clients, row in rows.items():
                level = clients if clients == MEDIUM_KEY else f"{clients:>2} clients"
                print(
                    f"  {mode:>6}, {level}: {row['requests_per_s']} req/s, latency p50 {row['latency_p50_ms']} ms, "
                    f"errors {row['errors']}{' ' + str(row['error_samples']) if row['errors'] else ''}, "
                    f"load client CPU {row['client_cpu_us']:g} µs/request"
                )
        ratios = [(f"{c} clients", row) for c, row in report.get("small", {}).items()]
        if "medium" in report:
            ratios.append((MEDIUM_KEY, report["medium"]))
        for level, row in ratios:
            print(
                f"  pool/inline at {level}: {ratio_text(row['pool_req_s'], row['inline_req_s'])} req/s, "
                f"p50 {row['pool_p50_ms'] - row['inline_p50_ms']:+.2f} ms"
            )


def run(args) -> int:
    quick = args.quick
    count = args.requests or (4 if quick else 8)
    tokens = args.tokens or (80_000 if quick else 250_000)
    rounds = args.rounds or 2
    modes = [m for m in args.modes.split(",") if m]
    import tokenizers

    from tokenmill.settings import ServeSettings

    workers = args.workers or ServeSettings().workers
    # every request of every round has its own text: the tokenization cache (on, as deployed)
    # can reuse only the shared system prompt, so the figures measure real tokenization
    everything = long_bodies(count * rounds, tokens, "deepseek-v4")
    rounds_of_bodies = [everything[r * count : (r + 1) * count] for r in range(rounds)]
    n_passes = max(1, args.passes)
    report = {
        "workload": f"{count} chats of ~{tokens:,} tokens sent together, {rounds} round(s), {n_passes} pass(es), the modes taking turns round by round; pool mode with {workers} worker(s)",
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "tokenizers": tokenizers.__version__,
            "platform": platform.platform(),
        },
        "modes": {},
    }
    # The modes take turns round by round (run_pass), in mirrored order: this machine's speed drifts
    # by tens of percent within a minute, and a fixed order would weigh that drift on one mode.
    passes: dict[str, list] = {mode: [] for mode in modes}
    for p in range(n_passes):
        print(f"running pass {p + 1} of {n_passes}: {', '.join(modes)} taking turns ...", file=sys.stderr, flush=True)
        for mode, samples in run_pass(
            modes, rounds_of_bodies, workers, reverse=len(rounds_of_bodies) * p % 2 == 1
        ).items():
            passes[mode].append(samples)
    report["modes"] = {mode: summarize(passes[mode]) for mode in modes}
    if "pool" in report["modes"]:
        eff, plain = worker_efficiency(everything, report["modes"]["pool"], workers)
        report["worker_efficiency"], report["plain_encode_tokens_per_s"] = eff, plain
    short_modes = [m for m in ("inline", "pool") if m in modes]
    print(f"running small requests, {' and '.join(short_modes)} taking turns ...", file=sys.stderr, flush=True)
    small_count = args.small_requests or (800 if quick else 4000)
    report["small_requests"] = run_small(short_modes, small_count, SMALL_CLIENTS, workers) if short_modes else {}
    report["small"] = small_summary(report["small_requests"])
    if MEDIUM_KEY in report["small"]:
        report["medium"] = {
            "clients": MEDIUM_CLIENTS,
            "body_bytes": len(medium_body("deepseek-v4")),
            **report["small"].pop(MEDIUM_KEY),
        }
    print_report(report)
    write_json(args.json, report)
    return 0
