"""Helpers for the fault, overload, security and fuzz tests.

Everything here is bounded: every wait has a deadline, every socket a timeout.
Nothing asserts a duration; time only bounds waits.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from conftest import ROOT, http

ERROR_FIELDS = {"message", "type", "param", "code"}
CHAT_MODEL = "deepseek-v4"
_WORDS = (
    "alpha beta gamma delta tokenizer river valley mill wheel harvest bell swallow kite "
    "Köln 東京 naïve résumé 🙂 1234 0x1f {json} <tag> snake_case CamelCase"
).split()


# ---- waiting ------------------------------------------------------------------------------


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll predicate() until it returns something truthy; return it, or raise after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except OSError as exc:  # the server may be restarting something; keep polling
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last value: {last!r}")


# ---- server introspection -------------------------------------------------------------------


def state(srv) -> dict:
    status, _, body = http("GET", srv.url + "/debug/state", timeout=10)
    assert status == 200 and isinstance(body, dict), (status, body)
    return body


def metric(srv, name: str, **labels) -> float:
    """Sum of the samples of one metric whose labels include the given ones (0 when absent)."""
    status, _, text = http("GET", srv.url + "/metrics", timeout=10)
    assert status == 200
    text = text.decode() if isinstance(text, bytes) else str(text)
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            total += float(match.group(4))
    return total


def idle(srv) -> dict | None:
    """The /debug/state when nothing is in flight, else None (for wait_until)."""
    s = state(srv)
    quiet = (
        s["generations"] == 0
        and s["queued_conversions"] == 0
        and s["conversions_in_flight"] == 0
        and s.get("scheduler_requests", 0) == 0
    )
    return s if quiet else None


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_gone(pid: int, started: int | None = None) -> bool:
    """True once the process no longer runs: os.kill(pid, 0) raises ProcessLookupError, or it
    is a zombie waiting for a reaper (PID 1 of a container may be slow to reap), or the pid now
    belongs to another process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    if fields[0] in ("Z", "X"):
        return True
    return started is not None and int(fields[19]) != started


def tokenizer_worker_pids(srv) -> list[int]:
    return [p for p in srv.children() if "tokenizer worker" in _safe_cmdline(p)]


def _safe_cmdline(pid: int) -> str:
    try:
        return cmdline(pid)
    except OSError:
        return ""


# ---- request bodies ------------------------------------------------------------------------------


def long_text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def chat_body(content: str, max_tokens: int = 4, stream: bool = False, **extra) -> dict:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def assert_openai_error(body, status: int | None = None, code: str | None = None) -> dict:
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"not an OpenAI error body: {body!r}"
    err = body["error"]
    assert set(err) == ERROR_FIELDS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- raw HTTP: disconnect tricks and SSE reading -------------------------------------------------


class RawRequest:
    """One HTTP/1.1 request on its own socket, read by hand (so the test can hang up at will)."""

    def __init__(self, url: str, path: str, body: dict | bytes, headers: dict | None = None, timeout: float = 30.0):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}:{port}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
            "Connection: close",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        self.file = self.sock.makefile("rb")
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self._chunked = False
        self._buf = b""
        self._eof = False

    def read_head(self) -> int:
        line = self.file.readline()
        if not line:
            raise ConnectionError("the server closed the connection before answering")
        self.status = int(line.split()[1])
        while True:
            line = self.file.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        return self.status

    def _more(self) -> bool:
        if self._eof:
            return False
        if self._chunked:
            size_line = self.file.readline()
            if not size_line:
                self._eof = True
                return False
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.file.readline()
                self._eof = True
                return False
            data = self.file.read(size)
            self.file.readline()
        else:
            data = self.file.read1(65536)
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    def body(self) -> bytes:
        if self.status is None:
            self.read_head()
        if not self._chunked and "content-length" in self.headers:
            want = int(self.headers["content-length"])
            while len(self._buf) < want and self._more():
                pass
            return self._buf
        while self._more():
            pass
        return self._buf

    def json(self):
        return json.loads(self.body())

    def events(self):
        """SSE data payloads as they arrive: dicts, or the string "[DONE]"."""
        if self.status is None:
            self.read_head()
        while True:
            while b"\n\n" not in self._buf:
                if not self._more():
                    if self._buf.strip():
                        raise AssertionError(f"stream ended inside an event: {self._buf[:200]!r}")
                    return
            event, self._buf = self._buf.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data: "):
                    payload = line[6:].decode()
                    yield payload if payload == "[DONE]" else json.loads(payload)

    def hang_up(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.file.close()
        self.sock.close()


# ---- outcome accounting ------------------------------------------------------------------------------


@dataclass
class Ledger:
    """What a fault test sent and how each request ended. lost = sent - answered."""

    name: str
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    unclear: list = field(default_factory=list)

    def send(self, n: int = 1) -> None:
        self.sent += n

    def answer(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def bad(self, what) -> None:
        """A request that ended without a response or a clear error."""
        self.unclear.append(what)

    @property
    def answered(self) -> int:
        return sum(self.outcomes.values())

    @property
    def lost(self) -> int:
        return self.sent - self.answered

    def report(self) -> str:
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items()))
        text = f"[{self.name}] sent {self.sent}; answered {self.answered} ({parts}); lost {self.lost}"
        if self.unclear:
            text += f"; UNCLEAR {self.unclear}"
        print(text)
        return text

    def check(self) -> None:
        text = self.report()
        assert not self.unclear, text
        assert self.lost == 0, text


def error_code_of(exc) -> str:
    """'<status> <code>' for an openai.APIStatusError, the class name for anything else."""
    status = getattr(exc, "status_code", None)
    if status is None:
        return type(exc).__name__
    body = getattr(exc, "body", None)
    code = None
    if isinstance(body, dict):
        code = body.get("code") if "code" in body else (body.get("error") or {}).get("code")
    return f"{status} {code}"


# ---- a standalone simulated scheduler -------------------------------------------------------------


class Simulator:
    """`tokenmill simulate-scheduler` as a subprocess of the test (not of the gateway)."""

    def __init__(self, endpoint: str, *args: str):
        self.endpoint = endpoint
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "simulate-scheduler", "--bind", self.endpoint, *self.args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def repo_path(*parts: str) -> Path:
    return ROOT.joinpath(*parts)


def parse_raw_response(raw: bytes) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, de-chunked body) of one raw HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        return status, headers, rest
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return status, headers, body


def read_raw_response(sock: socket.socket, timeout: float = 15.0) -> bytes:
    """Read one whole HTTP/1.1 response (Content-Length or chunked) or until the peer closes."""
    sock.settimeout(timeout)
    data = b""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower and rest.endswith(b"0\r\n\r\n"):
                return data
            for line in lower.split(b"\r\n"):
                if line.startswith(b"content-length:") and len(rest) >= int(line.split(b":")[1]):
                    return data
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
