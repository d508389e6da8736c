"""``tokenmill render``: render conversation files with a model's chat template and tokenize them.

For each file one JSON line is printed: ``{"file", "prompt", "token_ids"}``, or ``{"file", "error"}``
when the file cannot be read or the template refuses it. The exit status is 0 when every file
rendered, else 1. Rendering goes through the same ``ChatTemplates`` the server uses.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.tokenizer_workers.chat_template import ChatTemplates, TemplateError, render_conversation
from tokenmill.tokenizer_workers.model import ModelError, load_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="HuggingFace model directory (tokenizer.json, tokenizer_config.json, chat template); "
        "default: the embedded DeepSeek-V4 tokenizer and its chat template",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="Jinja chat template file to use instead of the model's",
    )
    parser.add_argument(
        "conversations",
        metavar="CONVERSATION.json",
        nargs="+",
        help="JSON object with messages and optional tools, add_generation_prompt, "
        "continue_final_message, template_kwargs",
    )


def run(args: argparse.Namespace) -> int:
    try:
        model = load_model(args.model, chat_template_file=args.chat_template)
    except (ModelError, OSError, ValueError) as exc:
        print(f"tokenmill render: {exc}", file=sys.stderr)
        return 1
    templates = ChatTemplates(model.templates, model.special_tokens)
    status = 0
    for path in args.conversations:
        try:
            with open(path, encoding="utf-8") as f:
                conversation = json.load(f)
            prompt = render_conversation(templates, conversation)
        except (OSError, ValueError, TemplateError) as exc:  # json.JSONDecodeError is a ValueError
            _emit({"file": path, "error": str(exc)})
            status = 1
            continue
        ids = model.tokenizer.encode(prompt, add_special_tokens=False).ids
        _emit({"file": path, "prompt": prompt, "token_ids": ids})
    return status


def _emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
