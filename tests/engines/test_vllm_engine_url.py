"""`tokenmill serve --engine-url` against a real, unmodified vLLM server (the session stack's own `vllm
serve --enable-scale-out`, tests/vllm_stack.py): a client that hangs up and a stop string the workers
match each stop the request inside vLLM (its running count falls to zero while the request would have
gone on for 2,000 tokens), and a tokenmill whose chat template tokenizes differently from the server's is
refused at start with what differs, checked against vLLM's own /v1/chat/completions/render.

Outputs equal to vLLM's own server, field by field, are checked through this path by
tests/engines/test_vllm_field_parity.py, test_vllm_messages_parity.py and test_vllm_responses_parity.py.
"""

from __future__ import annotations

import re

import httpx
import pytest
from vllm_env import missing_reason

_why = missing_reason()
if _why:
    pytest.skip(_why, allow_module_level=True)

import vllm_stack  # noqa: E402
from conftest import FIXTURES, Server, http  # noqa: E402
from faultutil import wait_until  # noqa: E402
from vllm_stack import NAME  # noqa: E402

start_early = vllm_stack.start_early
stack = vllm_stack.module_fixture()

LONG = {"max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def running(stack) -> float:
    """vLLM's own count of the requests it is generating."""
    status, _, text = http("GET", stack.vllm.url + "/metrics")
    assert status == 200
    text = text.decode() if isinstance(text, bytes) else str(text)
    match = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    assert match, "vllm:num_requests_running not in vLLM's /metrics"
    return float(match.group(1))


def test_a_hang_up_and_a_stop_string_stop_the_request_inside_vllm(stack):
    front = stack.http_front
    aborts = '"POST /inference/v1/abort_requests HTTP/1.1" 200'  # vLLM's access log
    aborted_before = stack.vllm.log().count(aborts)
    with httpx.Client(timeout=60) as client:
        body = {"model": NAME, "messages": [{"role": "user", "content": "Tell me about the river"}], **LONG}
        with client.stream("POST", front.url + "/v1/chat/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            seen = []
            lines = response.iter_lines()  # kept: once collected, httpx closes the response, which hangs up
            for line in lines:
                if line.startswith("data: "):
                    seen.append(line)
                if sum('"content":"' in x for x in seen) >= 4:
                    break
            assert not any('"error"' in x for x in seen), seen
            # vLLM's gauge follows its engine's steps: read until it shows the request
            wait_until(lambda: running(stack) == 1, 20, what=f"vLLM running the request (stream so far: {seen})")
    # the hang-up: tokenmill aborts the request on the server (abort_requests, then its connection closes)
    wait_until(lambda: running(stack) == 0, 20, what="vLLM's running count back to zero")
    assert stack.vllm.log().count(aborts) == aborted_before + 1  # explicitly

    # a stop string, matched in the workers' text: vLLM would go on to 2,000 tokens; tokenmill aborts it
    greedy = stack.t.completions.create(model=NAME, prompt="The river wound slowly", max_tokens=8, temperature=0)
    stop = greedy.choices[0].text[len(greedy.choices[0].text) // 2 :][:3]
    answer = stack.http_front.client().completions.create(
        model=NAME,
        prompt="The river wound slowly",
        stop=[stop],
        extra_body={"ignore_eos": True},
        max_tokens=2000,
        temperature=0,
    )
    assert answer.choices[0].finish_reason == "stop" and stop not in answer.choices[0].text
    wait_until(lambda: running(stack) == 0, 20, what="vLLM's running count back to zero")
    assert stack.vllm.log().count(aborts) == aborted_before + 2


def test_another_tokenization_is_refused_with_what_differs(stack):
    """tokenmill with another chat template than the server's: the canary's IDs differ from vLLM's render."""
    template = FIXTURES / "chat_templates" / "chatml-openhermes-2.5-mistral-7b.jinja"
    front = Server(
        "--model",
        str(stack.model),
        "--chat-template",
        str(template),
        "--engine-url",
        stack.vllm.url,
        "--workers",
        "1",
        ready=False,
    )
    try:
        wait_until(
            lambda: (
                http("GET", front.url + "/debug/state")[2]["engine_bridges"][0]["exits"]
                if http("GET", front.url + "/health")[0] == 200
                else None
            ),
            60,
            what="the bridge's refusal",
        )
        status, _, ready = http("GET", front.url + "/ready")
        assert status == 503 and ready["engines"] == [{"url": stack.vllm.url, "connected": False}], ready
    finally:
        front.stop()
    out = front.output()
    assert "tokenizes the canary conversation differently" in out and "refused its engine" in out, out[-3000:]
