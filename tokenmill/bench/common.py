"""What the benchmarks share: figures (percentiles, rounding, ratios), the corpus text, loopback HTTP,
the /health prober, an unrelated stream's gaps, process CPU and memory accounting, and the options
several scenarios take. Standard library only: every scenario imports it to build its options.

The client functions below run in client processes of their own (``multiprocessing`` spawn), so that
a load's own GIL does not blur what it measures: they take plain arguments and report on a queue.
"""

from __future__ import annotations

import http.client
import json
import os
import sysconfig
import threading
import time
from pathlib import Path

# ---- figures ---------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank, no interpolation); None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def rnd(x: float | None, digits: int = 1) -> float | None:
    """``round`` that passes None through (a figure with no samples)."""
    return None if x is None else round(x, digits)


def ratio(a, b) -> float | None:
    """a / b where both are numbers and b is not zero, else None."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return a / b


def ratio_text(a, b) -> str:
    """a / b as a table cell: ``1.23x``, or ``-`` where there is no ratio."""
    r = ratio(a, b)
    return "-" if r is None else f"{r:.2f}x"


# ---- the workload's text ---------------------------------------------------------------------


def corpus(chars: int) -> str:
    """Deterministic text: Python's standard-library sources, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= chars:
            break
    text = "".join(parts)
    while len(text) < chars:
        text += text
    return text[:chars]


def long_bodies(count: int, tokens: int, model: str) -> list[bytes]:
    """``count`` long chats of about ``tokens`` tokens, each its own slice of the corpus, max_tokens 1."""
    chars = int(tokens * 4.1)  # ~4.1 characters per token for Python source with this tokenizer
    text = corpus(chars * count + 1)
    bodies = []
    for i in range(count):
        chunk = text[i * chars : (i + 1) * chars]
        messages = [
            {"role": "system", "content": "You are a coding agent. Review the repository below."},
            {"role": "user", "content": chunk},
        ]
        bodies.append(json.dumps({"model": model, "messages": messages, "max_tokens": 1}).encode())
    return bodies


# ---- loopback HTTP ---------------------------------------------------------------------------


def all_at_once(one, items) -> float:
    """``one(item)`` for every item, each on its own thread, all started together; the seconds until the
    last one returned."""
    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def free_port() -> int:
    """A loopback port nothing listens on right now (for the servers a benchmark starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(
    port: int, method: str, path: str, body: bytes | None = None, timeout: float = 10, piece_bytes: int = 0
) -> tuple[int, bytes]:
    """One request to 127.0.0.1:``port`` on a connection of its own: (status, body). Raises what
    ``http.client`` raises (OSError, HTTPException). ``piece_bytes``: send the body in writes of at
    most this many bytes, not one: a client on another host holds none of these cores, but one here
    sending 5 MB in one write holds a core inside the kernel for milliseconds, which on a kernel
    without kernel preemption delays whatever the server would run there next."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if body is not None and piece_bytes and len(body) > piece_bytes:
        headers["Content-Length"] = str(len(body))
        view = memoryview(body)
        body = [view[i : i + piece_bytes] for i in range(0, len(view), piece_bytes)]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def try_get(port: int, path: str, timeout: float = 10) -> tuple[int | None, bytes]:
    """GET ``path``: (status, body), or (None, b"") where nothing answered."""
    try:
        return request(port, "GET", path, timeout=timeout)
    except (OSError, http.client.HTTPException):
        return None, b""


# ---- client loops (each run in a process of its own) -----------------------------------------


class _HealthAnswer:
    """httptools' callbacks for one /health response: done once the whole message has come."""

    def __init__(self) -> None:
        self.done = False

    def on_message_complete(self) -> None:
        self.done = True


_HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def _ask_health(sock) -> None:
    """One GET /health on ``sock``, read to its end by httptools' response parser; raises OSError on
    anything but a complete 200."""
    import httptools

    answer = _HealthAnswer()
    parser = httptools.HttpResponseParser(answer)
    sock.sendall(_HEALTH_REQUEST)
    while not answer.done:
        data = sock.recv(65536)
        if not data:
            raise OSError("connection closed")
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as e:
            raise OSError(f"bad response: {e}") from e
    if parser.get_status_code() != 200:
        raise OSError(f"status {parser.get_status_code()}")


def probe_health(
    port: int,
    stop,
    latencies: list,
    *,
    count_failures: bool = False,
    timeout: float = 60.0,
    started=None,
    starts: list | None = None,
) -> None:
    """GET /health every 10 ms until ``stop`` is set, appending each latency in ms to ``latencies``
    (and, given ``starts``, when each probe began: ``time.perf_counter()``, the system's monotonic clock).
    A failed probe reconnects; with ``count_failures`` it counts as taking until it failed. ``started``
    (an Event) is set once the first probe has been answered. A health checker on another host does
    not wait for this machine's cores, so what it measures should be the server's delay, not its own
    (the same for every server measured): the prober's thread runs real-time where the bench may (as
    root), else asks for a short time slice and, at the end, prints how long it waited for a core itself
    (that wait is then in its figures, reported apart), and its process leaves the bench's session, so that the
    load threads' CPU (sending megabytes of bodies) is not charged to its scheduling group (autogroups).
    For the same reason it speaks HTTP through a plain socket and httptools' C parser: ``http.client``
    spent ~0.25 ms of Python of its own per probe here (an idle server's p50 0.54 against 0.31 ms)."""
    import socket

    from tokenmill.process.procutil import request_latency_slice, request_realtime, set_process_name

    set_process_name("bench-prober")  # its thread, by name in ps, top and perf sched
    try:
        os.setsid()
    except OSError:  # already a session or group leader: stays where it is
        pass
    realtime = request_realtime(1)
    if not realtime:
        request_latency_slice(100)
    waited = _own_runqueue_wait()
    sock = None
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _ask_health(sock)
            latencies.append((time.perf_counter() - t0) * 1000)
            if starts is not None:
                starts.append(t0)
            if started is not None and not started.is_set():
                started.set()
        except OSError:
            if count_failures:
                latencies.append((time.perf_counter() - t0) * 1000)
                if starts is not None:
                    starts.append(t0)
            if sock is not None:
                sock.close()
            sock = None
        time.sleep(0.010)
    if sock is not None:
        sock.close()
    if not realtime:  # its own waits are in its figures: say how much, apart from them
        waited = _own_runqueue_wait() - waited
        print(
            f"the /health prober could not run real-time (no CAP_SYS_NICE): it waited {waited * 1000:.0f} ms "
            f"for a core itself over {len(latencies)} probes, and that is in its figures",
            flush=True,
        )


def _own_runqueue_wait() -> float:
    """Seconds the calling thread has spent runnable, waiting for a core (/proc/thread-self/schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def health_prober(port: int, stop, out, started=None) -> None:
    """A client process: :func:`probe_health` until ``stop``, then ("health", latencies) on ``out``;
    ``started`` is set once it has a first answer."""
    latencies: list[float] = []
    probe_health(port, stop, latencies, started=started)
    out.put(("health", latencies))


def timed_health_prober(port: int, stop, out, started=None) -> None:
    """:func:`health_prober` that also says when each probe began: ("health", latencies, starts)."""
    latencies: list[float] = []
    starts: list[float] = []
    probe_health(port, stop, latencies, started=started, starts=starts)
    out.put(("health", latencies, starts))


def stall_watcher(cpu: int, period: float, stop, out, ready) -> None:
    """A process pinned to ``cpu`` at SCHED_FIFO 99, waking every ``period`` s until ``stop``; puts
    (cpu, gaps) on ``out``: (start, end) on the monotonic clock of each wake-up more than a period late.
    Without the privilege, (cpu, None): a fair-scheduled watcher would measure the load, not the machine.
    Sets ``ready`` once it watches (or knows it cannot)."""
    os.sched_setaffinity(0, {cpu})
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(99))
    except OSError:
        out.put((cpu, None))
        return
    finally:
        ready.set()
    gaps, last = [], time.perf_counter()
    while not stop.is_set():
        time.sleep(period)
        now = time.perf_counter()
        if now - last > 2 * period:
            gaps.append((last + period, now))
        last = now
    out.put((cpu, gaps))


class CpuStalls:
    """When a CPU ran nothing of anyone's: one :func:`stall_watcher` per CPU. Nothing on the machine
    holds off a real-time priority 99 thread on its own core but the kernel or, on a VM, the host
    taking the virtual CPU away (steal): a late watcher marks a span in which whatever that CPU was to
    run, a server's loop or the prober, could not. On this 2-core VM: one CPU gone for 100 ms (100 ms of
    steal in /proc/stat), and both at once for 58-62 ms, each a few times in a ten-minute benchmark.
    The watchers wake every 10 ms, as often as the prober."""

    def __init__(self, ctx, period: float = 0.01):
        cpus = sorted(os.sched_getaffinity(0))
        self.stop, self.out = ctx.Event(), ctx.Queue()
        self._ready = [ctx.Event() for _ in cpus]
        self.processes = [
            ctx.Process(target=stall_watcher, args=(c, period, self.stop, self.out, r))
            for c, r in zip(cpus, self._ready)
        ]
        for p in self.processes:
            p.start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every watcher runs: spawned, each imports first, which a busy machine can make seconds."""
        deadline = time.monotonic() + timeout
        for r in self._ready:
            if not r.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"CPU stall watchers not running after {timeout:.0f} s")

    def finish(self) -> list[tuple[float, float]] | None:
        """Every CPU's stalls, in time order (None where the watchers could not run real-time)."""
        self.stop.set()
        per_cpu = [self.out.get(timeout=60)[1] for _ in self.processes]
        for p in self.processes:
            p.join(30)
        if any(gaps is None for gaps in per_cpu):
            return None
        return sorted(span for gaps in per_cpu for span in gaps)


def steal_seconds() -> float:
    """CPU time the host has taken from this VM's CPUs since boot (/proc/stat), 0 where not told."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def outside(starts: list[float], latencies: list[float], spans: list[tuple[float, float]]) -> list[float]:
    """The latencies (ms) of the probes that overlap none of ``spans`` (monotonic seconds)."""
    return [
        latency
        for t0, latency in zip(starts, latencies)
        if not any(a < t0 + latency / 1000 and t0 < b for a, b in spans)
    ]


def stream_gaps(port: int, body: str, started, stop, out) -> None:
    """A client process: one streamed chat (``body``), the gaps in ms between its SSE events until
    ``stop`` or the stream's end, then ("stream", gaps) on ``out``. ``started`` is set once the
    answer's head has come."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    gaps, last = [], None
    started.set()
    while not stop.is_set():
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter()
        if last is not None:
            gaps.append((now - last) * 1000)
        last = now
    conn.close()
    out.put(("stream", gaps))


# ---- process accounting (Linux /proc) ----------------------------------------------------------


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and every process below it: pid -> name (for ``tokenmill serve``: tm-gateway, tm-worker-N,
    tm-scheduler)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.append(child)
                frontier.append(child)
    names = {}
    for p in tree:
        try:
            with open(f"/proc/{p}/comm") as f:
                names[p] = f.read().strip()
        except OSError:
            pass
    return names


def process_role(name: str) -> str:
    """gateway, workers or scheduler, from a process name of a server's tree (:func:`process_tree`)."""
    if name.startswith("tm-worker"):
        return "workers"
    return "scheduler" if name == "tm-scheduler" else "gateway"


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process has spent (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def pss_kib(pid: int) -> int:
    """Proportional set size: a page shared by k processes counts 1/k in each."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---- options several scenarios take ------------------------------------------------------------


def add_common_options(parser) -> None:
    """--quick and --json: every scenario's."""
    parser.add_argument("--quick", action="store_true", help="A smaller run that finishes in under a minute.")
    parser.add_argument("--json", metavar="FILE", help="Also write the figures as JSON.")


def add_server_options(parser, modes: tuple[str, ...]) -> None:
    """--workers and --modes: the scenarios that start ``tokenmill serve`` in several conversion modes."""
    parser.add_argument("--workers", type=int, default=None, help="Tokenizer workers in pool mode (default: as serve).")
    parser.add_argument("--modes", default=",".join(modes), help=f"Comma-separated subset of {','.join(modes)}.")


def add_long_prompt_options(parser, requests: tuple[int, int], tokens: tuple[int, int]) -> None:
    """--requests, --tokens, --rounds, --passes: rounds of long chats sent together. ``requests`` and
    ``tokens``: (default, quick default), for the help."""
    parser.add_argument(
        "--requests",
        type=int,
        help=f"Long requests sent together per round (default {requests[0]}; quick {requests[1]}).",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        help=f"Approximate prompt tokens per long request (default {tokens[0]}; quick {tokens[1]}).",
    )
    parser.add_argument("--rounds", type=int, help="Rounds of long requests (default 2).")
    parser.add_argument(
        "--passes",
        type=int,
        default=2,
        help="Runs of the long-request load per mode, the order reversed each time (default 2).",
    )


def add_conversation_options(parser, defaults: str) -> None:
    """--conversations, --turns, --append-tokens: replayed agent conversations. ``defaults`` says what
    the scenario takes when they are not given, e.g. "16 x 30 turns, 2000-8000 tokens; quick 4 x 10, 1000-3000"."""
    group = parser.add_argument_group("conversations", f"Defaults: {defaults}.")
    group.add_argument("--conversations", type=int, help="Conversations replayed at once.")
    group.add_argument("--turns", type=int, help="Turns per conversation.")
    group.add_argument("--append-tokens", metavar="LO-HI", help="Tokens of tool output appended per turn.")


def vllm_venv_default() -> str:
    """The virtual environment with vLLM: $TOKENMILL_VLLM_VENV, else .venv-vllm in the checkout."""
    return os.environ.get("TOKENMILL_VLLM_VENV", str(Path(__file__).resolve().parents[2] / ".venv-vllm"))


def add_vllm_options(parser) -> None:
    """--vllm-venv and --vllm-model: the scenarios that run vLLM."""
    parser.add_argument(
        "--vllm-venv",
        default=vllm_venv_default(),
        help="The virtual environment with vLLM (default: .venv-vllm, built by ./scripts/test.sh).",
    )
    parser.add_argument(
        "--vllm-model", metavar="DIR", help="The model vLLM serves (default: a tiny random model made for the run)."
    )


def write_json(path: str | None, report: dict) -> None:
    """--json FILE: the report, indented."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2))
