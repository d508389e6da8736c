"""``tokenmill bench vllm``: vLLM's own OpenAI server against tokenmill in front of the same vLLM engine.

Both stacks serve one tiny random model (``tokenmill.tiny_model``, or ``--model DIR``) from the
vLLM environment that ``./scripts/test.sh`` builds, on the same machine, and each scenario runs
on one stack and then the other, ``--repeat`` times, with fresh text every run (a unique tag at
the start of every long message, so no cache of either side can serve it):

* **long context**: 4 chats of ~250k tokens after templating sent together to ``/tokenize``
  (with messages: both servers render and tokenize everything, and the engine has nothing to
  do), twice, while a prober in its own process GETs ``/health`` every 10 ms and an unrelated
  stream receives tokens from the engine;
* **agent replay**: conversations growing by a tool output per turn to ~60k tokens, each turn
  sent whole to ``/tokenize``: the conversion time of the late turns;
* **agent messages**: a Claude-Code-shaped conversation over Anthropic's ``/v1/messages/count_tokens``
  (a ~16k-token system prompt with tool schemas, growing by tool results to ~50k tokens) with a
  ``/health`` prober, then the front process's CPU per ``/v1/messages`` and per chat-completions
  request (``tokenmill.bench.agent_messages``);
* **short chats**: streamed ~50-token chats at concurrency 32 for 20 s, tokens counted from
  ``usage``: engine-bound on the CPU, so this shows what the front end costs the engine;
* **images** (``--images``, on its own, on a tiny Qwen2-VL): 8 chats with 4 new 1024 x 1024 images
  each, sent together, then resent one turn later, with a ``/health`` prober
  (``tokenmill.bench.images``);
* **busy stream**: the long-context rounds again (fresh text, to ``/tokenize``), while one streaming
  chat after another keeps exactly one alive through the engine (``--busy-chat-tokens`` each), so the
  engine decodes throughout unless the front stops starting streams. Reported beside /health: the
  gaps within each stream, the gaps across stream boundaries (a slow start of the next stream counts),
  the stream's tokens per second during the rounds and as a share of its rate just before, and every
  thread of each stack by role over the rounds (CPU, run-queue wait, switches:
  ``tokenmill.bench.threads``), and each target (:data:`BUSY_TARGETS`) met or missed, per run pair;
  ``--split-cores`` runs it (and every scenario) with each engine on cores of its own, as on a GPU
  node, instead of sharing every core with its front end;
* ``--pairing http``: one ``vllm serve --enable-scale-out`` for both sides, its own clients against
  tokenmill's in front of its token-in API (``tokenmill serve --engine-url``), so that what differs is
  the front alone, and tokenmill pays a hop; then what vLLM's API process spends taking in a 265k-token
  ``token_ids`` list (:func:`token_ids_parse`), which it still parses on its event loop;
* **busy engine**: the long-context rounds again (fresh text), while short streaming chats
  (``--busy-chat-tokens``, 64) start at a fixed rate (``--busy-rate``, 8/s) through the engine
  instead of one long stream: the engine decodes on the same cores and new requests keep
  arriving, as on a serving node (``tokenmill.bench.busy.measure_busy``).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tokenmill.bench.agent_messages import agent_messages, front_cpu
from tokenmill.bench.busy import add_busy_load_options, measure_busy
from tokenmill.bench.common import (
    add_common_options,
    add_vllm_options,
    all_at_once,
    corpus,
    free_port,
    health_prober,
    pct,
    process_tree,
    ratio,
    request,
    rnd,
    stream_gaps,
    try_get,
    write_json,
)
from tokenmill.bench.servers import ROOT, ProcessHandle
from tokenmill.bench.threads import table_of_dicts as thread_table

NAME = "bench"
#: how tokenmill reaches vLLM: its own engine process (tokenmill engine --backend vllm) beside vLLM's server,
#: or the token-in API of vLLM's server itself (--engine-url), one engine for both front ends
PAIRINGS = ("engine", "http")
MAX_MODEL_LEN = 131072  # the tiny model's positions: the agent scenario reaches ~100k tokens


def add_arguments(parser) -> None:
    add_common_options(parser)
    add_vllm_options(parser)
    parser.add_argument(
        "--repeat", type=int, help="Runs of each scenario on each stack, alternating (default 2; quick 1)."
    )
    parser.add_argument("--short-seconds", type=float, help="Length of the short-chat load (default 20; quick 8).")
    parser.add_argument(
        "--tokens", type=int, help="Approximate prompt tokens per long request (default 250000; quick 60000)."
    )
    parser.add_argument(
        "--scenarios",
        default="",
        help="Comma-separated subset of the scenarios to run (default all): " + ", ".join(FIGURES) + ".",
    )
    add_busy_load_options(parser)
    parser.add_argument(
        "--pairing",
        choices=PAIRINGS,
        default="engine",
        help="engine (default): vLLM's server, and tokenmill in front of its own vLLM engine process; http: one "
        "vllm serve --enable-scale-out, its clients against tokenmill's in front of its token-in API "
        "(--engine-url): the same engine behind both.",
    )
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="Give each stack's engine processes the CPUs vLLM bound its model worker to, and the front "
        "processes the others, as on a GPU node whose engine threads have cores of their own (default: "
        "everything shares every core).",
    )
    group = parser.add_argument_group(
        "images", "The image scenario, run on its own on a tiny Qwen2-VL: tokenmill.bench.images."
    )
    group.add_argument("--images", action="store_true", help="Run the image scenario instead of the others.")
    group.add_argument(
        "--vision-path",
        default=os.environ.get("TOKENMILL_VLLM_VISION", str(ROOT / ".venv-vllm-vision")),
        metavar="DIR",
        help="A torch + torchvision overlay (pip install --target) put first on PYTHONPATH for the processes "
        "that run vLLM: its Qwen2-VL needs torchvision (default $TOKENMILL_VLLM_VISION, else .venv-vllm-vision, "
        "which ./scripts/test.sh builds).",
    )
    group.add_argument(
        "--images-engine",
        choices=("vllm", "simulated"),
        default="vllm",
        help="What tokenmill serves from: tokenmill engine --backend vllm (default), or its simulated scheduler.",
    )
    group.add_argument(
        "--image-rounds", type=int, help="Rounds of 8 chats x 4 new images per run (default 3; quick 1)."
    )


# ---- the two stacks ----------------------------------------------------------------------------


class Stacks:
    """vLLM's API server, and tokenmill serve in front of tokenmill engine --backend vllm (or, with
    ``simulated``, in front of its own simulated scheduler; with ``pairing="http"``, in front of that same
    vLLM server's token-in API, ``--engine-url``, so that both front ends share one engine). ``vllm_env``:
    extra environment for the processes that run vLLM (the image scenario's torchvision overlay on
    PYTHONPATH)."""

    def __init__(
        self,
        vllm_python: str,
        model: str,
        workdir: str,
        *,
        max_model_len: int = MAX_MODEL_LEN,
        vllm_env: dict | None = None,
        simulated: bool = False,
        eager: bool = False,
        pairing: str = "engine",
    ):
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {PAIRINGS}")
        self.pairing = pairing
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
        self.procs: list[ProcessHandle] = []
        self.vllm_port, self.tokenmill_port = free_port(), free_port()
        engine = f"ipc://{workdir}/engine.sock"
        vllm_server = [
            vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            NAME,
            "--max-model-len",
            str(max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.vllm_port),
            *(["--enforce-eager"] if eager else []),
            *(["--enable-scale-out"] if pairing == "http" else []),
        ]
        engine_args = [
            vllm_python,
            "-m",
            "tokenmill.cli",
            "engine",
            "--backend",
            "vllm",
            "--model",
            model,
            "--max-model-len",
            str(max_model_len),
            "--bind",
            engine,
            *(["--engine-arg", "enforce_eager=true"] if eager else []),
        ]
        serve = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--model",
            model,
            *(
                ["--max-model-len", str(max_model_len)]
                if simulated
                else ["--engine-url", f"http://127.0.0.1:{self.vllm_port}"]
                if pairing == "http"
                else ["--scheduler", engine]
            ),
            "--served-model-name",
            NAME,
            "--port",
            str(self.tokenmill_port),
            "--log-level",
            "warning",
            "--max-queued-conversions",
            "100000",
        ]
        start = [("vllm", vllm_server, vllm_env), ("engine", engine_args, vllm_env), ("tokenmill", serve, None)]
        if simulated or pairing == "http":
            del start[1]
        for name, args, extra in start:
            self.procs.append(
                ProcessHandle(
                    name,
                    args,
                    log=Path(workdir) / f"{name}.log",
                    env={**env, **(extra or {})},
                    cwd=ROOT,
                    new_session=True,  # stop() ends the group: vLLM's engine-core children too
                )
            )
        self.front_pids = {"vllm": self.procs[0].pid, "tokenmill": self.procs[-1].pid}
        self.stack_pids = {"vllm": [self.procs[0].pid], "tokenmill": [p.pid for p in self.procs[1:]]}

    def split_cores(self) -> dict[str, list[int]]:
        """Each stack's engine (vLLM's engine core and model worker below its API server; tokenmill's
        engine bridge and everything below it) on the CPUs vLLM bound its model worker to, and the front
        ends (vLLM's API server process; tokenmill serve, its gateway and workers) on the others. Every
        thread is moved; threads started later inherit their creator's CPUs."""
        if len(self.procs) != 3:
            raise RuntimeError("--split-cores needs tokenmill in front of its own vLLM engine (--pairing engine)")
        api, bridge, serve = (p.pid for p in self.procs)
        engine = {pid: name for pid, name in process_tree(api).items() if pid != api} | process_tree(bridge)
        workers = [pid for pid, name in engine.items() if name.startswith("VLLM::Worker")]
        if not workers:
            raise RuntimeError("no vLLM model worker process to take the engine's CPUs from")
        engine_cpus = set().union(*(os.sched_getaffinity(pid) for pid in workers))
        front_cpus = set(os.sched_getaffinity(0)) - engine_cpus
        if not front_cpus:
            raise RuntimeError(
                f"vLLM's model workers are bound to every CPU ({sorted(engine_cpus)}): none left to split"
            )
        for pids, cpus in ((engine, engine_cpus), ([api, *process_tree(serve)], front_cpus)):
            for pid in pids:
                for tid in _tasks(pid):
                    try:
                        os.sched_setaffinity(tid, cpus)
                    except OSError:  # gone meanwhile
                        pass
        return {"engine": sorted(engine_cpus), "front": sorted(front_cpus)}

    def ready(self) -> bool:
        for proc in self.procs:
            proc.check_alive()
        return try_get(self.vllm_port, "/health", 5)[0] == 200 and try_get(self.tokenmill_port, "/ready", 5)[0] == 200

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return
            time.sleep(1)
        raise RuntimeError("the servers did not become ready in time")

    def close(self) -> None:
        for proc in self.procs:
            if proc.proc.poll() is None:
                proc.proc.terminate()  # all at once: each shuts down while the others do
        for proc in self.procs:
            proc.stop(30, leftovers=True)


def _tasks(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


# ---- client processes ----------------------------------------------------------------------------


def stream_body() -> str:
    """An unrelated stream: the engine's tokens, one SSE event each, for as long as the model allows."""
    return json.dumps(
        {
            "model": NAME,
            "messages": [{"role": "user", "content": "Stream to me."}],
            "stream": True,
            "max_tokens": MAX_MODEL_LEN - 100,
            "ignore_eos": True,
            "temperature": 0,
        }
    )


class Texts:
    """Fresh text for every request of the run: consecutive slices of Python's standard library
    (31M characters), so that no tokenization cache has seen a request's text before."""

    def __init__(self) -> None:
        self.text = corpus(32_000_000)
        self.at = 0

    def take(self, chars: int) -> str:
        if self.at + chars > len(self.text):
            self.at = 0  # a run longer than the corpus: the unique tags still keep whole messages apart
        self.at += chars
        return self.text[self.at - chars : self.at]


def long_bodies(texts: Texts, tag: str, count: int, tokens: int) -> list[bytes]:
    chars = int(tokens * 4.1)  # ~4.1 characters per token for Python source with this tokenizer
    return [
        json.dumps(
            {
                "model": NAME,
                "messages": [
                    {"role": "system", "content": "You are a coding agent. Review the repository below."},
                    {"role": "user", "content": f"[{tag} {i}]\n" + texts.take(chars)},
                ],
            }
        ).encode()
        for i in range(count)
    ]


def _send_rounds(port: int, rounds: list[list[bytes]], out) -> None:
    walls, tokens, errors = [], [], []

    def one(body: bytes) -> None:
        status, data = request(port, "POST", "/tokenize", body, timeout=600)
        if status == 200:
            tokens.append(json.loads(data)["count"])
        else:
            errors.append(f"{status}: {data[:200]!r}")

    began = time.perf_counter()
    for bodies in rounds:
        walls.append(all_at_once(one, bodies))
    out.put(("long", {"walls": walls, "tokens": tokens, "errors": errors, "window": (began, time.perf_counter())}))


def long_context(port: int, bodies: list[list[bytes]]) -> dict:
    """``bodies``: rounds of long /tokenize requests, each round sent together."""
    ctx = mp.get_context("spawn")
    out, stop, started = ctx.Queue(), ctx.Event(), ctx.Event()
    stream = ctx.Process(target=stream_gaps, args=(port, stream_body(), started, stop, out))
    stream.start()
    started.wait(60)
    prober = ctx.Process(target=health_prober, args=(port, stop, out))
    prober.start()
    time.sleep(1.0)
    sender = ctx.Process(target=_send_rounds, args=(port, bodies, out))
    sender.start()
    got = dict([out.get(timeout=3600)])
    stop.set()
    got.update([out.get(timeout=120), out.get(timeout=120)])
    for p in (stream, prober, sender):
        p.join(30)
    health, gaps, long = got["health"], got["stream"], got["long"]
    return {
        "health_p50_ms": rnd(pct(health, 0.5), 2),
        "health_p99_ms": rnd(pct(health, 0.99), 2),
        "health_max_ms": rnd(max(health, default=None), 2),
        "stream_gap_p50_ms": rnd(pct(gaps, 0.5)),
        "stream_gap_p99_ms": rnd(pct(gaps, 0.99)),
        "stream_gap_max_ms": rnd(max(gaps, default=None)),
        "conversion_wall_s": round(statistics.mean(long["walls"]), 3),
        "mean_prompt_tokens": round(statistics.mean(long["tokens"])) if long["tokens"] else 0,
        "errors": long["errors"][:3],
    }


def agent_pieces(texts: Texts, conversations: int, turns: int, turn_tokens: int) -> list[list[str]]:
    """The tool outputs, per turn and conversation."""
    return [[texts.take(int(turn_tokens * 4.1)) for _ in range(conversations)] for _ in range(turns)]


def agent_replay(port: int, tag: str, pieces: list[list[str]]) -> dict:
    """Conversations that grow by a tool output per turn, each turn sent whole to /tokenize."""
    turns, conversations = len(pieces), len(pieces[0])
    histories = [
        [
            {"role": "system", "content": f"[{tag} agent {c}] You are a coding agent with tools."},
            {"role": "user", "content": "Read the repository and fix the failing test."},
        ]
        for c in range(conversations)
    ]
    times: list[list[float]] = [[] for _ in range(turns)]
    tokens, errors = [], []
    for turn in range(turns):
        for c, history in enumerate(histories):
            piece = pieces[turn][c]
            history += [{"role": "assistant", "content": f"Reading part {turn}."}, {"role": "user", "content": piece}]
            t0 = time.perf_counter()
            status, data = request(
                port, "POST", "/tokenize", json.dumps({"model": NAME, "messages": history}).encode(), timeout=600
            )
            times[turn].append((time.perf_counter() - t0) * 1000)
            if status == 200:
                tokens.append(json.loads(data)["count"])
            else:
                errors.append(f"{status}: {data[:200]!r}")
    late = [t for turn_times in times[-3:] for t in turn_times]
    return {
        "late_turn_p50_ms": rnd(pct(late, 0.5), 2),
        "late_turn_max_ms": rnd(max(late, default=None), 2),
        "first_turn_p50_ms": rnd(pct(times[0], 0.5), 2),
        "final_prompt_tokens": max(tokens, default=0),
        "errors": errors[:3],
    }


def _short_chats(port: int, concurrency: int, seconds: float, out) -> None:
    body = json.dumps(
        {
            "model": NAME,
            "max_tokens": 32,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {
                    "role": "user",
                    "content": "Summarize the plot of a short story about a lighthouse keeper "
                    "and a storm, in one sentence, please, for a child.",
                }
            ],
        }
    ).encode()
    ttft, e2e, output_tokens, errors = [], [], [], []
    end = time.perf_counter() + seconds

    def loop() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            first = None
            try:
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status != 200:
                    errors.append(resp.status)
                    resp.read()
                    continue
                for line in resp:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        output_tokens.append(chunk["usage"]["completion_tokens"])
            except (OSError, http.client.HTTPException, ValueError) as exc:
                errors.append(repr(exc))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                continue
            done = time.perf_counter()
            ttft.append(((first or done) - t0) * 1000)
            e2e.append((done - t0) * 1000)
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(
        (
            "short",
            {
                "elapsed": time.perf_counter() - t0,
                "ttft": ttft,
                "e2e": e2e,
                "tokens": output_tokens,
                "errors": errors[:3],
            },
        )
    )


def short_chats(port: int, concurrency: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_short_chats, args=(port, concurrency, seconds, out))
    p.start()
    _, res = out.get(timeout=seconds + 600)
    p.join(30)
    elapsed = res["elapsed"]
    return {
        "requests_per_s": round(len(res["e2e"]) / elapsed, 2),
        "output_tokens_per_s": round(sum(res["tokens"]) / elapsed, 1),
        "ttft_p50_ms": rnd(pct(res["ttft"], 0.5)),
        "ttft_p99_ms": rnd(pct(res["ttft"], 0.99)),
        "e2e_p50_ms": rnd(pct(res["e2e"], 0.5)),
        "e2e_p99_ms": rnd(pct(res["e2e"], 0.99)),
        "errors": res["errors"],
    }


# ---- the run ----------------------------------------------------------------------------------------

# figure -> True when lower is better (the ratio tokenmill / vLLM below 1 is then tokenmill's win)
FIGURES = {
    "long_context": [
        "health_p50_ms",
        "health_p99_ms",
        "health_max_ms",
        "stream_gap_p50_ms",
        "stream_gap_p99_ms",
        "stream_gap_max_ms",
        "conversion_wall_s",
        "mean_prompt_tokens",
    ],
    "agent_replay": ["first_turn_p50_ms", "late_turn_p50_ms", "late_turn_max_ms", "final_prompt_tokens"],
    "agent_messages": [
        "first_turn_ms",
        "late_turn_p50_ms",
        "late_turn_max_ms",
        "health_p50_ms",
        "health_p99_ms",
        "health_probes",
        "loop_lag_p99_ms",
        "front_cpu_ms_per_s",
        "front_runq_wait_ms_per_s",
        "prober_runq_wait_ms_per_s",
        "final_prompt_tokens",
    ],
    "front_cpu": ["messages_cpu_ms_per_request", "chat_cpu_ms_per_request"],
    "short_chats": ["requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"],
    "busy_stream": [
        "health_p50_ms",
        "health_p99_ms",
        "health_max_ms",
        "conversion_wall_s",
        "stream_gap_p99_ms",
        "kept_alive_gap_p99_ms",
        "kept_alive_gap_max_ms",
        "stream_tokens_per_s",
        "stream_tokens_share",
    ],
    "busy_engine": [
        "health_p50_ms",
        "health_p99_ms",
        "health_max_ms",
        "conversion_wall_s",
        "chat_ttft_p50_ms",
        "chat_ttft_p99_ms",
        "chat_e2e_p99_ms",
        "chats",
    ],
}


# What tokenmill must show against vLLM's own server beside an engine kept decoding by one stream:
# (figure, the largest ratio tokenmill / vLLM that meets it). Each is judged on the medians and on
# every alternating pair of runs, so that the spread is in the report and not only in the table.
BUSY_TARGETS = (
    ("conversion_wall_s", 1.0),  # a round converts no slower
    ("stream_gap_p99_ms", 1.0),  # the unrelated stream's gaps no worse
    ("health_p99_ms", 0.25),  # /health at least 4x faster
    ("health_max_ms", 0.25),
)


def token_ids_parse(port: int, tokens: int, tries: int = 3) -> dict:
    """What vLLM's API process spends taking in one token-in request of ``tokens`` IDs on its event loop:
    the time to its 400 for a request that is refused only once its body is parsed and validated (a
    negative temperature), so no engine work is in it. Median and max of ``tries``, in milliseconds."""
    body = json.dumps(
        {"token_ids": [1000 + i % 100_000 for i in range(tokens)], "sampling_params": {"temperature": -1}}
    ).encode()
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        status, answer = request(port, "POST", "/inference/v1/generate", body, timeout=120)
        times.append((time.perf_counter() - t0) * 1000)
        if status != 400:
            raise RuntimeError(f"expected vLLM to refuse the probe (400), got {status}: {answer[:300]!r}")
    return {
        "tokens": tokens,
        "body_mb": round(len(body) / 1e6, 2),
        "p50_ms": rnd(statistics.median(times)),
        "max_ms": rnd(max(times)),
    }


def busy_targets(report: dict, scenario: str = "busy_stream") -> list[dict]:
    """Each of BUSY_TARGETS: the medians' ratio, whether it is met, and in how many run pairs."""
    out = []
    runs = report["runs"]
    pairs = list(zip(runs["vllm"].get(scenario) or [], runs["tokenmill"].get(scenario) or []))
    for figure, limit in BUSY_TARGETS:
        r = _ratio(report["tokenmill"][scenario].get(figure), report["vllm"][scenario].get(figure))
        pair_ratios = [_ratio(ours.get(figure), theirs.get(figure)) for theirs, ours in pairs]
        out.append(
            {
                "figure": figure,
                "limit": limit,
                "ratio": r,
                "met": r is not None and r <= limit,
                "pairs_met": sum(1 for x in pair_ratios if x is not None and x <= limit),
                "pairs": len(pair_ratios),
            }
        )
    return out


def _median_runs(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        out[key] = round(statistics.median(values), 3) if values else runs[0][key]
    return out


def run(args) -> int:
    venv = Path(args.vllm_venv)
    python = venv / "bin" / "python"
    if not python.exists():
        print(
            f"tokenmill bench vllm: no vLLM environment at {venv} (./scripts/test.sh builds it on x86_64 Linux)",
            file=sys.stderr,
        )
        return 2
    if args.images:
        return run_images(args, python)
    quick = args.quick
    repeat = args.repeat or (1 if quick else 2)
    seconds = args.short_seconds or (8.0 if quick else 20.0)
    long_tokens = args.tokens or (60_000 if quick else 250_000)
    chosen = [s for s in args.scenarios.split(",") if s] or list(FIGURES)
    unknown = sorted(set(chosen) - set(FIGURES))
    if unknown:
        print(f"tokenmill bench vllm: unknown scenario(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="tokenmill-bench-vllm-")
    stacks = None
    started = time.monotonic()
    try:
        model = args.vllm_model
        if model is None:
            model = os.path.join(workdir, "tiny-model")
            subprocess.run(
                [str(python), "-m", "tokenmill.tiny_model", model], cwd=ROOT, check=True, stdout=subprocess.DEVNULL
            )
        stacks = Stacks(str(python), model, workdir, pairing=args.pairing)
        stacks.wait_ready()
        print(f"both stacks ready after {time.monotonic() - started:.0f} s", flush=True)
        split = stacks.split_cores() if args.split_cores else None
        if split:
            print(f"engines on CPUs {split['engine']}, front ends on CPUs {split['front']}", flush=True)
        ports = {"vllm": stacks.vllm_port, "tokenmill": stacks.tokenmill_port}
        pid_of = {port: stacks.front_pids[side] for side, port in ports.items()}  # the front processes
        roots_of = {ports[side]: pids for side, pids in stacks.stack_pids.items()}  # each side's whole stack
        texts = Texts()
        results: dict[str, dict[str, list]] = {side: {s: [] for s in chosen} for side in ports}
        for k in range(repeat):
            # the same fresh text for both stacks within a run; each stack sees every text once
            tag = f"run {k} {time.time_ns()}"
            work = {}
            if "long_context" in chosen:
                rounds = [long_bodies(texts, f"{tag} round {r}", 4, long_tokens) for r in range(2)]
                work["long_context"] = lambda port, rounds=rounds: long_context(port, rounds)
            if "agent_replay" in chosen:
                pieces = agent_pieces(texts, 3, 6 if quick else 12, 5000)
                work["agent_replay"] = lambda port, pieces=pieces, tag=tag: agent_replay(port, tag, pieces)
            if "agent_messages" in chosen:
                # Claude-Code-shaped: a ~16k-token system prompt with tools, growing by ~3k-token tool results to
                # ~100k tokens, as the agent (this text runs 2.2-3.7 characters per token, ~3.7 in most
                # runs: 60k + 26 x 12k characters; the tiny model has 131,072 positions); quick: to ~50k
                system = texts.take(60_000)
                turns = 10 if quick else 26
                results_ = [[texts.take(12_000) for _ in range(turns)] for _ in range(2)]  # two conversations
                work["agent_messages"] = lambda port, a=system, b=results_, tag=tag: agent_messages(
                    port, pid_of[port], NAME, tag, a, b
                )
            if "front_cpu" in chosen:
                work["front_cpu"] = lambda port: front_cpu(port, pid_of[port], NAME, 100 if quick else 300)
            if "short_chats" in chosen:
                work["short_chats"] = lambda port: short_chats(port, 32, seconds)
            if "busy_stream" in chosen:
                kept = [long_bodies(texts, f"{tag} kept round {r}", 4, long_tokens) for r in range(2)]
                work["busy_stream"] = lambda port, kept=kept: measure_busy(
                    port, NAME, _send_rounds, kept, 0, args.busy_chat_tokens, kept_alive=True, roots=roots_of[port]
                )
            if "busy_engine" in chosen:
                busy = [long_bodies(texts, f"{tag} busy round {r}", 4, long_tokens) for r in range(2)]
                work["busy_engine"] = lambda port, busy=busy: measure_busy(
                    port, NAME, _send_rounds, busy, args.busy_rate, args.busy_chat_tokens, roots=roots_of[port]
                )
            for side, port in ports.items():
                for scenario in chosen:
                    results[side][scenario].append(work[scenario](port))
                print(f"  run {k + 1}/{repeat} on {side} done", flush=True)
        report = {side: {s: _median_runs(runs) for s, runs in per.items()} for side, per in results.items()}
        report["runs"] = results
        report["ratios"] = {
            s: {f: _ratio(report["tokenmill"][s].get(f), report["vllm"][s].get(f)) for f in figs}
            for s, figs in FIGURES.items()
            if s in chosen
        }
        if "busy_stream" in chosen:
            report["busy_stream_targets"] = busy_targets(report)
        report["versions"] = _versions(python)
        report["split_cores"] = split
        report["pairing"] = args.pairing
        if args.pairing == "http":
            report["vllm_token_ids_parse"] = parse = token_ids_parse(stacks.vllm_port, 265_000)
            print(
                f"vLLM's API process takes in {parse['tokens']:,} token IDs ({parse['body_mb']} MB of JSON) in "
                f"{parse['p50_ms']} ms (median, max {parse['max_ms']} ms), on its event loop",
                flush=True,
            )
        print_table(report, repeat)
        write_json(args.json, report)
        return 0
    finally:
        if stacks is not None:
            stacks.close()
        shutil.rmtree(workdir, ignore_errors=True)


def run_images(args, python: Path) -> int:
    """The image scenario alone, on both stacks (tokenmill.bench.images)."""
    from tokenmill.bench import images as img

    repeat = args.repeat or (1 if args.quick else 2)
    rounds = args.image_rounds or (1 if args.quick else 3)
    vllm_env = {"PYTHONPATH": args.vision_path} if args.vision_path else None
    workdir = tempfile.mkdtemp(prefix="tokenmill-bench-images-")
    stacks = None
    started = time.monotonic()
    try:
        model = args.vllm_model
        if model is None:
            model = os.path.join(workdir, "Tiny-Qwen2-VL")
            maker = [str(python), str(ROOT / "tests" / "image_model.py"), model]
            subprocess.run(maker, cwd=ROOT, check=True, env={**os.environ, **(vllm_env or {})})
        # every run's images made before the servers start (a PNG takes ~0.7 s to encode): the same for both sides
        count = img.CHATS * img.IMAGES_PER_CHAT
        work = [
            [
                img.chat_bodies(NAME, f"run {k} round {r} {time.time_ns()}", img.photo_images(count, k * 1000 + r))
                for r in range(rounds)
            ]
            for k in range(repeat)
        ]
        simulated = args.images_engine == "simulated"
        # eager on both sides: torch.compile's start-up on two shared cores is minutes, and the same for both
        stacks = Stacks(
            str(python), model, workdir, max_model_len=32768, vllm_env=vllm_env, simulated=simulated, eager=True
        )
        stacks.wait_ready()
        print(f"both stacks ready after {time.monotonic() - started:.0f} s", flush=True)
        split = stacks.split_cores() if args.split_cores else None
        if split:
            print(f"engines on CPUs {split['engine']}, front ends on CPUs {split['front']}", flush=True)
        ports = {"vllm": stacks.vllm_port, "tokenmill": stacks.tokenmill_port}
        for port in ports.values():
            img.warm_up(port, NAME)
        results: dict[str, list] = {side: [] for side in ports}
        for k in range(repeat):
            for side in list(ports)[:: 1 if k % 2 == 0 else -1]:  # the order alternates between runs
                results[side].append(img.image_chats(ports[side], side, stacks.front_pids[side], work[k]))
                print(f"  run {k + 1}/{repeat} on {side} done", flush=True)
        report = {side: {"images": _median_runs(runs)} for side, runs in results.items()}
        report["runs"] = {side: {"images": runs} for side, runs in results.items()}
        report["ratios"] = {
            "images": {
                f: _ratio(report["tokenmill"]["images"].get(f), report["vllm"]["images"].get(f)) for f in img.FIGURES
            }
        }
        report["engine"] = "simulated scheduler" if simulated else "tokenmill engine --backend vllm"
        report["versions"] = _versions(python, vllm_env)
        print_table(report, repeat, {"images": img.FIGURES})
        print(f"tokenmill's side served by: {report['engine']}")
        write_json(args.json, report)
        return 0
    finally:
        if stacks is not None:
            stacks.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _ratio(ours, theirs) -> float | None:
    r = ratio(ours, theirs)
    return None if r is None else round(r, 3)


def _versions(python: Path, env: dict | None = None) -> dict:
    from importlib.metadata import version

    probe = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    found = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, env={**os.environ, **(env or {})}
    ).stdout.split()
    return {
        "tokenmill": version("tokenmill"),
        "vllm": found[0] if found else None,
        "torch": found[1] if len(found) > 1 else None,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
    }


def _spread(runs: list[dict], figure: str) -> str:
    """The range over the runs: the noise this machine shows."""
    values = [r[figure] for r in runs if isinstance(r.get(figure), (int, float))]
    return f"{min(values):g}-{max(values):g}" if len(values) > 1 else ""


def print_table(report: dict, repeat: int, figures: dict | None = None) -> None:
    v = report["versions"]
    print(
        f"\ntokenmill bench vllm: vLLM {v['vllm']}'s own server vs tokenmill in front of the same engine "
        f"({v['cores']} cores; medians of {repeat} alternating run(s) each; ratio = tokenmill / vLLM)"
    )
    if report.get("split_cores"):
        split = report["split_cores"]
        print(f"engines on CPUs {split['engine']}, front ends on CPUs {split['front']} (--split-cores)")
    print(
        f"{'scenario':>13} {'figure':>20} {'vLLM':>10} {'tokenmill':>10} {'ratio':>8}   {'vLLM runs':>17} {'tokenmill runs':>17}"
    )
    for scenario, names in (figures or FIGURES).items():
        if scenario not in report["ratios"]:
            continue
        for figure in names:
            a, b = report["vllm"][scenario].get(figure), report["tokenmill"][scenario].get(figure)
            r = report["ratios"][scenario][figure]
            spread = [_spread(report["runs"][side][scenario], figure) for side in ("vllm", "tokenmill")]
            print(
                f"{scenario:>13} {figure:>20} {a!s:>10} {b!s:>10} {'' if r is None else f'{r:.2f}x':>8}"
                f"   {spread[0]:>17} {spread[1]:>17}"
            )
    if report.get("busy_stream_targets"):
        print("\nbusy_stream targets (ratio = tokenmill / vLLM; met on the medians, and in how many run pairs):")
        for t in report["busy_stream_targets"]:
            ratio_text = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
            print(
                f"  {t['figure']:>20} <= {t['limit']:g}x: {ratio_text:>7} {'met' if t['met'] else 'MISSED':>6}"
                f"  ({t['pairs_met']} of {t['pairs']} pairs)"
            )
    for scenario in ("busy_stream", "busy_engine"):
        for side in ("vllm", "tokenmill"):
            last = (report["runs"][side].get(scenario) or [{}])[-1]
            if last.get("threads"):
                print(f"\n{scenario}, {side}: every thread of the stack over the long rounds (last run), by role")
                print(thread_table(last["threads"], last["threads_s"]))
    for side in ("vllm", "tokenmill"):
        errors = [e for s in report["ratios"] for e in report[side][s].get("errors") or []]
        if errors:
            print(f"{side} errors: {errors[:5]}")
