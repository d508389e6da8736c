"""The simulated scheduler's command line: ``tokenmill simulate-scheduler --bind ENDPOINT`` and
``python -m tokenmill.engines.simulated --bind ENDPOINT`` (the gateway starts the latter itself).

Its flags become :class:`~tokenmill.engines.simulated.scheduler.SimulatedScheduler`'s arguments
(:func:`scheduler_from_args`); :func:`run` serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import zmq

from tokenmill.engines.simulated.scheduler import DEFAULT_VOCAB_SIZE, SimulatedScheduler
from tokenmill.scheduler_client.scheduler_side import read_curve_secret

log = logging.getLogger("tokenmill.simulated_scheduler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--title", default="simulated scheduler", help="what ps shows for this process (ignored)")
    parser.add_argument(
        "--bind",
        required=True,
        metavar="ENDPOINT",
        help="ZeroMQ endpoint to bind, e.g. ipc:///run/tokenmill/scheduler.sock or tcp://0.0.0.0:5557",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=200_000.0,
        metavar="N",
        help="prefill speed; prompts are prefilled one at a time (0: instant; default %(default).0f)",
    )
    parser.add_argument(
        "--inter-token-latency-ms",
        type=float,
        default=20.0,
        metavar="F",
        help="time between decode steps (0: as fast as possible; default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        metavar="N",
        help="the engine's context length (prompt and output), reported in Welcome; longer prompts are refused "
        "(0: none; default %(default)s)",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        metavar="N",
        help="model a prefix cache of N tokens (blocks of 16, LRU): cached prompt tokens skip prefill and "
        "are reported as cached_tokens (0: none; default %(default)s)",
    )
    parser.add_argument(
        "--tokens-per-step",
        type=int,
        default=1,
        metavar="N",
        help="tokens each request gets per decode step, as engines with speculative decoding emit (default %(default)s)",
    )
    parser.add_argument(
        "--scheduling",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="the order waiting requests are admitted in: fcfs (arrival), or priority (Generate.priority, lower "
        "first, FIFO among equals; only then is the 'priority' feature listed, as vLLM's --scheduling-policy; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=256,
        metavar="N",
        help="requests decoded at once; the rest wait (default %(default)s)",
    )
    parser.add_argument(
        "--mode",
        choices=("random", "echo"),
        default="random",
        help="random: generated tokens; echo: repeat the prompt's tokens (default %(default)s)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a HuggingFace model directory with tokenizer.json, or 'default' for the embedded model: "
        "random tokens are then drawn from readable English text and the vocabulary size is the tokenizer's",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help=f"vocabulary size (default: the tokenizer's with --model, else {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument(
        "--eos-probability",
        type=float,
        default=0.0,
        metavar="P",
        help="chance per generated token to emit the request's first stop token and finish "
        "with 'stop' (random mode; not with ignore_eos; default %(default)s)",
    )
    parser.add_argument(
        "--stats-interval-s",
        type=float,
        default=1.0,
        metavar="S",
        help="how often Stats go to every front end (default %(default)s)",
    )
    parser.add_argument(
        "--replies",
        metavar="FILE",
        default=None,
        help='script the output: JSON lines of {"match": "...", "text": "..."}; a request whose prompt contains '
        "match generates text (tokenized with the model's tokenizer, special tokens included) and then the "
        "model's EOS; where several match, the latest in the prompt wins (implies --model default if none given)",
    )
    parser.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        metavar="N",
        help="keep N cores busy while any request runs, as a GPU engine's CPU side spins (default %(default)s)",
    )
    parser.add_argument(
        "--image-cache-bytes",
        type=int,
        default=4 << 30,
        metavar="N",
        help="images.by_hash: the bytes of images it holds by content hash, least recently used out first "
        "(as vLLM's processor cache, 4 GiB by default); a request naming one it no longer holds gets image_missing",
    )
    parser.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        default=None,
        help="act as a ZeroMQ CURVE server with this secret key (a file holding the Z85 key, "
        "or a zmq.auth '.key_secret' certificate)",
    )


def _set_process_name() -> None:
    try:
        from tokenmill.process.procutil import die_with_supervisor, set_process_name
    except ImportError:  # pragma: no cover
        return
    die_with_supervisor()  # when started by a gateway: die with it, even after its kill -9
    set_process_name("tm-scheduler")


def scheduler_from_args(args: argparse.Namespace) -> SimulatedScheduler:
    curve = read_curve_secret(args.curve_secret_key_file) if args.curve_secret_key_file else None
    return SimulatedScheduler(
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        inter_token_latency_s=args.inter_token_latency_ms / 1000.0,
        max_running=args.max_running,
        mode=args.mode,
        model=args.model,
        vocab_size=args.vocab_size,
        eos_probability=args.eos_probability,
        stats_interval_s=args.stats_interval_s,
        curve_secret_key=curve,
        replies=args.replies,
        tokens_per_step=args.tokens_per_step,
        prefix_cache_tokens=args.prefix_cache_tokens,
        busy_cores=args.busy_cores,
        max_model_len=args.max_model_len or None,
        scheduling=getattr(args, "scheduling", "fcfs"),
        image_cache_bytes=getattr(args, "image_cache_bytes", 4 << 30),
    )


async def _serve_until_signalled(scheduler: SimulatedScheduler, endpoint: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not on Linux
            pass
    serving = asyncio.create_task(scheduler.serve(endpoint))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    await scheduler.close()
    try:
        await serving
    except zmq.ZMQError as exc:
        log.error("cannot serve %s: %s", endpoint, exc)
        return 1
    except Exception:
        log.exception("the simulated scheduler failed")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """The ``tokenmill simulate-scheduler`` command. Returns the exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _set_process_name()
    try:
        scheduler = scheduler_from_args(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"simulate-scheduler: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve_until_signalled(scheduler, args.bind))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.engines.simulated", description="A simulated GPU scheduler (simulate-scheduler)."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
