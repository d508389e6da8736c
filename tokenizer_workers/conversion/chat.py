"""Chat Completions, and the two APIs whose bodies become a chat request: Anthropic's Messages
(anthropic_messages.py) and OpenAI's Responses (openai_responses.py)."""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING

from tokenmill.scheduler_client import protocol
from tokenmill.tokenizer_workers import anthropic_messages as am
from tokenmill.tokenizer_workers import generation_params as gp
from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers import openai_responses as responses
from tokenmill.tokenizer_workers.chat_messages import ImageRef
from tokenmill.tokenizer_workers.conversion.plan import (
    Conversion,
    DetokSpec,
    RenderedPrompts,
    generate_fields,
    plan,
)
from tokenmill.tokenizer_workers.messages import ConvertJob, ResponsesShape, Timing

if TYPE_CHECKING:
    from tokenmill.tokenizer_workers.conversion.core import ConverterCore


def convert_chat(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    return chat(cv, job, oa.parse("chat", body))


def convert_responses(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    """The Responses API over the chat core: its body converted to a chat request (openai_responses.py),
    plus what the gateway's Responses framer needs to name the output items."""
    converted = responses.convert(body)
    conversion = chat(cv, job, converted.chat)
    done = conversion.done
    done.completion = None  # framed by the Responses framer, from this instead:
    done.responses = ResponsesShape(converted.custom_tools, converted.namespaces, converted.echo)
    if converted.affinity is not None:  # the client's name for the conversation beats the messages' hash
        done.conversation = zlib.crc32(converted.affinity.encode())
    return conversion


def convert_messages(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    """Anthropic's /v1/messages: converted to the chat request (anthropic_messages.py), then the chat path."""
    req = am.parse(body)
    cv.check_model(req.model)
    conversion = chat(cv, job, am.to_chat_request(req, cv.merge_inline_system()))
    conversion.done.completion = None  # the Messages framer shows none of chat's extras
    return conversion


def chat(cv: ConverterCore, job: ConvertJob, req: oa.ChatCompletionRequest) -> Conversion:
    """The path all three kinds take: checks, the template, the encoding, the plan, then the output
    parsers and what chat's answer shows beyond the text."""
    cv.check_model(req.model)
    oa.check_sampling(req)
    functions = legacy_functions(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    cv.check_max_tokens(max_tokens, "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    # everything that can be refused is refused before rendering
    forced_spec, forced = gp.forced_tools(req, cv.engine)
    spec, fields = gp.structured(req, cv.engine)
    if forced_spec is not None and spec is not None:
        raise oa.InvalidRequest(
            "A forced tool_choice constrains the output already; drop the other output "
            "constraint or use tool_choice 'auto'.",
            "tool_choice",
        )
    params = generate_fields(cv, req, max_tokens, forced_spec or spec, chat=True)
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    t0 = time.perf_counter()
    refs: list[ImageRef] = []
    prompt = cv.render(req.messages, req, refs)
    if refs:
        cv.engine.require(protocol.FEATURE_IMAGES, refs[0].where, "Image input")
    images = cv.load_images(refs)
    t1, cpu = time.perf_counter(), cv.encode_cpu.start()
    try:
        ids, report = cv.encode_chat(prompt)
    finally:
        cpu = cv.encode_cpu.stop(cpu)
    ids, items = cv.expand_images(ids, images)
    t2 = time.perf_counter()
    timing = Timing(render_s=t1 - t0, tokenize_s=t2 - t1, tokenize_cpu_s=cpu, cache=report)
    conversion = plan(cv, job, req, params, RenderedPrompts([ids], "messages", timing, images=list(zip(items, images))))
    done, shape = conversion.done, conversion.done.completion
    echo = chat_echo(req)
    for spec_ in conversion.detok:
        attach_parser(cv, spec_, req, prompt, parse_tools, forced)
        spec_.prefix = echo
    if req.return_token_ids and not req.include_reasoning and any(s.parser for s in conversion.detok):
        for spec_ in conversion.detok:  # as vLLM: with a parser at work and the reasoning left out, the
            spec_.token_ids = False  # generated IDs are not shown (they would tell the reasoning)
        shape.token_ids = False
    done.fields = {"structured": "tool_choice"} if forced_spec is not None else fields
    # forced: the named function (calls finish "stop", as OpenAI's), "" for "required", None when not forced
    done.calls_finish = "stop" if forced else "function_call" if functions else "tool_calls"
    shape.forced_calls = forced is not None
    shape.functions = functions
    shape.role = answer_role(req)
    done.conversation = conversation_key(req.messages)
    return conversion


def attach_parser(cv: ConverterCore, spec: DetokSpec, req, prompt: str, parse_tools: bool, forced: str | None) -> None:
    max_calls = 1 if req.parallel_tool_calls is False else 0
    recipe = (req.tools if parse_tools else None, cv.parsers.prompt_hint(prompt), forced, max_calls)
    parser = cv.parsers.make(*recipe)
    if parser is not None:
        spec.parser = parser
        spec.parser_recipe = recipe
        spec.include_reasoning = req.include_reasoning
        spec.tool_parser_name = "forced" if forced is not None else cv.parsers.tool_name


def legacy_functions(req) -> bool:
    """OpenAI's deprecated functions and function_call, mapped as OpenAI does: functions are tools of
    type function, function_call "none", "auto" or {"name": N} the matching tool_choice, and (as
    OpenAI's legacy answer holds one function_call) at most one call. True when the request used them."""
    functions, call = req.functions, req.function_call
    if functions is None:
        if call is not None:
            raise oa.InvalidRequest("function_call needs functions: none were given.", "function_call")
        return False
    if req.tools is not None:
        raise oa.InvalidRequest("Give either tools or functions (their deprecated form), not both.", "functions")
    if not functions or not all(
        isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"] for f in functions
    ):
        raise oa.InvalidRequest("functions must be a non-empty list of objects, each with a name.", "functions")
    if call is not None and req.tool_choice is not None:
        raise oa.InvalidRequest(
            "Give either tool_choice or function_call (its deprecated form), not both.", "function_call"
        )
    if call in ("none", "auto"):
        req.tool_choice = call
    elif isinstance(call, dict) and set(call) == {"name"}:
        if call["name"] not in {f["name"] for f in functions}:
            raise oa.InvalidRequest(
                f"function_call names {call['name']!r}, which is not among the functions.", "function_call"
            )
        req.tool_choice = {"type": "function", "function": {"name": call["name"]}}
    elif call is not None:
        raise oa.InvalidRequest("function_call must be 'none', 'auto' or {'name': ...}.", "function_call")
    req.tools = [{"type": "function", "function": f} for f in functions]
    req.parallel_tool_calls = False
    return True


def answer_role(req) -> str:
    """The answer's role, as vLLM 0.32 names it: the assistant's, or with add_generation_prompt false
    the last message's own (the model goes on writing that message)."""
    if req.add_generation_prompt or not req.messages:
        return "assistant"
    role = req.messages[-1].get("role")
    return role if isinstance(role, str) and role else "assistant"


def chat_echo(req) -> str:
    """vLLM's chat echo: the last message's content, when its role is the answer's (the assistant's,
    or with add_generation_prompt false the last message's own); parts' texts joined by newlines."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    role = answer_role(req)
    content = last.get("content")
    if last.get("role") != role or not content:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def conversation_key(messages: list[dict]) -> int:
    """What identifies a conversation on every turn: its messages up to the first user message (a
    system prompt alone is shared by many), for the scheduler rank holding its history."""
    end = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1) + 1
    return _crc_of(messages[:end], 0)


_WHOLE = 65536  # characters: a longer string (a data: URL's megabytes of base64) is hashed by its ends


def _crc_of(value, crc: int) -> int:
    """CRC-32 of a JSON value's structure and contents, without encoding it: a first turn carrying
    four screenshots is megabytes of base64 that every turn would otherwise encode and checksum
    (~14% of a worker's CPU for a resent image); a string past 64K characters counts by its length and
    its first and last 4K, plenty to tell conversations apart (the key only picks a scheduler rank)."""
    if isinstance(value, str):
        if len(value) > _WHOLE:
            value = f"{len(value)}:{value[:4096]}{value[-4096:]}"
        return zlib.crc32(value.encode("utf-8", "surrogatepass"), zlib.crc32(b"s", crc))
    if isinstance(value, dict):
        crc = zlib.crc32(b"{", crc)
        for key, item in value.items():
            crc = _crc_of(item, _crc_of(key, crc))
        return crc
    if isinstance(value, list):
        crc = zlib.crc32(b"[", crc)
        for item in value:
            crc = _crc_of(item, crc)
        return zlib.crc32(b"]", crc)
    return zlib.crc32(repr(value).encode(), crc)
