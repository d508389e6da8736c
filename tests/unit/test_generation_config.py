"""A model's generation_config.json gives the sampling settings a request leaves out (temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens as the default max_tokens), as vLLM's servers apply
them; the request's own values win, and ``generation_config = "vllm"`` turns the defaults off. An engine
reached over its token-in API (vLLM's /inference/v1/generate) applies none of them itself, so the
front end must."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenmill.scheduler_client import protocol
from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.converter import Converter
from tokenmill.tokenizer_workers.model import default_model_dir
from tokenmill.tokenizer_workers.settings import ConverterSettings

DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    )
    generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "max_new_tokens": 7, **DEFAULTS}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def converter(model_dir, generation_config: str = "auto") -> Converter:
    conv = Converter(
        ConverterSettings(model_dir=str(model_dir), served_model_name="x", generation_config=generation_config)
    )
    conv.limit_context(m.Limits(features=list(protocol.FEATURES)))
    return conv


def generate(conv: Converter, **fields) -> protocol.Generate:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], **fields}
    conversion = conv.convert(m.ConvertJob(1, "chat", "r"), json.dumps(body).encode())
    assert conversion.done.error is None, conversion.done.error
    header = protocol.decode_to_scheduler(conversion.frames[0])
    assert isinstance(header, protocol.Generate)
    return header


def sampling_of(gen: protocol.Generate) -> dict:
    s = gen.sampling
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
    }


def test_the_models_defaults_fill_what_the_request_leaves_out(model_dir):
    gen = generate(converter(model_dir))
    assert sampling_of(gen) == pytest.approx(DEFAULTS)
    assert gen.max_new_tokens == 7


def test_the_requests_own_values_win(model_dir):
    gen = generate(converter(model_dir), temperature=0, top_k=-1, max_tokens=30, repetition_penalty=1.0)
    got = sampling_of(gen)
    assert (got["temperature"], got["top_k"], got["repetition_penalty"], gen.max_new_tokens) == (0, 0, 1.0, 30)
    assert (got["top_p"], got["min_p"]) == pytest.approx((0.95, 0.05))  # still the model's


def test_vllm_turns_the_defaults_off(model_dir):
    gen = generate(converter(model_dir, "vllm"))
    assert sampling_of(gen) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    assert gen.max_new_tokens > 7  # the rest of the context
