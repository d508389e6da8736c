"""``tokenmill bench busy``: long prompts while the engine is busy and new chats keep arriving.

The frontloop scenario measures a front end beside an idle engine. On a real node the engine's
CPU side is busy whenever anything runs (a GPU engine's step loop spins a core; a CPU engine
computes on all of them), and new requests arrive all the time. Here, for each conversion mode
(inline, thread, pool) against a fresh ``tokenmill serve`` whose simulated scheduler keeps
``--busy-cores`` cores busy while it has work (``--sim-busy-cores``):

* short streaming chats start at a fixed rate (open loop: a new one every 1/rate s whether or
  not the others are done), each ``max_tokens`` tokens at 20 ms per token;
* after they have filled the engine, rounds of long chats are sent together, while a prober
  GETs ``/health`` every 10 ms;
* reported: ``/health`` p50/p99/max, the gateway's loop lag, the long rounds' wall time, and the
  short chats' time to first content token (p50/p99) and errors.

``tokenmill bench vllm`` runs the same measurement (:func:`measure_busy`) against vLLM's own
server and tokenmill in front of the same vLLM engine (scenario ``busy_engine``), with the same
``--busy-rate`` and ``--busy-chat-tokens`` (:func:`add_busy_load_options`).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

from tokenmill.bench.common import (
    add_common_options,
    add_long_prompt_options,
    add_server_options,
    all_at_once,
    health_prober,
    long_bodies,
    pct,
    ratio_text,
    rnd,
    write_json,
)
from tokenmill.bench.servers import ServeProcess

MODES = ("inline", "thread", "pool")
FIGURES = (
    "health_p50_ms",
    "health_p99_ms",
    "health_max_ms",
    "loop_lag_p99_ms",
    "loop_lag_max_ms",
    "conversion_wall_s",
    "chat_ttft_p50_ms",
    "chat_ttft_p99_ms",
    "chats",
)
ARRIVAL_LIMIT = 5000  # short chats started at most per measurement, whatever the rate and time


def add_busy_load_options(parser) -> None:
    """--busy-rate and --busy-chat-tokens: the short chats that keep the engine busy (also bench vllm's)."""
    parser.add_argument(
        "--busy-rate",
        type=float,
        default=8.0,
        help="Short streaming chats started per second while the long prompts go (default 8).",
    )
    parser.add_argument(
        "--busy-chat-tokens", type=int, default=64, help="Tokens each short chat generates (default 64)."
    )


def add_arguments(parser) -> None:
    add_common_options(parser)
    add_server_options(parser, MODES)
    add_long_prompt_options(parser, requests=(4, 2), tokens=(250_000, 60_000))
    add_busy_load_options(parser)
    parser.add_argument(
        "--busy-cores",
        type=int,
        default=None,
        help="Cores the simulated engine keeps busy while it has work (default: all).",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="A `tokenmill serve` flag for every server, e.g. --serve-arg=--conversion-nice=10 (repeatable).",
    )


# ---- client processes ------------------------------------------------------------------------


def _first_content(line: bytes) -> bool:
    """An SSE line whose chunk carries text (not the role chunk, not usage)."""
    if not line.startswith(b"data: {"):
        return False
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") or c.get("text") for c in chunk.get("choices") or ())


def _short_chat(model: str, max_tokens: int) -> bytes:
    """The body of one short streaming chat that generates exactly ``max_tokens`` tokens."""
    return json.dumps(
        {
            "model": model,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": "Tell me about the lighthouse keeper and the storm."}],
        }
    ).encode()


def _arrivals(port: int, model: str, rate: float, max_tokens: int, stop, out) -> None:
    """Short streaming chats started every 1/rate s until ``stop`` (at most ARRIVAL_LIMIT)."""
    body = _short_chat(model, max_tokens)
    ttft, e2e, errors = [], [], []

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        t0 = time.perf_counter()
        first = None
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                errors.append(f"{resp.status}: {resp.read()[:200]!r}")
                return
            for line in resp:
                if first is None and _first_content(line):
                    first = time.perf_counter()
        except (OSError, http.client.HTTPException) as exc:
            errors.append(repr(exc))
            return
        finally:
            conn.close()
        done = time.perf_counter()
        ttft.append(((first or done) - t0) * 1000)
        e2e.append((done - t0) * 1000)

    threads = []
    start = time.perf_counter()
    while not stop.is_set() and len(threads) < ARRIVAL_LIMIT:
        thread = threading.Thread(target=one, daemon=True)
        thread.start()
        threads.append(thread)
        delay = start + len(threads) / rate - time.perf_counter()
        if delay > 0:
            stop.wait(delay)
    for thread in threads:
        thread.join(330)
    out.put(("chats", {"ttft": ttft, "e2e": e2e, "errors": errors, "started": len(threads)}))


def _kept_alive(port: int, model: str, max_tokens: int, stop, out) -> None:
    """One streaming chat after another, so that exactly one is always alive, until ``stop``: when each
    began and when each of its content events came (``time.perf_counter``, the system's monotonic clock,
    comparable across the bench's processes). A server that is slow to start the next stream shows in
    the gap between one stream's last event and the next one's first, which a gap count within each
    stream never sees."""
    body = _short_chat(model, max_tokens)
    streams, errors = [], []
    while not stop.is_set() and len(streams) < ARRIVAL_LIMIT:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        began, events = time.perf_counter(), []
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                errors.append(f"{resp.status}: {resp.read()[:200]!r}")
                continue
            for line in resp:
                if _first_content(line):
                    events.append(time.perf_counter())
        except (OSError, http.client.HTTPException) as exc:
            errors.append(repr(exc))
        finally:
            conn.close()
        streams.append((began, events))
    out.put(("stream", {"streams": streams, "errors": errors}))


def kept_alive_figures(streams: list[tuple[float, list[float]]], window: tuple[float, float], warm: float) -> dict:
    """The kept-alive stream's figures over ``window`` (the long rounds): gaps within each stream (what
    a client of one stream sees), gaps between consecutive content events across stream boundaries (a
    slow start of the next stream counts), content events per second, and that rate as a share of the
    rate over the ``warm`` seconds before the window (the engine decoding with nothing else to do)."""
    start, end = window
    within, across, before = [], [], 0
    last = None
    for _, events in streams:
        previous = None
        for t in events:
            if start - warm <= t < start:
                before += 1
            if start <= t < end:
                if previous is not None and previous >= start:
                    within.append((t - previous) * 1000)
                if last is not None and last >= start:
                    across.append((t - last) * 1000)
            previous = last = t
    during = sum(1 for _, events in streams for t in events if start <= t < end)
    rate = during / (end - start) if end > start else None
    rate_before = before / warm if warm else None
    return {
        "stream_gap_p99_ms": rnd(pct(within, 0.99)),
        "kept_alive_gap_p99_ms": rnd(pct(across, 0.99)),
        "kept_alive_gap_max_ms": rnd(max(across, default=None)),
        "stream_tokens_per_s": rnd(rate),
        "stream_tokens_share": rnd(rate / rate_before, 3) if rate is not None and rate_before else None,
    }


def _send_chat_rounds(port: int, rounds: list[list[bytes]], out) -> None:
    """Each round's long chats (max_tokens 1) sent together: the wall time of every round."""
    walls, errors = [], []

    def one(body: bytes) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                errors.append(f"{resp.status}: {data[:200]!r}")
        except (OSError, http.client.HTTPException) as exc:
            errors.append(repr(exc))
        finally:
            conn.close()

    began = time.perf_counter()
    for bodies in rounds:
        walls.append(all_at_once(one, bodies))
    out.put(("long", {"walls": walls, "errors": errors, "window": (began, time.perf_counter())}))


# ---- one measurement -------------------------------------------------------------------------


def measure_busy(
    port: int,
    model: str,
    sender,
    rounds: list[list[bytes]],
    rate: float,
    chat_tokens: int,
    lag_of=None,
    warm_s: float = 2.0,
    kept_alive: bool = False,
    roots: list[int] | None = None,
) -> dict:
    """Long rounds sent by ``sender(port, rounds, out)`` (a client process putting ("long", {"walls",
    "errors", "window"})) while short chats arrive at ``rate`` per second, or (``kept_alive``) one
    streaming chat after another keeps exactly one alive, and a prober GETs /health.
    ``lag_of``: a callable returning the server's /debug/loop-lag (reset=True resets it), if it has one.
    ``roots``: the server's processes, whose every thread's CPU, run-queue wait and switches over the
    long rounds are reported by role (``threads``: tokenmill.bench.threads)."""
    from tokenmill.bench import threads as census

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    procs = []
    before = after = None
    if kept_alive:
        load, warm_s = (_kept_alive, (port, model, chat_tokens, stop, out)), max(warm_s, 3.0)
    else:
        load = (_arrivals, (port, model, rate, chat_tokens, stop, out))
    try:
        chats = ctx.Process(target=load[0], args=load[1])
        chats.start()
        procs.append(chats)
        time.sleep(warm_s)  # the engine fills with chats before the long prompts come
        probing = ctx.Event()
        prober = ctx.Process(target=health_prober, args=(port, stop, out, probing))
        prober.start()
        procs.append(prober)
        if not probing.wait(60):  # a spawned process takes a while to import: the rounds start once it probes
            raise RuntimeError("the /health prober never got an answer")
        time.sleep(0.1)
        if lag_of is not None:
            lag_of(True)
        if roots:
            before, census_began = census.census(roots), time.perf_counter()
        long_sender = ctx.Process(target=sender, args=(port, rounds, out))
        long_sender.start()
        procs.append(long_sender)
        got = dict([out.get(timeout=3600)])  # the long rounds finish first
        if roots:
            after, census_s = census.census(roots), time.perf_counter() - census_began
        lag = (lag_of(False) or {}) if lag_of is not None else {}
        stop.set()
        got.update([out.get(timeout=400), out.get(timeout=400)])
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    health, long = got["health"], got["long"]
    threads = {}
    if before is not None and after is not None:
        rows = census.by_role(census.delta(before, after))
        threads = {"threads": [row.as_dict() for row in rows], "threads_s": round(census_s, 2)}
    if kept_alive:
        stream = got["stream"]
        return {
            "health_p50_ms": rnd(pct(health, 0.5), 2),
            "health_p99_ms": rnd(pct(health, 0.99), 2),
            "health_max_ms": rnd(max(health, default=None), 2),
            "conversion_wall_s": round(statistics.mean(long["walls"]), 3) if long["walls"] else None,
            **kept_alive_figures(stream["streams"], long["window"], warm_s - 0.5),
            "errors": (long["errors"] + stream["errors"])[:5],
            **threads,
        }
    chats = got["chats"]
    return {
        "health_p50_ms": rnd(pct(health, 0.5), 2),
        "health_p99_ms": rnd(pct(health, 0.99), 2),
        "health_max_ms": rnd(max(health, default=None), 2),
        "loop_lag_p99_ms": rnd(lag.get("p99_ms"), 2),
        "loop_lag_max_ms": rnd(lag.get("max_ms"), 2),
        "conversion_wall_s": round(statistics.mean(long["walls"]), 3) if long["walls"] else None,
        "chat_ttft_p50_ms": rnd(pct(chats["ttft"], 0.5)),
        "chat_ttft_p99_ms": rnd(pct(chats["ttft"], 0.99)),
        "chat_e2e_p99_ms": rnd(pct(chats["e2e"], 0.99)),
        "chats": len(chats["ttft"]),
        "errors": (long["errors"] + chats["errors"])[:5],
        **threads,
    }


def median_rows(rows: list[dict]) -> dict:
    """One row per figure: the median over runs (a machine this noisy needs more than one)."""
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if key == "errors":
            out[key] = [e for r in rows for e in r.get("errors") or []][:5]
        else:
            out[key] = round(statistics.median(values), 3) if values else rows[0][key]
    return out


# ---- the run ---------------------------------------------------------------------------------


def run(args) -> int:
    quick = args.quick
    modes = [m for m in args.modes.split(",") if m in MODES]
    count = args.requests or (2 if quick else 4)
    tokens = args.tokens or (60_000 if quick else 250_000)
    rounds_n = args.rounds or 2
    passes = max(1, args.passes)
    cores = args.busy_cores if args.busy_cores is not None else os.cpu_count() or 1
    everything = long_bodies(count * rounds_n, tokens, "deepseek-v4")
    rounds = [everything[r * count : (r + 1) * count] for r in range(rounds_n)]
    report = {
        "workload": {
            "long_requests": count,
            "tokens": tokens,
            "rounds": rounds_n,
            "passes": passes,
            "busy_cores": cores,
            "chat_rate_per_s": args.busy_rate,
            "chat_tokens": args.busy_chat_tokens,
            "cores": os.cpu_count(),
            "serve_args": args.serve_arg,
        },
        "modes": {},
    }
    rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    for p in range(passes):
        # fresh servers every pass, so that no tokenization cache has seen the text; one per mode, all
        # up at once (an idle one costs nothing measurable), taking turns in an order reversed each pass
        servers = {}
        try:
            for mode in modes:
                servers[mode] = ServeProcess(
                    mode, args.workers, itl_ms=20, extra=("--sim-busy-cores", str(cores), *args.serve_arg)
                )
            for mode in modes if p % 2 == 0 else modes[::-1]:
                server = servers[mode]
                print(f"  {mode}, pass {p + 1} of {passes} ...", file=sys.stderr, flush=True)
                rows[mode].append(
                    measure_busy(
                        server.port,
                        server.model,
                        _send_chat_rounds,
                        rounds,
                        args.busy_rate,
                        args.busy_chat_tokens,
                        lag_of=lambda reset, s=server: s.get("/debug/loop-lag?reset=1" if reset else "/debug/loop-lag")[
                            1
                        ],
                        warm_s=1.0 if quick else 2.0,
                    )
                )
        finally:
            for server in servers.values():
                server.close()
    report["modes"] = {mode: median_rows(r) for mode, r in rows.items()}
    report["runs"] = rows
    print_report(report)
    write_json(args.json, report)
    return 0


def print_report(report: dict) -> None:
    w, modes = report["workload"], report["modes"]
    print(
        f"\ntokenmill bench busy: {w['long_requests']} chats of ~{w['tokens']:,} tokens sent together, "
        f"{w['rounds']} round(s), while {w['chat_rate_per_s']:g} short streaming chats/s ({w['chat_tokens']} tokens "
        f"each) arrive and the simulated engine keeps {w['busy_cores']} of {w['cores']} cores busy; "
        f"medians of {w['passes']} pass(es)"
    )
    print(f"{'mode':>12} " + " ".join(f"{f:>18}" for f in FIGURES))
    for mode, row in modes.items():
        print(f"{mode:>12} " + " ".join(f"{row.get(f)!s:>18}" for f in FIGURES))
    for base in ("inline", "thread"):
        if base in modes and "pool" in modes:
            print(
                f"{'pool/' + base:>12} "
                + " ".join(f"{ratio_text(modes['pool'].get(f), modes[base].get(f)):>18}" for f in FIGURES)
            )
    for mode, row in modes.items():
        if row.get("errors"):
            print(f"{mode}: errors: {row['errors']}")
