"""The gateway's loop never renders or tokenizes: /health answers while a conversion grinds.

A chat template with a busy loop (sized by a template kwarg) makes one conversion take
seconds. With worker processes, /health keeps answering the whole time; with conversion
on the gateway loop (the benchmark's ``inline`` baseline) it does not, which shows the
test can tell the two apart. Counts of answers are compared, never durations.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.request

import pytest
from conftest import Server

SLOW_TEMPLATE = (
    "{% for i in range(slow) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)
SLOW = 20000  # 20M template loop iterations: a few seconds of CPU in whoever renders


def health_answers_during_slow_request(srv: Server) -> tuple[int, str | None]:
    model = srv.client().models.list().data[0].id
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "chat_template_kwargs": {"slow": SLOW},
        }
    )
    sent = threading.Event()
    answered_head = threading.Event()  # the chat's answer has begun: the conversion is over
    result: dict = {}

    def slow_request():
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            sent.set()  # the whole request is on the wire: from here on the gateway is converting it
            resp = conn.getresponse()
            answered_head.set()
            result["status"] = resp.status
            resp.read()
        except Exception as exc:  # reported by the caller
            result["error"] = repr(exc)
        finally:
            sent.set()
            answered_head.set()
            conn.close()

    thread = threading.Thread(target=slow_request)
    thread.start()
    sent.wait(30)
    answered = 0
    for _ in range(5000):  # bounded; ends as soon as the slow request is answered
        if answered_head.is_set():  # not the thread's end: reading the rest and closing come after
            break
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=60) as resp:
                if resp.status == 200 and not answered_head.is_set():
                    answered += 1
        except OSError:
            pass
    thread.join(60)
    if result.get("status") != 200:
        return answered, result.get("error") or f"status {result.get('status')}"
    return answered, None


@pytest.fixture
def slow_template(tmp_path):
    path = tmp_path / "slow.jinja"
    path.write_text(SLOW_TEMPLATE)
    return str(path)


@pytest.mark.parametrize(
    "mode, workers_or_mode",
    [
        ("pool", ("--workers", "1")),  # tokenizer worker processes: /health keeps answering
        ("inline", ("--conversion-mode", "inline")),
    ],  # the control: conversion on the loop starves /health
)
def test_health_answers_only_when_conversion_is_off_the_loop(slow_template, mode, workers_or_mode):
    srv = Server(*workers_or_mode, "--chat-template", slow_template, "--sim-inter-token-latency-ms", "1")
    try:
        answered, error = health_answers_during_slow_request(srv)
    finally:
        srv.stop()
    assert error is None
    print(f"{mode} mode: /health answered {answered} times while the slow conversion ran")
    # Apart by more than either bound's margin. Some answers slip in around a conversion on the loop: before
    # it starts (the request's body read and checked) and after it ends (the one token, then the answer's
    # head); each takes a millisecond or less, so the faster the machine the more: 3 to 21 seen.
    if mode == "pool":
        assert answered >= 100  # about 1,500 here alone
    else:
        assert answered <= 60
