"""OpenAI wire format for responses: JSON bodies, SSE chunks, and error objects."""

from __future__ import annotations

import uuid

import msgspec

from tokenizer_workers.messages import ApiError

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


def message(content: str, reasoning: str, calls, forced_calls: bool = False) -> dict:
    """A chat.completion message: content null when the model only reasoned or called tools (""
    when the request forced the calls, as vLLM answers)."""
    empty = "" if forced_calls else None
    out: dict = {"role": "assistant", "content": content if content or not (reasoning or calls) else empty}
    if reasoning:
        out["reasoning"] = reasoning
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.text}}
                             for c in calls]  # fmt: skip
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

    def __init__(self, kind: str, request_id: str, created: int, model: str, include_usage: bool):
        self.chat = kind == "chat"
        self.id = request_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self._templates: dict = {}  # (kind, index) -> the chunk's bytes around its text

    def _template(self, kind: str, index: int) -> list[bytes]:
        """A text or reasoning chunk as bytes with holes for the text: the same bytes the dict
        would encode to, built once per choice, so a token's event costs one string encode."""
        hole = f"@{uuid.uuid4().hex}@"
        chunk = self.text_chunk_slow(index, hole) if kind == "text" else self.reasoning_chunk_slow(index, hole)
        parts = chunk.split(_json.encode(hole))
        self._templates[(kind, index)] = parts
        return parts

    def _chunk(self, choices: list) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self, index: int) -> bytes:
        return sse(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))

    def text_chunk(self, index: int, text: str) -> bytes:
        parts = self._templates.get(("text", index)) or self._template("text", index)
        return _json.encode(text).join(parts)

    def reasoning_chunk(self, index: int, text: str) -> bytes:
        parts = self._templates.get(("reasoning", index)) or self._template("reasoning", index)
        return _json.encode(text).join(parts)

    def text_chunk_slow(self, index: int, text: str) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        return sse(self._chunk([choice]))

    def reasoning_chunk_slow(self, index: int, text: str) -> bytes:
        """Reasoning under vLLM's name and under the name SGLang and most client libraries read."""
        delta = {"reasoning": text, "reasoning_content": text}
        return sse(self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]))

    def delta_chunk(self, kind: str, index: int, text: str) -> bytes:
        """A "text" or "reasoning" delta."""
        return self.text_chunk(index, text) if kind == "text" else self.reasoning_chunk(index, text)

    def call_chunks(self, index: int, call) -> bytes:
        """One whole tool call as OpenAI streams it: id, type and name first, then the arguments."""
        head = {"index": call.index, "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}  # fmt: skip
        args = {"index": call.index, "function": {"arguments": call.text}}
        return b"".join(
            sse(self._chunk([{"index": index, "delta": {"tool_calls": [item]}, "logprobs": None, "finish_reason": None}]))
            for item in (head, args)
        )

    def logprobs_chunk(self, index: int, text: str, fragments: list[bytes]) -> bytes:
        """A text delta with its tokens' logprobs (fragments from the worker, spliced in as they are)."""
        if self.chat:
            choice = {"index": index, "delta": {"content": text}, "logprobs": chat_logprobs([fragments]),
                      "finish_reason": None}  # fmt: skip
        else:
            choice = {"index": index, "text": text, "logprobs": completion_logprobs([fragments]), "finish_reason": None}
        return sse(self._chunk([choice]))

    def finish_chunk(self, index: int, reason: str) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        return sse(self._chunk([choice]))

    def usage_chunk(self, usage_obj: dict) -> bytes:
        return sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "choices": [], "usage": usage_obj})

    def full(self, texts: list[str], reasons: list[str], usage_obj: dict, reasoning=None, calls=None,
             logprobs=None, forced_calls: bool = False) -> bytes:
        """The whole response; ``logprobs``: per choice, the fragments of its deltas (None: not asked)."""
        lps = [None] * len(texts)
        if logprobs is not None:
            lps = [(chat_logprobs if self.chat else completion_logprobs)(f) for f in logprobs]
        if self.chat:
            choices = [
                {"index": i, "message": message(t, reasoning[i] if reasoning else "", calls[i] if calls else (),
                                                forced_calls),
                 "logprobs": lps[i], "finish_reason": r}
                for i, (t, r) in enumerate(zip(texts, reasons))
            ]  # fmt: skip
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": t, "logprobs": lps[i], "finish_reason": r}
                for i, (t, r) in enumerate(zip(texts, reasons))
            ]
            obj = "text_completion"
        return _json.encode(
            {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, "usage": usage_obj}
        )
