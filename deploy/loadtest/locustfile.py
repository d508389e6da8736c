"""Load test for a tokenmill node: the OpenAI chat API under a mix of realistic clients.

    locust -f deploy/loadtest/locustfile.py --host http://NODE:8000 --headless -u 50 -r 10 --run-time 5m --csv out

User classes (pick some by naming them after the options, e.g. ``... StreamingChatUser``):

* ShortChatUser      short one-shot chats, not streamed ("short chat")
* LongContextUser    a long document (LOADTEST_LONG_CONTEXT_TOKENS tokens, 32000 by default,
                     generated deterministically) and a question about it ("long-context chat")
* StreamingChatUser  streamed chats ("chat stream"). The POST row times the response headers;
                     each stream also records its time to first token as request type TTFT,
                     every gap between two arrivals of text as request type ITL, and the whole
                     stream, request to [DONE], as request type E2E (all in milliseconds)
* MultiTurnUser      an agent-like conversation that grows turn by turn, resending the whole
                     history each time, for up to LOADTEST_TURNS turns ("multi-turn chat")

A response counts as failed when its status is not 200, its JSON or SSE is malformed, it
carries an error, or it lacks the fields a client relies on (choices, finish_reason, usage).

Environment:
  LOADTEST_MODEL                model to ask for (default: the first of GET /v1/models)
  LOADTEST_API_KEY              bearer token (default: TOKENMILL_API_KEY, else none)
  LOADTEST_LONG_CONTEXT_TOKENS  approximate prompt length of LongContextUser (default 32000)
  LOADTEST_MAX_TOKENS           max_tokens of each request (default 64)
  LOADTEST_TURNS                turns before a MultiTurnUser starts a new conversation (default 8)
  LOADTEST_SEED                 seed of the generated text (default 0)
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time

from locust import HttpUser, between, events, task

MAX_TOKENS = int(os.environ.get("LOADTEST_MAX_TOKENS", "64"))
LONG_CONTEXT_TOKENS = int(os.environ.get("LOADTEST_LONG_CONTEXT_TOKENS", "32000"))
TURNS = int(os.environ.get("LOADTEST_TURNS", "8"))
SEED = int(os.environ.get("LOADTEST_SEED", "0"))
API_KEY = os.environ.get("LOADTEST_API_KEY") or os.environ.get("TOKENMILL_API_KEY")
CHAT = "/v1/chat/completions"

WORDS = (
    "the scheduler batches requests while the gateway streams tokens back to each client and a pool of "
    "tokenizer workers renders chat templates converts text into token ids and turns generated ids back "
    "into text so that the event loop only routes bytes between sockets queues latency throughput memory "
    "prefill decode cache context window attention layer model weights quantization replica node cluster "
    "operator dashboard alert metric histogram percentile budget capacity report summary question answer"
).split()
SHORT_PROMPTS = [
    "Say hello in three languages.",
    "What is the capital of France?",
    "Give me a haiku about load balancers.",
    "Explain TCP keep-alive in one sentence.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into German.",
    "What does an inference gateway do?",
    "Name a sorting algorithm and its complexity.",
]
AGENT_STEPS = [
    "You are helping me debug a failing deployment. The service exits with status 1 on start. What do you check first?",
    "The journal says: 'Address already in use' on port 8000. What next?",
    "ss -ltnp shows an old process still bound to the port. How do I stop it safely?",
    "Done. Now it starts, but /ready returns 503 with scheduler_connected false. Ideas?",
    "The scheduler endpoint was a typo. Fixed. Summarize what we changed, as a checklist.",
    "Write the systemd drop-in that orders tokenmill after the scheduler.",
    "Now propose an alert for this failure so we hear about it before users do.",
    "Condense the whole conversation into a short incident report.",
]

_model_lock = threading.Lock()
_model_name: str | None = os.environ.get("LOADTEST_MODEL")
_tokens_per_word: float | None = None
_user_numbers = itertools.count()


def headers() -> dict:
    h = {"Content-Type": "application/json"}
    if API_KEY:
        h["Authorization"] = f"Bearer {API_KEY}"
    return h


def words(n: int, seed) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def document(index: int, tokens_per_word: float) -> str:
    """A deterministic document of about LONG_CONTEXT_TOKENS tokens, in paragraphs."""
    count = max(1, int(LONG_CONTEXT_TOKENS / tokens_per_word))
    text = words(count, f"{SEED}-doc-{index}").split(" ")
    paragraphs = [" ".join(text[i : i + 120]).capitalize() + "." for i in range(0, len(text), 120)]
    return f"Document {index}:\n\n" + "\n\n".join(paragraphs)


class ChatUser(HttpUser):
    """What every user class shares: the model name, and checking a non-streamed answer."""

    abstract = True
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        global _model_name
        with _model_lock:
            if _model_name is None:
                with self.client.get("/v1/models", headers=headers(), name="/v1/models", catch_response=True) as resp:
                    try:
                        _model_name = resp.json()["data"][0]["id"]
                    except (ValueError, KeyError, IndexError, TypeError):
                        resp.failure(f"cannot read /v1/models: {resp.status_code} {resp.text[:200]!r}")
                        return
        self.model = _model_name
        self.rng = random.Random(f"{SEED}-{type(self).__name__}-{next(_user_numbers)}")

    def chat(self, name: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> str | None:
        """POST a chat, check the answer; its text, or None when it failed."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.7}
        with self.client.post(CHAT, json=body, headers=headers(), name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]!r}")
                return None
            try:
                data = resp.json()
                choice = data["choices"][0]
                text = choice["message"]["content"]
                usage = data["usage"]
                assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), choice
                assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, usage
            except (ValueError, KeyError, IndexError, TypeError, AssertionError) as exc:
                resp.failure(f"malformed answer ({type(exc).__name__}: {exc}): {resp.text[:300]!r}")
                return None
            resp.success()
            return text


class ShortChatUser(ChatUser):
    weight = 4

    @task
    def short_chat(self) -> None:
        self.chat(
            "short chat", [{"role": "user", "content": self.rng.choice(SHORT_PROMPTS)}], max_tokens=min(32, MAX_TOKENS)
        )


class LongContextUser(ChatUser):
    weight = 1
    wait_time = between(2.0, 5.0)
    documents: dict[int, str] = {}

    def on_start(self) -> None:
        super().on_start()
        self.tokens_per_word = self.calibrate()

    def calibrate(self) -> float:
        """Tokens per generated word for this model's tokenizer, asked once of /tokenize."""
        global _tokens_per_word
        with _model_lock:
            if _tokens_per_word is None:
                sample = words(2000, f"{SEED}-calibration")
                body = {"model": self.model, "prompt": sample, "add_special_tokens": False}
                with self.client.post(
                    "/tokenize", json=body, headers=headers(), name="/tokenize (calibration)", catch_response=True
                ) as resp:
                    try:
                        _tokens_per_word = resp.json()["count"] / 2000
                    except (ValueError, KeyError, TypeError):
                        resp.failure(f"cannot calibrate: {resp.status_code} {resp.text[:200]!r}")
                        return 1.3  # typical for English text
            return _tokens_per_word

    @task
    def long_context_chat(self) -> None:
        index = self.rng.randrange(4)  # a few documents: some prompts repeat, as in real traffic
        if index not in self.documents:
            self.documents[index] = document(index, self.tokens_per_word)
        question = self.rng.choice(["Summarize the document.", "Which words occur most often?", "Give it a title."])
        messages = [
            {"role": "system", "content": "Answer questions about the document the user gives you."},
            {"role": "user", "content": self.documents[index] + "\n\n" + question},
        ]
        self.chat("long-context chat", messages)


class StreamingChatUser(ChatUser):
    weight = 3

    @task
    def chat_stream(self) -> None:
        name = "chat stream"
        prompt = self.rng.choice(SHORT_PROMPTS) + " " + words(self.rng.randrange(20, 200), self.rng.random())
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        size = 0
        arrivals: list[float] = []  # when text arrived, one entry per network read that carried some
        with self.client.post(CHAT, json=body, headers=headers(), name=name, stream=True, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]!r}")
                return
            if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                resp.failure(f"not an event stream: {resp.headers.get('content-type')!r}")
                return
            problem = None
            done = finished = False
            usage = None
            text_chunks = 0
            buffer = b""
            try:
                for data in resp.iter_content(chunk_size=None):
                    now = time.perf_counter()
                    size += len(data)
                    buffer += data
                    got_text = False
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data: "):
                                if line.strip():
                                    problem = problem or f"not an SSE data line: {line[:100]!r}"
                                continue
                            payload = line[6:]
                            if payload == b"[DONE]":
                                done = True
                                continue
                            if done:
                                problem = problem or "data after [DONE]"
                            chunk = json.loads(payload)
                            if "error" in chunk:
                                problem = problem or f"error event: {chunk['error']}"
                                continue
                            if chunk.get("object") != "chat.completion.chunk":
                                problem = problem or f"unexpected object {chunk.get('object')!r}"
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                            for choice in chunk.get("choices", []):
                                if choice.get("delta", {}).get("content"):
                                    got_text = True
                                    text_chunks += 1
                                if choice.get("finish_reason") is not None:
                                    finished = True
                    if got_text:
                        arrivals.append(now)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                problem = problem or f"malformed stream ({type(exc).__name__}: {exc})"
            if problem is None:
                if buffer.strip():
                    problem = f"stream ended mid-event: {buffer[:100]!r}"
                elif not done:
                    problem = "stream ended without data: [DONE]"
                elif not finished:
                    problem = "no finish_reason"
                elif not arrivals:
                    problem = "no text"
                elif not usage or usage.get("completion_tokens", 0) <= 0:
                    problem = f"no usage chunk with completion_tokens: {usage!r}"
            if problem:
                resp.failure(problem)
                return
            resp.success()
            end = time.perf_counter()
        events.request.fire(
            request_type="E2E",
            name=name,
            response_time=(end - start) * 1000,
            response_length=size,
            exception=None,
            context={},
        )
        events.request.fire(
            request_type="TTFT",
            name=name,
            response_time=(arrivals[0] - start) * 1000,
            response_length=0,
            exception=None,
            context={},
        )
        for before, after in zip(arrivals, arrivals[1:]):
            events.request.fire(
                request_type="ITL",
                name=name,
                response_time=(after - before) * 1000,
                response_length=0,
                exception=None,
                context={},
            )


class MultiTurnUser(ChatUser):
    weight = 2
    wait_time = between(1.0, 3.0)  # an agent thinks (runs tools) between turns

    def on_start(self) -> None:
        super().on_start()
        self.new_conversation()

    def new_conversation(self) -> None:
        self.history = [{"role": "system", "content": "You are a careful site-reliability assistant. Be concise."}]
        self.turn = 0

    @task
    def next_turn(self) -> None:
        step = AGENT_STEPS[self.turn % len(AGENT_STEPS)]
        if self.turn % 3 == 2:  # now and then a tool result joins the history, as agents do
            step += "\n\nTool output:\n" + words(self.rng.randrange(100, 400), self.rng.random())
        self.history.append({"role": "user", "content": step})
        reply = self.chat("multi-turn chat", self.history)
        if reply is None:
            self.new_conversation()  # a failed turn ends the conversation, as it would for an agent
            return
        self.history.append({"role": "assistant", "content": reply})
        self.turn += 1
        if self.turn >= TURNS:
            self.new_conversation()
