"""OpenAI Responses wire format: the response object, its output items, and the stream's events.

The same methods App._stream / App._collect call on the chat framer (gateway/openai_format.py), over
the pieces the workers already parsed (text, reasoning, whole tool calls): no tokens, no templates.
Each item keeps one id (and a call its call_id) in its ``added``, ``done`` and final forms, every
event carries a ``sequence_number``, and a stream ends in exactly one terminal event:
``response.completed``, ``response.incomplete`` (max_output_tokens reached) or ``response.failed``.
"""

from __future__ import annotations

import uuid

import msgspec

from tokenmill.tokenizer_workers.messages import ApiError, ResponsesShape

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: dict, reasoning_tokens: int = 0) -> dict:
    """Chat's usage object in the Responses API's names."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
        "total_tokens": prompt + completion,
    }


class ResponsesFramer:
    """Builds one /v1/responses answer: a ``response`` object, or its stream of events."""

    chat = True  # App._stream opens the stream with role_chunk: here response.created and .in_progress
    include_usage = False  # the usage goes in the terminal event, not in a chunk of its own

    def __init__(self, response_id: str, created: int, model: str, shape: ResponsesShape):
        self.id = response_id
        self.created = created
        self.model = model
        self.fields = shape.response_fields or b"{}"  # the request fields the response repeats (the worker's JSON)
        self.custom_tools = frozenset(shape.custom_tools)
        self.namespaces = shape.tool_namespaces  # ns__name -> ns: the call is answered as name in namespace ns
        self.sequence = 0
        self.output: list[dict] = []  # finished items, in order: the final response's output
        self.open: dict | None = None  # the text or reasoning item being streamed
        self.open_text: list[str] = []
        self.reason = "stop"
        self.reasoning_tokens = 0

    # ---- the response object ---------------------------------------------------------

    def _response(self, status: str, usage: dict | None = None, error: ApiError | None = None) -> msgspec.Raw:
        head = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": self.output if status != "in_progress" else [],
            "error": {"code": error.code or error.type, "message": error.message} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage,
        }
        encoded = _json.encode(head)
        fields = self.fields
        if len(fields) > 2:
            encoded = encoded[:-1] + b"," + fields[1:]
        return msgspec.Raw(encoded)

    def _event(self, kind: str, **body) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(body) + b"\n\n"

    # ---- items ---------------------------------------------------------------------

    def _open(self, kind: str) -> bytes:
        """Start a reasoning or message item (closing the other kind first)."""
        out = self._close()
        index = len(self.output)
        if kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": _new_id("msg"),
                "type": "message",
                "role": "assistant",
                "content": [],
                "status": "in_progress",
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open = item
        self.open_text = []
        out += self._event("response.output_item.added", output_index=index, item=item)
        out += self._event(
            "response.content_part.added", output_index=index, item_id=item["id"], content_index=0, part=part
        )
        return out

    def _close(self) -> bytes:
        item = self.open
        if item is None:
            return b""
        self.open = None
        text = "".join(self.open_text)
        index = len(self.output)
        ids = {"output_index": index, "item_id": item["id"], "content_index": 0}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out = self._event("response.reasoning_text.done", **ids, text=text)
            done = {"id": item["id"], "type": "reasoning", "summary": [], "content": [part], "status": "completed"}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = self._event("response.output_text.done", **ids, text=text, logprobs=[])
            status = "incomplete" if self.reason == "length" else "completed"
            done = {"id": item["id"], "type": "message", "role": "assistant", "content": [part], "status": status}
        out += self._event("response.content_part.done", **ids, part=part)
        out += self._event("response.output_item.done", output_index=index, item=done)
        self.output.append(done)
        return out

    def _call_item(self, call) -> dict:
        if call.name in self.custom_tools:
            return {
                "id": _new_id("ctc"),
                "type": "custom_tool_call",
                "call_id": call.call_id,
                "name": call.name,
                "input": custom_input(call.text),
                "status": "completed",
            }
        item = {
            "id": _new_id("fc"),
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.text,
            "status": "completed",
        }
        namespace = self.namespaces.get(call.name)
        if namespace is not None:  # as vLLM answers it: the function's own name, and its namespace
            item["name"] = call.name[len(namespace) + 2 :]
            item["namespace"] = namespace
        return item

    # ---- the methods App._stream calls --------------------------------------------------

    def role_chunk(self, index: int) -> bytes:
        created = self._response("in_progress")
        return self._event("response.created", response=created) + self._event("response.in_progress", response=created)

    def delta_chunk(self, kind: str, index: int, text: str, tokens: int = 0) -> bytes:
        out = b""
        wanted = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != wanted:
            out = self._open(wanted)
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            tail = b"}\n\n" if kind == "reasoning" else b',"logprobs":[]}\n\n'
            head = b'event: %s\ndata: {"type":"%s","sequence_number":' % (name.encode(), name.encode())
            ids = b',"output_index":%d,"item_id":%s,"content_index":0,"delta":' % (
                len(self.output),
                _json.encode(self.open["id"]),
            )
            self._delta = (head, ids, tail)  # the item's delta event as bytes around its number and text
        if kind == "reasoning":
            self.reasoning_tokens = tokens
        self.open_text.append(text)
        head, ids, tail = self._delta
        self.sequence += 1
        return out + b"".join((head, b"%d" % (self.sequence - 1), ids, _json.encode(text), tail))

    def call_chunks(self, index: int, call, tokens: int = 0) -> bytes:
        out = self._close()
        item = self._call_item(call)
        output_index = len(self.output)
        custom = item["type"] == "custom_tool_call"
        key = "input" if custom else "arguments"
        prefix = "response.custom_tool_call_input" if custom else "response.function_call_arguments"
        out += self._event(
            "response.output_item.added", output_index=output_index, item={**item, key: "", "status": "in_progress"}
        )
        ids = {"output_index": output_index, "item_id": item["id"]}
        out += self._event(prefix + ".delta", **ids, delta=item[key])
        out += self._event(prefix + ".done", **ids, **{key: item[key]})
        out += self._event("response.output_item.done", output_index=output_index, item=item)
        self.output.append(item)
        return out

    def logprobs_chunk(self, index: int, text: str, fragments, tokens: int = 0) -> bytes:
        return self.delta_chunk("text", index, text, tokens)  # logprobs are refused on /v1/responses

    def ids_chunk(self, index: int, kind, text: str, ids: bytes, fragments, tokens: int = 0) -> bytes:
        return self.delta_chunk(kind, index, text, tokens) if kind is not None and text else b""

    def finish_chunk(self, index: int, reason: str, tokens: int = 0, stop_reason=None) -> bytes:
        self.reason = reason
        return self._close()

    def usage_chunk(self, usage_obj: dict) -> bytes:
        return b""

    def done_chunk(self, usage: dict, failed: bool) -> bytes:
        """The terminal event (after a failure, error_chunk sent it already)."""
        if failed:
            return b""
        status = "incomplete" if self.reason == "length" else "completed"
        response = self._response(status, responses_usage(usage, self.reasoning_tokens))
        return self._event(f"response.{status}", response=response)

    def error_chunk(self, error: ApiError) -> bytes:
        return self._close() + self._event("response.failed", response=self._response("failed", error=error))

    # ---- the whole response (App._collect) --------------------------------------------

    def full(self, texts, reasons, usage_obj, reasoning=None, calls=None, logprobs=None, **_) -> bytes:
        self.reason = reasons[0]
        if reasoning and reasoning[0]:
            part = {"type": "reasoning_text", "text": reasoning[0]}
            self.output.append(
                {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [part], "status": "completed"}
            )
        if texts[0]:
            part = {"type": "output_text", "text": texts[0], "annotations": [], "logprobs": []}
            status = "incomplete" if self.reason == "length" else "completed"
            self.output.append(
                {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": [part], "status": status}
            )
        for call in calls[0] if calls else ():
            self.output.append(self._call_item(call))
        status = "incomplete" if self.reason == "length" else "completed"
        return _json.encode(self._response(status, responses_usage(usage_obj)))


def custom_input(arguments: str) -> str:
    """A custom tool's freeform input from the call's arguments (``{"input": ...}``); bare text as it is."""
    try:
        parsed = _decode.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    value = parsed.get("input") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments
