"""The load of ``tokenmill bench streams``, also run by its ``--history`` and ``--failover`` rounds and by
``tokenmill bench gateways``: the echo scheduler's flags, the load client, one level measured, the table.

Counting delivered tokens exactly, without parsing JSON in the load client: the scheduler
runs in echo mode on a prompt of one token repeated (`` elephant``), so every generated
token is that word and a client counts tokens by counting the word in the bytes it reads.
Emitted tokens are what the gateway received from the scheduler in the same window
(``tokenmill_generation_tokens_total``). Load clients are asyncio processes of their own;
their CPU is reported, so a saturated client is visible rather than mistaken for a slow
gateway.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import threading
import time

from tokenmill.bench.common import cpu_seconds, pct, probe_health, process_role, process_tree, rnd
from tokenmill.bench.servers import ServeProcess

WORD = b" elephant"  # one token with the embedded model's tokenizer
SLOW_STALL_S = 6.0  # slow readers read nothing at first
EMISSION_MS = 20.0


def add_level_options(parser, levels: str, window: str) -> None:
    """--levels and --window: the stream counts and the seconds measured at each (also bench gateways')."""
    parser.add_argument("--levels", default=None, help=f"Comma-separated concurrent stream counts (default {levels}).")
    parser.add_argument("--window", type=float, default=None, help=f"Seconds measured per level (default {window}).")


def echo_word_id() -> int:
    """The token id of WORD, which the echo scheduler repeats."""
    from tokenmill.tokenizer_workers.model import load_model

    ids = load_model().tokenizer.encode(WORD.decode(), add_special_tokens=False).ids
    if len(ids) != 1:
        raise RuntimeError(f"{WORD!r} is not one token for the embedded tokenizer")
    return ids[0]


# ---- the load client (its own process; asyncio, no JSON parsing) --------------------------


def stream_client(
    port: int, streams: int, body: bytes, ramp_s: float, stop_at, slow_read_s: float, stall_s: float, out
) -> None:
    import asyncio

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    tail_len = len(WORD) - 1
    results = []

    async def one(i: int) -> None:
        await asyncio.sleep(ramp_s * i / streams)
        times, counts, events, errors = [], [], 0, ""
        try:
            if slow_read_s:  # a small receive window, so the gateway sees the backlog soon
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
                reader, writer = await asyncio.open_connection(sock=sock, limit=2048)  # asyncio buffers 2x this
            else:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                errors = head.split(b"\r\n", 1)[0].decode()
            tail = b""
            if slow_read_s:
                await asyncio.sleep(stall_s)
            while not errors:
                chunk = await reader.read(512 if slow_read_s else 1 << 16)
                now = time.time()
                if not chunk:
                    break
                data = tail + chunk
                n = data.count(WORD) - tail.count(WORD)
                events += chunk.count(b"data: ")
                tail = data[-tail_len:]
                if n:
                    times.append(now)
                    counts.append(n)
                if now >= stop_at.value:
                    break
                if slow_read_s:
                    await asyncio.sleep(slow_read_s)
            writer.close()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            errors = repr(exc)
        results.append((times, counts, events, errors))

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(streams)))

    t0 = time.process_time()
    asyncio.run(main())
    out.put({"streams": results, "cpu_s": time.process_time() - t0})


def _metrics(port: int, *names: str) -> list[float]:
    """Values of these metrics from /metrics, read with a patient client: at saturation /metrics answers
    late too."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name):
                values[name] = float(line.rsplit(" ", 1)[1])
    return [values[name] for name in names]


def _counters(port: int) -> tuple[float, float]:
    """(generated tokens, coalesced deltas) so far."""
    generated, coalesced = _metrics(
        port, "tokenmill_generation_tokens_total", "tokenmill_stream_coalesced_deltas_total"
    )
    return generated, coalesced


# ---- one level -----------------------------------------------------------------------------


def run_level(
    server: ServeProcess,
    streams: int,
    window: float,
    tokens_per_step: int,
    word_id: int,
    slow_read_s: float = 0.0,
    stall_s: float = SLOW_STALL_S,
) -> dict:
    ramp = min(2.0, 0.002 * streams)
    # past the ramp and the first tokens of every stream; slow readers: until their sockets have backed up
    settle = ramp + (stall_s + 2.0 if slow_read_s else 1.5 + streams / 512)
    body = json.dumps(
        {"model": server.model, "prompt": [word_id] * 16, "max_tokens": 1_000_000, "ignore_eos": True, "stream": True}
    ).encode()
    clients = 1 if streams <= 128 else 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    emitted_before, coalesced_before = _counters(server.port)
    start = time.time()
    t0 = start + settle
    stop_at = ctx.RawValue("d", t0 + window + 60)  # moved to "now" once the window is measured
    procs = []
    for c in range(clients):
        share = streams // clients + (1 if c < streams % clients else 0)
        # the clients read on past t1: at saturation /metrics itself answers late, and the window
        # is the time between the two readings of the gateway's token counter
        p = ctx.Process(target=stream_client, args=(server.port, share, body, ramp, stop_at, slow_read_s, stall_s, out))
        p.start()
        procs.append(p)
    tree = process_tree(server.proc.pid)
    time.sleep(max(0.0, t0 - time.time()))
    # the window opens once every stream runs: on a busy machine the clients (spawned, so importing first)
    # can take longer to start than the settle time
    deadline = time.time() + 60
    while _metrics(server.port, "tokenmill_num_requests_running")[0] < streams and time.time() < deadline:
        time.sleep(0.05)
    health: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(
        target=probe_health,
        args=(server.port, stop, health),
        kwargs={"count_failures": True, "timeout": 30},
        daemon=True,
    )
    prober.start()
    # the window runs between the two readings of the gateway's token counter (taken as the
    # midpoint of each request: under overload /metrics answers late), CPU read right after each
    asked = time.time()
    emitted0, _ = _counters(server.port)
    t0 = (asked + time.time()) / 2
    cpu0 = {p: cpu_seconds(p) for p in tree}
    client_cpu0 = sum(cpu_seconds(p.pid) for p in procs)
    time.sleep(max(0.0, t0 + window - time.time()))
    asked = time.time()
    emitted_after, coalesced_after = _counters(server.port)
    emitted = emitted_after - emitted0
    # over the level's whole life, so deltas merged now from text held back earlier count against their tokens
    coalesced_share = (coalesced_after - coalesced_before) / max(1.0, emitted_after - emitted_before)
    t1 = (asked + time.time()) / 2
    cpu1 = {p: cpu_seconds(p) for p in tree}
    client_cpu1 = sum(cpu_seconds(p.pid) for p in procs)
    window = t1 - t0
    stop.set()
    prober.join(5)
    stop_at.value = time.time()  # the clients end their streams at their next read
    results = []
    for _ in procs:
        results.extend(out.get(timeout=120)["streams"])
    for p in procs:
        p.join(30)
    delivered, gaps, events, errors = 0, [], 0, [r[3] for r in results if r[3]]
    for times, counts, n_events, _ in results:
        events += n_events
        last = None
        for t, n in zip(times, counts):
            if t0 <= t < t1:
                delivered += n
                if last is not None:
                    gaps.append((t - last) * 1000)
                last = t
    cpu = {name: 0.0 for name in ("gateway", "workers", "scheduler")}
    for pid, name in tree.items():
        cpu[process_role(name)] += cpu1.get(pid, 0.0) - cpu0.get(pid, 0.0)
    ideal = streams * tokens_per_step * window * 1000 / EMISSION_MS
    front_cpu = cpu["gateway"] + cpu["workers"]
    return {
        "streams": streams,
        "tokens_per_step": tokens_per_step,
        "slow_read_ms": round(slow_read_s * 1000),
        "emitted_tokens_per_s": round(emitted / window),
        "delivered_tokens_per_s": round(delivered / window),
        "emitted_ratio": round(emitted / ideal, 3) if ideal else None,
        "delivered_ratio": round(delivered / emitted, 3) if emitted else None,
        "gap_p50_ms": rnd(pct(gaps, 0.5)),
        "gap_p99_ms": rnd(pct(gaps, 0.99)),
        "events_per_token": round(events / max(1, sum(sum(r[1]) for r in results)), 3),
        "coalesced_share": round(coalesced_share, 3),
        "cpu_ms_per_1k_tokens": round(1e6 * front_cpu / delivered, 1) if delivered else None,
        "gateway_cpu_share": round(cpu["gateway"] / window, 2),
        "workers_cpu_share": round(cpu["workers"] / window, 2),
        "scheduler_cpu_share": round(cpu["scheduler"] / window, 2),
        "client_cpu_share": round((client_cpu1 - client_cpu0) / window, 2),
        "health_p99_ms": rnd(pct(health, 0.99), 2),
        "errors": errors[:3],
    }


def serve_args(streams: int) -> tuple:
    """``tokenmill serve`` flags for this benchmark: the echo scheduler with room for every stream, and a
    fixed send buffer (docs/operations/security.md) so that slow readers back up soon."""
    return (
        "--sim-mode",
        "echo",
        "--sim-max-running",
        str(streams * 2),
        "--log-level",
        "warning",
        "--send-buffer-bytes",
        "16384",
    )


def print_report(report: dict) -> None:
    cols = [
        ("mode", "mode"),
        ("streams", "streams"),
        ("tokens_per_step", "tok/step"),
        ("slow_read_ms", "read ms"),
        ("emitted_tokens_per_s", "emitted/s"),
        ("emitted_ratio", "emit/ideal"),
        ("delivered_ratio", "deliv/emit"),
        ("gap_p50_ms", "gap p50"),
        ("gap_p99_ms", "gap p99"),
        ("events_per_token", "events/tok"),
        ("coalesced_share", "coalesced"),
        ("cpu_ms_per_1k_tokens", "cpu ms/1k"),
        ("gateway_cpu_share", "gw cpu"),
        ("workers_cpu_share", "wk cpu"),
        ("scheduler_cpu_share", "sim cpu"),
        ("client_cpu_share", "client cpu"),
        ("health_p99_ms", "health p99"),
    ]
    print(
        f"\ntokenmill bench streams: {report['emission_ms']:g} ms between decode steps, {report['window_s']:g} s "
        f"measured per row, {report['cores']} cores"
    )
    print(
        "deliv/emit = tokens clients read / tokens the gateway got from the scheduler; emit/ideal = the simulated "
        "scheduler's own pace; gap = client-observed time between reads carrying tokens (ms); coalesced = share of deltas merged into an "
        "earlier SSE event; cpu ms/1k = gateway + "
        "worker CPU per 1,000 delivered tokens; *_cpu = cores busy"
    )
    widths = [max(len(h), 7) for _, h in cols]
    print("  ".join(h.rjust(w) for (_, h), w in zip(cols, widths)))
    for row in report["levels"]:
        cells = ["-" if row.get(k) is None else str(row[k]) for k, _ in cols]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    for row in report["levels"]:
        if row.get("errors"):
            print(f"{row['mode']} {row['streams']}: errors: {row['errors']}")
    pairs = {}
    for row in report["levels"]:
        pairs.setdefault((row["streams"], row["tokens_per_step"], row["slow_read_ms"]), {})[row["mode"]] = row
    ratio_rows = [(key, p) for key, p in pairs.items() if "pool" in p and "inline" in p]
    if ratio_rows:
        print("pool / inline:")
        for (streams, tps, slow), p in ratio_rows:
            a, b = p["pool"], p["inline"]

            def ratio(k, a=a, b=b):
                return f"{a[k] / b[k]:.2f}x" if a.get(k) and b.get(k) else "-"

            print(
                f"  {streams} streams, {tps} tok/step{', slow readers' if slow else ''}: delivered/s "
                f"{ratio('delivered_tokens_per_s')}, gap p99 {ratio('gap_p99_ms')}, cpu/1k {ratio('cpu_ms_per_1k_tokens')}, "
                f"health p99 {ratio('health_p99_ms')}"
            )
