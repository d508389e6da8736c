"""`tokenmill serve --engine-url` against a real, unmodified vLLM server (the session stack's own `vllm
serve --enable-scale-out`, tests/vllm_stack.py): a client that hangs up and a stop string the workers
match each stop the request inside vLLM (its running count falls to zero while the request would have
gone on for 2,000 tokens), and a tokenmill whose chat template tokenizes differently from the server's is
refused at start with what differs, checked against vLLM's own /v1/chat/completions/render.

Replicas: a replica that starts after tokenmill (503s with Retry-After until then, then vLLM's own answers),
and kill -9 of one of two replicas under greedy streams, each then equal to its undisturbed run, while a
sampled stream on it ends with a clear error. Starting a second vLLM would take ~40 s here, so each
replica is a TCP forwarder (tests/tcp_forwarder.py) in front of the stack's one vLLM server, in its own
process: killing it closes its connections mid-stream and refuses later ones, as a replica whose server
process died does, while vLLM itself goes on serving the other replica.

Outputs equal to vLLM's own server, field by field, are checked through this path by
tests/engines/test_vllm_field_parity.py, test_vllm_messages_parity.py and test_vllm_responses_parity.py.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import openai
import pytest
from vllm_env import missing_reason

_why = missing_reason()
if _why:
    pytest.skip(_why, allow_module_level=True)

import vllm_stack  # noqa: E402
from conftest import FIXTURES, Server, free_port, http  # noqa: E402
from faultutil import metric, wait_until  # noqa: E402
from tcp_forwarder import Forwarder  # noqa: E402
from vllm_stack import LORA, LORA_TEST, MAX_MODEL_LEN, NAME, PARSERS, front_end, wait_all  # noqa: E402

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


# ---- replicas: TCP forwarders in front of the stack's vLLM server ---------------------------------


def engine_url_front(stack, *urls: str, ready: bool = True) -> Server:
    """`tokenmill serve` with the stack's settings (vllm_stack.front_end) in front of ``urls``, one replica each."""
    engines = [arg for url in urls for arg in ("--engine-url", url)]
    return Server(
        "--model", str(stack.model), *engines, "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
        "--workers", "1", *PARSERS, ready=ready, timeout=120,
    )  # fmt: skip


def ranks(front: Server) -> list[dict]:
    return http("GET", front.url + "/debug/state")[2]["scheduler_ranks"]


STORY = [{"role": "user", "content": "Tell me a story."}]


def test_a_replica_started_after_tokenmill_is_served_once_it_answers(stack):
    """No replica at start: 503s with Retry-After; the replica comes: tokenmill serves vLLM's own answer."""
    port = free_port()  # the replica's address: nothing listens there yet
    front = engine_url_front(stack, f"http://127.0.0.1:{port}", ready=False)
    forwarder = None
    try:
        body = {"model": NAME, "messages": STORY, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
        status, headers, error = wait_until(
            lambda: (r := http("POST", front.url + "/v1/chat/completions", body))[0] == 503 and r,
            60,
            what="a 503 while no replica serves",
        )
        assert error["error"]["code"] == "scheduler_unavailable" and headers.get("retry-after"), (headers, error)
        status, _, ready = http("GET", front.url + "/ready")
        assert status == 503 and ready["engines"] == [{"url": f"http://127.0.0.1:{port}", "connected": False}], ready

        forwarder = Forwarder(port, stack.vllm.port)
        wait_until(lambda: http("GET", front.url + "/ready")[0] == 200, 60, what="tokenmill serving the replica")
        status, _, ours = http("POST", front.url + "/v1/chat/completions", body, timeout=120)
        assert status == 200, ours
        status, _, theirs = http("POST", stack.vllm.url + "/v1/chat/completions", body, timeout=120)
        assert status == 200, theirs

        def essence(answer: dict) -> dict:
            choice = answer["choices"][0]
            return {
                "content": choice["message"]["content"],
                "reasoning": choice["message"].get("reasoning") or choice["message"].get("reasoning_content"),
                "token_ids": choice["token_ids"],
                "prompt_token_ids": answer["prompt_token_ids"],
                "finish_reason": choice["finish_reason"],
                "usage": {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
            }

        assert essence(ours) == essence(theirs)
        assert essence(ours)["token_ids"]
        assert front.stop() == 0
    finally:
        front.stop()
        if forwarder is not None:
            forwarder.stop()


# greedy, a fixed length (ignore_eos), long enough that the kill lands mid-stream; the generated token IDs too
GREEDY = {"temperature": 0, "max_tokens": 120, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
GREEDY_STREAMS = [{"messages": [{"role": "user", "content": f"Tell me about mill {i}"}], **GREEDY} for i in range(6)]
# sampled: it cannot go on on another replica; long, so that it is still running when the replica dies
SAMPLED = {
    "messages": [{"role": "user", "content": "Roll the dice"}],
    "temperature": 1,
    "seed": 7,
    "max_tokens": 1000,
    "extra_body": {"ignore_eos": True},
}


class Streams:
    """Chat streams, each in its own thread: what each has streamed so far (``progress``: content chunks),
    and at the end (text, finish reason, usage, token IDs), or ("error", code, message)."""

    def __init__(self, front: Server) -> None:
        self.front = front
        self.threads: list[threading.Thread] = []
        self.progress: list[int] = []
        self.results: list = []

    def start(self, body: dict) -> None:
        i = len(self.threads)
        self.progress.append(0)
        self.results.append(None)
        self.threads.append(threading.Thread(target=self._one, args=(i, body), daemon=True))
        self.threads[i].start()

    def _one(self, i: int, body: dict) -> None:
        text, finish, usage, ids = "", None, None, []
        try:
            for chunk in self.front.client().chat.completions.create(
                model=NAME, stream=True, stream_options={"include_usage": True}, **body
            ):
                if chunk.usage:
                    usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)
                for choice in chunk.choices:
                    if choice.delta.content:
                        text += choice.delta.content
                        self.progress[i] += 1
                    ids += getattr(choice, "token_ids", None) or []
                    finish = choice.finish_reason or finish
            self.results[i] = (text, finish, usage, ids)
        except openai.APIError as exc:
            self.results[i] = ("error", exc.code, str(exc))

    def join(self, timeout: float = 120) -> list:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), f"streams still open after {timeout} s: {self.progress}"
        return self.results


def test_a_replica_killed_mid_stream_and_its_greedy_streams_go_on_unbroken(stack):
    """kill -9 of one of two replicas while greedy streams run on both: each stream goes on on the other
    replica from its prompt and the tokens it had, and its client sees the same text, token IDs, finish
    and usage as an undisturbed run; the sampled stream that was on it ends with a clear error event."""
    a, b = free_port(), free_port()
    forwarders = [Forwarder(a, stack.vllm.port), Forwarder(b, stack.vllm.port)]
    front = None
    try:
        front = engine_url_front(stack, *(f.url for f in forwarders))
        wait_until(lambda: all(r["connected"] for r in ranks(front)), 60, what="both replicas")
        engines = http("GET", front.url + "/ready")[2]["engines"]
        assert [e["url"] for e in engines] == [f.url for f in forwarders], engines  # rank i is forwarder i

        undisturbed = Streams(front)
        for body in GREEDY_STREAMS:
            undisturbed.start(body)
        want = undisturbed.join()
        for got in want:
            assert got[1] == "length" and got[2][1] == GREEDY["max_tokens"] == len(got[3]), got

        disturbed = Streams(front)
        disturbed.start(SAMPLED)  # first: the replica it runs on is the one to kill
        victim = wait_until(
            lambda: [r["rank"] for r in ranks(front) if r["in_flight"]], 60, what="the sampled stream on a replica"
        )[0]
        for body in GREEDY_STREAMS:
            disturbed.start(body)
        # once every stream has content (the sampled one can then not move): how many the victim holds
        held = wait_until(
            lambda: all(disturbed.progress) and ranks(front)[victim]["in_flight"],
            60,
            interval=0.005,
            what="every stream streaming",
        )
        os.kill(forwarders[victim].pid, signal.SIGKILL)
        progress = list(disturbed.progress)
        got = disturbed.join()
        print(f"killed replica {victim} holding {held} streams; content chunks then: {progress}")
        assert held >= 2, f"the killed replica held only the sampled stream ({held})"
        assert got[1:] == want, [(i, g, w) for i, (g, w) in enumerate(zip(got[1:], want)) if g != w]
        assert got[0][:2] == ("error", "scheduler_unavailable"), got[0]
        assert metric(front, "tokenmill_stream_failovers_total", reason="rank_resumed") >= 1
        wait_until(lambda: [r["connected"] for r in ranks(front)][victim] is False, 30, what="the replica lost")
        # the forwarder's connections to vLLM closed with it: vLLM stopped the requests it was generating there
        wait_until(lambda: running(stack) == 0, 20, what="vLLM's running count back to zero")
        assert front.stop() == 0
    finally:
        if front is not None:
            front.stop()
        for f in forwarders:
            f.stop()


def test_a_lora_adapter_of_the_server_is_a_model_here_answering_as_vllm(stack):
    """vLLM serving a LoRA adapter (--enable-lora --lora-modules) lists it in /v1/models as a child of the
    base model: tokenmill in front of its token-in API lists it so too, and a chat or completion naming it
    gets what vLLM's own server gives for it (text, token IDs, the adapter as the model), different from
    the base model's answer."""
    assert LORA_TEST == test_a_lora_adapter_of_the_server_is_a_model_here_answering_as_vllm.__name__
    wait_all(stack.lora)
    front = front_end(stack.model, "--engine-url", stack.lora.url)
    try:
        cards = {card["id"]: card for card in front.client().models.list().model_dump()["data"]}
        assert (cards[NAME]["parent"], cards[LORA]["parent"]) == (None, NAME), cards
        greedy = {"max_tokens": 8, "temperature": 0, "extra_body": {"return_token_ids": True}}
        chat = [{"role": "user", "content": "Write a query for the mill's ledger"}]
        answers = {}
        for model in (LORA, NAME):
            theirs = stack.lora.client().chat.completions.create(model=model, messages=chat, **greedy)
            ours = front.client().chat.completions.create(model=model, messages=chat, **greedy)
            assert ours.model == theirs.model == model
            assert (ours.choices[0].token_ids, ours.choices[0].message.content) == (
                theirs.choices[0].token_ids,
                theirs.choices[0].message.content,
            ), model
            answers[model] = ours.choices[0].token_ids
            theirs = stack.lora.client().completions.create(model=model, prompt="The mill wheel", **greedy)
            ours = front.client().completions.create(model=model, prompt="The mill wheel", **greedy)
            assert ours.model == model and ours.choices[0].token_ids == theirs.choices[0].token_ids, model
        assert answers[LORA] != answers[NAME]  # the adapter changes the model
    finally:
        assert front.stop() == 0
