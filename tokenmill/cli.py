"""The ``tokenmill`` command: serve, simulate-scheduler, engine, render, bench."""

from __future__ import annotations

import argparse
import sys

from tokenmill import settings as settings_mod


def _serve(args) -> int:
    from gateway import server

    settings = settings_mod.resolve(args)

    def announce(gw) -> None:
        url = f"http://{settings.host}:{settings.port}"
        print(f"tokenmill is ready at {url}  (model {gw.model_name}, {settings.workers} tokenizer workers)", flush=True)
        print(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{gw.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'",
            flush=True,
        )

    return server.run(settings, on_ready=announce)


def _simulate(args) -> int:
    from scheduler_client import simulated

    return simulated.run(args)


def _engine(args) -> int:
    from engines import server as engine_server

    return engine_server.run(args)


def _render(args) -> int:
    from tokenmill import render_command

    return render_command.run(args)


def _bench(args) -> int:
    from tokenmill import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="An LLM front end whose event loop never tokenizes.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Serve the OpenAI API (gateway, tokenizer workers, simulated scheduler).")
    settings_mod.add_arguments(serve)
    serve.set_defaults(func=_serve)

    from scheduler_client import simulated

    sim = sub.add_parser("simulate-scheduler", help="Run the simulated GPU scheduler on its own.")
    simulated.add_arguments(sim)
    sim.set_defaults(func=_simulate)

    from engines import server as engine_server

    engine = sub.add_parser("engine", help="Run a real inference engine (transformers, SGLang, vLLM) behind the scheduler protocol.")
    engine_server.add_arguments(engine)
    engine.set_defaults(func=_engine)

    from tokenmill import render_command

    render = sub.add_parser("render", help="Render conversations with a model's chat template and tokenize them.")
    render_command.add_arguments(render)
    render.set_defaults(func=_render)

    from tokenmill import bench

    bench_parser = sub.add_parser("bench", help="Benchmark the front loop under long-context load (or the multiturn cache).")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
