"""``tokenmill bench dp``: which scheduler rank a conversation's turns go to, and what the engines' prefix caches make of it.

Two engine ranks behind one ``tokenmill serve --scheduler EP1 --scheduler EP2`` (gateway/scheduler_ranks.py),
and agent-like conversations replayed against it once per ``--dp-policy`` (affinity, round_robin,
least_loaded) in one run. Each conversation starts with its own tagged system prompt (no prefix is shared
between conversations, nor between the policies' runs, so only a rank that served the conversation's
earlier turns can have its history cached); each turn appends a tool output of a few hundred to a few
thousand tokens and resends the whole history, streamed, and the assistant's reply is appended as a fixed
note (the same transcript for every policy). Several conversations run interleaved, ``--concurrency``
requests in flight at once.

Figures, per policy:

* ``cached_share``: prompt tokens the engines served from their prefix caches (``usage.prompt_tokens_details
  .cached_tokens``) over all prompt tokens;
* ``late_ttft_p50_ms`` (and p99): time to the first content token of the turns from the fourth on, where the
  history is long enough that recomputing it shows;
* ``missed_turns``: turns (after the first) that got fewer cached tokens than the ideal below: the
  conversation did not find its history where it went.

``ideal_cached_share`` comes from the conversations themselves: every turn finds its previous turn's prompt
cached, as much of it as the engine can hold, in whole cache blocks (the longest common prefix of the two
prompts' token IDs, from ``/tokenize``, rounded down to the engine's block size: 16 tokens for the simulated
scheduler's model of a prefix cache, 128 for vLLM on the CPU, which also always computes the prompt's last
token).

Engines (``--engine``): ``vllm`` (the default where the vLLM environment is usable: x86_64 Linux with
``.venv-vllm``) starts two ``tokenmill engine --backend vllm`` on a tiny random model with prefix caching on,
each with its OMP threads bound to its own core where there are two; ``sim`` two simulated schedulers with
``--prefix-cache-tokens`` large enough to hold every run and a prefill speed that makes recomputation visible.
The engines are started once and serve all the policies' runs; ``tokenmill serve`` is started afresh per
policy. Everything started is stopped at the end, on errors and Ctrl-C too.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.common import (
    add_common_options,
    add_conversation_options,
    add_vllm_options,
    corpus,
    free_port,
    pct,
    ratio_text,
    request,
    vllm_venv_default,
    write_json,
)
from tokenmill.bench.servers import ROOT, ProcessHandle
from tokenmill.process.procutil import die_with_parent

POLICIES = ("affinity", "round_robin", "least_loaded")
LATE_FROM = 3  # turns counted as late: from the fourth on
SIM_BLOCK = 16  # tokenmill.engines.simulated.PrefixCache.BLOCK
VLLM_BLOCK = 128  # vLLM's default block size on the CPU (set explicitly below)
SIM_PREFILL_TOKENS_PER_S = 20_000
SIM_ITL_MS = 10
VLLM_NAME = "tiny-dp"
VLLM_MAX_MODEL_LEN = 16384


def add_arguments(parser) -> None:
    add_common_options(parser)
    parser.add_argument(
        "--engine",
        choices=("vllm", "sim"),
        default=None,
        help="Two real vLLM engines (default where .venv-vllm is usable) or two simulated schedulers.",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="The --dp-policy values compared, in order.")
    parser.add_argument("--concurrency", type=int, help="Requests in flight at once (default 3; 4 for a full sim run).")
    add_conversation_options(
        parser,
        "sim: 9 conversations x 16 turns, 1500-3000 tokens appended per turn, quick 5 x 8, "
        "800-1600; vllm: 7 x 12, 400-800, quick 5 x 8, 150-300",
    )
    add_vllm_options(parser)


# ---- the conversations' load -----------------------------------------------------------------


@dataclass
class ConversationLoad:
    """The agent conversations replayed: how many, their turns, the tokens each turn appends, how many at once."""

    conversations: int
    turns: int
    min_tokens: int
    max_tokens: int
    concurrency: int
    output_tokens: int


def conversation_load(args, engine: str) -> ConversationLoad:
    quick = args.quick
    if engine == "sim":
        conv, turns, lo, hi, conc = (5, 8, 800, 1600, 3) if quick else (9, 16, 1500, 3000, 4)
    else:  # the tiny model's prefill on 2 cores: keep prompts to a few thousand tokens
        conv, turns, lo, hi, conc = (5, 8, 150, 300, 3) if quick else (7, 12, 400, 800, 3)
    if args.append_tokens:
        lo, hi = (int(x) for x in args.append_tokens.split("-"))
    return ConversationLoad(args.conversations or conv, args.turns or turns, lo, hi, args.concurrency or conc, 8)


def transcripts(w: ConversationLoad) -> list[list[tuple[str, str]]]:
    """Per conversation, per turn: (the tool output the user turn carries, the assistant's note after it).
    Consecutive slices of Python's standard library: every tool output is different text."""
    text = corpus(w.conversations * w.turns * w.max_tokens * 4 + 100_000)
    out, pos = [], 0
    for c in range(w.conversations):
        turns = []
        for t in range(w.turns):
            tokens = w.min_tokens + ((c * 7919 + t * 104729) % (w.max_tokens - w.min_tokens + 1))
            chunk = text[pos : pos + tokens * 4]
            pos += tokens * 4
            turns.append(
                (
                    f"Tool output (step {t + 1}):\n{chunk}",
                    f"Step {t + 1} done: I read the output above and will look at the next file now.",
                )
            )
        out.append(turns)
    return out


def system_prompt(run: int, conversation: int) -> str:
    # the tag comes first, so the first cache block differs: no prefix is shared between conversations or runs
    return (
        f"[dp run {run} conversation {conversation:02d}] You are a coding agent working through a repository, "
        "one tool call at a time."
    )


def history(run: int, c: int, transcript: list[tuple[str, str]], turn: int) -> list[dict]:
    """The messages sent at ``turn``: the whole conversation so far and the turn's tool output."""
    msgs = [
        {"role": "system", "content": system_prompt(run, c)},
        {"role": "user", "content": "Read the repository and fix the failing test."},
    ]
    for t in range(turn):
        msgs += [{"role": "user", "content": transcript[t][0]}, {"role": "assistant", "content": transcript[t][1]}]
    msgs.append({"role": "user", "content": transcript[turn][0]})
    return msgs


def ideal_cached(prompts: list[list[int]], block: int, keep_last: bool) -> list[int]:
    """Per turn: the previous turn's prompt shared with this one, in whole blocks (the first turn: 0).
    ``keep_last``: the engine computes the prompt's last token even when all of it is cached (vLLM)."""
    out = [0]
    for prev, cur in zip(prompts, prompts[1:]):
        n = 0
        for a, b in zip(prev, cur):
            if a != b:
                break
            n += 1
        if keep_last:
            n = min(n, len(cur) - 1)
        out.append(n // block * block)
    return out


# ---- processes -------------------------------------------------------------------------------


def _die_with_the_bench() -> None:
    """In the child, before exec: SIGTERM when the bench dies, even by kill -9 (vLLM stops its own
    processes on SIGTERM; tokenmill engine takes them along on a harder death)."""
    die_with_parent(sig=signal.SIGTERM)


class Proc(ProcessHandle):
    """A subprocess in its own process group, logging to a file, SIGTERMed if the bench dies; stop()
    ends the whole group (vLLM's engine core, an orphaned worker)."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict | None = None) -> None:
        super().__init__(name, args, log=log, env=env or {}, cwd=ROOT, new_session=True, preexec_fn=_die_with_the_bench)

    def stop(self, timeout: float = 60.0) -> int | None:
        return super().stop(timeout, leftovers=True)


class Ranks:
    """The two engines, started together."""

    def __init__(self, engine: str, workdir: Path, vllm_python: Path | None, model: str | None) -> None:
        self.engine, self.model = engine, model
        self.endpoints = [f"ipc://{workdir}/rank{i}.sock" for i in range(2)]
        self.procs: list[Proc] = []
        cores = os.cpu_count() or 1
        for i, endpoint in enumerate(self.endpoints):
            log = workdir / f"rank{i}.log"
            if engine == "sim":
                args = [
                    sys.executable,
                    "-m",
                    "tokenmill.cli",
                    "simulate-scheduler",
                    "--bind",
                    endpoint,
                    "--model",
                    "default",
                    "--prefix-cache-tokens",
                    "20000000",
                    "--prefill-tokens-per-s",
                    str(SIM_PREFILL_TOKENS_PER_S),
                    "--inter-token-latency-ms",
                    str(SIM_ITL_MS),
                    "--stats-interval-s",
                    "0.2",
                ]
                env = None
            else:
                args = [
                    str(vllm_python),
                    "-m",
                    "tokenmill.cli",
                    "engine",
                    "--backend",
                    "vllm",
                    "--model",
                    model,
                    "--max-model-len",
                    str(VLLM_MAX_MODEL_LEN),
                    "--bind",
                    endpoint,
                    "--stats-interval-s",
                    "0.2",
                    "--engine-arg",
                    "enable_prefix_caching=true",
                    "--engine-arg",
                    f"block_size={VLLM_BLOCK}",
                    "--engine-arg",
                    "enforce_eager=true",
                ]
                env = {
                    "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1",
                    "PYTHONUNBUFFERED": "1",
                }
                if cores >= 2 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cores)  # one core per rank, as one GPU each
            self.procs.append(Proc(f"rank {i} ({engine})", args, log, env))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.procs)
        while pending:
            for p in pending:
                p.check_alive()
            pending = [p for p in pending if "listening on" not in p.output()]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{pending[0].name} not ready after {timeout:.0f} s:\n{pending[0].tail()}")
            time.sleep(0.3)

    def check_alive(self) -> None:
        for p in self.procs:
            p.check_alive()

    def stop(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)  # together: both shut down at once
        for p in self.procs:
            p.stop()


class Front:
    """``tokenmill serve`` in front of both ranks with one --dp-policy."""

    def __init__(self, ranks: Ranks, policy: str, workdir: Path) -> None:
        self.port = free_port()
        args = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--port",
            str(self.port),
            "--dp-policy",
            policy,
            "--log-level",
            "warning",
        ]
        for endpoint in ranks.endpoints:
            args += ["--scheduler", endpoint]
        if ranks.model:
            args += [
                "--model",
                ranks.model,
                "--served-model-name",
                VLLM_NAME,
                "--max-model-len",
                str(VLLM_MAX_MODEL_LEN),
            ]
        self.proc = Proc(f"tokenmill serve ({policy})", args, workdir / f"serve-{policy}.log")
        self.model = VLLM_NAME if ranks.model else None

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            status, data = request(self.port, "GET", "/ready", timeout=2)
            if status != 200 or json.loads(data).get("missing_ranks"):
                return False
            if self.model is None:
                self.model = json.loads(request(self.port, "GET", "/v1/models")[1])["data"][0]["id"]
            return True

        self.proc.wait_until(ready, timeout)

    def rank_counters(self) -> dict[str, list[float]]:
        """tokenmill_rank_*_total per rank, from /metrics."""
        _, data = request(self.port, "GET", "/metrics")
        out: dict[str, list[float]] = {}
        for line in data.decode().splitlines():
            for name in ("requests", "prompt_tokens", "cached_prompt_tokens"):
                prefix = f"tokenmill_rank_{name}_total{{"
                if line.startswith(prefix):
                    labels, value = line[len(prefix) :].rsplit("} ", 1)
                    rank = int(labels.split('rank="', 1)[1].split('"', 1)[0])
                    row = out.setdefault(name, [0.0, 0.0])
                    if rank < len(row):
                        row[rank] = float(value)
        return out


# ---- one policy's replay ------------------------------------------------------------------------


def _turn(port: int, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    first, usage = None, None
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"{resp.status}: {resp.read()[:300]!r}"}
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(
                c.get("delta", {}).get("content") or c.get("finish_reason") for c in chunk.get("choices", ())
            ):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return {"error": repr(exc)}
    finally:
        conn.close()
    done = time.perf_counter()
    if usage is None:
        return {"error": "no usage in the stream"}
    return {
        "ttft_ms": ((first or done) - t0) * 1000,
        "e2e_ms": (done - t0) * 1000,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def replay(front: Front, run: int, scripts: list, w: ConversationLoad) -> tuple[list[list[dict]], float]:
    """Every conversation in its own thread, turn after turn; at most w.concurrency requests in flight."""
    results: list[list[dict]] = [[] for _ in scripts]
    gate = threading.BoundedSemaphore(w.concurrency)

    def conversation(c: int) -> None:
        for turn in range(w.turns):
            messages = history(run, c, scripts[c], turn)
            with gate:
                results[c].append(_turn(front.port, front.model, messages, w.output_tokens))

    threads = [threading.Thread(target=conversation, args=(c,), daemon=True) for c in range(len(scripts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # (a join with a timeout lets Ctrl-C through)
            t.join(0.5)
            front.proc.check_alive()
    return results, time.perf_counter() - t0


def tokenized(front: Front, run: int, scripts: list, w: ConversationLoad) -> list[list[list[int]]]:
    """The prompt token IDs of every turn, as the engines got them (after the replay: /tokenize warms
    the gateway's tokenization cache)."""
    out = []
    for c, script in enumerate(scripts):
        prompts = []
        for turn in range(w.turns):
            body = json.dumps({"model": front.model, "messages": history(run, c, script, turn)}).encode()
            status, data = request(front.port, "POST", "/tokenize", body, timeout=120)
            if status != 200:
                raise RuntimeError(f"/tokenize: {status}: {data[:300]!r}")
            prompts.append(json.loads(data)["tokens"])
        out.append(prompts)
    return out


def summarize(
    results: list[list[dict]], prompts: list[list[list[int]]], block: int, keep_last: bool, elapsed: float
) -> dict:
    ok = [(t, r) for conv in results for t, r in enumerate(conv) if "error" not in r]
    errors = [r["error"] for conv in results for r in conv if "error" in r]
    prompt = sum(r["prompt_tokens"] for _, r in ok)
    cached = sum(r["cached_tokens"] for _, r in ok)
    ideal, missed, mismatched, turns = 0, 0, 0, []
    for c, conv in enumerate(results):
        ideals = ideal_cached(prompts[c], block, keep_last)
        for t, r in enumerate(conv):
            if "error" in r:
                continue
            ideal += ideals[t]
            missed += t > 0 and r["cached_tokens"] < ideals[t]
            mismatched += r["prompt_tokens"] != len(prompts[c][t])
            turns.append([c, t, r["prompt_tokens"], r["cached_tokens"], ideals[t], round(r["ttft_ms"], 1)])
    late = [r["ttft_ms"] for t, r in ok if t >= LATE_FROM]
    rnd = lambda x, d=1: None if x is None else round(x, d)  # noqa: E731
    return {
        "cached_share": round(cached / prompt, 4) if prompt else 0.0,
        "late_ttft_p50_ms": rnd(pct(late, 0.5)),
        "late_ttft_p99_ms": rnd(pct(late, 0.99)),
        "ttft_p50_ms": rnd(pct([r["ttft_ms"] for _, r in ok], 0.5)),
        "e2e_p50_ms": rnd(pct([r["e2e_ms"] for _, r in ok], 0.5)),
        "ideal_cached_share": round(ideal / prompt, 4) if prompt else 0.0,
        "missed_turns": missed,
        "turns": len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "elapsed_s": round(elapsed, 1),
        "errors": errors[:5],
        "prompt_token_mismatches": mismatched,
        # [conversation, turn, prompt tokens, cached tokens, ideal cached tokens, TTFT ms]: where the misses are
        "per_turn": turns,
    }


# ---- the run ----------------------------------------------------------------------------------


def _vllm_python(args) -> Path | None:
    venv = Path(args.vllm_venv or vllm_venv_default())
    python = venv / "bin" / "python"
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not python.exists():
        return None
    return python


def run(args) -> int:
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        print(f"tokenmill bench dp: --policies takes {','.join(POLICIES)}, got {args.policies!r}", file=sys.stderr)
        return 2
    python = _vllm_python(args)
    engine = args.engine or ("vllm" if python else "sim")
    if engine == "vllm" and python is None:
        print(
            "tokenmill bench dp: --engine vllm needs vLLM's CPU build in .venv-vllm (x86_64 Linux; ./scripts/test.sh "
            "builds it), or --vllm-venv; --engine sim runs without it",
            file=sys.stderr,
        )
        return 2
    w = conversation_load(args, engine)
    block, keep_last = (SIM_BLOCK, False) if engine == "sim" else (VLLM_BLOCK, True)
    scripts = transcripts(w)
    workdir = Path(tempfile.mkdtemp(prefix="tmdp-"))  # short: ipc paths are limited to ~100 bytes
    ranks: Ranks | None = None
    front: Front | None = None
    previous = signal.getsignal(signal.SIGTERM)

    def terminated(*_):  # a SIGTERM ends the run as Ctrl-C does: through the finally below
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminated)
    started = time.monotonic()
    try:
        model = None
        if engine == "vllm":
            model = args.vllm_model
            if model is None:
                model = str(workdir / "tiny-model")
                subprocess.run(
                    [str(python), "-m", "tokenmill.tiny_model", model],
                    cwd=ROOT,
                    check=True,
                    stdout=subprocess.DEVNULL,
                    env={**os.environ, "HF_HUB_OFFLINE": "1"},
                )
        ranks = Ranks(engine, workdir, python, model)
        ranks.wait_ready(600 if engine == "vllm" else 120)
        print(
            f"two {engine} ranks ready after {time.monotonic() - started:.0f} s; {w.conversations} conversations x "
            f"{w.turns} turns, {w.min_tokens}-{w.max_tokens} tokens appended per turn, {w.concurrency} in flight",
            flush=True,
        )
        report: dict = {"engine": engine}
        for run_index, policy in enumerate(policies):
            front = Front(ranks, policy, workdir)
            front.wait_ready()
            results, elapsed = replay(front, run_index, scripts, w)
            ranks.check_alive()
            per_rank = front.rank_counters()
            prompts = tokenized(front, run_index, scripts, w)
            front.proc.stop()
            front = None
            report[policy] = summarize(results, prompts, block, keep_last, elapsed)
            report[policy]["requests_per_rank"] = [int(x) for x in per_rank.get("requests", [])]
            report[policy]["cached_share_per_rank"] = [
                round(c / p, 4) if p else 0.0
                for c, p in zip(per_rank.get("cached_prompt_tokens", []), per_rank.get("prompt_tokens", []))
            ]
            r = report[policy]
            print(
                f"  {policy}: cached share {r['cached_share']}, late TTFT p50 {r['late_ttft_p50_ms']} ms, "
                f"{r['elapsed_s']} s",
                flush=True,
            )
        first = report[policies[0]]
        report["ideal_cached_share"] = report.get("affinity", first)["ideal_cached_share"]
        report["block_tokens"] = block
        report["workload"] = {**w.__dict__, "late_from_turn": LATE_FROM + 1, "cores": os.cpu_count()}
        if engine == "sim":
            report["workload"]["sim_prefill_tokens_per_s"] = SIM_PREFILL_TOKENS_PER_S
        print_table(report, policies)
        write_json(args.json, report)
        failed = any(report[p]["errors"] for p in policies)
        return 1 if failed else 0
    except KeyboardInterrupt:
        print("tokenmill bench dp: interrupted; stopping what it started", file=sys.stderr)
        return 130
    finally:
        if front is not None:
            front.proc.stop()
        if ranks is not None:
            ranks.stop()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)


def print_table(report: dict, policies: list[str]) -> None:
    w, engine = report["workload"], report["engine"]
    ideal = report["ideal_cached_share"]
    what = (
        f"simulated schedulers, prefix cache in blocks of {report['block_tokens']} tokens, prefill "
        f"{w.get('sim_prefill_tokens_per_s', 0):,} tokens/s"
        if engine == "sim"
        else f"vLLM engines (tiny random model), prefix caching in blocks of {report['block_tokens']} tokens"
    )
    print(
        f"\ntokenmill bench dp: 2 ranks ({what}); {w['conversations']} conversations x {w['turns']} turns, "
        f"{w['min_tokens']}-{w['max_tokens']} tokens appended per turn, {w['concurrency']} in flight, {w['cores']} cores"
    )
    print(
        f"ideal cached share {ideal} (each turn finds its previous turn's prompt cached, in whole blocks); "
        f"late = turns {w['late_from_turn']}+; TTFT in ms; ratios against affinity"
    )
    head = [
        "policy",
        "cached share",
        "of ideal",
        "vs affinity",
        "late TTFT p50",
        "vs affinity",
        "late TTFT p99",
        "missed turns",
        "requests per rank",
    ]
    print("  ".join(h.rjust(13) for h in head))
    base = report.get("affinity", {})
    for p in policies:
        r = report[p]
        cells = [
            p,
            f"{r['cached_share']:.3f}",
            ratio_text(r["cached_share"], ideal),
            ratio_text(r["cached_share"], base.get("cached_share")),
            str(r["late_ttft_p50_ms"]),
            ratio_text(r["late_ttft_p50_ms"], base.get("late_ttft_p50_ms")),
            str(r["late_ttft_p99_ms"]),
            f"{r['missed_turns']}/{r['turns'] - w['conversations']}",
            "/".join(str(x) for x in r["requests_per_rank"]),
        ]
        print("  ".join(c.rjust(13) for c in cells))
    for p in policies:
        if report[p]["errors"]:
            print(f"{p} errors: {report[p]['errors']}")
        if report[p]["prompt_token_mismatches"]:
            print(f"{p}: {report[p]['prompt_token_mismatches']} turns' usage.prompt_tokens differ from /tokenize")
