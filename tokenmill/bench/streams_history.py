"""``tokenmill bench streams --history``: what keeping each stream's token history costs the gateway.

The same load as ``tokenmill bench streams`` (the echo scheduler, a token every 20 ms per stream) on two
servers side by side: ``pool`` as it runs by default (each live choice's token frames kept, so that its
stream can move to another worker if its own dies) and ``pool`` with ``--stream-history-bytes 0``
(nothing kept). The levels run on both in turn, in alternating order per repeat, so load on a shared
machine falls on both alike; the report gives history / no history for the gap p99 and the gateway's
CPU per delivered token.
"""

from __future__ import annotations

import os
import sys

from tokenmill.bench.common import rnd
from tokenmill.bench.servers import ServeProcess
from tokenmill.bench.stream_load import EMISSION_MS, echo_word_id, print_report, run_level, serve_args

MODES = {"history": (), "no history": ("--stream-history-bytes", "0")}


def run_history(args) -> dict:
    quick = args.quick
    levels = [int(x) for x in (args.levels or ("256" if quick else "256,1024")).split(",") if x]
    window = args.window or (3.0 if quick else 10.0)
    repeats = 1 if quick else 2
    word_id = echo_word_id()
    servers = {}
    try:
        for mode, extra in MODES.items():
            servers[mode] = ServeProcess(
                "pool", args.workers, itl_ms=EMISSION_MS, extra=(*serve_args(max(levels)), *extra)
            )
        rows = []
        for streams in levels:
            for repeat in range(repeats):
                order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    print(f"streams --history: {mode}, {streams} streams ...", file=sys.stderr, flush=True)
                    row = run_level(servers[mode], streams, window, 1, word_id)
                    row["gateway_cpu_us_per_token"] = (
                        rnd(1e6 * row["gateway_cpu_share"] / row["delivered_tokens_per_s"])
                        if row["delivered_tokens_per_s"]
                        else None
                    )
                    rows.append({"mode": mode, "repeat": repeat, **row})
    finally:
        for server in servers.values():
            server.close()
    report = {"emission_ms": EMISSION_MS, "window_s": window, "cores": os.cpu_count(), "levels": rows}
    report["ratios"] = _ratios(rows)
    print_report(report)
    print_ratios(report)
    return report


def _ratios(rows: list[dict]) -> list[dict]:
    """history / no history per level, each figure averaged over the repeats first."""
    out = []
    for streams in dict.fromkeys(r["streams"] for r in rows):

        def mean(mode: str, key: str, streams=streams) -> float | None:
            values = [r[key] for r in rows if r["streams"] == streams and r["mode"] == mode and r.get(key) is not None]
            return sum(values) / len(values) if values else None

        ratio = {"streams": streams}
        for key in ("gap_p99_ms", "gateway_cpu_us_per_token", "cpu_ms_per_1k_tokens", "delivered_ratio"):
            a, b = mean("history", key), mean("no history", key)
            ratio[key] = {"history": rnd(a, 2), "no_history": rnd(b, 2), "ratio": round(a / b, 3) if a and b else None}
        out.append(ratio)
    return out


def print_ratios(report: dict) -> None:
    print("history / no history (means over the repeats):")
    for r in report["ratios"]:
        parts = [
            f"{label} {r[key]['history']} / {r[key]['no_history']} = {r[key]['ratio']}x"
            for key, label in (
                ("gap_p99_ms", "gap p99 ms"),
                ("gateway_cpu_us_per_token", "gateway CPU us/token"),
                ("cpu_ms_per_1k_tokens", "front CPU ms/1k tokens"),
                ("delivered_ratio", "delivered"),
            )
        ]
        print(f"  {r['streams']} streams: " + "; ".join(parts))
