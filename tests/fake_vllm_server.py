"""A stand-in for `vllm serve --enable-scale-out`, for the tests of `tokenmill serve --engine-url`
(tests/serving/test_engine_url.py): the token-in API as vLLM 0.32 serves it (engines/http_backend.py
cites the shapes), fast and on any machine, with faults a real server will not make on demand.

Run as a process: ``python tests/fake_vllm_server.py --port P [--model DIR] [--served-name NAME]``. It
generates by echoing the prompt's token IDs (cycling), or with ``--chain`` as a greedy model would (each
token a function of the one before), one token per ``--itl-ms``, until ``max_tokens`` ("length") or a
``stop_token_ids`` match ("stop"). The canary render tokenizes as tokenmill does with the
same model directory (the `tokenmill render` path), so it passes unless told to differ.

Control, for the tests: ``POST /fake/mode {"mode": M}`` where M is ``ok``; ``forbidden`` (the token-in
paths answer 403, as without --enable-scale-out); ``skewed`` (the canary render gives other IDs);
``malformed`` (a stream's second event is not JSON); ``oov`` (a stream's second token is far outside any
vocabulary); ``drop`` (a stream's connection is cut after its second token); ``unhealthy`` (/health 503).
``GET /fake/state`` -> {"running": [...], "aborted": [...] (by abort_requests), "finished": [...],
"disconnected": [...], "requests": N,
"last_body": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

from tokenmill.tokenizer_workers.chat_template import ChatTemplates, render_conversation
from tokenmill.tokenizer_workers.model import load_model

PREFIX = "generate-tokens-"


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = "ok"
        self.running: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.disconnected: list[str] = []  # streams whose client went away before their end
        self.requests = 0
        self.last_body: dict = {}
        self.model = load_model(args.model)
        self.templates = ChatTemplates(self.model.templates, self.model.special_tokens)
        words = " the river wound slowly past the mill and the old wheel turned in the evening light"
        self.chain = self.model.tokenizer.encode(words, add_special_tokens=False).ids

    # ---- vLLM's API

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.args.served_name,
                        "object": "model",
                        "owned_by": "vllm",
                        "root": self.args.model or "default",
                        "parent": None,
                        "max_model_len": self.args.max_model_len,
                    },
                    # LoRA adapters (--lora), listed as vLLM lists its --lora-modules: children of the base
                    *(
                        {
                            "id": name,
                            "object": "model",
                            "owned_by": "vllm",
                            "root": f"/loras/{name}",
                            "parent": self.args.served_name,
                            "max_model_len": None,
                        }
                        for name in self.args.lora
                    ),
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "unhealthy" else 200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0-fake"})

    def forbidden(self) -> web.Response:
        return web.json_response(
            {
                "error": {
                    "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
                    "type": "PermissionDeniedError",
                    "param": None,
                    "code": 403,
                }
            },
            status=403,
        )

    async def render(self, request: web.Request) -> web.Response:
        if self.mode == "forbidden":
            return self.forbidden()
        body = await request.json()
        conversation = {
            "messages": body["messages"],
            "add_generation_prompt": True,
            "template_kwargs": body.get("chat_template_kwargs") or {},
        }
        ids = self.model.tokenizer.encode(
            render_conversation(self.templates, conversation), add_special_tokens=False
        ).ids
        if self.mode == "skewed":
            ids = [ids[0], *ids]  # a second BOS, as a template and tokenizer that both add one would make
        return web.json_response({"request_id": "chatcmpl-fake", "token_ids": ids, "model": self.args.served_name})

    async def abort(self, request: web.Request) -> web.Response:
        if self.mode == "forbidden":
            return self.forbidden()
        body = await request.json()
        for rid in body["request_ids"]:
            event = self.running.get(rid)
            if event is not None:
                self.aborted.append(rid)
                event.set()
        return web.Response(status=200)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "forbidden":
            return self.forbidden()
        body = await request.json()
        params = body["sampling_params"]
        prompt = body["token_ids"]
        max_tokens = params.get("max_tokens") or 16
        if params.get("logprobs") is not None and params["logprobs"] > 20:
            return web.json_response(
                {
                    "error": {
                        "message": f"Requested sample logprobs of {params['logprobs']}, which is greater than max allowed: 20",
                        "type": "BadRequestError",
                        "param": "logprobs",
                        "code": 400,
                    }
                },
                status=400,
            )
        if len(prompt) + 1 > self.args.max_model_len:
            return web.json_response(
                {
                    "error": {
                        "message": "The decoder prompt is too long",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
                status=400,
            )
        self.requests += 1  # the ones it took (not the bridge's logprobs probe above)
        self.last_body = body
        rid = PREFIX + body.get("request_id", "x")
        stop_ids = set(params.get("stop_token_ids") or ())
        if not body.get("stream"):
            tokens = self.tokens(prompt, max_tokens)
            answer = {"request_id": rid, "choices": [{"index": 0, "finish_reason": "length", "token_ids": tokens}]}
            if body.get("kv_transfer_params") is not None:  # as a KV connector answers a prefill: where to fetch
                answer["kv_transfer_params"] = {"remote_engine_id": "fake", "asked": body["kv_transfer_params"]}
            return web.json_response(answer)
        aborted = self.running[rid] = asyncio.Event()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        mode = self.mode
        try:
            for i in range(max_tokens):
                if i:
                    try:
                        await asyncio.wait_for(aborted.wait(), self.args.itl_ms / 1000)
                    except asyncio.TimeoutError:
                        pass
                if aborted.is_set():
                    await self.send(response, rid, [], "abort")
                    break
                token = self.tokens(prompt, i + 1)[i]
                if mode == "oov" and i == 1:
                    token = 1 << 30
                if mode == "malformed" and i == 1:
                    await response.write(b"data: {not json\n\n")
                    continue
                if mode == "drop" and i == 2:
                    request.transport.close()
                    return response
                finish = "stop" if token in stop_ids else "length" if i == max_tokens - 1 else None
                await self.send(response, rid, [token], finish)
                if finish:
                    break
            await response.write(b"data: [DONE]\n\n")
            if not aborted.is_set():  # ended by itself, not by abort_requests
                self.finished.append(rid)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.append(rid)
            raise
        finally:
            self.running.pop(rid, None)
        return response

    def tokens(self, prompt: list[int], n: int) -> list[int]:
        """The first n tokens it generates for a prompt: the prompt's tokens again (echo), or with --chain
        each token a function of the one before, as a greedy model's depend only on what came before:
        started again from the prompt and the tokens so far, it goes on with the same tokens."""
        if not self.args.chain:
            return [prompt[i % len(prompt)] for i in range(n)]
        out, last = [], prompt[-1]
        for _ in range(n):
            last = self.chain[(last * 31 + 7) % len(self.chain)]
            out.append(last)
        return out

    @staticmethod
    async def send(response: web.StreamResponse, rid: str, tokens: list[int], finish: str | None) -> None:
        event = {
            "request_id": rid,
            "usage": None,
            "output_mode": "tokens",
            "choices": [
                {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": tokens, "logprobs": None}
            ],
        }
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

    # ---- control

    async def set_mode(self, request: web.Request) -> web.Response:
        self.mode = (await request.json())["mode"]
        return web.json_response({"mode": self.mode})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "running": sorted(self.running),
                "aborted": self.aborted,
                "finished": self.finished,
                "disconnected": self.disconnected,
                "requests": self.requests,
                "last_body": self.last_body,
                "time": time.time(),
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--served-name", default="fake-model")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--chain", action="store_true", help="generate as a greedy model would (see Fake.tokens)")
    parser.add_argument("--lora", action="append", default=[], help="a LoRA adapter's name to list (repeatable)")
    args = parser.parse_args()
    fake = Fake(args)
    fake.mode = args.mode
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/health", fake.health)
    app.router.add_get("/version", fake.version)
    app.router.add_post("/v1/chat/completions/render", fake.render)
    app.router.add_post("/inference/v1/abort_requests", fake.abort)
    app.router.add_post("/inference/v1/generate", fake.generate)
    app.router.add_post("/fake/mode", fake.set_mode)
    app.router.add_get("/fake/state", fake.state)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
