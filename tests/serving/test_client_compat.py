"""Real clients against tokenmill: no request a client of vLLM's sends may get a 400
that vLLM 0.32's own server would not give.

tests/client_requests/*.json hold request bodies captured from the clients themselves by
tests/client_capture.py (the official `openai` SDK with every chat.completions / completions
option, LangChain's ChatOpenAI and OpenAI, LiteLLM's "openai/" and "hosted_vllm/" providers,
`vllm bench serve`'s own request functions, guidellm's OpenAI HTTP backend); each file names the
client and the version that sent them. Every body is replayed against a real `tokenmill serve` on
the simulated scheduler. Then the clients that install beside tokenmill (langchain-openai,
litellm: the `test` extras) are run live against it: invoke, stream, a scripted tool call.

Where tokenmill and vLLM differ, the case is listed below with the reason, found by reading vLLM
0.32's vllm/entrypoints/openai/ (and checked by test_vllm_request_models_agree, which validates
every captured body with vLLM's own request models where ./scripts/test.sh built .venv-vllm):
  VLLM_REFUSES  vLLM answers 400; tokenmill must refuse it too, or accept it (never worse)
  NOT_YET       tokenmill answers 400 where vLLM would not: strict xfail, so a fix flips them
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest
import vllm_env
from conftest import Server, http

MODEL = "deepseek-v4"
HERE = Path(__file__).resolve().parents[1]  # tests/, where client_requests/ is
REQUESTS = HERE / "client_requests"

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# what the simulated model says to the captured prompts (others get paragraph text, up to the context)
REPLIES = [
    ("Say hello", "Hello there."),
    ("Once upon a time", " there was a mill."),
    ("one two three", " nine ten."),
    ("weather in Paris", f'Let me look.{B}{CB}get_weather{S}{{"city": "Paris"}}{CE}{E}'),
    ("Weather in Paris", f'{B}{CB}get_weather{S}{{"city": "Paris"}}{CE}{E}'),
    ("sunny, 21", "It is sunny in Paris, at 21 °C."),
]


def _load() -> list[tuple[str, dict, dict]]:
    cases = []
    for path in sorted(REQUESTS.glob("*.json")):
        fixture = json.loads(path.read_text(encoding="utf-8"))
        for entry in fixture["requests"]:
            cases.append((f"{fixture['client']}:{entry['name']}", fixture, entry))
    return cases


CASES = _load()

# vLLM 0.32 refuses these with a 400 (all in its request models' validators, before any engine):
# case -> (the param vLLM names, does tokenmill refuse it too?, where vLLM refuses it)
VLLM_REFUSES = {
    "openai-python:chat.misuse_stream_options_without_stream": (
        "stream_options",
        True,
        "chat_completion/protocol.py ChatCompletionRequest.validate_stream_options: "
        "'Stream options can only be defined when `stream=True`.'",
    ),
    "openai-python:completions.misuse_stream_options_without_stream": (
        "stream_options",
        True,
        "completion/protocol.py CompletionRequest.validate_stream_options: the same",
    ),
    "openai-python:chat.misuse_top_logprobs_without_logprobs": (
        "top_logprobs",
        True,
        "ChatCompletionRequest.check_logprobs: 'when using `top_logprobs`, `logprobs` must be set to true.'",
    ),
    "openai-python:chat.misuse_tools_empty": (
        "tools",
        False,
        "ChatCompletionRequest.check_tool_usage: '`tools` must not be an empty array.' "
        "(tokenmill takes tools: [] as no tools)",
    ),
    "openai-python:chat.misuse_tool_choice_without_tools": (
        "tool_choice",
        True,
        "ChatCompletionRequest.check_tool_usage: 'When using `tool_choice`, `tools` must be set.'",
    ),
}

_VLLM_IGNORES = (
    "vLLM 0.32 has no such field: its OpenAIBaseModel has extra='allow' and only logs it "
    "(serve/engine/protocol.py), so it answers 200"
)
# tokenmill answers 400 where vLLM 0.32 would not: case -> (the param tokenmill names, why vLLM accepts it)
NOT_YET = {
    "openai-python:chat.extra_body_priority": (
        "priority",
        "priority refused on purpose by an engine that does not schedule by priority (as refusing what "
        "the engine cannot do asks; the simulator's default is fcfs): vLLM 0.32 takes it and, under its default fcfs policy, drops it",
    ),
    "openai-python:completions.extra_body_priority": (
        "priority",
        "priority refused on purpose by an engine that does not schedule by priority: as for chat",
    ),
    "openai-python:completions.best_of_2": (
        "best_of",
        f"field best_of refused by tokenmill (docs/api/request-fields.md); {_VLLM_IGNORES}",
    ),
    "openai-python:chat.modalities_audio": (
        "audio",
        f"fields audio/modalities ['text', 'audio'] refused by tokenmill (no audio output); {_VLLM_IGNORES}",
    ),
    "openai-python:chat.prediction": ("prediction", f"field prediction refused by tokenmill; {_VLLM_IGNORES}"),
    "openai-python:chat.web_search_options": (
        "web_search_options",
        f"field web_search_options refused by tokenmill; {_VLLM_IGNORES}",
    ),
    "openai-python:chat.verbosity": ("verbosity", f"field verbosity refused by tokenmill; {_VLLM_IGNORES}"),
}


@pytest.fixture(scope="module")
def replies_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("replies") / "replies.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for match, text in REPLIES:
            f.write(json.dumps({"match": match, "text": text}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tm(replies_file):
    """The embedded model (its tool-call and reasoning parsers on, as served by default), a scripted
    simulated model, no decode delay, a small context so that a body without max_tokens ends soon."""
    srv = Server(
        "--workers", "1", "--sim-inter-token-latency-ms", "0", "--max-model-len", "2048", "--sim-replies", replies_file
    )
    yield srv
    srv.stop()


def _send(srv: Server, entry: dict) -> tuple[int, object]:
    """(status, parsed answer): a JSON body, or the list of a stream's data events ([DONE] as the string)."""
    headers = {k: v for k, v in (entry.get("headers") or {}).items() if k != "content-type"}
    body = entry["body"]
    if not (isinstance(body, dict) and body.get("stream")):
        status, _, answer = http(entry["method"], srv.url + entry["path"], body, headers=headers, timeout=60)
        return status, answer
    req = urllib.request.Request(
        srv.url + entry["path"],
        json.dumps(body).encode(),
        method=entry["method"],
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    events = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return status, events


class StillRefused(AssertionError):
    """A NOT_YET case got the 400 naming its field that the xfail mark expects (nothing else counts)."""


def _case_params():
    params = []
    for case, fixture, entry in CASES:
        marks = []
        if case in NOT_YET:
            marks.append(pytest.mark.xfail(strict=True, raises=StillRefused, reason=NOT_YET[case][1]))
        params.append(pytest.param(fixture, entry, id=case, marks=marks))
    return params


def test_the_fixtures_cover_every_client():
    """Each client this suite replays has its captured bodies here, with the version that sent them."""
    clients = {}
    for path in REQUESTS.glob("*.json"):
        fixture = json.loads(path.read_text(encoding="utf-8"))
        assert fixture["version"] and fixture["requests"], path
        assert path.stem == fixture["client"]
        clients[fixture["client"]] = fixture["version"]
    assert set(clients) == {"openai-python", "langchain-openai", "litellm", "vllm-bench", "guidellm"}, clients
    # the listed differences name captured cases (a re-capture that renames one must update them)
    ids = {case for case, _, _ in CASES}
    assert set(VLLM_REFUSES) <= ids and set(NOT_YET) <= ids
    assert not set(VLLM_REFUSES) & set(NOT_YET)


@pytest.mark.parametrize("fixture,entry", _case_params())
def test_replay_captured_request(tm, fixture, entry):
    """The body a real client sent gets what vLLM 0.32 would give it: 200 and a well-formed answer,
    or, where vLLM refuses it, the same 400 or (kinder) a 200."""
    case = f"{fixture['client']}:{entry['name']}"
    status, answer = _send(tm, entry)
    if case in VLLM_REFUSES:
        param, refuses, _ = VLLM_REFUSES[case]
        if refuses:
            assert status == 400 and answer["error"]["param"] == param, (status, answer)
        else:
            assert status == 200, (status, answer)
        return
    if case in NOT_YET and status == 400 and answer["error"]["param"] == NOT_YET[case][0]:
        raise StillRefused(answer["error"]["message"])
    assert status == 200, f"{case}: {status} {json.dumps(answer)[:600] if not isinstance(answer, bytes) else answer}"
    body, path = entry["body"] or {}, entry["path"]
    if isinstance(answer, list):  # a stream
        assert answer and answer[-1] == "[DONE]", answer[-3:]
        events = answer[:-1]
        assert not [e for e in events if "error" in e], events
        assert events and all(e["object"].endswith("chunk") or e["object"] == "text_completion" for e in events)
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0, events[-1]
            if options.get("continuous_usage_stats"):  # guidellm's and vllm bench's timing reads every chunk's
                assert all(e.get("usage") for e in events), [e for e in events if not e.get("usage")][:2]
        assert any(c.get("finish_reason") for e in events for c in e["choices"]), events[-3:]
    elif path.endswith("/chat/completions"):
        n = body.get("n") or 1
        assert len(answer["choices"]) == n and all(c["finish_reason"] for c in answer["choices"]), answer
        assert answer["usage"]["completion_tokens"] > 0
    elif path.endswith("/completions"):
        assert answer["choices"] and all(c["finish_reason"] for c in answer["choices"]), answer
    elif path.endswith("/tokenize"):
        assert answer["tokens"] and answer["count"] == len(answer["tokens"]), answer
    elif path.endswith("/detokenize"):
        assert isinstance(answer["prompt"], str), answer
    elif path.endswith("/models"):
        assert [card["id"] for card in answer["data"]] == [MODEL], answer


def test_request_id_header_names_the_response(tm):
    """`vllm bench serve --request-id-prefix` sends x-request-id: the response's id carries it, as vLLM's."""
    entry = next(e for c, _, e in CASES if c == "vllm-bench:openai-chat.request_id")
    assert entry["headers"]["x-request-id"] == "bench-0"
    status, events = _send(tm, entry)
    assert status == 200 and events[0]["id"] == "chatcmpl-bench-0", events[0]


_VLLM_CHECK = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
models = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
verdicts = {}
for case, path, body in json.load(sys.stdin):
    try:
        models[path].model_validate(body)
        verdicts[case] = None
    except Exception as exc:
        verdicts[case] = getattr(exc, "parameter", None) or str(exc)
print(json.dumps(verdicts))
"""


def test_vllm_request_models_agree():
    """vLLM 0.32's own request models (run in .venv-vllm) validate every captured chat and completions
    body except the ones VLLM_REFUSES lists, and refuse those naming the same parameter: the lists
    above are vLLM's verdicts, not guesses. (Checks beyond the request models, in vLLM's serving
    code, were read: none of them refuses a captured body; NOT_YET says why each is accepted.)"""
    if reason := vllm_env.missing_reason():
        pytest.skip(reason)
    bodies = [
        (case, e["path"], e["body"]) for case, _, e in CASES if e["path"] in ("/v1/chat/completions", "/v1/completions")
    ]
    proc = subprocess.run(
        [str(vllm_env.VLLM_PYTHON), "-c", _VLLM_CHECK],
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = json.loads(proc.stdout.strip().splitlines()[-1])
    refused = {case: verdict for case, verdict in verdicts.items() if verdict is not None}
    assert set(refused) == set(VLLM_REFUSES), refused
    for case, verdict in refused.items():
        assert VLLM_REFUSES[case][0] in verdict, (case, verdict)


# ---- the clients themselves, live against tokenmill --------------------------------------------


def test_langchain_openai_invoke_stream_tools_structured(tm):
    langchain_openai = pytest.importorskip("langchain_openai")
    import pydantic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = langchain_openai.ChatOpenAI(
        base_url=tm.url + "/v1",
        api_key="unused",
        model=MODEL,
        max_retries=0,
        max_tokens=64,
        stream_usage=True,
        timeout=60,
    )
    reply = llm.invoke("Say hello.")
    assert reply.content == "Hello there." and reply.response_metadata["finish_reason"] == "stop"
    assert reply.usage_metadata["output_tokens"] > 0

    chunks = list(llm.stream("Say hello."))
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined += chunk
    assert joined.content == "Hello there."
    assert joined.usage_metadata["output_tokens"] == reply.usage_metadata["output_tokens"]

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny, 21"

    with_tools = llm.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Paris?")
    call = with_tools.invoke([question])
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "Paris"})], call
    assert call.content == "Let me look."
    streamed = None
    for chunk in with_tools.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris"})]
    answer = with_tools.invoke([question, call, ToolMessage("sunny, 21", tool_call_id=call.tool_calls[0]["id"])])
    assert answer.content == "It is sunny in Paris, at 21 °C." and not answer.tool_calls

    class City(pydantic.BaseModel):
        city: str
        temperature: int

    for method in ("json_schema", "function_calling"):  # json_mode has no schema: any JSON object will do
        city = llm.with_structured_output(City, method=method).invoke("A city and its temperature, in JSON.")
        assert isinstance(city, City), (method, city)


@pytest.fixture(scope="module")
def litellm_module():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map at import
    return pytest.importorskip("litellm")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # pydantic on litellm's models
@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_completion_stream_tools(tm, litellm_module, provider):
    litellm = litellm_module
    base = {
        "model": f"{provider}/{MODEL}",
        "api_base": tm.url + "/v1",
        "api_key": "unused",
        "num_retries": 0,
        "timeout": 60,
        "max_tokens": 64,
    }
    hello = [{"role": "user", "content": "Say hello."}]
    reply = litellm.completion(messages=hello, **base)
    assert reply.choices[0].message.content == "Hello there." and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0

    stream = litellm.completion(messages=hello, stream=True, stream_options={"include_usage": True}, **base)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there."
    rebuilt = litellm.stream_chunk_builder(chunks, messages=hello)
    assert rebuilt.choices[0].message.content == "Hello there." and rebuilt.usage.completion_tokens > 0

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = litellm.completion(messages=question, tools=tools, **base)
    message = call.choices[0].message
    assert call.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    streamed = list(litellm.completion(messages=question, tools=tools, stream=True, **base))
    rebuilt = litellm.stream_chunk_builder(streamed, messages=question)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in rebuilt.choices[0].message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    followup = [
        *question,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21"},
    ]
    answer = litellm.completion(messages=followup, tools=tools, **base)
    assert answer.choices[0].message.content == "It is sunny in Paris, at 21 °C."

    text = litellm.text_completion(
        model=base["model"], api_base=base["api_base"], api_key="unused", prompt="Once upon a time", max_tokens=16
    )
    assert text.choices[0].text == " there was a mill."


_VLLM_BENCH = r"""
import asyncio, json, sys
import aiohttp
from vllm.benchmarks.lib import endpoint_request_func as erf
url, model = sys.argv[1], sys.argv[2]
async def main():
    out = {}
    async with aiohttp.ClientSession() as session:
        for name, func, path in (("openai", erf.async_request_openai_completions, "/v1/completions"),
                                 ("openai-chat", erf.async_request_openai_chat_completions, "/v1/chat/completions")):
            for extra in (None, {"temperature": 0.0, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}):
                r = await func(erf.RequestFuncInput(prompt="one two three four five", api_url=url + path,
                                                    prompt_len=5, output_len=8, model=model, ignore_eos=True,
                                                    extra_body=extra), session)
                out.setdefault(name, []).append({"success": r.success, "error": r.error, "text": r.generated_text,
                                                 "output_tokens": r.output_tokens, "itl": len(r.itl)})
    print(json.dumps(out))
asyncio.run(main())
"""


def test_vllm_bench_request_functions_live(tm):
    """`vllm bench serve`'s own request functions (backends openai and openai-chat, from .venv-vllm)
    against tokenmill: every request succeeds, and the usage they read counts the tokens."""
    if reason := vllm_env.missing_reason():
        pytest.skip(reason)
    proc = subprocess.run(
        [str(vllm_env.VLLM_PYTHON), "-c", _VLLM_BENCH, tm.url, MODEL], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for backend, results in out.items():
        for result in results:
            assert result["success"], (backend, result)
            # the scripted reply (ignore_eos: the simulator ends a scripted reply without its stop token)
            assert result["text"] == " nine ten." and result["output_tokens"] == 3, (backend, result)
