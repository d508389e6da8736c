"""A stand-in for SGLang's own server (``python -m sglang.launch_server``), for the tests of `tokenmill serve
--engine-url` with the SGLang flavour (tests/serving/test_engine_url_sglang.py): its native API in SGLang
0.5.23's shapes (engines/http_sglang.py cites the files they come from), fast and on any machine, with
faults a real server will not make on demand.

Run as a process: ``python tests/fake_sglang_server.py --port P [--model DIR] [--incremental] ...``.
``POST /generate`` takes ``input_ids`` and streams ``data: {"text", "output_ids", "meta_info"}`` events
ending with ``data: [DONE]``: ``output_ids`` holds every token so far (SGLang's default) or, with
``--incremental`` (SGLang's ``--incremental-streaming-output``), the new ones. It generates by echoing
the prompt's token IDs (cycling), or a set reply's IDs followed by the model's EOS, one event of
``stream_interval`` tokens per ``--itl-ms``, until ``max_new_tokens`` (``{"type": "length"}``), a
``stop_token_ids`` or EOS match (``{"type": "stop", "matched": ID}``; neither with ``ignore_eos``, as in
SGLang) or an abort (``{"type": "abort"}``). As SGLang's JSON contract does, it refuses a
``sampling_params`` key it does not know with a 400 ``{"error": "unknown field ..."}``; a value out of
range is an error event in the stream (SGLang validates after the stream began). ``/v1/tokenize`` renders
``messages`` and tokenizes as tokenmill does with the same model directory, so the canary passes unless
told to differ.

Options: ``--skip-tokenizer-init`` (no text, no /v1/tokenize, no min_new_tokens, as SGLang without its
tokenizer), ``--old-tokenize`` (a /v1/tokenize that takes only ``prompt``, as older SGLang releases),
``--model-type`` / ``--architectures`` (what /model_info says), ``--deterministic``
(``--enable-deterministic-inference``), ``--priority-scheduling``.

Control, for the tests: ``POST /fake/mode`` with any of ``{"mode": M, "incremental": bool,
"stream_interval": N, "reply": TEXT or null}``, where M is ``ok``; ``skewed`` (the canary tokenization
gives other IDs); ``malformed`` (a stream's second event is not JSON); ``oov`` (a stream's second token
is far outside any vocabulary); ``drop`` (a stream's connection is cut after its second token);
``unhealthy`` (/health 503); ``refuse`` (every /generate gets the error event SGLang's validation
sends for a top_p out of range). ``GET /fake/state`` -> {"running": [...], "aborted": [...] (rids, by
/abort_request), "finished": [...], "disconnected": [...], "requests": N, "last_body": {...},
"last_events": [len(output_ids) of each event of the last stream], "generated": {rid: tokens}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from aiohttp import web

from tokenmill.tokenizer_workers.chat_template import ChatTemplates, render_conversation
from tokenmill.tokenizer_workers.model import load_model

#: SGLang 0.5.23's sampling_params keys, in its contract's order (api/v1/api_types.py)
SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
VERSION = "0.5.23"


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = "ok"
        self.incremental = args.incremental
        self.stream_interval = 1
        self.reply: list[int] | None = None
        self.running: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.disconnected: list[str] = []
        self.generated: dict[str, int] = {}  # rid -> tokens generated
        self.requests = 0
        self.last_body: dict = {}
        self.last_events: list[int] = []
        self.model = load_model(args.model)
        self.templates = ChatTemplates(self.model.templates, self.model.special_tokens)
        self.vocab = self.model.vocab_size
        self.eos = self.eos_ids()

    def eos_ids(self) -> list[int]:
        """Where SGLang ends a request by itself (unless ignore_eos): the eos_token_id of config.json and of
        generation_config.json, the tokenizer's EOS token, and the turn-final markers it knows."""
        ids = set(self.model.eos_token_ids)
        for name in ("config.json", "generation_config.json"):
            path = self.model.directory / name
            eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
            ids.update(t for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int))
        turn_ends = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")
        for text in (self.model.special_tokens.get("eos_token"), *turn_ends):
            if text and (token := self.model.tokenizer.token_to_id(text)) is not None:
                ids.add(token)
        return sorted(ids)

    # ---- SGLang's API

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.args.served_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.args.served_name,
            "parent": None,
            "max_model_len": self.args.max_model_len,
        }
        # LoRA adapters (--lora), as SGLang lists its loaded ones: children of the base model
        loras = [
            {**card, "id": name, "root": f"/loras/{name}", "parent": self.args.served_name, "max_model_len": None}
            for name in self.args.lora
        ]
        return web.json_response({"object": "list", "data": [card, *loras]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "unhealthy" else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model or "deepseek-ai/DeepSeek-V4",
                "served_model_name": self.args.served_name,
                "tokenizer_path": self.args.model or "deepseek-ai/DeepSeek-V4",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.args.model_type,
                "architectures": self.args.architectures.split(",") if self.args.architectures else None,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model or "deepseek-ai/DeepSeek-V4",
                "tokenizer_path": self.args.model or "deepseek-ai/DeepSeek-V4",
                "served_model_name": self.args.served_name,
                "context_length": None,
                "skip_tokenizer_init": self.args.skip_tokenizer_init,
                "incremental_streaming_output": self.incremental,
                "stream_interval": 1,
                "enable_deterministic_inference": self.args.deterministic,
                "enable_priority_scheduling": self.args.priority_scheduling,
                "schedule_low_priority_values_first": False,
                "grammar_backend": "xgrammar",
                "max_running_requests": 64,
                "internal_states": [{"max_running_requests": 64}],
                "version": VERSION,
                "frontend": "python",
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("messages") is not None and not self.args.old_tokenize:
            conversation = {
                "messages": body["messages"],
                "add_generation_prompt": True,
                "template_kwargs": body.get("chat_template_kwargs") or {},
            }
            text = render_conversation(self.templates, conversation)
            ids = self.model.tokenizer.encode(text, add_special_tokens=False).ids
        elif isinstance(body.get("prompt"), str):
            ids = self.model.tokenizer.encode(
                body["prompt"], add_special_tokens=body.get("add_special_tokens", True)
            ).ids
        else:  # FastAPI's validation error, as an older TokenizeRequest (prompt required) gives
            return web.json_response(
                {"detail": [{"type": "missing", "loc": ["body", "prompt"], "msg": "Field required"}]}, status=422
            )
        if self.mode == "skewed":
            ids = [ids[0], *ids]  # a second BOS, as a template and tokenizer that both add one would make
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.args.max_model_len})

    async def abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid = body.get("rid") or ""
        event = self.running.get(rid)
        if event is not None:
            self.aborted.append(rid)
            event.set()
        return web.Response(status=200)  # SGLang answers 200 for any rid, running or not

    @staticmethod
    def contract_error(body) -> str | None:
        """SGLang's JSON contract on a /generate body: unknown top-level keys pass, unknown sampling keys do not."""
        if not isinstance(body, dict):
            return "invalid type: sequence, expected struct GenerateRequest"
        params = body.get("sampling_params")
        if params is None:
            return None
        if not isinstance(params, dict):
            return "invalid type: sequence, expected struct SamplingParams"
        for key in params:
            if key not in SAMPLING_KEYS:
                listed = ", ".join(f"`{f}`" for f in SAMPLING_KEYS)
                return f"unknown field `{key}`, expected one of {listed}"
        return None

    def verify(self, params: dict, prompt: list[int]) -> str | None:
        """SGLang's SamplingParams.verify and the tokenizer manager's checks (the messages' leading words)."""
        top_p, top_k = params.get("top_p", 1.0), params.get("top_k", -1)
        if not 0.0 < top_p <= 1.0:
            return f"top_p must be in (0, 1], got {top_p}."
        if top_k is not None and top_k != -1 and top_k < 1:
            return f"top_k must be -1 (disable) or at least 1, got {top_k}."
        if not 0.0 <= params.get("min_p", 0.0) <= 1.0:
            return f"min_p must be in [0, 1], got {params['min_p']}."
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= params.get(name, 0.0) <= 2.0:
                return f"{name} must be in [-2, 2], got {params[name]}."
        if not 0.0 < params.get("repetition_penalty", 1.0) <= 2.0:
            return f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {params['repetition_penalty']}."
        for token in params.get("logit_bias") or {}:
            if not 0 <= int(token) < self.vocab:
                return f"logit_bias must has keys in [0, {self.vocab - 1}], got {token}."
        if params.get("min_new_tokens") and self.args.skip_tokenizer_init:
            return (
                f"min_new_tokens={params['min_new_tokens']} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer for eos_token_id)."
            )
        if len(prompt) >= self.args.max_model_len:
            return f"The input ({len(prompt)} tokens) is longer than the model's context length ({self.args.max_model_len} tokens)."
        return None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "expected value at line 1 column 1"}, status=400)
        problem = self.contract_error(body)
        if problem is not None:
            return web.json_response({"error": problem}, status=400)
        params = body.get("sampling_params") or {}
        prompt = body.get("input_ids") or []
        rid = body.get("rid") or uuid.uuid4().hex
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        problem = self.verify(params, prompt)
        if self.mode == "refuse":
            problem = f"top_p must be in (0, 1], got {params.get('top_p')}."
        if problem is not None:
            error = {"message": problem, "type": "invalid_request_error", "code": 400, "retryable": False}
            await response.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        self.requests += 1
        self.last_body = body
        self.last_events = []
        aborted = self.running[rid] = asyncio.Event()
        max_new = params.get("max_new_tokens")
        max_new = 128 if max_new is None else max_new
        ends = set() if params.get("ignore_eos") else {*(params.get("stop_token_ids") or ()), *self.eos}
        plan = self.reply + self.model.eos_token_ids[:1] if self.reply is not None else None  # reply, then EOS
        mode, incremental, interval = self.mode, self.incremental, self.stream_interval
        logprobs = body.get("top_logprobs_num", 0) if body.get("return_logprob") else None
        out: list[int] = []
        offset = 0  # what earlier events held (incremental)
        events = 0
        try:
            finish = None
            while finish is None:
                if events:
                    try:
                        await asyncio.wait_for(aborted.wait(), self.args.itl_ms / 1000)
                    except asyncio.TimeoutError:
                        pass
                if aborted.is_set():
                    finish = {"type": "abort", "message": "Aborted by AbortReq.", "status_code": None, "err_type": None}
                else:
                    for _ in range(interval):
                        i = len(out)
                        token = plan[i % len(plan)] if plan is not None else prompt[i % len(prompt)]
                        if mode == "oov" and i == 1:
                            token = 1 << 30
                        out.append(token)
                        if token in ends:
                            finish = {"type": "stop", "matched": token}
                        elif len(out) >= max_new:
                            finish = {"type": "length", "length": max_new}
                        if finish is not None:
                            break
                events += 1
                if mode == "malformed" and events == 2:
                    await response.write(b"data: {not json\n\n")
                    continue
                if mode == "drop" and len(out) >= 2:
                    request.transport.close()
                    return response
                ids = out[offset:] if incremental else list(out)
                event = {
                    "output_ids": ids,
                    "meta_info": self.meta(rid, prompt, out, finish, logprobs, offset, incremental),
                }
                if not self.args.skip_tokenizer_init:
                    event["text"] = self.model.tokenizer.decode(ids)
                self.last_events.append(len(ids))
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                offset = len(out)
            await response.write(b"data: [DONE]\n\n")
            if finish["type"] != "abort":
                self.finished.append(rid)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.append(rid)
            raise
        finally:
            self.generated[rid] = len(out)
            self.running.pop(rid, None)
        return response

    def meta(self, rid, prompt, out, finish, logprobs, offset, incremental) -> dict:
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }
        if logprobs is not None:
            tokens = out[offset:] if incremental else out
            # each token's logprob -0.5; its candidates best first: itself, then the next IDs, 1 lower each
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in tokens]
            if logprobs:
                meta["output_top_logprobs"] = [
                    [[-0.5 - k, (t + k) % self.vocab, None] for k in range(logprobs)] for t in tokens
                ]
        return meta

    # ---- control

    async def set_mode(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.mode = body.get("mode", self.mode)
        self.incremental = body.get("incremental", self.incremental)
        self.stream_interval = body.get("stream_interval", self.stream_interval)
        if "reply" in body:
            text = body["reply"]
            self.reply = None if text is None else self.model.tokenizer.encode(text, add_special_tokens=False).ids
        return web.json_response({"mode": self.mode, "incremental": self.incremental, "reply": self.reply})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "running": sorted(self.running),
                "aborted": self.aborted,
                "finished": self.finished,
                "disconnected": self.disconnected,
                "generated": self.generated,
                "requests": self.requests,
                "last_body": self.last_body,
                "last_events": self.last_events,
                "time": time.time(),
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--served-name", default="fake-sglang-model")
    parser.add_argument("--lora", action="append", default=[], help="a LoRA adapter's name to list (repeatable)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--incremental", action="store_true", help="as SGLang's --incremental-streaming-output")
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--old-tokenize", action="store_true", help="a /v1/tokenize that takes prompt only")
    parser.add_argument("--model-type", default=None)
    parser.add_argument("--architectures", default=None, help="comma-separated")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--priority-scheduling", action="store_true")
    args = parser.parse_args()
    fake = Fake(args)
    fake.mode = args.mode
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/health", fake.health)
    app.router.add_get("/health_generate", fake.health)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, fake.model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, fake.server_info)
    if not args.skip_tokenizer_init:
        for path in ("/v1/tokenize", "/tokenize"):
            app.router.add_post(path, fake.tokenize)
    app.router.add_post("/generate", fake.generate)
    app.router.add_post("/abort_request", fake.abort)
    app.router.add_post("/fake/mode", fake.set_mode)
    app.router.add_get("/fake/state", fake.state)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
