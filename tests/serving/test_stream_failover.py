"""A tokenizer worker's death costs no stream: kill -9 of the worker detokenizing 32 streams,
and every stream (chat, completions, n=2, /v1/messages, /v1/responses) ends with exactly the text,
reasoning, tool calls and logprobs of an undisturbed run of the same seeded requests; the moved
conversations' next turns go to the worker that took them over; kill -9 of every worker at once, and the
streams wait for a replacement and go on there, identical too; the gateway holds nothing for finished
requests, also after 10,000 with failovers; a stream that cannot move (over --stream-history-bytes, moved
3 times already, no worker ready again within --stream-failover-wait) ends with a clear 503 worker_died,
never a hang nor a response cut short.

The requests and their scripted replies are tests/stream_replay.py's (at 15 ms a token, the kill lands
mid-stream). Waits are bounded; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import openai
import pytest
from conftest import ROOT, Server
from faultutil import CHAT_MODEL, idle, metric, rss_kib, state, tokenizer_worker_pids, wait_until
from stream_replay import PARAGRAPH, kill_busiest, requests, run, write_replies


@pytest.fixture(scope="module")
def failover_server(tmp_path_factory):
    path = write_replies(tmp_path_factory.mktemp("replies") / "replies.jsonl")
    srv = Server("--workers", "2", "--sim-inter-token-latency-ms", "10", "--sim-replies", path)
    yield srv
    srv.stop()


def _with_usage(sent: list) -> list:
    """The same requests, chat and completions asking for usage in their last chunk."""
    usage = {"stream_options": {"include_usage": True}}
    return [(e, {**b, **usage} if e in ("chat", "completion") else b) for e, b in sent]


@pytest.fixture(scope="module")
def undisturbed(failover_server):
    """tests/stream_replay.py's 32 seeded requests (chat and completions with usage), and what an
    undisturbed run of them gave."""
    sent = _with_usage(requests())
    baseline = asyncio.run(run(failover_server, sent))
    for got in baseline:
        assert "error" not in got, got
    return sent, baseline


def assert_unchanged(srv, sent: list, baseline: list, disturbed: list, how: str) -> None:
    """Every request's result equals its undisturbed one; those that differ are printed, with the server's log."""
    differ = [i for i, (want, got) in enumerate(zip(baseline, disturbed)) if got != want]
    for i in differ:
        print(f"request {i} {sent[i]}:\n  undisturbed {baseline[i]}\n  {how} {disturbed[i]}")
    if differ:
        print(srv.read_output()[-6000:])
    assert not differ, f"requests {differ} differ {how}"


def test_kill9_of_a_worker_mid_stream_loses_and_repeats_nothing(failover_server, undisturbed):
    srv = failover_server
    sent, baseline = undisturbed
    # the requests cover what they should: a stop string, reasoning, a call, logprobs, multi-byte text
    assert baseline[2][0]["finish"] == "stop" and "END-OF-PART" not in baseline[2][0]["content"]
    assert baseline[3][0]["reasoning"] and baseline[3][0]["content"]
    assert baseline[4][0]["calls"] and baseline[4][0]["finish"] == "tool_calls"
    assert baseline[5][0]["logprobs"] and "😀" in baseline[5][0]["content"]
    assert baseline[6].keys() == {0, 1, "usage"} and baseline[7][0]["logprobs"] and baseline[7]["usage"]
    # the agent APIs: Anthropic thinking, tool_use and a stop sequence; Responses function call and text
    assert baseline[8][0]["reasoning"] and baseline[8][0]["content"] and baseline[8][0]["logprobs"]
    assert baseline[18][0]["calls"] and baseline[18][0]["finish"][0] == "tool_use"
    assert baseline[28][0]["finish"][:2] == ("stop_sequence", "END-OF-PART")
    assert baseline[9][0]["calls"] and "😀" in baseline[19][0]["content"] and baseline[29][0]["content"]

    resumed_before = metric(srv, "tokenmill_stream_failovers_total", reason="resumed")
    killed = {}
    disturbed = asyncio.run(run(srv, sent, lambda p: killed.update(kill_busiest(srv, p))))
    print(f"killed worker {killed['index']} (pid {killed['pid']}) holding {killed['streams']} streams")
    assert_unchanged(srv, sent, baseline, disturbed, "with failover")
    resumed = metric(srv, "tokenmill_stream_failovers_total", reason="resumed") - resumed_before
    assert resumed >= 1, "no stream moved"
    # nothing is kept for finished requests
    wait_until(lambda: metric(srv, "tokenmill_stream_history_bytes") == 0, 30, what="token history freed")
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="the killed worker replaced")
    quiet = wait_until(lambda: idle(srv), 30, what="no live generation")
    assert all(w["streams"] == 0 for w in quiet["workers"]), [(w["index"], w["streams"]) for w in quiet["workers"]]


def test_a_moved_conversation_s_next_turn_goes_to_its_new_worker(failover_server):
    """Six conversations stream their first turn; kill -9 of the worker holding most of them moves those
    streams to the other worker, and with them the conversations' affinity: every conversation's next
    turn is converted and detokenized by the surviving worker, not by the dead one's replacement (which
    the hash ring would give them)."""
    srv = failover_server
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="both workers alive")
    firsts = [[{"role": "user", "content": f"plain story conversation {k}"}] for k in range(6)]
    killed = {}
    answers = asyncio.run(
        run(
            srv,
            [("chat", {"messages": m, "seed": k}) for k, m in enumerate(firsts)],
            lambda p: killed.update(kill_busiest(srv, p)),
        )
    )
    assert all("error" not in a for a in answers), answers
    survivor = next(w["index"] for w in state(srv)["workers"] if w["index"] != killed["index"])
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="the killed worker replaced")
    client = srv.client()
    holders = []
    for k, first in enumerate(firsts):
        turn = [
            *first,
            {"role": "assistant", "content": answers[k][0]["content"]},
            {"role": "user", "content": "go on"},
        ]
        stream = client.chat.completions.create(model=CHAT_MODEL, messages=turn, max_tokens=30, stream=True)
        next(iter(stream))  # under way: the worker detokenizing it holds it
        holders.append([w["index"] for w in state(srv)["workers"] if w["streams"]])
        for _ in stream:
            pass
    print(f"killed worker {killed['index']} holding {killed['streams']} streams; next turns held by {holders}")
    assert holders == [[survivor]] * len(firsts)


def _kill_every_worker(srv, progress, wait_chunks: int = 6) -> list[dict]:
    """Once every stream has had a few chunks, kill -9 every tokenizer worker at once."""
    wait_until(lambda: all(p[0] >= wait_chunks for p in progress), 60, interval=0.01, what="every stream under way")
    victims = [w for w in state(srv)["workers"] if w["alive"]]
    assert sum(w["streams"] for w in victims) > 0, victims
    for w in victims:
        os.kill(w["pid"], signal.SIGKILL)
    return victims


def test_kill9_of_every_worker_at_once_loses_and_repeats_nothing(failover_server, undisturbed):
    """Every tokenizer worker killed at once (an OOM kill, a crash on the same input) while 24 streams
    run: their streams wait for a replacement worker (--stream-failover-wait, 30 s by default) and go on
    there, each stream's text, reasoning, calls, logprobs, finish reason and usage identical to an
    undisturbed run."""
    srv = failover_server
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="both workers alive")
    sent, baseline = undisturbed[0][:24], undisturbed[1][:24]
    assert any("usage" in got for got in baseline)
    before = {r: metric(srv, "tokenmill_stream_failovers_total", reason=r) for r in ("waiting", "resumed", "no_worker")}
    killed = []
    disturbed = asyncio.run(run(srv, sent, lambda p: killed.extend(_kill_every_worker(srv, p))))
    print(f"killed workers {[(w['index'], w['pid'], w['streams']) for w in killed]}")
    assert_unchanged(srv, sent, baseline, disturbed, "after every worker died")
    counted = {r: metric(srv, "tokenmill_stream_failovers_total", reason=r) - n for r, n in before.items()}
    print(f"failovers meanwhile: {counted}")
    assert counted["waiting"] >= 1, "no stream waited for a replacement"
    assert counted["resumed"] >= counted["waiting"]  # each waiting request went on on a replacement
    assert counted["no_worker"] == 0
    wait_until(lambda: metric(srv, "tokenmill_stream_history_bytes") == 0, 30, what="token history freed")
    quiet = wait_until(lambda: idle(srv), 30, what="no live generation")
    assert quiet["waiting_for_worker"] == 0
    assert all(w["streams"] == 0 for w in quiet["workers"]), [(w["index"], w["streams"]) for w in quiet["workers"]]


LONG = PARAGRAPH * 60  # ~2,000 tokens: 20 s at 10 ms a token, longer than the kills below take


def test_repeated_kills_end_each_stream_whole_or_in_a_clear_error(tmp_path, undisturbed):
    """Every worker killed again as soon as a replacement is ready (and those still starting with it),
    four times, while 12 streams of the seeded requests and 3 long ones run: each stream ends either
    identical to an undisturbed run or with an error event worker_died, none hangs and no response is
    cut short; the long ones, still running at the fourth kill, had moved 3 times already (too_many).
    The gateway holds nothing for any of them afterwards."""
    path = tmp_path / "replies.jsonl"
    write_replies(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"match": "long story", "text": LONG}) + "\n")
    srv = Server("--workers", "2", "--sim-inter-token-latency-ms", "10", "--sim-replies", str(path))
    try:
        longs = [
            ("chat", {"messages": [{"role": "user", "content": f"long story {k}"}], "max_tokens": 4000})
            for k in range(3)
        ]
        sent = [*undisturbed[0][:12], *longs]
        killed: list[list[int]] = []

        def kill_repeatedly(progress):
            wait_until(lambda: all(p[0] >= 3 for p in progress), 60, interval=0.01, what="every stream under way")
            for _ in range(4):
                pids = tokenizer_worker_pids(srv)  # the ready ones and any still starting
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed.append(pids)
                gone = {pid for pids in killed for pid in pids}
                wait_until(
                    lambda gone=gone: [w for w in state(srv)["workers"] if w["alive"] and w["pid"] not in gone],
                    90,
                    interval=0.005,
                    what="a replacement ready",
                )

        results = asyncio.run(run(srv, sent, kill_repeatedly))
        print(
            f"killed {killed}; failovers "
            + ", ".join(
                f"{r} {metric(srv, 'tokenmill_stream_failovers_total', reason=r):g}"
                for r in ("resumed", "waiting", "too_many", "no_worker")
            )
        )
        print("errors:", sorted({got["error"][:120] for got in results if "error" in got}))
        for i, (want, got) in enumerate(zip(undisturbed[1][:12], results)):
            if "error" not in got:
                assert got == want, (i, sent[i], got, want)
            else:
                # worker_died (Anthropic's /v1/messages says overloaded_error, with the same message)
                assert "The tokenizer worker streaming this request died" in got["error"], (i, got)
        for got in results[12:]:
            assert "error" in got and "had moved 3 times already" in got["error"], got
        assert metric(srv, "tokenmill_stream_failovers_total", reason="too_many") >= len(longs)
        quiet = wait_until(lambda: idle(srv), 30, what="no live generation")
        assert quiet["waiting_for_worker"] == 0
        assert all(w["streams"] == 0 for w in quiet["workers"] if w["alive"]), quiet["workers"]
        assert metric(srv, "tokenmill_stream_history_bytes") == 0
    finally:
        srv.stop()


def test_streams_that_no_worker_takes_in_time_end_in_a_clear_error(tmp_path):
    """--stream-failover-wait 1, and no replacement can start (the chat template file its workers load
    is gone): every worker killed at once mid-stream, each stream ends after the wait with an error
    event worker_died naming it, and the gateway holds nothing for them. With the file back, the
    replacements start and serve."""
    template = tmp_path / "template.jinja"
    shutil.copy(ROOT / "tokenmill" / "default_model" / "chat_template.jinja", template)
    srv = Server(
        "--workers", "2", "--sim-inter-token-latency-ms", "10", "--sim-replies", write_replies(tmp_path / "r.jsonl"),
        "--stream-failover-wait", "1", "--chat-template", str(template),
    )  # fmt: skip
    try:
        sent = [("chat", {"messages": [{"role": "user", "content": f"plain story {k}"}]}) for k in range(6)]

        def kill_for_good(progress):
            wait_until(lambda: all(p[0] >= 3 for p in progress), 60, interval=0.01, what="every stream under way")
            template.rename(tmp_path / "gone.jinja")
            _kill_every_worker(srv, progress, wait_chunks=3)

        results = asyncio.run(run(srv, sent, kill_for_good))
        for got in results:
            assert "error" in got, got
            assert got["error"].startswith("worker_died: "), got
            assert "within --stream-failover-wait (1 s)" in got["error"], got
        assert metric(srv, "tokenmill_stream_failovers_total", reason="waiting") == len(sent)
        assert metric(srv, "tokenmill_stream_failovers_total", reason="no_worker") == len(sent)
        quiet = wait_until(lambda: idle(srv), 30, what="no live generation")
        assert quiet["waiting_for_worker"] == 0 and not any(w["alive"] for w in quiet["workers"])
        assert metric(srv, "tokenmill_stream_history_bytes") == 0
        (tmp_path / "gone.jinja").rename(template)
        wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 60, what="the workers replaced")
        assert "error" not in asyncio.run(run(srv, sent[:1]))[0]
    finally:
        srv.stop()


def test_a_stream_the_new_worker_cannot_rebuild_fails_alone(tmp_path_factory):
    """Two workers (tests/future_worker.py, joined over ipc://) write one stream's state as a later
    release would. kill -9 of the worker holding it and other streams: the others move and end exactly
    as undisturbed; that one ends with a clear 503 worker_died saying why (a state version this worker
    does not know); nothing is kept for any of them afterwards."""
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='tmfo')}/workers.sock"
    # a worker heartbeats every second; beside another busy test process one was held back past 2 s (lost twice)
    srv = Server(
        "--workers", "0", "--remote-workers", endpoint, "--remote-worker-timeout", "4",
        "--sim-inter-token-latency-ms", "25", "--sim-replies", write_replies(tmp_path_factory.mktemp("r") / "r.jsonl"),
        ready=False,
    )  # fmt: skip
    script = str(ROOT / "tests" / "future_worker.py")
    workers = [
        subprocess.Popen(
            [sys.executable, script, endpoint], cwd=ROOT, start_new_session=True, stderr=subprocess.DEVNULL
        )
        for _ in "ab"
    ]
    try:
        srv.wait_ready(90)
        wait_until(lambda: sum(w["alive"] for w in state(srv)["workers"]) == 2, 90, what="both workers joined")
        others = [(endpoint, {**body, "max_tokens": 100}) for endpoint, body in requests()[:6]]
        marked = {"messages": [{"role": "user", "content": "plain story marked"}], "stop": ["FUTURE-STATE"]}
        baseline = asyncio.run(run(srv, [("chat", marked), *others]))
        assert all("error" not in got for got in baseline), [g for g in baseline if "error" in g] + [
            srv.read_output()[-3000:]
        ]

        # the marked stream alone first: the worker holding a stream then holds it
        client = srv.client()
        stream = client.chat.completions.create(model=CHAT_MODEL, stream=True, max_tokens=400, **marked)
        text = next(iter(stream)).choices[0].delta.content or ""
        victim = next(w for w in state(srv)["workers"] if w["streams"])
        resumed = metric(srv, "tokenmill_stream_failovers_total", reason="resumed")
        tail = {}

        def read_rest():
            try:
                tail["text"] = text + "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            except openai.APIError as exc:
                tail["error"] = exc

        reader = threading.Thread(target=read_rest)
        reader.start()

        def kill(progress):
            wait_until(lambda: all(p[0] >= 3 for p in progress), 60, interval=0.01, what="every stream under way")
            os.kill(victim["pid"], signal.SIGKILL)

        disturbed = asyncio.run(run(srv, others, kill))
        reader.join(60)
        assert disturbed == baseline[1:]
        assert "error" in tail, tail
        err = tail["error"]
        assert err.code == "worker_died" and err.type == "ServiceUnavailableError", err.body
        assert "could not go on with it (stream state of version 2; this worker knows version 1)" in err.message
        assert metric(srv, "tokenmill_stream_failovers_total", reason="rebuild_failed") == 1
        assert metric(srv, "tokenmill_stream_failovers_total", reason="resumed") >= resumed + 2  # it and others
        quiet = wait_until(lambda: idle(srv), 30, what="no live generation")
        assert all(w["streams"] == 0 for w in quiet["workers"] if w["alive"]), quiet["workers"]
        assert metric(srv, "tokenmill_stream_history_bytes") == 0
    finally:
        for w in workers:
            w.kill()
            w.wait(10)
        srv.stop()


def test_a_stream_over_the_history_cap_is_not_resumed(tmp_path):
    path = tmp_path / "replies.jsonl"
    path.write_text(json.dumps({"match": "plain story", "text": PARAGRAPH * 4}) + "\n")
    srv = Server(
        "--workers", "2", "--sim-inter-token-latency-ms", "15", "--sim-replies", str(path),
        "--stream-history-bytes", "64",
    )  # fmt: skip
    try:
        plain = [("chat", {"messages": [{"role": "user", "content": f"plain story {i}"}]}) for i in range(4)]
        results = asyncio.run(run(srv, plain, lambda p: kill_busiest(srv, p, wait_chunks=30)))
        errors = [r["error"] for r in results if "error" in r]
        assert errors and all("--stream-history-bytes" in e for e in errors), results
        assert metric(srv, "tokenmill_stream_failovers_total", reason="not_resumable") >= 1
    finally:
        srv.stop()


def _joined(status: bytes, data: bytes) -> str:
    """A chat stream's content (its status line instead when not a 200, any error event after it)."""
    text = "" if b" 200 " in status[:16] else status.split(b"\r\n", 1)[0].decode()
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if "error" in event:
                text += f"error: {event['error']}"
            for choice in event.get("choices", ()):
                text += choice["delta"].get("content") or ""
    return text


async def _stream_texts(port: int, body: bytes, total: int, concurrency: int, done: list, texts: dict, pause) -> None:
    """``total`` streamed requests over ``concurrency`` keep-alive connections, read by hand (the SDK's
    client costs more CPU than the gateway does per request): the text of each, counted in ``texts``.
    Every 20th hangs up after its first event (counted as "aborted"). No new request starts while
    ``pause()`` is true, and a connection that waited so starts afresh: the server closes a keep-alive
    connection idle for --timeout-keep-alive (5 s), as long as a replacement worker may take to start
    after a worker that died right after starting (the supervisor's back-off)."""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    left = [total]

    async def connection() -> None:
        reader = writer = None
        while left[0] > 0:
            if pause() and writer is not None:
                writer.close()
                writer = None
            while pause():
                await asyncio.sleep(0.02)
            left[0] -= 1
            hang_up = left[0] % 20 == 0
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head)
                status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
                if hang_up:  # gone after the first event
                    await asyncio.wait_for(reader.readuntil(b"\n\n"), 60)
                    writer.close()
                    text, writer = "aborted", None
                else:
                    text = _joined(status, await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 60))
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                text, writer = f"error: {exc!r}", None
            texts[text] = texts.get(text, 0) + 1
            done[0] += 1
        if writer is not None:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))


def test_history_is_freed_after_10000_requests_with_failovers(failover_server):
    """10,000 short streams, 128 at a time, while workers holding streams are killed: one after 2,000,
    5,000 and 8,000 requests (if a replacement is not ready 1,000 requests later, new requests wait
    for it, so the three kills happen however fast the machine is). One in 20 clients hangs up after
    the first event; every other stream ends complete. Afterwards the gateway holds nothing for any: the token history gauge back to 0, no live
    generation, no stream counted on any worker, and its RSS no higher than after the first 2,000
    requests, give or take allocator noise."""
    srv = failover_server
    wait_until(lambda: all(w["alive"] for w in state(srv)["workers"]), 90, what="both workers alive")
    request = {"messages": [{"role": "user", "content": "plain story again"}], "max_tokens": 6}
    want = asyncio.run(run(srv, [("chat", request)]))[0]
    assert "error" not in want
    body = json.dumps({"model": CHAT_MODEL, "stream": True, **request}).encode()
    total, done, texts, killed, rss = 10_000, [0], {}, [], {}
    kills_at = (2000, 5000, 8000)

    def killer():
        """At each of kills_at, kill -9 a worker holding streams and wait for its replacement; note the
        gateway's RSS at the first."""
        for at in kills_at:
            wait_until(lambda at=at: done[0] >= at, 300, interval=0.005, what=f"{at} requests done")
            rss.setdefault("warm", rss_kib(srv.proc.pid))
            busy = wait_until(
                lambda: [w for w in state(srv)["workers"] if w["alive"] and w["streams"]], 30, 0.002, "streams"
            )
            os.kill(busy[0]["pid"], signal.SIGKILL)
            wait_until(
                lambda pid=busy[0]["pid"]: all(w["alive"] and w["pid"] != pid for w in state(srv)["workers"]),
                90,
                what="the worker replaced",
            )
            killed.append(busy[0]["pid"])

    def pause() -> bool:
        return any(done[0] >= at + 1000 and len(killed) <= k for k, at in enumerate(kills_at))

    async def main():
        kill = asyncio.create_task(asyncio.to_thread(killer))
        await _stream_texts(srv.port, body, total, 128, done, texts, pause)
        await kill

    resumed = metric(srv, "tokenmill_stream_failovers_total", reason="resumed")
    t0 = time.monotonic()
    asyncio.run(main())
    print(f"{total} requests in {time.monotonic() - t0:.1f} s, {len(killed)} workers killed meanwhile; {rss}")
    aborted = total // 20
    assert texts == {want[0]["content"]: total - aborted, "aborted": aborted}, {
        t: n for t, n in texts.items() if t != want[0]["content"]
    }
    assert len(killed) == len(kills_at)
    assert metric(srv, "tokenmill_stream_failovers_total", reason="resumed") >= resumed + len(killed)
    quiet = wait_until(lambda: idle(srv), 30, what="no live generation")
    assert all(w["streams"] == 0 for w in quiet["workers"]), [(w["index"], w["streams"]) for w in quiet["workers"]]
    assert metric(srv, "tokenmill_stream_history_bytes") == 0
    rss["end"] = rss_kib(srv.proc.pid)
    print(f"gateway RSS after 2,000 requests {rss['warm']} KiB, after {total}: {rss['end']} KiB")
    assert rss["end"] - rss["warm"] < 16 * 1024, rss
