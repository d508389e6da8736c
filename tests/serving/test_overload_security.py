"""Overload (10x the queue) is refused with 429s, not lost; the API key, body, header and
slow-body limits answer with OpenAI-style errors while other requests keep being served."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import openai
import pytest
from conftest import Server, http
from faultutil import (
    CHAT_MODEL,
    Ledger,
    assert_openai_error,
    chat_body,
    error_code_of,
    idle,
    long_text,
    metric,
    parse_raw_response,
    read_raw_response,
    rss_kib,
    wait_until,
)

SHORT = [{"role": "user", "content": "hi"}]


# ---- overload ----------------------------------------------------------------------------------------


class Watcher(threading.Thread):
    """Polls /health and the gateway's RSS until stopped (bounded in count and time)."""

    def __init__(self, srv, max_polls: int = 5000, max_seconds: float = 120):
        super().__init__(daemon=True)
        self.srv, self.max_polls, self.max_seconds = srv, max_polls, max_seconds
        self.stop = threading.Event()
        self.health_ok = self.health_other = 0
        self.max_rss_kib = 0

    def run(self):
        deadline = time.monotonic() + self.max_seconds
        for _ in range(self.max_polls):
            if self.stop.is_set() or time.monotonic() > deadline:
                return
            try:
                status = http("GET", self.srv.url + "/health", timeout=10)[0]
            except OSError:
                status = None
            if status == 200:
                self.health_ok += 1
            else:
                self.health_other += 1
            self.max_rss_kib = max(self.max_rss_kib, rss_kib(self.srv.proc.pid))
            time.sleep(0.02)


async def burst(srv, ledger: Ledger, bodies: list[dict]) -> None:
    client = srv.async_client().with_options(timeout=120)

    async def one(body):
        ledger.send()
        try:
            await client.chat.completions.create(**body)
        except openai.RateLimitError as exc:
            retry_after = exc.response.headers.get("retry-after")
            outcome = error_code_of(exc)
            ledger.answer(outcome)
            if outcome != "429 overloaded" or not (retry_after or "").isdigit():
                ledger.bad(f"{outcome} retry-after={retry_after!r}")
        except openai.APIStatusError as exc:  # another clear error: counted, allowed
            ledger.answer(error_code_of(exc))
        except openai.APIError as exc:  # no answer at all
            ledger.bad(repr(exc))
        else:
            ledger.answer("200")

    await asyncio.gather(*(one(b) for b in bodies))
    await client.close()


def test_overload_10x_is_refused_not_lost():
    """One worker, a queue of 4 conversions (or 1 MB of bodies): 10x that many long requests at
    once. Some are refused with 429 + Retry-After, the rest answered; none lost; /health answers
    throughout and the gateway's memory stays bounded."""
    queued, queued_bytes = 4, 1_000_000
    srv = Server(
        "--workers",
        "1",
        "--max-queued-conversions",
        str(queued),
        "--max-queued-bytes",
        str(queued_bytes),
        "--sim-inter-token-latency-ms",
        "1",
    )
    try:
        baseline_kib = rss_kib(srv.proc.pid)
        watcher = Watcher(srv)
        watcher.start()
        phases = [
            # 120 kB bodies: the count limit (4 queued = 480 kB) is reached before the byte limit
            ("queue_full", [chat_body(long_text(120_000, seed=i), max_tokens=4) for i in range(10 * queued)]),
            # 400 kB bodies: the byte limit (1 MB = 2 bodies) is reached before the count limit
            ("queue_bytes", [chat_body(long_text(400_000, seed=100 + i), max_tokens=4) for i in range(20)]),
        ]
        largest_phase = max(sum(len(json.dumps(b)) for b in bodies) for _, bodies in phases)
        try:
            for reason, bodies in phases:
                rejected_before = metric(srv, "tokenmill_rejections_total", reason=reason)
                ledger = Ledger(
                    f"overload: {len(bodies)} concurrent long chats, --workers 1, "
                    f"--max-queued-conversions {queued} --max-queued-bytes {queued_bytes} ({reason})"
                )
                asyncio.run(burst(srv, ledger, bodies))
                ledger.check()
                assert ledger.outcomes["429 overloaded"] >= 1, ledger.report()
                assert ledger.outcomes["200"] >= 1, ledger.report()
                assert metric(srv, "tokenmill_rejections_total", reason=reason) > rejected_before
                assert wait_until(lambda: idle(srv), 30, what="an idle server after the burst")
        finally:
            watcher.stop.set()
            watcher.join(30)
        # Every body of the largest phase held at once is ~8 MB; allow four copies of each (socket
        # buffers, the joined body, the frame to the worker, the client's side of loopback does not
        # count) and 64 MB of heap and allocator slack on top of the idle RSS.
        bound_kib = baseline_kib + 64 * 1024 + 4 * largest_phase // 1024
        print(
            f"[overload] /health answered {watcher.health_ok} times (other: {watcher.health_other}); gateway RSS "
            f"{baseline_kib // 1024} MB idle, {watcher.max_rss_kib // 1024} MB peak, bound {bound_kib // 1024} MB"
        )
        assert watcher.health_ok >= 1 and watcher.health_other == 0
        assert watcher.max_rss_kib < bound_kib
        # and it serves normally afterwards
        resp = srv.client().chat.completions.create(model=CHAT_MODEL, messages=SHORT, max_tokens=2)
        assert resp.usage.completion_tokens == 2
    finally:
        srv.stop()


# ---- API key -------------------------------------------------------------------------------------------

PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": CHAT_MODEL, "messages": SHORT, "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": CHAT_MODEL, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
]


@pytest.fixture(scope="module")
def guarded():
    srv = Server(
        "--workers",
        "1",
        "--api-key",
        "s3cret-key",
        "--max-header-bytes",
        "4096",
        "--max-body-bytes",
        "200000",
        "--body-timeout",
        "2",
        "--sim-inter-token-latency-ms",
        "1",
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize("method, path, body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_api_key_required_on_api_routes(guarded, method, path, body):
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret-key"},
        {"Authorization": "Basic s3cret-key"},
    ):
        status, _, answer = http(method, guarded.url + path, body, headers=headers)
        assert status == 401, (headers, answer)
        assert_openai_error(answer)
    status, _, answer = http(method, guarded.url + path, body, headers={"Authorization": "Bearer s3cret-key"})
    assert status == 200, answer


def test_api_key_with_the_openai_client_and_open_probes(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").chat.completions.create(model=CHAT_MODEL, messages=SHORT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()
    resp = guarded.client(api_key="s3cret-key").chat.completions.create(model=CHAT_MODEL, messages=SHORT, max_tokens=2)
    assert resp.usage.completion_tokens == 2
    for path in ("/health", "/ready", "/metrics"):
        assert http("GET", guarded.url + path)[0] == 200, path


def test_api_key_from_environment():
    srv = Server("--workers", "1", env={"TOKENMILL_API_KEY": "from-env"})
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="nope").completions.create(model=CHAT_MODEL, prompt="x", max_tokens=1)
        status, _, body = http("POST", srv.url + "/tokenize", {"prompt": "hi"})
        assert status == 401
        assert_openai_error(body)
        assert srv.client(api_key="from-env").completions.create(model=CHAT_MODEL, prompt="x", max_tokens=1).choices
        assert http("GET", srv.url + "/health")[0] == 200
    finally:
        srv.stop()


# ---- size and time limits --------------------------------------------------------------------------------

AUTH = {"Authorization": "Bearer s3cret-key"}


def test_body_too_large_is_413(guarded):
    big = chat_body("x" * 300_000)
    status, _, body = http("POST", guarded.url + "/v1/chat/completions", big, headers=AUTH)
    assert status == 413
    assert_openai_error(body, code="request_too_large")
    # the same without a Content-Length: a chunked body that grows past the limit
    host, port = guarded.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer s3cret-key\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"a" * 50_000
        try:
            for _ in range(10):  # 500 kB in all, bounded
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server may answer and close before the rest arrives
        answer = read_raw_response(sock)
    status, _, payload = parse_raw_response(answer)
    assert status == 413, answer[:300]
    assert_openai_error(json.loads(payload), code="request_too_large")
    assert http("GET", guarded.url + "/health")[0] == 200


def test_headers_too_large_is_431(guarded):
    status, _, body = http(
        "POST",
        guarded.url + "/v1/chat/completions",
        chat_body("hi", max_tokens=2),
        headers={**AUTH, "X-Padding": "p" * 8000},
    )
    assert status == 431
    assert_openai_error(body)
    status, _, body = http("POST", guarded.url + "/v1/chat/completions", chat_body("hi", max_tokens=2), headers=AUTH)
    assert status == 200, body


def test_slow_body_is_cut_off_while_others_are_served(guarded):
    """Headers, then a body trickled slower than --body-timeout (2 s): 408 or a closed
    connection, and a normal request made meanwhile is answered."""
    host, port = guarded.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps(chat_body("hello there", max_tokens=2)).encode()
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer s3cret-key\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body[:5]
    )
    answer = b""
    closed = False
    others = []
    try:
        for i in range(5, min(len(body) - 1, 5 + 40)):  # at most 40 bytes, one per 0.5 s: 20 s, bounded
            readable, _, _ = select.select([sock], [], [], 0.5)
            if readable:
                break
            if i == 7:  # meanwhile, a normal request
                others.append(
                    http("POST", guarded.url + "/v1/chat/completions", chat_body("hi", max_tokens=2), headers=AUTH)[0]
                )
            try:
                sock.sendall(body[i : i + 1])
            except OSError:
                closed = True
                break
        if not closed:
            try:
                answer = read_raw_response(sock, timeout=10)
            except (socket.timeout, TimeoutError):
                answer = b""  # neither an answer nor a close within 10 s: fails below
            else:
                closed = not answer  # the peer closed without answering
    finally:
        sock.close()
    print(f"[slow body] answer: {answer[:200]!r}; closed: {closed}; normal request meanwhile: {others}")
    assert others == [200]
    assert answer or closed, "the slow request got neither an answer nor a closed connection"
    if answer:
        status, _, payload = parse_raw_response(answer)
        assert status == 408, answer[:300]
        assert_openai_error(json.loads(payload))
    wait_until(lambda: idle(guarded), 10, what="an idle server")
