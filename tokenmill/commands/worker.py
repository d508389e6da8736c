"""``tokenmill worker --connect tcp://GATEWAY:PORT``: a tokenizer worker on another host.

It joins the pool of a gateway started with ``--remote-workers``, takes the gateway's
converter settings, and converts and detokenizes like the gateway's own workers. Run it
under systemd (deploy/systemd/tokenmill-worker.service): it exits on a refused key or a
changed configuration, and a restart is the cure for both.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from tokenmill.transport.security import require_secure


def add_arguments(parser) -> None:
    parser.add_argument(
        "--connect", required=True, help="The gateway's --remote-workers endpoint, e.g. tcp://10.0.0.5:5600."
    )
    parser.add_argument(
        "--keys",
        default=os.environ.get("TOKENMILL_WORKER_KEYS"),
        help="Directory with gateway.key and worker.key_secret, as `tokenmill curve-keys DIR "
        "--worker NAME` writes them to DIR/workers/NAME [env TOKENMILL_WORKER_KEYS].",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="Where this host keeps the gateway's model, if not at the same path (the gateway "
        "refuses a worker whose tokenizer or templates differ from its own).",
    )
    parser.add_argument("--insecure-tcp", action="store_true", help="Connect without CURVE (trusted network only).")
    parser.add_argument("--memory-limit-mb", type=int, default=8192, help="Address-space cap (0 = none).")
    parser.add_argument(
        "--conversion-threads",
        type=int,
        default=2,
        help="Requests converted at once, one thread each, sharing the tokenization cache.",
    )
    parser.add_argument(
        "--conversion-nice",
        type=int,
        default=0,
        help="Niceness the conversion threads add to this process's (0-19; as `serve --conversion-nice`).",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args) -> int:
    from tokenmill.process.procutil import ONE_BLAS_THREAD, limit_memory, set_process_name

    os.environ.update(ONE_BLAS_THREAD)  # before the worker's modules import numpy
    from tokenmill.tokenizer_workers.remote_link import RemoteWorkerLink
    from tokenmill.tokenizer_workers.worker import TokenizerWorker

    require_secure(args.connect, "The gateway's worker", args.insecure_tcp, bool(args.keys))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s remote tokenizer worker %(levelname)s %(message)s"
    )
    limit_memory(args.memory_limit_mb)
    set_process_name("tm-worker")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    sys.setswitchinterval(0.001)  # as the gateway's own workers: detokenization never waits long
    link = RemoteWorkerLink(args.keys, args.model)
    logging.getLogger("tokenmill.worker").info("joining the gateway at %s as %s", args.connect, link.identity.decode())
    TokenizerWorker(
        -1,
        args.connect,
        None,
        remote=link,
        conversion_threads=args.conversion_threads,
        conversion_nice=args.conversion_nice,
    ).run()
    return 0
