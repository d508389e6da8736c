"""OpenAI wire format for responses: JSON bodies, SSE chunks, and error objects."""

from __future__ import annotations

import uuid

import msgspec

from tokenmill.tokenizer_workers.messages import ApiError, CompletionShape

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def error_body(error: ApiError) -> bytes:
    return _json.encode(
        {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    )


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> ApiError:
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        408: "RequestTimeoutError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
    }.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return ApiError(status, message, kind, param, code)


def sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def message(
    content: str, reasoning: str, calls, forced_calls: bool = False, functions: bool = False, role: str = "assistant"
) -> dict:
    """A chat.completion message: content null when the model only reasoned or called tools (""
    when the request forced the calls, as vLLM answers); with OpenAI's legacy functions, the call
    is function_call {name, arguments}."""
    empty = "" if forced_calls else None
    out: dict = {"role": role, "content": content if content or not (reasoning or calls) else empty}
    if reasoning:
        out["reasoning"] = reasoning
        out["reasoning_content"] = reasoning
    if calls and functions:
        out["function_call"] = {"name": calls[0].name, "arguments": calls[0].text}
    elif calls:
        out["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.text}} for c in calls
        ]
    return out


def chat_logprobs(fragments: list[list[bytes]]) -> dict:
    """``{"content": [...]}`` from chat fragments (one list per delta, its one item the entries)."""
    joined = b",".join(f[0] for f in fragments if f and f[0])
    return {"content": msgspec.Raw(b"[" + joined + b"]")}


_COMPLETION_KEYS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


def completion_logprobs(fragments: list[list[bytes]]) -> dict:
    """The legacy completions object from per-delta [text_offset, token_logprobs, tokens, top_logprobs]."""
    out = {}
    for k, key in enumerate(_COMPLETION_KEYS):
        joined = b",".join(f[k] for f in fragments if f and f[k])
        out[key] = msgspec.Raw(b"[" + joined + b"]")
    return out


class Framer:
    """Builds the response objects of one request: chat.completion(.chunk) or text_completion."""

    def __init__(
        self, kind: str, shape: CompletionShape, *, response_id: str, created: int, model: str, prompt_tokens: list[int]
    ):
        """``shape``: what the request asked the response to show (the worker's); ``prompt_tokens``: per choice."""
        self.chat = kind == "chat"
        self.id = response_id
        self.created = created
        self.model = model
        self.include_usage = shape.include_usage
        # vLLM's continuous_usage_stats: every chunk of choice i carries the usage of its prompt
        # (prompt_tokens[i]) and of its tokens generated up to that chunk
        self.continuous_usage = shape.continuous_usage
        self.prompt_tokens = prompt_tokens
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        # vLLM's return_token_ids: each choice's prompt token IDs (a JSON array; None when not asked), and
        # whether its chunks and choices carry their generated token IDs
        prompt_ids = None
        if shape.prompt_token_ids:  # one per prompt: each choice's (choices are prompt-major)
            per_prompt = len(prompt_tokens) // len(shape.prompt_token_ids)
            prompt_ids = [shape.prompt_token_ids[i // per_prompt] for i in range(len(prompt_tokens))]
        self.prompt_ids = prompt_ids
        # OpenAI's legacy functions: a call is message.function_call / delta.function_call
        self.functions = shape.functions
        self.token_ids = shape.token_ids
        self.role = shape.role  # chat: the answer's role (vLLM: the last message's with add_generation_prompt false)
        self.forced_calls = shape.forced_calls  # a message with calls has content "", not null
        self._prompt_ids_due = set(range(len(prompt_ids))) if prompt_ids is not None and not self.chat else set()
        self._templates: dict = {}  # (kind, index) -> [the chunk's bytes around its text, after its usage]

    def _template(self, kind: str, index: int) -> list[bytes]:
        """A text or reasoning chunk as bytes with holes for the text (and, with continuous usage,
        for the usage object): the same bytes the dict would encode to, built once per choice, so a
        token's event costs one string encode."""
        hole = f"@{uuid.uuid4().hex}@"
        usage_hole = f"@{uuid.uuid4().hex}@"
        usage = msgspec.Raw(_json.encode(usage_hole)) if self.continuous_usage else None
        chunk = (
            self.text_chunk_slow(index, hole, usage)
            if kind == "text"
            else self.reasoning_chunk_slow(index, hole, usage)
        )
        # [the parts around the text (a reasoning chunk holds it twice), what follows the usage]
        head, _, tail = chunk.partition(_json.encode(usage_hole))
        parts = [head.split(_json.encode(hole)), tail]
        self._templates[(kind, index)] = parts
        return parts

    def _usage(self, index: int, tokens: int) -> msgspec.Raw | None:
        """The usage object of a chunk of choice ``index`` after ``tokens`` generated tokens (continuous
        usage), else None (``"usage": null`` when the request asked for usage at the end)."""
        if not self.continuous_usage:
            return None
        prompt = self.prompt_tokens[index] if index < len(self.prompt_tokens) else 0
        return msgspec.Raw(
            b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (prompt, tokens, prompt + tokens)
        )

    def _chunk(self, choices: list, usage: msgspec.Raw | None = None) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = usage
        return out

    def role_chunk(self, index: int) -> bytes:
        chunk = self._chunk(
            [{"index": index, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}],
            self._usage(index, 0),
        )
        if self.prompt_ids is not None:  # as vLLM: every choice's role chunk, the first of its stream
            chunk["prompt_token_ids"] = msgspec.Raw(self.prompt_ids[index])
        return sse(chunk)

    def _choice_ids(self, choice: dict, index: int, ids: bytes) -> dict:
        """vLLM's return_token_ids on a streamed choice: completions' first chunk of each choice carries
        its prompt's IDs; every chunk its generated IDs."""
        if index in self._prompt_ids_due:
            self._prompt_ids_due.discard(index)
            choice["prompt_token_ids"] = msgspec.Raw(self.prompt_ids[index])
        choice["token_ids"] = msgspec.Raw(b"[" + ids + b"]")
        return choice

    def ids_chunk(
        self, index: int, kind: str | None, text: str, ids: bytes, fragments: list[bytes] | None, tokens: int = 0
    ) -> bytes:
        """One delta with its generated token IDs (and its logprobs, if asked): ``kind`` "text",
        "reasoning", or None for an empty delta."""
        logprobs = None
        if fragments:
            logprobs = (chat_logprobs if self.chat else completion_logprobs)([fragments])
        if self.chat:
            delta = (
                {"content": text}
                if kind == "text"
                else {"reasoning": text, "reasoning_content": text}
                if kind == "reasoning"
                else {}
            )
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return sse(self._chunk([self._choice_ids(choice, index, ids)], self._usage(index, tokens)))

    def text_chunk(self, index: int, text: str, tokens: int = 0) -> bytes:
        parts = self._templates.get(("text", index)) or self._template("text", index)
        return self._fill(parts, index, text, tokens)

    def reasoning_chunk(self, index: int, text: str, tokens: int = 0) -> bytes:
        parts = self._templates.get(("reasoning", index)) or self._template("reasoning", index)
        return self._fill(parts, index, text, tokens)

    def _fill(self, parts: list, index: int, text: str, tokens: int) -> bytes:
        around, tail = parts
        if not tail:
            return _json.encode(text).join(around)
        return b"".join((_json.encode(text).join(around), self._usage(index, tokens), tail))

    def text_chunk_slow(self, index: int, text: str, usage: msgspec.Raw | None = None) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        return sse(self._chunk([choice], usage))

    def reasoning_chunk_slow(self, index: int, text: str, usage: msgspec.Raw | None = None) -> bytes:
        """Reasoning under vLLM's name and under the name SGLang and most client libraries read."""
        delta = {"reasoning": text, "reasoning_content": text}
        return sse(self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], usage))

    def delta_chunk(self, kind: str, index: int, text: str, tokens: int = 0) -> bytes:
        """A "text" or "reasoning" delta."""
        return self.text_chunk(index, text, tokens) if kind == "text" else self.reasoning_chunk(index, text, tokens)

    def call_chunks(self, index: int, call, tokens: int = 0) -> bytes:
        """One whole tool call as OpenAI streams it: id, type and name first, then the arguments
        (legacy functions: delta.function_call, its name first, then its arguments)."""
        if self.functions:
            deltas = (
                {"function_call": {"name": call.name, "arguments": ""}},
                {"function_call": {"arguments": call.text}},
            )
        else:
            head = {
                "index": call.index,
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            args = {"index": call.index, "function": {"arguments": call.text}}
            deltas = ({"tool_calls": [head]}, {"tool_calls": [args]})
        usage = self._usage(index, tokens)
        return b"".join(
            sse(self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], usage))
            for delta in deltas
        )

    def logprobs_chunk(self, index: int, text: str, fragments: list[bytes], tokens: int = 0) -> bytes:
        """A text delta with its tokens' logprobs (fragments from the worker, spliced in as they are)."""
        if self.chat:
            choice = {
                "index": index,
                "delta": {"content": text},
                "logprobs": chat_logprobs([fragments]),
                "finish_reason": None,
            }
        else:
            choice = {"index": index, "text": text, "logprobs": completion_logprobs([fragments]), "finish_reason": None}
        return sse(self._chunk([choice], self._usage(index, tokens)))

    def finish_chunk(self, index: int, reason: str, tokens: int = 0, stop_reason: str | int | None = None) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        if stop_reason is not None:  # vLLM's: the stop string or stop token ID that ended the choice
            choice["stop_reason"] = stop_reason
        if self.token_ids:  # its tokens went out with the deltas before it
            self._choice_ids(choice, index, b"")
        return sse(self._chunk([choice], self._usage(index, tokens)))

    def done_chunk(self, usage_obj: dict, failed: bool) -> bytes:
        """The stream's closing bytes: the usage chunk (when asked, and the stream did not fail), then [DONE]."""
        tail = self.usage_chunk(usage_obj) if self.include_usage and not failed else b""
        return tail + DONE

    def error_chunk(self, error: ApiError) -> bytes:
        """A mid-stream error, as vLLM sends it: a data event holding the error object."""
        return sse({"error": msgspec.structs.asdict(error)})

    def usage_chunk(self, usage_obj: dict) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_obj,
            }
        )

    def full(
        self,
        texts: list[str],
        reasons: list[str],
        usage_obj: dict,
        reasoning=None,
        calls=None,
        logprobs=None,
        token_ids=None,
        stop_reasons=None,
        prompt_logprobs=None,
        kv_transfer_params=None,
    ) -> bytes:
        """The whole response; ``logprobs``: per choice, the fragments of its deltas (None: not asked);
        ``token_ids``: per choice, the generated IDs of its deltas (vLLM's return_token_ids);
        ``prompt_logprobs``: per choice, its prompt's as JSON or None (None for the list: not asked);
        ``kv_transfer_params``: (what the engine returned,) when the response carries it."""
        lps = [None] * len(texts)
        if logprobs is not None:
            lps = [(chat_logprobs if self.chat else completion_logprobs)(f) for f in logprobs]
        if self.chat:
            choices = [
                {
                    "index": i,
                    "message": message(
                        t,
                        reasoning[i] if reasoning else "",
                        calls[i] if calls else (),
                        self.forced_calls,
                        self.functions,
                        self.role,
                    ),
                    "logprobs": lps[i],
                    "finish_reason": r,
                }
                for i, (t, r) in enumerate(zip(texts, reasons))
            ]
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": t, "logprobs": lps[i], "finish_reason": r}
                for i, (t, r) in enumerate(zip(texts, reasons))
            ]
            obj = "text_completion"
        for choice, stop_reason in zip(choices, stop_reasons or ()):
            if stop_reason is not None:  # vLLM's: the stop string or stop token ID that ended the choice
                choice["stop_reason"] = stop_reason
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_obj,
        }
        if self.prompt_ids is not None:  # vLLM's return_token_ids: chat's prompt once, completions' per choice
            for i, choice in enumerate(choices):
                if not self.chat:
                    choice["prompt_token_ids"] = msgspec.Raw(self.prompt_ids[i])
                joined = b",".join(f for f in token_ids[i] if f) if token_ids is not None else b""
                choice["token_ids"] = msgspec.Raw(b"[" + joined + b"]") if self.token_ids else None
            if self.chat:
                out["prompt_token_ids"] = msgspec.Raw(self.prompt_ids[0])
        if prompt_logprobs is not None:  # vLLM's: chat's at the top (one prompt), completions' on each choice
            raws = [msgspec.Raw(p) if p is not None else None for p in prompt_logprobs]
            if self.chat:
                out["prompt_logprobs"] = raws[0] if raws else None
            else:
                for choice, raw in zip(choices, raws):
                    choice["prompt_logprobs"] = raw
        if kv_transfer_params is not None:
            out["kv_transfer_params"] = kv_transfer_params[0]
        return _json.encode(out)
