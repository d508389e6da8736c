"""Clients that read slowly, stop reading, dribble their headers, or sit idle.

Each is bounded by a documented setting (docs/operations/security.md, "The HTTP API"): a slow reader's
text is coalesced into fewer SSE events and none of it is lost; a reader that falls more
than --stream-buffer-limit characters behind is aborted at the scheduler, counted, and
disconnected; a request head must be complete within --header-timeout; an idle
keep-alive connection is closed after --timeout-keep-alive. --send-buffer-bytes keeps the
kernel from buffering megabytes first. Real sockets on loopback.
"""

from __future__ import annotations

import json
import resource
import socket
import time

import pytest
from conftest import Server
from faultutil import metric, parse_raw_response, read_raw_response, state, wait_until

WORD = " elephant"  # one token of the embedded model's tokenizer


@pytest.fixture(scope="module")
def word_id(default_tokenizer) -> int:
    ids = default_tokenizer.encode(WORD, add_special_tokens=False).ids
    assert len(ids) == 1
    return ids[0]


def _request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def _small_window_socket(port: int) -> socket.socket:
    """A client socket with a 4 KiB receive buffer, so the gateway sees a backlog soon."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def _sse_events(body: bytes) -> list:
    events = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[len(b"data: ") :]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def fast_echo():
    srv = Server(
        "--workers",
        "1",
        "--sim-mode",
        "echo",
        "--sim-inter-token-latency-ms",
        "1",
        "--stream-buffer-limit",
        "200000",
        "--send-buffer-bytes",
        "16384",
    )
    yield srv
    srv.stop()


def test_a_slow_reader_gets_every_token_in_fewer_events(fast_echo, word_id):
    srv = fast_echo
    before = metric(srv, "tokenmill_stream_coalesced_deltas_total")
    tokens = 3000
    sock = _small_window_socket(srv.port)
    sock.sendall(
        _request(
            "/v1/completions",
            {
                "model": "deepseek-v4",
                "prompt": [word_id] * 8,
                "max_tokens": tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    time.sleep(4)  # ~4,000 tokens' worth of emission with nobody reading: the socket backs up
    status, _, body = parse_raw_response(read_raw_response(sock, timeout=60))
    sock.close()
    assert status == 200
    events = _sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e.get("choices")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == WORD * tokens  # in order, nothing lost, nothing doubled
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == tokens
    text_events = [c for c in chunks if c["choices"][0]["text"]]
    assert len(text_events) < tokens // 2, len(text_events)  # coalesced while the client was behind
    assert metric(srv, "tokenmill_stream_coalesced_deltas_total") - before >= tokens // 2


def test_a_fast_reader_gets_one_event_per_token(fast_echo, word_id):
    """Coalescing is for clients that fall behind: one that keeps up sees the scheduler's own steps."""
    stream = fast_echo.client().completions.create(
        model="deepseek-v4", prompt=[word_id] * 8, max_tokens=200, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    assert "".join(pieces) == WORD * 200
    assert len(pieces) >= 150, len(pieces)  # a busy test machine may still merge a few


def test_a_client_that_stops_reading_is_aborted_counted_and_disconnected(word_id):
    srv = Server(
        "--workers",
        "1",
        "--sim-mode",
        "echo",
        "--sim-inter-token-latency-ms",
        "1",
        "--stream-buffer-limit",
        "20000",
        "--send-buffer-bytes",
        "16384",
    )
    try:
        sock = _small_window_socket(srv.port)
        sock.sendall(
            _request(
                "/v1/completions",
                {"model": "deepseek-v4", "prompt": [word_id] * 8, "max_tokens": 1_000_000, "stream": True},
            )
        )
        wait_until(
            lambda: metric(srv, "tokenmill_aborts_total", reason="slow_client") >= 1, 60, what="the slow client's abort"
        )
        assert metric(srv, "tokenmill_closed_connections_total", reason="slow_client") >= 1
        # freed everywhere: no generation, no scheduler request, no decoder state
        wait_until(
            lambda: (
                (s := state(srv))["generations"] == 0
                and s["scheduler_requests"] == 0
                and all(w["streams"] == 0 for w in s["workers"])
            ),
            10,
            what="everything freed",
        )
        sock.settimeout(10)
        got = 0
        try:
            while chunk := sock.recv(65536):  # what was already on its way, then the end
                got += len(chunk)
        except ConnectionResetError:
            pass
        sock.close()
        assert got < 1_000_000  # bounded: the socket buffers and the limit's worth, not a million tokens
        stream = srv.client().completions.create(model="deepseek-v4", prompt=[word_id] * 8, max_tokens=5, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == WORD * 5  # others are served as usual
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def strict():
    srv = Server("--workers", "1", "--header-timeout", "1", "--timeout-keep-alive", "1")
    yield srv
    srv.stop()


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_slow_loris_headers_are_cut_off(strict):
    srv = strict
    before = metric(srv, "tokenmill_closed_connections_total", reason="header_timeout")
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    started = time.monotonic()
    closed = False
    for _ in range(50):  # a header byte every 0.1 s, for up to 5 s
        try:
            sock.sendall(b"X")
        except OSError:
            closed = True
            break
        sock.settimeout(0.1)
        try:
            if sock.recv(4096) == b"":
                closed = True
                break
        except socket.timeout:
            pass
        except ConnectionResetError:
            closed = True
            break
    assert closed, "the server kept a connection whose headers never ended"
    assert time.monotonic() - started < 4
    sock.close()
    silent = socket.create_connection(("127.0.0.1", srv.port))  # connects, sends nothing
    assert _closed_by_peer(silent, 4)
    silent.close()
    assert metric(srv, "tokenmill_closed_connections_total", reason="header_timeout") >= before + 2


def test_thousands_of_idle_connections_are_closed_and_health_still_answers(strict):
    srv = strict
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    idle_count = min(1500, (soft - 100) // 3)  # the server holds one fd for each as well
    keepalive_count = min(500, idle_count // 3)
    silent = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(idle_count)]
    kept = []
    for _ in range(keepalive_count):  # one request each, then idle on a keep-alive connection
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, _, body = parse_raw_response(read_raw_response(sock))
        assert status == 200 and body == b'{"status":"ok"}'
        kept.append(sock)
    t0 = time.perf_counter()
    probe = socket.create_connection(("127.0.0.1", srv.port))
    probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert parse_raw_response(read_raw_response(probe))[0] == 200
    probe.close()
    assert time.perf_counter() - t0 < 5
    deadline = time.monotonic() + 15
    for sock in silent + kept:
        assert _closed_by_peer(sock, max(0.1, deadline - time.monotonic())), "an idle connection stayed open"
        sock.close()
