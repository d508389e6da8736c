"""Completions: a prompt (text or token IDs, or a list of those) tokenized as it is, no template."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenmill.tokenizer_workers import generation_params as gp
from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers.conversion.core import FIM_MARKERS
from tokenmill.tokenizer_workers.conversion.plan import Conversion, RenderedPrompts, generate_fields, plan
from tokenmill.tokenizer_workers.messages import ConvertJob, Timing

if TYPE_CHECKING:
    from tokenmill.tokenizer_workers.conversion.core import ConverterCore


def convert_completion(cv: ConverterCore, job: ConvertJob, body: bytes) -> Conversion:
    req: oa.CompletionRequest = oa.parse("completion", body)
    cv.check_model(req.model)
    oa.check_sampling(req)
    cv.check_max_tokens(req.max_tokens, "max_tokens")
    spec, fields = gp.structured(req, cv.engine)
    params = generate_fields(cv, req, req.max_tokens, spec, chat=False)
    echo_logprobs = gp.echo_prompt_logprobs(req, cv.engine, cv.vocab_size)
    t0 = time.perf_counter()
    prompts = completion_prompts(cv, req.prompt)
    if req.suffix is not None:
        prompts = fill_in_the_middle(cv, req, prompts)
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(e.ids for e in cv.tokenizer.encode_batch(texts, add_special_tokens=True)) if texts else iter(())
    id_lists = [next(encoded) if isinstance(p, str) else p for p in prompts]
    echo = None
    # as vLLM: the prompt as given, a token-ID prompt decoded (special tokens kept), before truncation;
    # with return_token_ids vLLM echoes no text (the prompt's IDs are in the response instead)
    if req.echo and not req.return_token_ids:
        echo = [p if isinstance(p, str) else cv.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    t1 = time.perf_counter()
    rendered = RenderedPrompts(id_lists, "prompt", Timing(tokenize_s=t1 - t0), echo, echo_logprobs)
    conversion = plan(cv, job, req, params, rendered)
    conversion.done.fields = fields
    return conversion


def completion_prompts(cv: ConverterCore, prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise oa.InvalidRequest("prompt must be a non-empty string, token list, or list of those.", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        cv.check_token_ids(prompt, "prompt")
        return [prompt]
    if all(isinstance(p, list) and p for p in prompt):
        for p in prompt:
            cv.check_token_ids(p, "prompt")
        return list(prompt)
    raise oa.InvalidRequest(
        "prompt must be a string, a list of strings, a list of token IDs, or a list of token-ID lists.", "prompt"
    )


def fill_in_the_middle(cv: ConverterCore, req, prompts: list) -> list[str]:
    """vLLM's completions suffix: each text prompt becomes begin, prompt, hole, suffix, end."""
    if req.echo:
        raise oa.InvalidRequest("Echo is unsupported with suffix.", "suffix")
    if req.truncate_prompt_tokens is not None:
        raise oa.InvalidRequest("suffix is not supported with truncate_prompt_tokens", "suffix")
    if not all(isinstance(p, str) for p in prompts):
        raise oa.InvalidRequest("suffix requires text prompt input for FIM completion rendering", "suffix")
    if not cv.fim:
        raise oa.InvalidRequest("suffix is only supported for models with FIM completion rendering", "suffix")
    begin, hole, end = FIM_MARKERS
    return [f"{begin}{p}{hole}{req.suffix}{end}" for p in prompts]
