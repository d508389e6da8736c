"""The kinds that answer with a finished body and generate nothing: tokenize, detokenize, and the
prompt a generating route would send (Anthropic's count_tokens, vLLM's render routes)."""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING

import msgspec

from tokenmill.tokenizer_workers import anthropic_messages as am
from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers import openai_responses as responses
from tokenmill.tokenizer_workers.chat_messages import ImageRef
from tokenmill.tokenizer_workers.conversion.plan import Conversion
from tokenmill.tokenizer_workers.messages import ConvertDone, ConvertJob, Timing

if TYPE_CHECKING:
    from tokenmill.tokenizer_workers.conversion.core import ConverterCore
    from tokenmill.tokenizer_workers.images.pipeline import ProcessedImage

_json = msgspec.json.Encoder()


def convert_count_tokens(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    """Anthropic's /v1/messages/count_tokens: the prompt /v1/messages would render, counted."""
    t0 = time.perf_counter()
    req = am.parse(body)
    cv.check_model(req.model)
    chat = am.to_chat_request(req, cv.merge_inline_system(), count_only=True)
    refs: list[ImageRef] = []
    prompt = cv.render(chat.messages, chat, refs)
    images = cv.load_images(refs)  # decoded and processed (and cached) as /v1/messages would
    ids = cv.expand_images(cv.encode_chat(prompt)[0], images)[0]
    # as vLLM answers (and Anthropic's beta with context_management): nothing is cleared here
    body = _json.encode({"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}})
    return Conversion(ConvertDone(job.job_id, body=body, timing=Timing(tokenize_s=time.perf_counter() - t0)))


def convert_messages_render(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    """/v1/messages/render (vLLM's route of that name): the prompt token IDs /v1/messages would send."""
    req = am.parse(body)
    cv.check_model(req.model)
    return render_ids(cv, job, am.to_chat_request(req, cv.merge_inline_system(), count_only=True))


def convert_responses_render(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    """/v1/responses/render (vLLM's route of that name): the prompt token IDs /v1/responses would send."""
    chat = responses.convert(body).chat
    cv.check_model(chat.model)
    return render_ids(cv, job, chat)


def render_ids(cv: ConverterCore, job: ConvertJob, chat: oa.ChatCompletionRequest) -> Conversion:
    """``{"token_ids": [...]}``: the field of vLLM's render answer (a GenerateRequest) that holds the
    prompt; its sampling parameters are not repeated here."""
    t0 = time.perf_counter()
    refs: list[ImageRef] = []
    ids = cv.encode_chat(cv.render(chat.messages, chat, refs))[0]
    if refs:
        raise oa.InvalidRequest("Images are not rendered by this route.", refs[0].where)
    body = _json.encode({"token_ids": ids.tolist() if hasattr(ids, "tolist") else list(ids)})
    return Conversion(ConvertDone(job.job_id, body=body, timing=Timing(tokenize_s=time.perf_counter() - t0)))


def convert_tokenize(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    req: oa.TokenizeRequest = oa.parse("tokenize", body)
    cv.check_model(req.model)
    render_s = 0.0
    images: list[ProcessedImage] = []
    t0 = time.perf_counter()
    if req.messages is not None:
        if req.prompt is not None:
            raise oa.InvalidRequest("Give either prompt or messages, not both.", "prompt")
        refs: list[ImageRef] = []
        prompt = cv.render(req.messages, req, refs)
        images = cv.load_images(refs)
        add_special = bool(req.add_special_tokens)  # default False for chat prompts
        render_s = time.perf_counter() - t0
    elif req.prompt is not None:
        prompt, add_special = req.prompt, req.add_special_tokens is not False
    else:
        raise oa.InvalidRequest("Give prompt (a string) or messages (a chat).", "prompt")
    t1 = time.perf_counter()
    if req.messages is not None and not add_special and not req.return_token_strs:
        ids = cv.encode_chat(prompt)[0].tolist()
        strs = None
    else:
        enc = cv.tokenizer.encode_batch([prompt], add_special_tokens=add_special)[0]
        ids, strs = enc.ids, (enc.tokens if req.return_token_strs else None)
    if images:  # the prompt the engine gets: each image placeholder expanded to the image's tokens
        pad = cv.image_token_id
        if strs is not None:
            counts = iter(image.tokens for image in images)
            strs = [s for i, s in zip(ids, strs) for s in ([s] * (next(counts, 1) if i == pad else 1))]
        ids = cv.expand_images(array("I", ids), images)[0].tolist()
    answer = {"count": len(ids), "max_model_len": cv.max_model_len, "tokens": ids, "token_strs": strs}
    timing = Timing(render_s=render_s, tokenize_s=time.perf_counter() - t1)
    return Conversion(ConvertDone(job.job_id, body=_json.encode(answer), timing=timing))


def convert_detokenize(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    req: oa.DetokenizeRequest = oa.parse("detokenize", body)
    cv.check_model(req.model)
    cv.check_token_ids(req.tokens, "tokens")
    text = cv.tokenizer.decode_batch([req.tokens], skip_special_tokens=False)[0]
    return Conversion(ConvertDone(job.job_id, body=_json.encode({"prompt": text}), timing=Timing()))
