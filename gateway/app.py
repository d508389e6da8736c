"""The ASGI application: routes, limits, and streaming. No web framework; uvicorn parses HTTP.

Everything here is cheap by construction: request bodies go to a tokenizer worker as
bytes, Generate headers and prompt frames come back ready to forward, and text comes
back ready to frame. The handlers only wait, route and write.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid

import msgspec

from tokenmill.gateway import anthropic_format as anthropic
from tokenmill.gateway import apis
from tokenmill.gateway import openai_format as fmt
from tokenmill.gateway import stream_events as ev
from tokenmill.gateway.generations import Choice, Generation
from tokenmill.gateway.request_body import RequestBody
from tokenmill.gateway.worker_pool import ConversionRejected
from tokenmill.scheduler_client.client import SchedulerUnavailable
from tokenmill.tokenizer_workers.messages import ApiError, CompletionShape, Timing

_json = msgspec.json.Encoder()
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_DELTA_KIND = {ev.Text: "text", ev.Reasoning: "reasoning"}  # the framers' delta kinds


class BodyTooLarge(Exception):
    pass


def timing_headers(timing: Timing) -> list:
    """Server-Timing (ms) and cache figures of the conversion, for clients and benchmarks."""
    parts = [
        f"queue;dur={timing.queue_s * 1000:.3f}",
        f"render;dur={timing.render_s * 1000:.3f}",
        f"tokenize;dur={timing.tokenize_s * 1000:.3f}",
        f"tokenize-cpu;dur={timing.tokenize_cpu_s * 1000:.3f}",
    ]
    headers = [(b"server-timing", ", ".join(parts).encode())]
    if timing.cache is not None:
        headers.append((b"x-tokenmill-cached-prompt-tokens", str(timing.cache.cached_tokens).encode()))
    return headers


class App:
    def __init__(self, gateway):
        self.gw = gateway  # tokenmill.gateway.server.Gateway: settings, conversion, scheduler, generations, metrics
        self.routes = {
            ("POST", "/v1/chat/completions"): lambda s, r, w: self.generate(apis.CHAT, s, r, w),
            ("POST", "/v1/completions"): lambda s, r, w: self.generate(apis.COMPLETIONS, s, r, w),
            ("POST", "/v1/responses"): lambda s, r, w: self.generate(apis.RESPONSES, s, r, w),
            ("POST", "/v1/messages"): lambda s, r, w: self.generate(apis.MESSAGES, s, r, w),
            ("POST", "/v1/messages/count_tokens"): lambda s, r, w: self.convert_only("count_tokens", s, r, w),
            ("POST", "/v1/messages/render"): lambda s, r, w: self.convert_only("messages_render", s, r, w),
            ("POST", "/v1/responses/render"): lambda s, r, w: self.convert_only("responses_render", s, r, w),
            ("POST", "/tokenize"): lambda s, r, w: self.convert_only("tokenize", s, r, w),
            ("POST", "/detokenize"): lambda s, r, w: self.convert_only("detokenize", s, r, w),
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
            ("GET", "/ready"): self.ready,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/debug/loop-lag"): self.loop_lag,
            ("GET", "/debug/state"): self.state,
        }
        self.paths = {path for _, path in self.routes}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # uvicorn runs with lifespan="off": the gateway owns start and stop
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self.routes.get((scope["method"], path))
        if handler is None:
            if path in self.paths:
                await self.error(send, fmt.error(405, f"Method {scope['method']} is not allowed on {path}."), path)
            else:  # one label for every unknown path: a scanner must not mint a metric series per path it tries
                await self.error(
                    send,
                    fmt.error(404, f"No route for {scope['method']} {path}.", code="not_found"),
                    "unmatched",
                    shape_path=path,
                )
            return
        if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
            if not self._authorized(scope):
                await self.error(
                    send,
                    fmt.error(
                        401,
                        "Missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY').",
                        code="invalid_api_key",
                    ),
                    path,
                )
                return
        await handler(scope, receive, send)

    # ---- plumbing -----------------------------------------------------------------------

    def _authorized(self, scope) -> bool:
        key = self.gw.settings.api_key
        if not key:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode()):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), key.encode()):  # Anthropic's clients
                return True
        return False

    async def respond(self, send, status: int, body: bytes, endpoint: str, headers=_JSON) -> None:
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.gw.metrics.request(endpoint, status)

    async def error(
        self, send, error: ApiError, endpoint: str, retry_after: int | None = None, shape_path: str | None = None
    ) -> None:
        """An error response, in Anthropic's shape on the Messages routes, else in OpenAI's."""
        headers = list(_JSON)
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        anthropic_route = (shape_path or endpoint).startswith("/v1/messages")
        body = (anthropic if anthropic_route else fmt).error_body(error)
        await self.respond(send, error.status, body, endpoint, headers)

    async def read_body(self, scope, receive) -> RequestBody:
        settings = self.gw.settings
        limit = settings.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                length = int(value)
                if length > limit:
                    raise BodyTooLarge
                # refuse before reading when the queue could not take the body anyway
                self.gw.conversion.check_capacity(length)
        # the gateway's protocol keeps the pieces as they came (request_body.RequestBody), never joined here
        given = (scope.get("extensions") or {}).get("tokenmill.body")
        body = given if given is not None else RequestBody()
        async with asyncio.timeout(settings.body_timeout):  # no task of its own, unlike wait_for: 4.9 us, not 7.8
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ConnectionResetError
                if given is None:
                    body.append(message.get("body", b""))
                body.unread = 0
                if body.size > limit:
                    raise BodyTooLarge
                if not message.get("more_body"):
                    return body

    async def _body_or_error(self, scope, receive, send, endpoint) -> RequestBody | None:
        metrics = self.gw.metrics
        header_bytes = sum(len(k) + len(v) for k, v in scope["headers"])
        if header_bytes > self.gw.settings.max_header_bytes:
            metrics.rejections.labels(reason="headers_too_large").inc()
            await self.error(
                send,
                fmt.error(
                    431,
                    f"The request headers exceed {self.gw.settings.max_header_bytes} bytes.",
                    code="headers_too_large",
                ),
                endpoint,
            )
            return None
        try:
            return await self.read_body(scope, receive)
        except BodyTooLarge:
            limit = self.gw.settings.max_body_bytes
            metrics.rejections.labels(reason="body_too_large").inc()
            await self.error(
                send,
                fmt.error(413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large"),
                endpoint,
            )
        except ConversionRejected as exc:
            await self.error(send, exc.error, endpoint, exc.retry_after)
        except asyncio.TimeoutError:
            metrics.rejections.labels(reason="body_timeout").inc()
            await self.error(
                send,
                fmt.error(
                    408,
                    f"The request body did not arrive within {self.gw.settings.body_timeout:g} s.",
                    code="body_timeout",
                ),
                endpoint,
            )
        except ConnectionResetError:
            metrics.aborts.labels(reason="client_disconnect").inc()
        return None

    async def _convert(self, kind, request_id, body, affinity, receive, send, endpoint):
        """Convert in a worker, giving up (and freeing the queue slot) if the client leaves. ``affinity``:
        the conversation's key, which keeps its turns on the worker that holds its prefix (or None)."""
        if self.gw.draining:
            await self.error(send, fmt.error(503, "The server is shutting down.", code="shutdown"), endpoint, 5)
            return None, None
        watcher = asyncio.ensure_future(receive())
        task = asyncio.ensure_future(self.gw.conversion.convert(kind, request_id, body, affinity))
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            self.gw.metrics.aborts.labels(reason="client_disconnect").inc()
            return None, None
        try:
            result = task.result()
        except ConversionRejected as exc:
            watcher.cancel()
            await self.error(send, exc.error, endpoint, exc.retry_after)
            return None, None
        if result.done.error is not None:
            watcher.cancel()
            await self.error(send, result.done.error, endpoint)
            return None, None
        return result, watcher

    # ---- endpoints ----------------------------------------------------------------------

    async def convert_only(self, kind, scope, receive, send) -> None:
        endpoint = scope["path"]
        body = await self._body_or_error(scope, receive, send, endpoint)
        if body is None:
            return
        affinity = apis.conversation_key(body.head()) if kind == "tokenize" else None  # a chat's turn, tokenized
        result, watcher = await self._convert(kind, "tok", body, affinity, receive, send, endpoint)
        if result is not None:
            watcher.cancel()
            await self.respond(send, 200, result.done.body, endpoint)

    async def generate(self, api: apis.Api, scope, receive, send) -> None:
        arrival = time.monotonic()
        endpoint = scope["path"]
        gw = self.gw
        body = await self._body_or_error(scope, receive, send, endpoint)
        if body is None:
            return
        if not gw.scheduler.connected:
            gw.metrics.rejections.labels(reason="scheduler_unavailable").inc()
            await self.error(
                send,
                fmt.error(503, "The GPU scheduler is not connected; retry shortly.", code="scheduler_unavailable"),
                endpoint,
                retry_after=2,
            )
            return
        own_id = uuid.uuid4().hex
        request_id = f"{api.prefix}-{own_id}"  # the scheduler's ids: unique whatever the client says
        pinger = api.pinger(body, send, gw.settings.messages_ping_interval, _SSE)
        if pinger is not None:
            send = pinger.send
        try:
            result, watcher = await self._convert(
                api.kind, request_id, body, api.affinity(body), receive, send, endpoint
            )
        finally:
            if pinger is not None:
                await pinger.stop()
        if result is None:
            return
        done = result.done
        if gw.closing:  # converted just as the drain ended: free its decoder state, start nothing
            watcher.cancel()
            gw.conversion.release(result.owner, [c.request_id for c in done.choices])
            await self.error(send, fmt.error(503, "The server is shutting down.", code="shutdown"), endpoint, 5)
            return
        gen = Generation(
            request_id,
            result.owner,
            [
                Choice(
                    i,
                    c.request_id,
                    c.prompt_tokens,
                    c.counts_prompt,
                    calls_finish=done.calls_finish,
                    resume=done.resume[i] if done.resume else None,
                )
                for i, c in enumerate(done.choices)
            ],
            arrival,
            fields=done.fields,
            owner_deaths=result.owner_deaths,
            affinity=result.affinity,
            image_hashes=done.images_by_hash,
        )
        k = done.frames_per_choice
        if k > 2:  # images: their pixel frames, or empty ones (the engine holds them, or maps their files)
            pixels = [len(result.frames[k * i + j]) for i in range(len(gen.choices)) for j in range(2, k)]
            gw.metrics.images_sent_by_hash.inc(pixels.count(0) - done.images_shm)
            gw.metrics.images_sent_shm.inc(done.images_shm)
            gw.metrics.images_sent_pixels.inc(len(pixels) - pixels.count(0))
        if done.images_by_hash:  # kept until the engine answers, in case it has lost an image (image_missing)
            for i, choice in enumerate(gen.choices):
                choice.sent = tuple(result.frames[k * i : k * i + 2])
        if k == 2 and len(gw.scheduler.ranks) > 1:  # kept while it runs, to go on on another rank if its own is lost
            for i, choice in enumerate(gen.choices):
                choice.engine_frames = (result.frames[k * i], result.frames[k * i + 1])
        extensions = scope.get("extensions") or {}
        gen.drop_connection = extensions.get("tokenmill.drop_connection")
        try:
            rank = gw.scheduler.pick(done.conversation, done.home_rank)
            gen.rank = rank.index
            if gw.shares_placements and done.conversation is not None:
                gw.conversion.placed(result.owner, done.conversation, rank.index)
            gw.generations.add(gen)
            for i in range(len(done.choices)) if gen in gw.generations.live else ():  # (failed: its owner died)
                gw.scheduler.generate(rank, *result.frames[k * i : k * i + k])
        except SchedulerUnavailable:
            gw.generations.add(gen)  # (a no-op if it was added) so that cancel frees its decoder state
            watcher.cancel()
            gw.generations.cancel(gen, abort=True, reason="scheduler_lost")
            await self.error(
                send,
                fmt.error(503, "The GPU scheduler became unavailable; retry shortly.", code="scheduler_unavailable"),
                endpoint,
                retry_after=2,
            )
            return
        gw.metrics.prompt_tokens.inc(sum(c.prompt_tokens for c in gen.choices))
        watcher.add_done_callback(lambda _: gen.events.put_nowait(ev.DISCONNECTED))
        framer = api.framer(done.adapter or gw.model_name, done, gen.choices, api.public_id(scope, done, own_id))
        try:
            if done.stream:
                await self._stream(
                    gen, framer, send, endpoint, timing_headers(done.timing), extensions.get("tokenmill.write_paused")
                )
            else:
                await self._collect(gen, framer, send, endpoint, timing_headers(done.timing), done.completion)
        finally:
            watcher.cancel()
            gw.generations.cancel(gen)  # no-op when it finished; frees everything otherwise
            gw.metrics.e2e_latency.observe(time.monotonic() - arrival)

    def _usage(self, gen: Generation) -> dict:
        return fmt.usage(
            sum(c.prompt_tokens for c in gen.choices if c.counts_prompt),
            sum(c.completion_tokens for c in gen.choices),
            sum(c.cached_tokens for c in gen.choices),
        )

    async def _stream(
        self, gen: Generation, framer: fmt.Framer, send, endpoint: str, extra_headers=(), write_paused=None
    ) -> None:
        """Write the generation's events as SSE. Each delta is its own event, as the scheduler made it,
        while the client keeps up; text that piles up while the client's socket is backed up goes out
        as one event per run of the same kind and choice (in order, nothing dropped), so a slow
        reader costs one event per write rather than one per token."""
        await send({"type": "http.response.start", "status": 200, "headers": [*_SSE, *extra_headers]})
        self.gw.metrics.request(endpoint, 200)
        head = b"".join(framer.role_chunk(c.index) for c in gen.choices) if framer.chat else b""
        if head:
            await send({"type": "http.response.body", "body": head, "more_body": True})
        failed = False
        open_choices = len(gen.choices)  # count finish events, not gen.finished: events may still be queued
        coalesced = 0
        merge = False  # the last write found the client's socket backed up
        while open_choices and not failed:
            parts: list[bytes] = []
            run: list[str] = []  # text deltas of one kind and choice in a row, while merging: one event
            run_kind, run_index, run_tokens = None, -1, 0
            event = await gen.events.get()
            while True:  # write everything already waiting in one go
                kind = type(event)
                if kind is ev.Text or kind is ev.Reasoning:
                    if run and (not merge or kind is not run_kind or event.choice != run_index):
                        parts.append(framer.delta_chunk(_DELTA_KIND[run_kind], run_index, "".join(run), run_tokens))
                        coalesced += len(run) - 1
                        run.clear()
                    run_kind, run_index, run_tokens = kind, event.choice, event.tokens
                    run.append(event.text)
                    gen.buffered -= len(event.text)
                else:
                    if run:
                        parts.append(framer.delta_chunk(_DELTA_KIND[run_kind], run_index, "".join(run), run_tokens))
                        coalesced += len(run) - 1
                        run.clear()
                    if kind is ev.Call:
                        gen.buffered -= len(event.piece.text)
                        parts.append(framer.call_chunks(event.choice, event.piece, event.tokens))
                    elif kind is ev.Logprobs:
                        gen.buffered -= len(event.text)
                        parts.append(framer.logprobs_chunk(event.choice, event.text, event.fragments, event.tokens))
                    elif kind is ev.Ids:
                        gen.buffered -= len(event.text)
                        parts.append(
                            framer.ids_chunk(
                                event.choice, event.kind, event.text, event.ids, event.fragments, event.tokens
                            )
                        )
                    elif kind is ev.Finish:
                        parts.append(framer.finish_chunk(event.choice, event.reason, event.tokens, event.stop_reason))
                        self.gw.metrics.finished(event.reason)
                        open_choices -= 1
                    elif kind is ev.Failed:
                        parts.append(framer.error_chunk(event.error))
                        self.gw.metrics.stream_errors.labels(code=event.error.code or "error").inc()
                        failed = True
                        break
                    elif kind is ev.Disconnected:
                        return
                if gen.events.empty():
                    break
                event = gen.events.get_nowait()
            if run:
                parts.append(framer.delta_chunk(_DELTA_KIND[run_kind], run_index, "".join(run), run_tokens))
                coalesced += len(run) - 1
            if coalesced:
                self.gw.metrics.coalesced_deltas.inc(coalesced)
                coalesced = 0
            merge = write_paused is not None and write_paused()
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        await send(
            {"type": "http.response.body", "body": framer.done_chunk(self._usage(gen), failed), "more_body": False}
        )

    async def _collect(
        self,
        gen: Generation,
        framer: fmt.Framer,
        send,
        endpoint: str,
        extra_headers=(),
        shape: CompletionShape | None = None,
    ) -> None:
        """The whole response at the end; ``shape``: what chat and completions responses show beyond the
        text (None for the APIs that show none of it)."""
        texts = [[] for _ in gen.choices]
        logprobs = [[] for _ in gen.choices] if shape is not None and shape.logprobs else None
        token_ids = [[] for _ in gen.choices] if shape is not None and shape.token_ids else None
        reasoning = [[] for _ in gen.choices]
        calls = [[] for _ in gen.choices]
        reasons = ["stop"] * len(gen.choices)
        stop_reasons = [None] * len(gen.choices)
        open_choices = len(gen.choices)
        while open_choices:
            event = await gen.events.get()
            kind = type(event)
            if kind is ev.Text:
                texts[event.choice].append(event.text)
                gen.buffered -= len(event.text)
            elif kind is ev.Logprobs:
                texts[event.choice].append(event.text)
                gen.buffered -= len(event.text)
                if logprobs is not None:
                    logprobs[event.choice].append(event.fragments)
            elif kind is ev.Reasoning:
                reasoning[event.choice].append(event.text)
                gen.buffered -= len(event.text)
            elif kind is ev.Ids:
                (reasoning if event.kind == "reasoning" else texts)[event.choice].append(event.text)
                gen.buffered -= len(event.text)
                if token_ids is not None:
                    token_ids[event.choice].append(event.ids)
                if logprobs is not None and event.fragments:
                    logprobs[event.choice].append(event.fragments)
            elif kind is ev.Call:
                calls[event.choice].append(event.piece)
                gen.buffered -= len(event.piece.text)
            elif kind is ev.Finish:
                reasons[event.choice] = event.reason
                stop_reasons[event.choice] = event.stop_reason
                self.gw.metrics.finished(event.reason)
                open_choices -= 1
            elif kind is ev.Failed:
                await self.error(send, event.error, endpoint)
                return
            elif kind is ev.Disconnected:
                return
        prompt_logprobs = kv_transfer_params = None
        if (
            shape is not None and shape.prompt_logprobs
        ):  # each choice shows its prompt's (the first choice of it got them)
            prompt_logprobs, current = [], None
            for c in gen.choices:
                if c.counts_prompt:
                    current = c.prompt_logprobs
                prompt_logprobs.append(current)
        if shape is not None and shape.kv_transfer_params or any(c.kv_transfer_params is not None for c in gen.choices):
            kv_transfer_params = (gen.choices[0].kv_transfer_params,)  # as vLLM: the first prompt's
        body = framer.full(
            ["".join(t) for t in texts],
            reasons,
            self._usage(gen),
            ["".join(r) for r in reasoning],
            calls,
            logprobs,
            token_ids=token_ids,
            stop_reasons=stop_reasons,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=kv_transfer_params,
        )
        await self.respond(send, 200, body, endpoint, [*_JSON, *extra_headers])

    async def models(self, scope, receive, send) -> None:
        """The served model, then the LoRA adapters every engine serves, as vLLM lists them (``parent``)."""
        gw = self.gw
        card = {
            "id": gw.model_name,
            "object": "model",
            "created": gw.started_at,
            "owned_by": "tokenmill",
            "root": gw.model_name,
            "parent": None,
            "max_model_len": gw.max_model_len,
        }
        cards = [card]
        for adapter in gw.scheduler.limits().adapters or ():
            cards.append({**card, "id": adapter, "root": adapter, "parent": gw.model_name, "max_model_len": None})
        await self.respond(send, 200, _json.encode({"object": "list", "data": cards}), "/v1/models")

    async def health(self, scope, receive, send) -> None:
        await self.respond(send, 200, b'{"status":"ok"}', "/health")

    async def ready(self, scope, receive, send) -> None:
        gw = self.gw
        state = {
            "ready": gw.is_ready,
            "workers_alive": gw.conversion.alive,
            "scheduler_connected": gw.scheduler.connected,
            "draining": gw.draining,
        }
        ranks = gw.scheduler.state()
        if len(ranks) > 1:  # data-parallel: which ranks serve, and why the others do not
            state["scheduler_ranks"] = ranks
            state["missing_ranks"] = [r["endpoint"] for r in ranks if not r["connected"] or r["refused"]]
        if gw.engine_bridges is not None:  # --engine-url: which engine servers serve
            state["engines"] = [
                {"url": url, "connected": r["connected"] and not r["refused"]}
                for url, r in zip(gw.engine_bridges.urls, ranks, strict=False)
            ]
        await self.respond(send, 200 if state["ready"] else 503, _json.encode(state), "/ready")

    async def state(self, scope, receive, send) -> None:
        await self.respond(send, 200, _json.encode(self.gw.state()), "/debug/state")

    async def loop_lag(self, scope, receive, send) -> None:
        """Loop-lag percentiles and maximum since the last ?reset=1 (for tokenmill bench)."""
        reset = b"reset=1" in scope.get("query_string", b"")
        body = _json.encode(self.gw.loop_lag_summary(reset))
        await self.respond(send, 200, body, "/debug/loop-lag")

    async def metrics(self, scope, receive, send) -> None:
        await self.respond(
            send,
            200,
            await self.gw.node_metrics(),
            "/metrics",
            [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
        )
