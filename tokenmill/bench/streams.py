"""``tokenmill bench streams``: hundreds of concurrent streams through one gateway.

The simulated scheduler emits a token for every stream every 20 ms (or several per step,
as engines with speculative decoding do), for 64, 256 and 1024 streams at once. Two
front ends take the same load in one run: ``pool`` (detokenization in the tokenizer
workers) and ``inline`` (detokenization on the gateway's loop, vLLM's API-server design).

A last row per mode has slow readers: 4 KiB receive buffers, nothing read for the first
6 s, then 512 bytes every 100 ms, half the pace the text is written at (the gateway runs
with --send-buffer-bytes 16384, so their sockets back up within seconds). The text waiting
for them goes out as fewer, larger SSE events: "coalesced" is the share of the deltas
generated for the row's streams that were merged into an earlier event (the clients are
still reading what was written before their sockets backed up, so their own events/tok
moves later). Once merged, a token costs them a few bytes instead of an event's ~200, so
they keep up in tokens while reading half the bytes.
"""

from __future__ import annotations

import os
import sys

from tokenmill.bench.common import add_common_options, add_server_options, write_json
from tokenmill.bench.servers import ServeProcess
from tokenmill.bench.stream_load import (
    EMISSION_MS,
    SLOW_STALL_S,
    add_level_options,
    echo_word_id,
    print_report,
    run_level,
    serve_args,
)
from tokenmill.bench.streams_failover import run_failover
from tokenmill.bench.streams_history import run_history


def add_arguments(parser) -> None:
    add_common_options(parser)
    add_server_options(parser, ("inline", "pool"))
    add_level_options(parser, "64,256,1024", "10; quick 3")
    parser.add_argument(
        "--slow-stall",
        type=float,
        default=SLOW_STALL_S,
        help=f"Seconds the slow readers read nothing at first (default {SLOW_STALL_S:g}).",
    )
    parser.add_argument(
        "--failover",
        action="store_true",
        help="Instead: 256 streams with --workers 2, undisturbed then with one worker killed mid-run "
        "(streams_failover.py): delivered ratio and read gaps of the streams it held.",
    )
    parser.add_argument(
        "--history",
        action="store_true",
        help="Instead: the pool keeping each stream's token history for failover (the default) and with "
        "--stream-history-bytes 0, side by side (streams_history.py; levels 256,1024, quick 256).",
    )


def run(args) -> int:
    if args.history:
        write_json(args.json, run_history(args))
        return 0
    if args.failover:
        write_json(args.json, run_failover(args))
        return 0
    quick = args.quick
    levels = [int(x) for x in (args.levels or "64,256,1024").split(",") if x]
    window = args.window or (3.0 if quick else 10.0)
    modes = [m for m in args.modes.split(",") if m in ("pool", "inline")] or ["pool", "inline"]
    wid = echo_word_id()
    report = {"emission_ms": EMISSION_MS, "window_s": window, "cores": os.cpu_count(), "levels": []}
    sim = serve_args(max(levels))
    for tokens_per_step in (1, 4):
        for mode in modes:
            server = ServeProcess(
                mode, args.workers, itl_ms=EMISSION_MS, extra=(*sim, "--sim-tokens-per-step", str(tokens_per_step))
            )
            try:
                runs = levels if tokens_per_step == 1 else [256 if 256 in levels else levels[0]]
                for streams in runs:
                    print(
                        f"streams: {mode}, {streams} streams, {tokens_per_step} token(s) per step ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    row = run_level(server, streams, window, tokens_per_step, wid)
                    report["levels"].append({"mode": mode, **row})
                if tokens_per_step == 1:
                    print(f"streams: {mode}, 64 slow readers ...", file=sys.stderr, flush=True)
                    row = run_level(server, 64, window, 1, wid, slow_read_s=0.1, stall_s=args.slow_stall)
                    report["levels"].append({"mode": mode, **row})
            finally:
                server.close()
    print_report(report)
    write_json(args.json, report)
    return 0
