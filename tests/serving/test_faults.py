"""Nothing is lost under faults: dead workers, stuck or hostile templates, a lost scheduler,
clients that hang up, shutdown, and kill -9 of the gateway itself.

Each test prints what it sent and how every request ended (lost must be 0), and asserts
that every request ended in a response or a clear OpenAI-style error. Waits are bounded;
nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import Server, http
from faultutil import (
    CHAT_MODEL,
    Ledger,
    RawRequest,
    Simulator,
    assert_openai_error,
    chat_body,
    cmdline,
    comm,
    error_code_of,
    idle,
    long_text,
    metric,
    pid_gone,
    start_time,
    state,
    wait_until,
)

SHORT = [{"role": "user", "content": "Say something short."}]


def normal_chat(srv, max_tokens: int = 4) -> str:
    resp = srv.client().chat.completions.create(model=CHAT_MODEL, messages=SHORT, max_tokens=max_tokens)
    assert resp.choices[0].finish_reason in ("length", "stop")
    return resp.choices[0].message.content


def stop_server(srv) -> None:
    if srv is not None:
        t0 = time.monotonic()
        code = srv.stop()
        print(f"  (server stopped with {code} after {time.monotonic() - t0:.1f} s)")


# ---- worker death ---------------------------------------------------------------------------------


def test_worker_kill9_during_burst_of_long_requests():
    """kill -9 of a busy tokenizer worker mid-burst: it is replaced, its conversion runs again
    elsewhere, and every request ends in a 200 or a clear 503 worker_died."""
    srv = Server("--workers", "2", "--sim-inter-token-latency-ms", "1")
    try:
        before = {w["index"]: w["pid"] for w in state(srv)["workers"]}
        restarts_before = metric(srv, "tokenmill_worker_restarts_total")
        n = 12
        bodies = [chat_body(long_text(160_000, seed=i), max_tokens=8) for i in range(n)]
        ledger = Ledger("worker kill -9 during 12 long chats (~160k chars each), --workers 2")
        killed: dict = {}

        async def one(client, body):
            ledger.send()
            try:
                resp = await client.chat.completions.create(**body)
            except openai.APIStatusError as exc:
                outcome = error_code_of(exc)
                ledger.answer(outcome)
                if outcome != "503 worker_died":
                    ledger.bad(outcome)
                return
            except openai.APIError as exc:  # no response at all: a timeout or a dropped connection
                ledger.bad(repr(exc))
                return
            ledger.answer("200")
            assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 10_000

        def killer():
            def busy_worker():
                for w in state(srv)["workers"]:
                    if w["busy"] and w["alive"]:
                        return w
                return None

            w = wait_until(busy_worker, 60, interval=0.02, what="a busy tokenizer worker")
            os.kill(w["pid"], signal.SIGKILL)
            killed.update(w)

        async def main():
            client = srv.async_client().with_options(timeout=120)
            kill = asyncio.create_task(asyncio.to_thread(killer))
            await asyncio.gather(*(one(client, b) for b in bodies))
            await kill

        asyncio.run(main())
        ledger.check()
        print(f"killed worker {killed['index']} (pid {killed['pid']}) while it was converting")
        assert ledger.outcomes["200"] >= 1

        # the worker is back under the same index with a new process
        def replaced():
            w = state(srv)["workers"][killed["index"]]
            return w if w["alive"] and w["pid"] not in (None, killed["pid"]) else None

        new = wait_until(replaced, 60, what="the killed worker's replacement")
        assert before[killed["index"]] == killed["pid"] and new["pid"] != killed["pid"]
        assert pid_gone(killed["pid"])
        assert metric(srv, "tokenmill_worker_restarts_total") >= restarts_before + 1
        assert wait_until(lambda: idle(srv), 30, what="nothing in flight after the burst")
        assert normal_chat(srv) is not None
    finally:
        stop_server(srv)
    print("re-dispatch logged:", "re-dispatching" in srv.read_output())


# ---- stuck conversions and hostile templates --------------------------------------------------------

ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
RECURSIVE = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
HUGE_AT_ONCE = "{{ 'x' * 10**10 }}"
HUGE_DOUBLING = (
    "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}"
)
HUGE_PIECES = "{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}"


def hostile(srv, template: str, timeout: float = 60):
    """(status, body) of a chat with a request-supplied template."""
    body = chat_body("hello", max_tokens=2, chat_template=template)
    status, _, answer = http("POST", srv.url + "/v1/chat/completions", body, timeout=timeout)
    return status, answer


@pytest.fixture(scope="module")
def trusting():
    """Request templates accepted, 3 s per conversion, and a 2 GiB address-space limit per worker
    (low, so that the doubling template below cannot take much of the test machine)."""
    srv = Server(
        "--workers",
        "2",
        "--trust-request-chat-template",
        "--conversion-timeout",
        "3",
        "--worker-memory-limit-mb",
        "2048",
        "--sim-inter-token-latency-ms",
        "1",
    )
    yield srv
    stop_server(srv)


def all_workers_alive(srv):
    workers = state(srv)["workers"]
    return workers if all(w["alive"] for w in workers) else None


def test_endless_template_times_out_and_the_other_worker_keeps_serving(trusting):
    srv = trusting
    ledger = Ledger("endless template (conversion timeout 3 s) + concurrent normal request")
    timeouts_before = metric(srv, "tokenmill_conversion_timeouts_total")
    restarts_before = metric(srv, "tokenmill_worker_restarts_total")
    with ThreadPoolExecutor(1) as pool:
        ledger.send()
        stuck = pool.submit(hostile, srv, ENDLESS)

        def busy():
            return next((w for w in state(srv)["workers"] if w["busy"]), None)

        victim = wait_until(busy, 30, interval=0.02, what="the endless conversion to start")
        ledger.send()
        assert normal_chat(srv) is not None  # served by the other worker meanwhile
        ledger.answer("200 (normal, concurrent)")
        normal_done_first = not stuck.done()
        status, body = stuck.result(timeout=90)
    code = body["error"]["code"] if isinstance(body, dict) and "error" in body else repr(body)
    ledger.answer(f"{status} {code}")
    ledger.check()
    assert normal_done_first, "the normal request should finish while the endless one is still stuck"
    assert status == 400, body
    assert_openai_error(body, code="conversion_timeout")

    def replaced():
        w = state(srv)["workers"][victim["index"]]
        return w if w["alive"] and w["pid"] != victim["pid"] else None

    wait_until(replaced, 60, what="the stuck worker's replacement")
    assert pid_gone(victim["pid"])
    assert metric(srv, "tokenmill_conversion_timeouts_total") >= timeouts_before + 1
    assert metric(srv, "tokenmill_worker_restarts_total") >= restarts_before + 1
    for _ in range(3):  # both workers serve again
        assert normal_chat(srv) is not None
    assert wait_until(lambda: idle(srv), 30, what="an idle server")


def test_recursive_template_is_a_clear_4xx(trusting):
    srv = trusting
    ledger = Ledger("recursive macro template")
    for _ in range(2):
        ledger.send()
        status, body = hostile(srv, RECURSIVE)
        err = assert_openai_error(body)
        ledger.answer(f"{status} {err['code']}")
        assert 400 <= status < 500, body
    ledger.send()
    assert normal_chat(srv) is not None
    ledger.answer("200 (normal, after)")
    ledger.check()


def test_huge_template_output_is_a_clear_4xx_and_service_continues(trusting):
    """Memory bombs from a template: refused with a 4xx (MemoryError under the worker's memory
    limit, or the conversion timeout), never a 5xx; the worker keeps (or is replaced and) serving."""
    srv = trusting
    ledger = Ledger("huge template outputs (worker memory limit 2 GiB)")
    for name, template in (("x*10**10", HUGE_AT_ONCE), ("doubling", HUGE_DOUBLING), ("10 GB of pieces", HUGE_PIECES)):
        ledger.send()
        status, body = hostile(srv, template, timeout=90)
        code = body["error"]["code"] if isinstance(body, dict) and "error" in body else None
        ledger.answer(f"{status} {code}")
        print(f"  {name}: {status} {body}")
        assert 400 <= status < 500, f"{name}: {status} {body}"
        assert_openai_error(body)
        wait_until(lambda: all_workers_alive(srv), 60, what="live workers")
        ledger.send()
        assert normal_chat(srv) is not None
        ledger.answer("200 (normal, after)")
    ledger.check()
    assert wait_until(lambda: idle(srv), 30, what="an idle server")


# ---- scheduler loss --------------------------------------------------------------------------------


def test_scheduler_killed_mid_stream_then_restarted(tmp_path):
    endpoint = f"ipc://{tmp_path}/s.sock"
    sim = Simulator(endpoint, "--inter-token-latency-ms", "20", "--model", "default")
    srv = None
    try:
        srv = Server("--scheduler", endpoint, "--workers", "2")
        ledger = Ledger("scheduler SIGKILL mid-stream, then restarted")
        streams = []
        for i in range(4):
            ledger.send()
            streams.append(
                RawRequest(srv.url, "/v1/chat/completions", chat_body(f"story {i}", max_tokens=3000, stream=True))
            )
        firsts = []
        for s in streams:
            assert s.read_head() == 200
            events = s.events()
            got = [next(events) for _ in range(3)]  # role chunk and some text
            firsts.append(events)
            assert all(isinstance(e, dict) and "choices" in e for e in got)

        results: dict[int, tuple] = {}

        def blocking(i):
            results[i] = http(
                "POST", srv.url + "/v1/chat/completions", chat_body(f"essay {i}", max_tokens=3000), timeout=60
            )

        threads = [threading.Thread(target=blocking, args=(i,)) for i in range(2)]
        for t in threads:
            ledger.send()
            t.start()
        wait_until(lambda: state(srv)["generations"] >= 6, 30, what="6 generations in flight")

        sim.kill()

        for events in firsts:
            tail = list(events)
            assert tail[-1] == "[DONE]", tail[-3:]
            err = tail[-2]
            assert isinstance(err, dict) and "error" in err, tail[-3:]
            assert err["error"]["code"] == "scheduler_unavailable", err
            assert set(err["error"]) >= {"message", "type", "code"}
            ledger.answer("stream: error event scheduler_unavailable + [DONE]")
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        for status, headers, body in results.values():
            assert status == 503, body
            assert_openai_error(body, code="scheduler_unavailable")
            ledger.answer("503 scheduler_unavailable (in flight)")

        def not_ready():
            status, _, body = http("GET", srv.url + "/ready", timeout=5)
            return (status, body) if status == 503 and body["scheduler_connected"] is False else None

        wait_until(not_ready, 15, what="/ready to report the lost scheduler")
        ledger.send()
        status, headers, body = http("POST", srv.url + "/v1/chat/completions", chat_body("now?"))
        assert status == 503, body
        assert_openai_error(body, code="scheduler_unavailable")
        retry_after = {k.lower(): v for k, v in headers.items()}.get("retry-after")
        assert retry_after is not None and retry_after.isdigit(), headers
        ledger.answer("503 scheduler_unavailable + Retry-After (new)")
        assert wait_until(lambda: idle(srv), 15, what="nothing in flight while the scheduler is away")

        sim.start()
        wait_until(
            lambda: http("GET", srv.url + "/ready", timeout=5)[0] == 200,
            60,
            interval=0.2,
            what="/ready after the scheduler came back",
        )
        ledger.send()
        assert normal_chat(srv) is not None
        ledger.answer("200 (after restart)")
        ledger.check()
    finally:
        stop_server(srv)
        sim.stop()


# ---- clients that hang up ---------------------------------------------------------------------------

BUSY = "{% for i in range(spins) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"


@pytest.fixture(scope="module")
def one_worker():
    """One worker converting one request at a time: whatever else is sent waits in the gateway's queue."""
    srv = Server(
        "--workers",
        "1",
        "--conversion-threads",
        "1",
        "--trust-request-chat-template",
        "--conversion-timeout",
        "60",
        "--sim-inter-token-latency-ms",
        "20",
    )
    yield srv
    srv.stop()


def slow_chat(srv, spins: int, timeout: float = 60):
    body = chat_body("slow", max_tokens=2, chat_template=BUSY, chat_template_kwargs={"spins": spins})
    return http("POST", srv.url + "/v1/chat/completions", body, timeout=timeout)


def spins_for(srv, seconds: float) -> int:
    """Spins of the BUSY template that keep a conversion thread busy for about this long."""
    timings = []
    for spins in (1, 1, 21):  # warm up, then time 1 and 21 spins: the difference is 20 spins of the loop
        t0 = time.monotonic()
        status, _, body = slow_chat(srv, spins)
        assert status == 200, body
        timings.append(time.monotonic() - t0)
    per_spin = max(1e-4, (timings[2] - timings[1]) / 20)
    spins = max(2, min(100_000, int(seconds / per_spin)))
    print(f"busy loop: {per_spin * 1000:.1f} ms per spin, using {spins} spins")
    return spins


def test_a_second_slow_conversion_starts_beside_the_first():
    """One worker with two conversion threads (the default) converts two slow requests at once; a third
    waits in the gateway's queue until a thread is free, and all three are answered."""
    srv = Server("--workers", "1", "--trust-request-chat-template", "--conversion-timeout", "60")
    try:
        spins = spins_for(srv, 2.0)
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(slow_chat, srv, spins, 120) for _ in range(2)]
            wait_until(
                lambda: state(srv)["workers"][0]["converting"] == 2,
                30,
                interval=0.02,
                what="both slow conversions running",
            )
            third = pool.submit(slow_chat, srv, spins, 120)
            wait_until(lambda: state(srv)["queued_conversions"] == 1, 30, interval=0.02, what="the third queued")
            assert state(srv)["workers"][0]["converting"] == 2
            for future in [*first, third]:
                status, _, body = future.result(timeout=120)
                assert status == 200, body
        assert wait_until(lambda: idle(srv), 30, what="nothing in flight")["workers"][0]["converting"] == 0
    finally:
        srv.stop()


def test_client_disconnect_while_queued(one_worker):
    srv = one_worker
    spins = spins_for(srv, 3.0)  # keeps the only conversion thread busy for about 3 s

    conversions_before = metric(srv, "tokenmill_tokenize_seconds_count")
    aborts_before = metric(srv, "tokenmill_aborts_total", reason="client_disconnect")
    ledger = Ledger("clients hang up while queued behind a slow conversion (--workers 1)")
    n = 6
    with ThreadPoolExecutor(1) as pool:
        ledger.send()
        slow = pool.submit(slow_chat, srv, spins, 120)
        wait_until(lambda: state(srv)["workers"][0]["busy"], 30, interval=0.02, what="the slow conversion")
        waiting = []
        for i in range(n):
            ledger.send()
            waiting.append(RawRequest(srv.url, "/v1/chat/completions", chat_body(long_text(20_000, seed=i))))
        wait_until(lambda: state(srv)["queued_conversions"] == n, 30, interval=0.02, what=f"{n} queued conversions")
        for r in waiting:
            r.hang_up()
        wait_until(lambda: state(srv)["queued_conversions"] == 0, 30, interval=0.02, what="the queue to empty")
        for _ in waiting:
            ledger.answer("hung up by the client (freed)")
        status, _, body = slow.result(timeout=120)
        ledger.answer(str(status))
        assert status == 200, body
    final = wait_until(lambda: idle(srv), 30, what="nothing in flight")
    ledger.check()
    print("state after:", final)
    assert final["generations"] == 0 and final["queued_conversions"] == 0 and final["conversions_in_flight"] == 0
    # the abandoned requests were never converted: only the slow one was
    assert metric(srv, "tokenmill_tokenize_seconds_count") == conversions_before + 1
    assert metric(srv, "tokenmill_aborts_total", reason="client_disconnect") == aborts_before + n


def test_client_disconnect_mid_stream_aborts_in_scheduler(one_worker):
    srv = one_worker
    aborts_before = metric(srv, "tokenmill_aborts_total", reason="client_disconnect")
    ledger = Ledger("clients hang up mid-stream")
    n = 5
    streams = []
    for i in range(n):
        ledger.send()
        s = RawRequest(
            srv.url, "/v1/chat/completions", chat_body(f"tell a long story {i}", max_tokens=5000, stream=True)
        )
        assert s.read_head() == 200
        events = s.events()
        for _ in range(3):
            assert isinstance(next(events), dict)
        streams.append(s)
    wait_until(
        lambda: metric(srv, "tokenmill_scheduler_num_requests_running") >= n,
        15,
        interval=0.2,
        what="the scheduler to report the streams running",
    )
    assert state(srv)["generations"] == n
    for s in streams:
        s.hang_up()
        ledger.answer("hung up by the client (freed)")
    final = wait_until(lambda: idle(srv), 15, what="no generations after the hang-ups")
    assert final["generations"] == 0 and final["scheduler_requests"] == 0
    wait_until(
        lambda: metric(srv, "tokenmill_scheduler_num_requests_running") == 0,
        15,
        interval=0.2,
        what="the scheduler to stop running the abandoned requests",
    )
    assert metric(srv, "tokenmill_aborts_total", reason="client_disconnect") == aborts_before + n
    ledger.check()


# ---- shutdown and the gateway's own death ------------------------------------------------------------


def process_tree(srv) -> dict[int, int | None]:
    return {pid: start_time(pid) for pid in srv.children()}


def test_sigterm_during_load_drains_and_leaves_no_children():
    srv = Server("--workers", "2", "--shutdown-timeout", "2", "--sim-inter-token-latency-ms", "20")
    children = process_tree(srv)
    assert len(children) == 3, children  # two workers and the simulated scheduler
    ledger = Ledger("SIGTERM during load (--shutdown-timeout 2)")
    try:
        ledger.send()
        long = RawRequest(
            srv.url, "/v1/chat/completions", chat_body("a very long story", max_tokens=100_000, stream=True)
        )
        assert long.read_head() == 200
        events = long.events()
        assert isinstance(next(events), dict)

        shorts: dict[int, tuple] = {}

        def short(i):
            shorts[i] = http(
                "POST", srv.url + "/v1/chat/completions", chat_body(f"short {i}", max_tokens=60), timeout=30
            )

        threads = [threading.Thread(target=short, args=(i,)) for i in range(4)]
        for t in threads:
            ledger.send()
            t.start()
        wait_until(lambda: state(srv)["generations"] == 5, 20, interval=0.01, what="5 generations in flight")
        srv.proc.send_signal(signal.SIGTERM)

        def draining():
            status, _, body = http("GET", srv.url + "/ready", timeout=5)
            return body if status == 503 and body.get("draining") is True else None

        wait_until(draining, 5, interval=0.02, what="/ready to say draining")
        ledger.send()
        status, headers, body = http("POST", srv.url + "/v1/chat/completions", chat_body("too late"), timeout=10)
        assert status == 503, body
        err = assert_openai_error(body)
        ledger.answer(f"503 {err['code']} (new, while draining)")

        tail = list(events)
        assert tail[-1] == "[DONE]", tail[-3:]
        last = tail[-2]
        if isinstance(last, dict) and "error" in last:
            assert last["error"]["code"] == "shutdown", last
            ledger.answer("stream: error event shutdown + [DONE]")
        else:
            ledger.answer("stream: completed")
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        for status, _, body in shorts.values():
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 60
            ledger.answer("200 (short, in flight at SIGTERM)")
        assert srv.proc.wait(30) == 0
        ledger.check()
        wait_until(lambda: all(pid_gone(p, st) for p, st in children.items()), 15, what="no child process left")
    finally:
        stop_server(srv)


def test_process_names_and_kill9_of_gateway_takes_children_along():
    srv = Server("--workers", "2")
    try:
        assert comm(srv.proc.pid) == "tm-gateway"
        children = process_tree(srv)
        lines = {pid: cmdline(pid) for pid in children}
        print("\n".join(f"  {pid}: {line}" for pid, line in lines.items()))
        for w in state(srv)["workers"]:
            assert f"tokenizer worker {w['index']}" in lines[w["pid"]], lines
        assert sum("simulated scheduler" in line for line in lines.values()) == 1, lines
        assert len(children) == 3, lines

        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        wait_until(
            lambda: all(pid_gone(p, st) for p, st in children.items()),
            15,
            what="the workers and simulated scheduler to die with the gateway",
        )
        print(f"[gateway kill -9] {len(children)} children, {len(children)} gone")
    finally:
        stop_server(srv)
