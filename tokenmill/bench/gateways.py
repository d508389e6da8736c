"""``tokenmill bench gateways``: what a second gateway process buys, and what it costs, on this machine.

One run, the same node started as ``tokenmill serve --gateways 1`` and then ``--gateways 2`` (the
same tokenizer workers, the simulated scheduler), each taking the same loads:

* **small requests**: ~50-token chats, ``max_tokens`` 1, a zero-latency scheduler, 8 and 64 keep-alive
  clients (as ``tokenmill bench``): requests/s and latency p50. Per request the gateway's share of the
  CPU is the largest of the three processes (docs/design/components.md).
* **streams**: hundreds of concurrent streams at a 20 ms emission interval (as ``tokenmill bench
  streams``; default 1024 and 2048, quick 2048): delivered tokens/s, inter-token gap p99, /health p99
  and the CPU of the gateways, the workers and the scheduler. One gateway's loop is the first
  bottleneck here (docs/design/benchmarks.md), so this is where a second one can pay.
* **cost**, measured on the idle node before any load: its memory (PSS summed over its processes, so
  pages shared between them count once), its CPU while idle, the time from start to every gateway
  answering, and the latency of a ``/metrics`` scrape (with several gateways one scrape gathers and
  merges all their expositions).

Which gateway a connection reaches is the kernel's choice (SO_REUSEPORT hashes the connection's
addresses), so a handful of keep-alive clients can split unevenly; ``/debug/state`` on new
connections checks that every gateway is up before a load starts. Ratios are 2 gateways / 1.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from tokenmill.bench import stream_load
from tokenmill.bench.common import add_common_options, cpu_seconds, process_role, process_tree, pss_kib, rnd, write_json
from tokenmill.bench.frontloop import SMALL_CLIENTS, short_rows
from tokenmill.bench.servers import ServeProcess


def add_arguments(parser) -> None:
    add_common_options(parser)
    parser.add_argument("--workers", type=int, default=None, help="Tokenizer workers (default: as serve).")
    stream_load.add_level_options(parser, "1024,2048; quick 2048", "8; quick 3")
    parser.add_argument(
        "--gateway-counts", default="1,2", help="Comma-separated --gateways values to compare (default 1,2)."
    )


# ---- the node's processes ----------------------------------------------------------------------


def idle_cost(server: ServeProcess, seconds: float) -> dict:
    tree = process_tree(server.proc.pid)
    time.sleep(min(1.0, seconds / 2))  # start-up work (imports, first scrapes) out of the way
    cpu0 = {p: cpu_seconds(p) for p in tree}
    time.sleep(seconds)
    cpu = sum(cpu_seconds(p) - cpu0[p] for p in tree)
    pss = {}
    for pid, name in tree.items():
        role = process_role(name)
        pss[role] = pss.get(role, 0) + pss_kib(pid)
    scrapes = []
    for _ in range(20):  # a new connection each: reaches any gateway, as Prometheus' would
        t0 = time.perf_counter()
        status, _ = server.get("/metrics")
        if status == 200:
            scrapes.append((time.perf_counter() - t0) * 1000)
    return {
        "processes": len(tree),
        "pss_mib": round(sum(pss.values()) / 1024, 1),
        "gateways_pss_mib": round(pss.get("gateway", 0) / 1024, 1),
        "idle_cpu_share": round(cpu / seconds, 3),
        "metrics_scrape_p50_ms": rnd(statistics.median(scrapes), 2) if scrapes else None,
    }


def gateway_pids(server: ServeProcess, expected: int, timeout: float = 60.0) -> set[int]:
    """Ask /debug/state on new connections until every gateway process has answered."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, state = server.get("/debug/state")
        if (
            status == 200
            and state.get("scheduler_connected")
            and state.get("workers")
            and all(w["alive"] for w in state["workers"])
        ):
            seen.add(state["pid"])
            if len(seen) >= expected:
                return seen
        time.sleep(0.05)
    raise RuntimeError(f"only {len(seen)} of {expected} gateway processes answered within {timeout:g}s")


# ---- one node --------------------------------------------------------------------------------


def run_node(gateways: int, args, levels: list[int], window: float, small_count: int, word_id: int) -> dict:
    workers = args.workers
    started = time.monotonic()
    # small requests: the zero-latency scheduler, as tokenmill bench
    server = ServeProcess("pool", workers, itl_ms=0, extra=("--gateways", str(gateways)))
    try:
        pids = gateway_pids(server, gateways)
        ready_s = time.monotonic() - started
        row = {"gateways": gateways, "gateway_pids_seen": len(pids), "ready_s": round(ready_s, 2)}
        row.update(idle_cost(server, 1.0 if args.quick else 5.0))
        print(f"gateways: {gateways} gateway(s), small requests ...", file=sys.stderr, flush=True)
        row["small"] = short_rows(server, small_count, SMALL_CLIENTS)
    finally:
        server.close()
    # streams: the echo scheduler at 20 ms, as tokenmill bench streams
    server = ServeProcess(
        "pool",
        workers,
        itl_ms=stream_load.EMISSION_MS,
        extra=("--gateways", str(gateways), *stream_load.serve_args(max(levels))),
    )
    try:
        gateway_pids(server, gateways)
        row["streams"] = []
        for streams in levels:
            print(f"gateways: {gateways} gateway(s), {streams} streams ...", file=sys.stderr, flush=True)
            row["streams"].append(stream_load.run_level(server, streams, window, 1, word_id))
    finally:
        server.close()
    return row


def run(args) -> int:
    counts = [int(x) for x in args.gateway_counts.split(",") if x]
    if not counts or min(counts) < 1:
        print("tokenmill bench gateways: --gateway-counts takes positive integers, e.g. 1,2", file=sys.stderr)
        return 2
    levels = [int(x) for x in (args.levels or ("2048" if args.quick else "1024,2048")).split(",") if x]
    window = args.window or (3.0 if args.quick else 8.0)
    small_count = 300 if args.quick else 3000
    word_id = stream_load.echo_word_id()
    report = {
        "cores": os.cpu_count(),
        "emission_ms": stream_load.EMISSION_MS,
        "window_s": window,
        "small_requests_per_level": small_count,
        "nodes": [],
    }
    for gateways in counts:
        report["nodes"].append(run_node(gateways, args, levels, window, small_count, word_id))
    print_report(report)
    write_json(args.json, report)
    return 0


# ---- report ----------------------------------------------------------------------------------


def _lines(report: dict) -> list[tuple[str, list]]:
    """(label, value per node) for every figure, in the order printed."""
    nodes = report["nodes"]
    lines = [
        ("idle: processes", [n["processes"] for n in nodes]),
        ("idle: memory, PSS MiB (all processes)", [n["pss_mib"] for n in nodes]),
        ("idle: memory, PSS MiB (gateways)", [n["gateways_pss_mib"] for n in nodes]),
        ("idle: CPU (cores busy)", [n["idle_cpu_share"] for n in nodes]),
        ("start to every gateway ready, s", [n["ready_s"] for n in nodes]),
        ("/metrics scrape p50, ms", [n["metrics_scrape_p50_ms"] for n in nodes]),
    ]
    for clients in map(str, SMALL_CLIENTS):
        lines.append((f"small, {clients} clients: req/s", [n["small"][clients]["requests_per_s"] for n in nodes]))
        lines.append((f"small, {clients} clients: p50 ms", [n["small"][clients]["latency_p50_ms"] for n in nodes]))
    for i, level in enumerate(nodes[0]["streams"]):
        s = level["streams"]
        rows = [n["streams"][i] for n in nodes]
        lines += [
            (f"{s} streams: delivered tokens/s", [r["delivered_tokens_per_s"] for r in rows]),
            (f"{s} streams: delivered / emitted", [r["delivered_ratio"] for r in rows]),
            (f"{s} streams: emitted / ideal", [r["emitted_ratio"] for r in rows]),
            (f"{s} streams: gap p99 ms", [r["gap_p99_ms"] for r in rows]),
            (f"{s} streams: /health p99 ms", [r["health_p99_ms"] for r in rows]),
            (f"{s} streams: gateways CPU (cores)", [r["gateway_cpu_share"] for r in rows]),
            (f"{s} streams: workers CPU (cores)", [r["workers_cpu_share"] for r in rows]),
            (f"{s} streams: scheduler CPU (cores)", [r["scheduler_cpu_share"] for r in rows]),
            (f"{s} streams: front CPU ms / 1k tokens", [r["cpu_ms_per_1k_tokens"] for r in rows]),
            (f"{s} streams: load client CPU (cores)", [r["client_cpu_share"] for r in rows]),
        ]
    return lines


def print_report(report: dict) -> None:
    nodes = report["nodes"]
    heads = [f"{n['gateways']} gateway{'s' if n['gateways'] > 1 else ''}" for n in nodes]
    base = nodes[0]["gateways"]
    if len(nodes) > 1:
        heads += [f"{n['gateways']}/{base}" for n in nodes[1:]]
    print(
        f"\ntokenmill bench gateways: {report['cores']} cores, simulated scheduler; small requests as tokenmill "
        f"bench ({report['small_requests_per_level']} per level); streams at {report['emission_ms']:g} ms, "
        f"{report['window_s']:g} s measured per level"
    )
    width = max(len(label) for label, _ in _lines(report)) + 2
    print("".ljust(width) + "".join(h.rjust(12) for h in heads))
    for label, values in _lines(report):
        cells = ["-" if v is None else f"{v:g}" for v in values]
        cells += [f"{v / values[0]:.2f}x" if isinstance(v, (int, float)) and values[0] else "-" for v in values[1:]]
        print(label.ljust(width) + "".join(c.rjust(12) for c in cells))
    for n in nodes:
        errors = [e for level in n["streams"] for e in level["errors"]]
        errors += [f"{c} clients: {r['errors']} errors" for c, r in n["small"].items() if r["errors"]]
        if errors:
            print(f"{n['gateways']} gateway(s): errors: {errors[:5]}")
