"""``tokenmill bench vllm --images``: image chats against vLLM's own server and against tokenmill.

Both stacks serve one tiny random Qwen2-VL (``tests/image_model.py``, made for the run with vLLM's
Python, or ``--vllm-model``). vLLM's Qwen2-VL path imports torchvision, which this machine's CPU
torch lacks: ``--vision-path`` (an overlay of torch and torchvision made with ``pip install
--target``) goes first on PYTHONPATH for every process that runs vLLM.

Per round, 8 chats are sent together, each with 4 images of 1024 x 1024 never seen before (photo-
like: smooth colour fields with grain; two JPEG, two PNG, as base64 ``data:`` URLs), one output
token each: the front end fetches nothing, but decodes, resizes, patches and expands 32 images. Then
the same 8 chats one turn later (an assistant answer and a new question added), resending the same
images: what an agent does every turn (each side has had one chat of its own first: ``warm_up``).
A prober in its own process GETs ``/health`` every 10 ms through all of it, and for 10 s before it
with no chats (``health_idle_p99_ms``: on a VM mostly the time a halted core takes to wake, a floor
no server goes below). Beside it, a real-time watcher per CPU (``CpuStalls``) notes when a CPU
ran nothing of anyone's (on a VM, the host took it): ``cpu_stall_max_ms`` is the longest such span in
the run, ``health_max_clear_ms`` the slowest probe that overlapped none (``health_max_ms`` is every
probe's), ``steal_ms`` the CPU time the host reports taking meanwhile. Figures: the prober's
percentiles, images per second over the first turns (wall time, the engine's vision tower and
prefill included: the same engine on both sides), each turn's latency, and the front end's CPU per
image (vLLM: its API-server process; tokenmill: the gateway and the workers), first turn against
resend, and of that the gateway's alone over both turns.
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import time

from tokenmill.bench.common import (
    CpuStalls,
    all_at_once,
    cpu_seconds,
    outside,
    pct,
    process_role,
    process_tree,
    request,
    rnd,
    steal_seconds,
    timed_health_prober,
    try_get,
)

CHATS = 8
IMAGES_PER_CHAT = 4
SIZE = 1024


def photo_images(count: int, seed: int) -> list[tuple[str, bytes]]:
    """``count`` distinct 1024 x 1024 photo-like images as (media type, file bytes), JPEG and PNG in
    turn: a bicubic-smoothed random colour field with +-6 levels of grain (a JPEG of ~180 KB, a PNG
    of ~1.8 MB; noise alone would make a PNG no photo makes)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        low = Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).resize((SIZE, SIZE), Image.BICUBIC)
        grain = rng.integers(-6, 7, (SIZE, SIZE, 3), dtype=np.int16)
        image = Image.fromarray(np.clip(np.asarray(low, dtype=np.int16) + grain, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        if i % 2:
            image.save(buf, "PNG")
            out.append(("image/png", buf.getvalue()))
        else:
            image.save(buf, "JPEG", quality=90)
            out.append(("image/jpeg", buf.getvalue()))
    return out


def chat_bodies(model: str, tag: str, images: list[tuple[str, bytes]]) -> tuple[list[bytes], list[bytes]]:
    """Per chat, its first turn and its second turn (the same images resent), as request bodies."""
    first, resend = [], []
    for c in range(len(images) // IMAGES_PER_CHAT):
        parts: list[dict] = [{"type": "text", "text": f"[{tag} chat {c}] Compare these screenshots."}]
        for media, data in images[c * IMAGES_PER_CHAT : (c + 1) * IMAGES_PER_CHAT]:
            url = f"data:{media};base64,{base64.b64encode(data).decode()}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        messages = [{"role": "user", "content": parts}]
        body = {"model": model, "max_tokens": 1, "temperature": 0, "messages": messages}
        first.append(json.dumps(body).encode())
        messages += [
            {"role": "assistant", "content": "The second one has a dialog open."},
            {"role": "user", "content": "What does the dialog say?"},
        ]
        resend.append(json.dumps(body).encode())
    return first, resend


def warm_up(port: int, model: str) -> None:
    """One chat of 4 images of its own, before any measured run (each side alike): a front end's first
    requests load code paths and grow its processes' heaps, and the runs measure it warm."""
    body = chat_bodies(model, f"warm-up {time.time_ns()}", photo_images(IMAGES_PER_CHAT, 999_999))[0][0]
    status, data = request(port, "POST", "/v1/chat/completions", body, timeout=600, piece_bytes=256 << 10)
    if status != 200:
        raise RuntimeError(f"the warm-up chat failed: {status} {data[:300]!r}")


def front_cpu_s(side: str, pid: int) -> dict[str, float]:
    """CPU seconds of the front end: vLLM's API-server process (its engine core is a child, left out);
    tokenmill serve's gateway and its workers (a simulated scheduler in its tree left out)."""
    if side == "vllm":
        return {"gateway": cpu_seconds(pid), "workers": 0.0}
    out = {"gateway": 0.0, "workers": 0.0}
    for p, name in process_tree(pid).items():
        role = process_role(name)
        if role != "scheduler":
            out[role] += cpu_seconds(p)
    return out


def _send_together(port: int, bodies: list[bytes]) -> tuple[float, list[float], list[int], list[str]]:
    """The bodies sent at once, a thread each: (wall s, latencies ms, prompt tokens, errors)."""
    latencies, tokens, errors = [], [], []

    def one(body: bytes) -> None:
        t0 = time.perf_counter()
        try:
            status, data = request(port, "POST", "/v1/chat/completions", body, timeout=600, piece_bytes=256 << 10)
        except OSError as exc:
            errors.append(repr(exc))
            return
        latencies.append((time.perf_counter() - t0) * 1000)
        if status == 200:
            tokens.append(json.loads(data)["usage"]["prompt_tokens"])
        else:
            errors.append(f"{status}: {data[:300]!r}")

    return all_at_once(one, bodies), latencies, tokens, errors


IDLE_PROBE_S = 10.0


class _Prober:
    """timed_health_prober in a process of its own, from start() until finish() returns its probes."""

    def __init__(self, ctx, port: int):
        self.out, self.stop, started = ctx.Queue(), ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=timed_health_prober, args=(port, self.stop, self.out, started))
        self.process.start()
        started.wait(60)

    def finish(self) -> tuple[list[float], list[float]]:
        """The probes' latencies (ms) and start times (monotonic s)."""
        self.stop.set()
        _, latencies, starts = self.out.get(timeout=120)
        self.process.join(30)
        return latencies, starts


def image_chats(port: int, side: str, pid: int, rounds: list[tuple[list[bytes], list[bytes]]]) -> dict:
    """``rounds``: (first turns, resent turns) of 8 chats each, every round's images new. The prober
    first runs IDLE_PROBE_S with no chats: the server's idle latency, which on a VM is mostly the
    time a halted core takes to wake (the floor under the loaded figures)."""
    ctx = mp.get_context("spawn")
    prober = _Prober(ctx, port)
    idle_cpu0, idle_t0 = front_cpu_s(side, pid), time.monotonic()
    time.sleep(IDLE_PROBE_S)
    idle_cpu1, idle_t1 = front_cpu_s(side, pid), time.monotonic()
    idle, _ = prober.finish()
    # what the front end spends per second with no chats: answering the prober, its own timers
    idle_rate = (sum(idle_cpu1.values()) - sum(idle_cpu0.values())) / (idle_t1 - idle_t0)
    stalls = CpuStalls(ctx)
    stalls.wait_ready()
    steal0 = steal_seconds()
    prober = _Prober(ctx, port)
    time.sleep(0.5)
    walls, first_ms, resend_ms, tokens, errors = [], [], [], [], []
    cpu = {"first": 0.0, "resend": 0.0}
    busy_s = {"first": 0.0, "resend": 0.0}  # the turns' wall time, for the idle rate's share
    gateway_cpu = 0.0  # tokenmill's gateway alone (vLLM's front is one process: all of it)
    images = 0
    resent0 = _metric_total(port, "tokenmill_image_pixels_resent_total") if side == "tokenmill" else None
    if side == "tokenmill":
        try_get(port, "/debug/loop-lag?reset=1")
    try:
        for first, resend in rounds:
            for kind, bodies in (("first", first), ("resend", resend)):
                cpu0, t0 = front_cpu_s(side, pid), time.monotonic()
                wall, latencies, counted, failed = _send_together(port, bodies)
                cpu1, t1 = front_cpu_s(side, pid), time.monotonic()
                cpu[kind] += sum(cpu1.values()) - sum(cpu0.values())
                busy_s[kind] += t1 - t0
                gateway_cpu += cpu1["gateway"] - cpu0["gateway"]
                errors += failed
                if kind == "first":
                    walls.append(wall)
                    first_ms += latencies
                    tokens += counted
                    images += IMAGES_PER_CHAT * len(counted)
                else:
                    resend_ms += latencies
    finally:
        lag = _loop_lag_max_ms(port) if side == "tokenmill" else None
        health, starts = prober.finish()
        stalled = stalls.finish()
        steal = steal_seconds() - steal0
    first_p50, resend_p50 = pct(first_ms, 0.5), pct(resend_ms, 0.5)
    resent = None  # tokenmill only: requests sent again with their pixels after the engine said image_missing
    if side == "tokenmill" and resent0 is not None:
        resent = _metric_total(port, "tokenmill_image_pixels_resent_total") - resent0
    sent = IMAGES_PER_CHAT * sum(len(first) for first, _ in rounds)
    return {
        "health_idle_p99_ms": rnd(pct(idle, 0.99), 2),
        "health_p50_ms": rnd(pct(health, 0.5), 2),
        "health_p99_ms": rnd(pct(health, 0.99), 2),
        "health_max_ms": rnd(max(health, default=None), 2),
        # a CPU that ran nothing of anyone's (its real-time watcher late): the host or the kernel had it
        "cpu_stall_max_ms": None if stalled is None else rnd(max(((b - a) * 1000 for a, b in stalled), default=0), 1),
        "health_max_clear_ms": None if stalled is None else rnd(max(outside(starts, health, stalled), default=None), 2),
        "steal_ms": rnd(steal * 1000, 0),
        # tokenmill's gateway: its loop's own longest lateness meanwhile (a slow probe with a short lag
        # waited outside the loop: in the kernel, on the host, or in the prober)
        "loop_lag_max_ms": rnd(lag, 2),
        "images_per_s": rnd(images / sum(walls), 2) if images else None,
        "first_turn_p50_ms": rnd(first_p50),
        "resend_turn_p50_ms": rnd(resend_p50),
        "resend_vs_first": rnd(resend_p50 / first_p50, 3) if first_p50 and resend_p50 else None,
        "front_cpu_ms_per_image": rnd(cpu["first"] * 1000 / sent, 2),
        "resend_front_cpu_ms_per_image": rnd(cpu["resend"] * 1000 / sent, 2),
        "resend_cpu_vs_first": rnd(cpu["resend"] / cpu["first"], 3) if cpu["first"] else None,
        "idle_front_cpu_ms_per_s": rnd(idle_rate * 1000, 2),
        # the same ratio for what the turns themselves cost: each turn's CPU less the idle rate over its wall
        # time (the prober's /health every 10 ms runs through the turns, and weighs most on the short resend)
        "resend_cpu_vs_first_net": _net_ratio(cpu, busy_s, idle_rate),
        "gateway_cpu_ms_per_image": rnd(gateway_cpu * 1000 / (2 * sent), 2),
        "pixels_resent": resent,
        "prompt_tokens": max(tokens, default=0),
        "errors": errors[:3],
    }


FIGURES = [
    "health_idle_p99_ms",
    "health_p50_ms",
    "health_p99_ms",
    "health_max_ms",
    "cpu_stall_max_ms",
    "health_max_clear_ms",
    "steal_ms",
    "loop_lag_max_ms",
    "images_per_s",
    "first_turn_p50_ms",
    "resend_turn_p50_ms",
    "resend_vs_first",
    "front_cpu_ms_per_image",
    "resend_front_cpu_ms_per_image",
    "resend_cpu_vs_first",
    "idle_front_cpu_ms_per_s",
    "resend_cpu_vs_first_net",
    "gateway_cpu_ms_per_image",
    "pixels_resent",
    "prompt_tokens",
]


def _net_ratio(cpu: dict[str, float], busy_s: dict[str, float], idle_rate: float) -> float | None:
    """Resent turns' CPU over first turns', each less ``idle_rate`` (CPU s per s) over its wall time."""
    first = cpu["first"] - idle_rate * busy_s["first"]
    resend = cpu["resend"] - idle_rate * busy_s["resend"]
    return rnd(max(resend, 0.0) / first, 3) if first > 0 else None


def _loop_lag_max_ms(port: int) -> float | None:
    """tokenmill's ``/debug/loop-lag`` maximum since its last reset; None if it could not be read."""
    status, data = try_get(port, "/debug/loop-lag")
    return json.loads(data).get("max_ms") if status == 200 else None


def _metric_total(port: int, name: str) -> float | None:
    """The sum of a counter's samples on ``/metrics`` (all its labels), None if it could not be read."""
    status, data = try_get(port, "/metrics")
    if status != 200:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in data.decode().splitlines() if line.startswith(name + "{"))
