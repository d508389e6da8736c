"""Checked against vLLM, field by field: the same request to vLLM 0.32's own OpenAI server
and to `tokenmill serve` in front of `tokenmill engine --backend vllm`, both on the same tiny random
model (the stack tests/vllm_stack.py starts once per session, shared with tests/engines/test_vllm_engine.py),
gives the same response, ids and timestamps aside.

One row of ROWS per honoured request field (docs/api/request-fields.md, "Honoured"): a request body,
sent to both servers as it is (plain HTTP, streamed and not where it matters), both answers
normalised, then compared whole. A row's known differences are listed on it (Diff: where, what
each side answers, why) and asserted as differences, so the row fails when either side changes.
Greedy (temperature 0) throughout, so the engine is deterministic; the model's planted cues
(tokenmill/tiny_model.py: " farewell" -> " goodbye" -> EOS) give rows that stop by themselves.

Normalisation (`normalise`), applied to both sides alike:

* `id`: only its prefix (`chatcmpl-` / `cmpl-`) is kept, unless the row names the id (`request_id`);
  `created` and `system_fingerprint` are dropped;
* key order does not count (dicts compare as dicts);
* keys vLLM always writes and tokenmill omits when they are empty are dropped where null (NULL_KEYS:
  `refusal`, `annotations`, `audio`, `function_call`, `reasoning`, `reasoning_content`, `tool_calls`
  (empty) in a message; `stop_reason`,
  `token_ids`, `prompt_token_ids`, `prompt_logprobs`, `routed_experts` in a choice;
  `service_tier`, `prompt_text`, `kv_transfer_params`, `ec_transfer_params`, `metrics` at the top;
  `*_tokens_details` in usage): a null there means "not asked" or "nothing", as absence does.
  `stop_reason` is compared where vLLM gives one (tokenmill writes it only then);
* a stream is merged into the shape of the whole response (a choice's content, reasoning, text,
  token IDs and logprobs joined in order, its finish reason; the last chunk's usage), because the
  two split it differently (vLLM puts the finish reason on the last text chunk, tokenmill sends it
  in a chunk of its own; tokenmill writes `"usage": null` on every chunk when usage was asked, as
  OpenAI does, vLLM leaves the key out). What a stream says beyond that is kept where a field is
  about it: which chunk of a choice carries `prompt_token_ids`, and with continuous usage the usage
  after each piece of text;
* logprobs compare within 1e-3 (the same engine, the same numerics; a float's last digits aside);
* an error compares as its status alone (messages are worded differently).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest
from vllm_env import missing_reason

_why = missing_reason()
if _why:
    pytest.skip(_why, allow_module_level=True)

import vllm_stack  # noqa: E402
from conftest import ROOT  # noqa: E402
from vllm_stack import NAME  # noqa: E402

# the shared stack (tests/vllm_stack.py): started once per session, as soon as the tests are collected
start_early = vllm_stack.start_early
stack = vllm_stack.module_fixture()

NULL_KEYS = {
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "reasoning",
    "stop_reason",
    "token_ids",
    "prompt_token_ids",
    "prompt_logprobs",
    "routed_experts",
    "service_tier",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
    "prompt_tokens_details",
    "completion_tokens_details",
    "reasoning_content",
    "tool_calls",
}
DROPPED = {"created", "system_fingerprint"}
TOLERANCE = 1e-3


# ---- requests ---------------------------------------------------------------------------------------


def post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, object]:
    """(status, headers, answer): the parsed JSON, or a stream's data events (parsed, "[DONE]" kept)."""
    req = urllib.request.Request(
        url + path,
        json.dumps({"model": NAME, **body}).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, hdrs, raw = resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        status, hdrs, raw = err.code, dict(err.headers), err.read().decode()
    if status == 200 and body.get("stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        return status, hdrs, [e if e == "[DONE]" else json.loads(e) for e in events]
    return status, hdrs, json.loads(raw)


# ---- normalisation ----------------------------------------------------------------------------------


def _strip(obj, keep_id: bool):
    """Drops DROPPED keys and null NULL_KEYS everywhere, and the random part of top-level ids."""
    if isinstance(obj, list):
        return [_strip(x, keep_id) for x in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        if k in DROPPED or (k in NULL_KEYS and v in (None, [])):
            continue
        out[k] = _strip(v, keep_id)
    return out


def _id(value: str, keep_id: bool) -> str:
    return value if keep_id else value.split("-", 1)[0] + "-"


def _join_logprobs(into: dict | None, piece: dict | None) -> dict | None:
    if piece is None:
        return into
    if into is None:
        return json.loads(json.dumps(piece))
    for key, values in piece.items():
        into[key] = (into.get(key) or []) + (values or [])
    return into


def _merge_stream(events: list, keep_id: bool) -> dict:
    """A stream merged into the whole response's shape (see the module's docstring)."""
    assert events and events[-1] == "[DONE]", events[-2:]
    events = events[:-1]
    errors = [e for e in events if "error" in e]
    if errors:  # an error event ends a stream that had begun
        return {"stream_error": errors[-1]["error"].get("type"), "events": len(events)}
    ids = {_id(e["id"], keep_id) for e in events}
    objects = {e["object"] for e in events}
    assert len(ids) == 1 and len(objects) == 1, (ids, objects)
    out: dict = {"id": ids.pop(), "object": objects.pop().removesuffix(".chunk"), "model": events[0]["model"]}
    choices: dict[int, dict] = {}
    chunk_no: dict[int, int] = {}
    text_so_far: dict[int, str] = {}
    trace: dict[int, dict] = {}  # continuous usage: index -> {text so far: usage after it}
    for e in events:
        if e.get("prompt_token_ids") is not None:  # chat: on the chunk
            out["prompt_token_ids"] = e["prompt_token_ids"]
            out["prompt_token_ids_chunk"] = [chunk_no.get(c["index"], 0) for c in e["choices"]]
        if not e["choices"]:
            if e.get("usage") is not None:
                out["usage"] = e["usage"]
            continue
        for c in e["choices"]:
            i = c["index"]
            n = chunk_no[i] = chunk_no.get(i, -1) + 1
            m = choices.setdefault(i, {"index": i})
            if "delta" in c:
                msg = m.setdefault("message", {})
                for k, v in c["delta"].items():
                    if v is None:
                        continue
                    if k == "role":
                        msg["role"] = v
                    elif k in ("content", "reasoning", "reasoning_content"):
                        msg[k] = msg.get(k, "") + v
                    elif k == "tool_calls":
                        calls = msg.setdefault("tool_calls", {})
                        for call in v:
                            into = calls.setdefault(call["index"], {"function": {"arguments": ""}})
                            for key in ("id", "type"):
                                if call.get(key):
                                    into[key] = call[key]
                            fn = call.get("function") or {}
                            if fn.get("name"):
                                into["function"]["name"] = fn["name"]
                            into["function"]["arguments"] += fn.get("arguments") or ""
                    elif k == "function_call":
                        into = msg.setdefault("function_call", {"arguments": ""})
                        if v.get("name"):
                            into["name"] = v["name"]
                        into["arguments"] += v.get("arguments") or ""
                    else:
                        msg[k] = v
                piece = c["delta"].get("content") or c["delta"].get("reasoning") or ""
            else:
                m["text"] = m.get("text", "") + c["text"]
                piece = c["text"]
            m["logprobs"] = _join_logprobs(m.get("logprobs"), c.get("logprobs"))
            if c.get("token_ids") is not None:
                m["token_ids"] = m.get("token_ids", []) + c["token_ids"]
            if c.get("prompt_token_ids") is not None:  # completions: on the choice
                m["prompt_token_ids"] = c["prompt_token_ids"]
                m["prompt_token_ids_chunk"] = n
            for key in ("finish_reason", "stop_reason"):
                if c.get(key) is not None:
                    m[key] = c[key]
            text_so_far[i] = text_so_far.get(i, "") + piece
            if e.get("usage") is not None:
                trace.setdefault(i, {})[text_so_far[i]] = e["usage"]
    for m in choices.values():
        if "message" in m and "tool_calls" in m["message"]:
            m["message"]["tool_calls"] = [m["message"]["tool_calls"][k] for k in sorted(m["message"]["tool_calls"])]
    out["choices"] = [choices[i] for i in sorted(choices)]
    if trace:
        out["usage_trace"] = [[list(kv) for kv in sorted(trace[i].items())] for i in sorted(trace)]
    return _strip(out, keep_id)


def normalise(status: int, answer, stream: bool, keep_id: bool = False) -> dict:
    if status != 200:
        assert isinstance(answer, dict) and "error" in answer, answer
        return {"status": status}
    if stream:
        return _merge_stream(answer, keep_id)
    out = _strip(answer, keep_id)
    out["id"] = _id(out["id"], keep_id)
    return out


def differences(a, b, path: str = "") -> list[str]:
    """The paths where two normalised answers differ (floats within TOLERANCE are equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}{k}")
            else:
                out += differences(a[k], b[k], f"{path}{k}.")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [path.rstrip(".")]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}{i}.")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return [] if abs(a - b) <= TOLERANCE else [path.rstrip(".")]
    return [] if a == b else [path.rstrip(".")]


MISSING = object()


def at(obj, path: str):
    if not path:
        return obj
    for part in path.split("."):
        if isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            return MISSING
    return obj


# ---- the table --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    """A known difference: at `path` (of the normalised answer) vLLM has `vllm` and tokenmill
    `tokenmill` (MISSING: the key is absent; a callable: a check of the value), for the reason `why`.
    `streams`: the modes it shows in."""

    path: str
    vllm: object
    tokenmill: object
    why: str
    streams: tuple = (False, True)
    fronts: tuple = ("bridge", "http")  # the front ends it shows in (FRONTS)


@dataclass(frozen=True)
class Row:
    name: str
    fields: tuple  # the request fields (docs/api/request-fields.md) it checks
    endpoint: str  # "chat" or "completions"
    body: dict
    streams: tuple = (False, True)
    diffs: tuple = ()
    keep_id: bool = False  # the id is the point of the row
    headers: dict = field(default_factory=dict)
    check: object = None  # a check of vLLM's normalised answer: the row exercises what it is about
    skip: str | None = None


def _eq(value):
    return value


MAX = {"max_tokens": 6, "temperature": 0}
HELLO = [{"role": "user", "content": "Hello!"}]
STORY = [{"role": "user", "content": "Tell me a story."}]  # greedy: "ária המת�height oktoberLeft� ..."
RIVER = "The river wound slowly"  # greedy: " hurd它是一种جا folks stochastic martyrสมา� supplements ..."
FAREWELL = "We wave farewell"  # the model's cue: " goodbye", then EOS
LEAVE = [{"role": "user", "content": "Leave"}, {"role": "assistant", "content": FAREWELL}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


GUIDED = (
    "vLLM 0.32 no longer defines the guided_* fields and ignores them (the output is unconstrained); "
    "tokenmill honours them as the older names of structured_outputs, as vLLM did before"
)
ECHO_IDS = (
    "vLLM's streamed echo puts the prompt's token IDs on each choice's first chunk even without "
    "return_token_ids; tokenmill only when return_token_ids asks for them"
)
FUNCTIONS = (
    "vLLM 0.32 ignores OpenAI's deprecated functions and function_call (the model sees no tools); "
    "tokenmill maps them to tools and tool_choice as OpenAI does, so the prompt and the answer differ"
)
STOP_TOKEN_TEXT = (
    "tokenmill's text is the decode of the tokens it counts, the stop token's included; vLLM's "
    "detokenizer leaves the stopping token out (docs/engines/tokenmill-engine.md)"
)


UTF8_TAIL = (
    "the generated tokens end inside a UTF-8 sequence: tokenmill's text is the decode of its tokens "
    "(ending in U+FFFD), vLLM drops the bytes its detokenizer held back (docs/engines/tokenmill-engine.md)"
)


def refused_by_vllm(tokenmill, why: str) -> Diff:
    """The whole answer: vLLM's a 400, tokenmill's what `tokenmill` checks."""
    return Diff("", {"status": 400}, tokenmill, why)


def answered(a) -> bool:
    return "choices" in a and len(a["choices"]) >= 1


def text(value: str):
    return lambda v: v == value


def any_str(v) -> bool:
    return isinstance(v, str)


def _text(a, i: int = 0) -> str:
    c = a["choices"][i]
    return c["message"].get("content") or "" if "message" in c else c["text"]


def _finish(reason):
    return lambda a: all(c["finish_reason"] == reason for c in a["choices"])


ROWS = [
    # --- the request's basics
    Row("model-messages", ("model", "messages", "max_tokens", "temperature"), "chat", {"messages": HELLO, **MAX}),
    Row("prompt-text", ("prompt",), "completions", {"prompt": RIVER, **MAX}),
    Row("prompt-ids", ("prompt",), "completions", {"prompt": [671, 12334, 21928, 13257], **MAX}),
    Row("prompt-list", ("prompt",), "completions", {"prompt": [RIVER, FAREWELL], **MAX}),
    Row(
        "max-completion-tokens",
        ("max_completion_tokens",),
        "chat",
        {"messages": HELLO, "max_completion_tokens": 3, "temperature": 0},
    ),
    Row(
        "sampling",
        ("top_p", "top_k", "seed"),
        "chat",
        {"messages": HELLO, "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 5},
    ),
    Row(
        "penalties",
        ("presence_penalty", "frequency_penalty"),
        "completions",
        {"prompt": RIVER, "max_tokens": 12, "temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 1.0},
    ),
    Row(
        "stream-include-usage",
        ("stream", "stream_options"),
        "chat",
        {"messages": HELLO, **MAX, "stream_options": {"include_usage": True}},
        streams=(True,),
    ),
    Row(
        "stream-options-alone",
        ("stream_options",),
        "chat",
        {"messages": HELLO, **MAX, "stream_options": {"include_usage": True}},
        streams=(False,),
        check=lambda a: a == {"status": 400},
    ),
    # --- stopping
    Row(
        "stop-string",
        ("stop",),
        "completions",
        {
            "prompt": RIVER,
            "max_tokens": 12,
            "temperature": 0,
            "stop": ["chastic mar", "nowhere"],
            "stream_options": {"include_usage": True},
        },
        check=_finish("stop"),
    ),
    Row(
        "stop-string-continuous-usage",
        ("stop", "stream_options.continuous_usage_stats"),
        "completions",
        {
            "prompt": RIVER,
            "max_tokens": 12,
            "temperature": 0,
            "stop": ["chastic mar"],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        streams=(True,),
        check=_finish("stop"),
    ),
    Row(
        "stop-string-chat",
        ("stop",),
        "chat",
        {"messages": STORY, "max_tokens": 12, "temperature": 0, "stop": "height"},
        check=_finish("stop"),
    ),
    Row(
        "include-stop-str",
        ("include_stop_str_in_output",),
        "completions",
        {
            "prompt": RIVER,
            "max_tokens": 12,
            "temperature": 0,
            "stop": [" folks", "chastic"],
            "include_stop_str_in_output": True,
        },
        check=_finish("stop"),
    ),
    Row(
        "include-stop-str-chat",
        ("include_stop_str_in_output",),
        "chat",
        {"messages": STORY, "max_tokens": 12, "temperature": 0, "stop": ["height"], "include_stop_str_in_output": True},
        check=_finish("stop"),
    ),
    Row(
        "eos",
        ("stop_token_ids",),
        "completions",
        {"prompt": FAREWELL, "max_tokens": 8, "temperature": 0},
        check=_finish("stop"),
    ),
    Row(
        "stop-token-ids",
        ("stop_token_ids",),
        "completions",
        {"prompt": RIVER, "max_tokens": 12, "temperature": 0, "stop_token_ids": [25035]},
        check=_finish("stop"),
        diffs=(Diff("choices.0.text", " hurd它是一种جا", " hurd它是一种جا folks", STOP_TOKEN_TEXT),),
    ),
    Row(
        "stop-token-ids-eos",
        ("stop_token_ids", "ignore_eos"),
        "completions",
        {"prompt": FAREWELL, "max_tokens": 8, "temperature": 0, "stop_token_ids": [1]},
        check=_finish("stop"),
    ),
    Row(
        "stop-token-ids-eos-ignored",
        ("stop_token_ids", "ignore_eos"),
        "completions",
        {"prompt": FAREWELL, "max_tokens": 8, "temperature": 0, "stop_token_ids": [1], "ignore_eos": True},
        check=lambda a: a["choices"][0].get("stop_reason") == 1,
    ),
    Row(
        "ignore-eos",
        ("ignore_eos",),
        "completions",
        {"prompt": FAREWELL, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        check=_finish("length"),
    ),
    Row(
        "skip-special-tokens",
        ("skip_special_tokens",),
        "completions",
        {"prompt": FAREWELL, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False},
    ),
    Row(
        "spaces-between-special-tokens",
        ("spaces_between_special_tokens",),
        "completions",
        {
            "prompt": FAREWELL,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        },
    ),
    # --- several choices, usage
    Row(
        "n",
        ("n",),
        "chat",
        {
            "messages": HELLO,
            "max_tokens": 5,
            "temperature": 1.0,
            "seed": 3,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    ),
    Row(
        "n-completions",
        ("n",),
        "completions",
        {
            "prompt": [RIVER, FAREWELL],
            "max_tokens": 4,
            "temperature": 0.9,
            "seed": 9,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    ),
    Row(
        "continuous-usage",
        ("stream_options.continuous_usage_stats",),
        "chat",
        {"messages": HELLO, **MAX, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        streams=(True,),
        check=lambda a: len(a["usage_trace"][0]) >= 2,
    ),
    Row(
        "n-greedy",
        ("n",),
        "completions",
        {"prompt": RIVER, "max_tokens": 3, "temperature": 0, "n": 2},
        streams=(False,),
        diffs=(
            refused_by_vllm(
                lambda a: a["choices"][0] == a["choices"][1] | {"index": 0} and a["usage"]["completion_tokens"] == 6,
                'vLLM 0.32 refuses n > 1 with greedy sampling ("n must be 1 when using greedy sampling"); tokenmill '
                "answers n identical choices, as OpenAI does",
            ),
        ),
    ),
    Row(
        "continuous-usage-completions",
        ("stream_options.continuous_usage_stats",),
        "completions",
        {
            "prompt": [RIVER, FAREWELL],
            "max_tokens": 5,
            "temperature": 0.8,
            "seed": 1,
            "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        streams=(True,),
    ),
    # --- logprobs and token IDs
    Row(
        "logprobs-chat",
        ("logprobs", "top_logprobs"),
        "chat",
        {"messages": HELLO, **MAX, "logprobs": True, "top_logprobs": 3},
        check=lambda a: len(a["choices"][0]["logprobs"]["content"]) == 6,
    ),
    Row("logprobs-completions", ("logprobs",), "completions", {"prompt": RIVER, **MAX, "logprobs": 2}),
    Row(
        "token-ids-as-names-chat",
        ("return_tokens_as_token_ids",),
        "chat",
        {"messages": HELLO, **MAX, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True},
    ),
    Row(
        "token-ids-as-names-completions",
        ("return_tokens_as_token_ids",),
        "completions",
        {"prompt": RIVER, **MAX, "logprobs": 2, "return_tokens_as_token_ids": True},
    ),
    Row(
        "return-token-ids-chat",
        ("return_token_ids",),
        "chat",
        {"messages": STORY, "max_tokens": 5, "temperature": 0, "return_token_ids": True},
    ),
    Row(
        "return-token-ids-completions",
        ("return_token_ids",),
        "completions",
        {"prompt": [RIVER, FAREWELL], **MAX, "return_token_ids": True},
    ),
    Row(
        "return-token-ids-stop",
        ("return_token_ids",),
        "completions",
        {"prompt": RIVER, "max_tokens": 12, "temperature": 0, "stop": ["chastic mar"], "return_token_ids": True},
    ),
    # --- sampling (protocol 1.1, 1.2)
    Row(
        "min-p",
        ("min_p",),
        "completions",
        {"prompt": FAREWELL, "max_tokens": 6, "temperature": 1.0, "seed": 7, "min_p": 0.5},
    ),
    Row(
        "repetition-penalty",
        ("repetition_penalty",),
        "completions",
        {"prompt": RIVER, "max_tokens": 12, "temperature": 0, "repetition_penalty": 1.5},
    ),
    Row(
        "min-tokens",
        ("min_tokens",),
        "completions",
        {"prompt": FAREWELL, "max_tokens": 8, "temperature": 0, "min_tokens": 5},
        check=lambda a: a.get("usage", {"completion_tokens": 5})["completion_tokens"] >= 5,
    ),
    Row("logit-bias", ("logit_bias",), "completions", {"prompt": RIVER, **MAX, "logit_bias": {"54458": -100, "42": 5}}),
    Row(
        "allowed-token-ids",
        ("allowed_token_ids",),
        "completions",
        {"prompt": RIVER, **MAX, "allowed_token_ids": [42, 43, 44, 1]},
    ),
    Row(
        "bad-words",
        ("bad_words",),
        "completions",
        {"prompt": RIVER, "max_tokens": 12, "temperature": 0, "bad_words": ["它是一种"]},
        check=lambda a: _text(a).startswith(" hurd") and "它是一种" not in _text(a),
    ),
    # (a word the tokenizer splits in two without a leading space but keeps whole after one, such as
    # "folks", bans only the two-token form: vLLM's update_from_tokenizer adds the spaced form only when it has
    # as many tokens. tokenmill tokenizes the same way, so " folks" is generated on both.)
    Row("priority", ("priority",), "completions", {"prompt": RIVER, **MAX, "priority": 0}),
    Row(
        "priority-nonzero",
        ("priority",),
        "completions",
        {"prompt": RIVER, **MAX, "priority": 3},
        streams=(False,),
        diffs=(
            Diff(
                "",
                answered,
                {"status": 400},
                "the stack's vLLM server schedules by priority (tests/vllm_stack.py) and tokenmill in front of "
                "it is told so (--engine-scheduling-policy priority), so both answer; the bridge's own engine "
                "schedules first come first served (vLLM's default), where vLLM would take a non-zero priority "
                "and ignore it: tokenmill refuses it (400 unsupported)",
                fronts=("bridge",),
            ),
        ),
    ),
    Row("cache-salt", ("cache_salt",), "chat", {"messages": HELLO, **MAX, "cache_salt": "tenant-a"}),
    # --- output constraints
    Row(
        "response-format-json-object",
        ("response_format",),
        "chat",
        {"messages": HELLO, "max_tokens": 8, "temperature": 0, "response_format": {"type": "json_object"}},
    ),
    Row(
        "response-format-json-schema",
        ("response_format",),
        "chat",
        {
            "messages": HELLO,
            "max_tokens": 12,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]},
                },
            },
        },
    ),
    Row(
        "structured-outputs-choice",
        ("structured_outputs",),
        "chat",
        {"messages": HELLO, "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
    ),
    Row(
        "structured-outputs-regex",
        ("structured_outputs",),
        "completions",
        {"prompt": RIVER, "max_tokens": 8, "temperature": 0, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    ),
    Row(
        "guided-choice",
        ("guided_json", "guided_regex", "guided_choice", "guided_grammar"),
        "completions",
        {"prompt": RIVER, "max_tokens": 8, "temperature": 0, "guided_choice": ["yes", "no"]},
        diffs=(
            Diff("choices.0.text", text(" hurd它是一种جا folks stochastic martyrสมา� supplements"), text("no"), GUIDED),
            Diff("choices.0.finish_reason", "length", "stop", GUIDED),
            Diff(
                "usage",
                lambda u: u["completion_tokens"] == 8,
                lambda u: u["completion_tokens"] == 3,
                GUIDED,
                streams=(False,),
            ),
        ),
    ),
    # --- echo, truncation, ids
    Row(
        "echo-completions",
        ("echo",),
        "completions",
        {"prompt": RIVER, **MAX, "echo": True},
        check=lambda a: _text(a).startswith(RIVER + " "),
        diffs=(
            Diff("choices.0.prompt_token_ids", [671, 12334, 21928, 13257], MISSING, ECHO_IDS, streams=(True,)),
            Diff("choices.0.prompt_token_ids_chunk", 0, MISSING, ECHO_IDS, streams=(True,)),
        ),
    ),
    Row(
        "echo-logprobs",
        ("echo",),
        "completions",
        {"prompt": RIVER, **MAX, "echo": True, "logprobs": 1},
        check=lambda a: len(a["choices"][0]["logprobs"]["tokens"]) == 4 + 6,
        diffs=(
            Diff("choices.0.prompt_token_ids", [671, 12334, 21928, 13257], MISSING, ECHO_IDS, streams=(True,)),
            Diff("choices.0.prompt_token_ids_chunk", 0, MISSING, ECHO_IDS, streams=(True,)),
        ),
    ),
    Row(
        "echo-chat",
        ("echo",),
        "chat",
        {"messages": [*STORY, {"role": "assistant", "content": "Once"}], **MAX, **CONTINUE, "echo": True},
        # non-streamed, vLLM's chat echo returns the prompt's logprobs unasked, and so does tokenmill
        check=lambda a: (
            _text(a).startswith("Once")
            and (
                a.get("prompt_logprobs") is None
                or (len(a["prompt_logprobs"]) == 10 and a["prompt_logprobs"][0] is None)
            )
        ),
    ),
    Row(
        "suffix",
        ("suffix",),
        "completions",
        {"prompt": RIVER, **MAX, "suffix": " and on."},
        streams=(False,),
        diffs=(
            refused_by_vllm(
                lambda a: a.get("choices") and a["usage"]["prompt_tokens"] > 4,
                "vLLM renders a suffix (fill in the middle) only for models whose renderer is DeepSeek-V4's; this "
                "tiny Llama has the DeepSeek-V4 tokenizer and its FIM markers, from which tokenmill renders it",
            ),
        ),
    ),
    Row(
        "guided-whitespace-pattern",
        ("guided_whitespace_pattern",),
        "completions",
        {"prompt": RIVER, **MAX, "guided_json": {"type": "object"}, "guided_whitespace_pattern": " ?"},
        streams=(False,),
        diffs=(
            Diff(
                "",
                lambda a: a.get("choices") is not None,
                {"status": 400},
                "vLLM 0.32 ignores every guided_* field (unconstrained output); tokenmill honours them, and no "
                "vLLM backend reads a whitespace pattern per request, so the bridge does not announce it: a 400 "
                "unsupported naming the field",
            ),
        ),
    ),
    Row(
        "truncate-left",
        ("truncate_prompt_tokens", "truncation_side"),
        "completions",
        {
            "prompt": RIVER + " and on",
            "max_tokens": 5,
            "temperature": 0,
            "truncate_prompt_tokens": 3,
            "return_token_ids": True,
        },
        check=lambda a: a["choices"][0]["prompt_token_ids"] == [13257, 305, 377],
    ),
    Row(
        "truncate-right",
        ("truncate_prompt_tokens", "truncation_side"),
        "chat",
        {"messages": STORY, **MAX, "truncate_prompt_tokens": 4, "truncation_side": "right", "return_token_ids": True},
        check=lambda a: a["prompt_token_ids"] == [0, 128803, 50433, 678],
    ),
    Row(
        "request-id",
        ("request_id",),
        "chat",
        {"messages": HELLO, **MAX, "request_id": "abc-123"},
        keep_id=True,
        check=lambda a: a["id"] == "chatcmpl-abc-123",
    ),
    Row(
        "request-id-header",
        ("request_id",),
        "completions",
        {"prompt": RIVER, **MAX, "request_id": "abc-123"},
        keep_id=True,
        headers={"X-Request-Id": "from-header"},
        check=lambda a: a["id"] == "cmpl-from-header",
    ),
    # --- chat templates and tools
    Row(
        "tools-none",
        ("tools", "tool_choice"),
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            **MAX,
            "tools": [WEATHER],
            "tool_choice": "none",
        },
    ),
    Row(
        "tools-auto",
        ("tools", "tool_choice"),
        "chat",
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], **MAX, "tools": [WEATHER]},
    ),
    Row(
        "tools-required",
        ("tools", "tool_choice"),
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            **MAX,
            "tools": [WEATHER],
            "tool_choice": "required",
        },
        streams=(False,),
        diffs=(
            Diff(
                "choices.0.message.content",
                "",
                lambda text: text.startswith("[{"),
                "the forced call's JSON cut by max_tokens (this random model writes whitespace inside the "
                "array): vLLM drops the unfinished call's text, tokenmill returns it as content, as it does "
                "with every broken call (docs/api/tool-calls.md)",
            ),
        ),
    ),
    Row(
        "parallel-tool-calls",
        ("parallel_tool_calls",),
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            **MAX,
            "tools": [WEATHER],
            "tool_choice": "none",
            "parallel_tool_calls": False,
        },
    ),
    Row(
        "functions",
        ("functions", "function_call"),
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            **MAX,
            "functions": [WEATHER["function"]],
            "function_call": "none",
        },
        diffs=(
            Diff("choices.0.message.content", any_str, any_str, FUNCTIONS),
            Diff(
                "usage",
                lambda u: u["prompt_tokens"] == 8,
                lambda u: u["prompt_tokens"] > 100,
                FUNCTIONS,
                streams=(False,),
            ),
        ),
    ),
    Row("include-reasoning", ("include_reasoning",), "chat", {"messages": HELLO, **MAX, "include_reasoning": False}),
    Row("reasoning-effort", ("reasoning_effort",), "chat", {"messages": HELLO, **MAX, "reasoning_effort": "low"}),
    Row("documents", ("documents",), "chat", {"messages": HELLO, **MAX, "documents": [{"title": "t", "text": "x"}]}),
    Row(
        "chat-template-kwargs",
        ("chat_template_kwargs",),
        "chat",
        {"messages": HELLO, **MAX, "chat_template_kwargs": {"enable_thinking": True}},
    ),
    Row(
        "add-generation-prompt",
        ("add_generation_prompt",),
        "chat",
        {"messages": HELLO, **MAX, "add_generation_prompt": False},
        check=lambda a: a["choices"][0]["message"]["role"] == "user",
    ),
    Row(
        "continue-final-message",
        ("continue_final_message",),
        "chat",
        {"messages": LEAVE, "max_tokens": 8, "temperature": 0, **CONTINUE},
        check=_finish("stop"),
    ),
    Row(
        "continue-with-generation-prompt",
        ("continue_final_message", "add_generation_prompt"),
        "chat",
        {"messages": LEAVE, **MAX, "continue_final_message": True},
        streams=(False,),
        check=lambda a: a == {"status": 400},
    ),
    Row(
        "chat-template",
        ("chat_template",),
        "chat",
        {"messages": HELLO, **MAX, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        streams=(False,),
        check=lambda a: a == {"status": 400},
    ),  # both refuse it without --trust-request-chat-template
    # --- what protocol 1.2 passes to the engine and back
    Row(
        "kv-transfer-params",
        ("kv_transfer_params",),
        "completions",
        {"prompt": RIVER, **MAX, "kv_transfer_params": {"do_remote_decode": True}},
        streams=(False,),
        diffs=(
            Diff(
                "",
                lambda a: a.get("choices") is not None,
                {"status": 400},
                "without a KV connector vLLM takes kv_transfer_params and nothing reads them; tokenmill's vLLM "
                "bridge announces the feature only with a connector, so tokenmill answers 400 unsupported",
            ),
        ),
    ),
    Row(
        "vllm-xargs",
        ("vllm_xargs",),
        "completions",
        {"prompt": RIVER, **MAX, "vllm_xargs": {"note": "passed to SamplingParams.extra_args", "n_layers": 2}},
    ),
    Row(
        "prompt-logprobs",
        ("prompt_logprobs",),
        "completions",
        {"prompt": RIVER, **MAX, "prompt_logprobs": 2},
        streams=(False,),
        check=lambda a: len(a["choices"][0]["prompt_logprobs"]) == 4 and a["choices"][0]["prompt_logprobs"][0] is None,
    ),
    Row(
        "prompt-logprobs-chat",
        ("prompt_logprobs",),
        "chat",
        {"messages": HELLO, **MAX, "prompt_logprobs": 1},
        streams=(False,),
        check=lambda a: a["prompt_logprobs"][0] is None and len(a["prompt_logprobs"]) > 3,
    ),
]


def test_rows_cover_the_honoured_fields():
    """Every field of docs/api/request-fields.md's Honoured table has a row here."""
    doc = (ROOT / "docs" / "api" / "request-fields.md").read_text()
    table = doc.split("## Honoured", 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in table.splitlines()[4:]:
        if line.startswith("|"):
            named |= set(re.findall(r"`([a-z_.]+)`", line.split("|")[1]))
    covered = {f for row in ROWS for f in row.fields}
    # image_url: the parity stack's tiny model is text-only; images are compared with vLLM's own server on a
    # tiny Qwen2-VL in tests/engines/test_vllm_images.py
    covered |= {"image_url"}
    assert not named - covered, f"fields without a row: {sorted(named - covered)}"


def _ask(url: str, row: Row, stream: bool) -> dict:
    path = "/v1/chat/completions" if row.endpoint == "chat" else "/v1/completions"
    body = dict(row.body, stream=True) if stream else dict(row.body)
    if not stream and True in row.streams:
        body.pop("stream_options", None)  # it belongs to the streamed request (alone, a 400: stream-options-alone)
    status, _, answer = post(url, path, body, row.headers)
    return normalise(status, answer, stream, row.keep_id)


def _matches(expected, value) -> bool:
    if callable(expected) and expected is not MISSING:
        return bool(expected(value))
    return not differences(expected, value) if value is not MISSING else expected is MISSING


def _common_trace(v: dict, t: dict) -> None:
    """Continuous usage: the two servers may send a run of tokens in one chunk or in several (vLLM
    merges the outputs that queued up meanwhile), so the usage is compared after the texts both
    sent, the whole text included."""
    if "usage_trace" not in v or "usage_trace" not in t or len(v["usage_trace"]) != len(t["usage_trace"]):
        return
    for i, (vt, tt) in enumerate(zip(v["usage_trace"], t["usage_trace"])):
        common = {text for text, _ in vt} & {text for text, _ in tt}
        assert vt and tt and vt[-1][0] == tt[-1][0] in common, (i, vt[-1:], tt[-1:])
        v["usage_trace"][i] = [x for x in vt if x[0] in common]
        t["usage_trace"][i] = [x for x in tt if x[0] in common]


def _reasoning_details(v, t) -> None:
    """Two differences of every chat answer, asserted here: vLLM, run with a reasoning parser (the stack's,
    tests/vllm_stack.py), writes usage.completion_tokens_details {"reasoning_tokens": N} (and in each
    streamed usage), which tokenmill leaves out (docs/api/request-fields.md, "Where tokenmill differs");
    tokenmill writes a message's reasoning as `reasoning_content` too."""
    if isinstance(v, dict):
        if isinstance(t, dict) and "reasoning_content" in t and "reasoning_content" not in v:
            # tokenmill writes the reasoning under both names, vLLM 0.32 under "reasoning" (docs/api/tool-calls.md)
            assert t.pop("reasoning_content") == t.get("reasoning") == v.get("reasoning"), (v, t)
        details = v.pop("completion_tokens_details", MISSING)
        if details is not MISSING:
            assert set(details) == {"reasoning_tokens"}, details
            assert not isinstance(t, dict) or "completion_tokens_details" not in t, t
        for key, value in v.items():
            _reasoning_details(value, t.get(key) if isinstance(t, dict) else None)
    elif isinstance(v, list):
        for i, value in enumerate(v):
            _reasoning_details(value, t[i] if isinstance(t, list) and i < len(t) else None)


def compare(v: dict, t: dict, row: Row, stream: bool, front: str) -> None:
    _common_trace(v, t)
    if row.endpoint == "chat":
        _reasoning_details(v, t)
    diffs = [d for d in row.diffs if stream in d.streams and front in d.fronts]
    for d in diffs:
        vv, tv = at(v, d.path), at(t, d.path)
        assert _matches(d.vllm, vv), f"{row.name} ({d.path}): vLLM no longer answers as listed: {vv!r}"
        assert _matches(d.tokenmill, tv), f"{row.name} ({d.path}): tokenmill no longer answers as listed: {tv!r}"
    found = differences(v, t)
    unlisted = [p for p in found if not any(not d.path or p == d.path or p.startswith(d.path + ".") for d in diffs)]
    assert not unlisted, (
        f"{row.name} (stream {stream}): differs from vLLM at {unlisted}\n"
        f"vLLM:      {json.dumps(v, ensure_ascii=False)}\n"
        f"tokenmill: {json.dumps(t, ensure_ascii=False)}"
    )


#: the front ends checked: tokenmill in front of `tokenmill engine --backend vllm` (vLLM's engine in-process),
#: and tokenmill in front of the same vLLM server's token-in HTTP API (`tokenmill serve --engine-url`)
FRONTS = ("bridge", "http")
#: fields the token-in HTTP API cannot carry (engines/http_backend.py): there tokenmill answers a 400 naming them
#: (none of the rows': bad_words go as the words, priority and kv_transfer_params are refused on both fronts
#: by an fcfs server without a KV connector)
HTTP_REFUSED: tuple[str, ...] = ()
_vllm_answers: dict = {}


@pytest.fixture(scope="module", params=FRONTS)
def answers(stack, request):
    """Every row's request to vLLM's server (once for both front ends), then every row's to tokenmill (one
    server at a time: an idle vLLM keeps polling its queues for a second after a request, which slows the other
    server's next one on 2 cores): {(row name, stream): (vLLM's, tokenmill's)}."""
    t0 = time.monotonic()
    front = stack.front if request.param == "bridge" else stack.http_front
    todo = [(row, s) for row in ROWS if not row.skip for s in row.streams]
    for row, s in todo:
        if (row.name, s) not in _vllm_answers:
            _vllm_answers[row.name, s] = _ask(stack.vllm.url, row, s)
    ts = {(row.name, s): _ask(front.url, row, s) for row, s in todo}
    print(f"\n{len(todo)} requests to tokenmill ({request.param}) in {time.monotonic() - t0:.1f} s")
    return request.param, {key: (_vllm_answers[key], ts[key]) for key in ts}


def _refused_over_http(row: Row) -> str | None:
    """The field of the row's body that tokenmill refuses in front of an engine's HTTP API, if any."""
    return next((f for f in HTTP_REFUSED if f in row.body), None)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_field_as_vllm(answers, row, stack):
    if row.skip:
        pytest.skip(row.skip)
    front, answered = answers
    refused = _refused_over_http(row) if front == "http" else None
    for stream in row.streams:
        v, t = answered[row.name, stream]
        if row.check is not None:
            assert row.check(v), f"{row.name}: vLLM's answer does not show what the row is about: {v}"
        if refused:
            assert t == {"status": 400}, t
            path = "/v1/chat/completions" if row.endpoint == "chat" else "/v1/completions"
            _, _, error = post(stack.http_front.url, path, row.body)
            assert error["error"]["param"] == refused, error
            continue
        compare(v, t, row, stream, front)
