"""``tokenmill bench [SCENARIO] [options]``: one subcommand per scenario, each with its own options.

Without a scenario it runs ``frontloop``, as it always has: ``tokenmill bench --quick`` is
``tokenmill bench frontloop --quick``. A scenario module has ``add_arguments(parser)`` and
``run(args)``; all of them import only the standard library (and ``tokenmill``'s light modules) at
the top, so building every scenario's options costs nothing: the work imports happen in ``run``.
"""

from __future__ import annotations

import importlib

DEFAULT = "frontloop"
# name -> (module, one-line help)
SCENARIOS = {
    "frontloop": (
        "tokenmill.bench.frontloop",
        "Long-context responsiveness of the front loop, in three conversion modes (the default).",
    ),
    "multiturn": ("tokenmill.bench.multiturn", "Agent conversations replayed: what the tokenization cache saves."),
    "parsers": (
        "tokenmill.bench.parsers",
        "Tool-call and reasoning parsing cost per output token, beside vLLM's parsers.",
    ),
    "vllm": ("tokenmill.bench.vllm", "Side by side with vLLM's own server in front of the same vLLM engine."),
    "streams": ("tokenmill.bench.streams", "Hundreds of concurrent streams through one gateway, and slow readers."),
    "dp": ("tokenmill.bench.dp", "Data-parallel routing policies and the engines' prefix caches."),
    "gateways": ("tokenmill.bench.gateways", "What a second gateway process buys and costs."),
    "busy": ("tokenmill.bench.busy", "Long prompts while the engine keeps cores busy and short chats keep arriving."),
}
HELP = ("-h", "--help")


def prepare_args(args: list[str]) -> list[str]:
    """The arguments after ``bench`` with the scenario first: ``frontloop`` where none is named, and a
    scenario named after options (``bench --quick multiturn``, as the single parser took it) moved to
    the front. A word following an option is that option's value (``--json parsers`` names a file)."""
    if args and (args[0] in SCENARIOS or args[0] in HELP):
        return args
    for i, word in enumerate(args):
        after_option = i > 0 and args[i - 1].startswith("--") and "=" not in args[i - 1] and not _is_flag(args[i - 1])
        if word in SCENARIOS and not after_option:
            return [word, *args[:i], *args[i + 1 :]]
    return [DEFAULT, *args]


def _is_flag(option: str) -> bool:
    """Options that take no value, in any scenario."""
    return option in ("--quick", "--no-vllm")


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="scenario", metavar="SCENARIO", required=True)
    for name, (module, text) in SCENARIOS.items():
        p = sub.add_parser(name, help=text, description=text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(bench_run=mod.run)


def run(args) -> int:
    return args.bench_run(args)
