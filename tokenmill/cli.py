"""The ``tokenmill`` command. Each subcommand lives in its own module, imported only when chosen,
so ``tokenmill serve`` never imports an optional engine backend and vice versa."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with add_arguments(parser) and run(args), one-line help); a module may also have
# prepare_args(the arguments after the command) -> the arguments its parser reads (bench: the scenario first)
COMMANDS = {
    "serve": ("tokenmill.commands.serve", "Serve the OpenAI API (gateway, tokenizer workers, simulated scheduler)."),
    "simulate-scheduler": ("tokenmill.engines.simulated", "Run the simulated GPU scheduler on its own."),
    "engine": (
        "tokenmill.engines.bridge",
        "Run a real inference engine (transformers, SGLang, vLLM) behind the scheduler protocol.",
    ),
    "render": ("tokenmill.commands.render", "Render conversations with a model's chat template and tokenize them."),
    "worker": ("tokenmill.commands.worker", "Run a tokenizer worker that joins a gateway's pool from another host."),
    "curve-keys": (
        "tokenmill.commands.curve_keys",
        "Create CURVE keys for a tcp:// scheduler link, or for remote workers.",
    ),
    "bench": (
        "tokenmill.bench.command",
        "Benchmark the front end: long-context load (default), multiturn, parsers, vllm, streams, dp, gateways, busy.",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="An LLM front end whose event loop never tokenizes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in COMMANDS:
        prepare = getattr(importlib.import_module(COMMANDS[command][0]), "prepare_args", None)
        if prepare is not None:
            at = argv.index(command) + 1
            argv = [*argv[:at], *prepare(argv[at:])]
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
