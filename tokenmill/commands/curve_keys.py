"""``tokenmill curve-keys DIR``: CURVE certificates for tcp:// links (the scheduler's, or remote workers')."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="Where to write the keys.")
    parser.add_argument(
        "--worker",
        metavar="NAME",
        action="append",
        default=[],
        help="Make keys for a remote tokenizer worker NAME instead (repeatable): DIR/workers/NAME "
        "goes to the worker's host, DIR/authorized_workers/NAME.key admits it.",
    )


def run(args) -> int:
    from tokenmill.transport.security import make_keys, make_worker_keys

    if args.worker:
        for name in args.worker:
            for path in make_worker_keys(args.directory, name):
                print(path)
        print("Start the gateway with --remote-workers tcp://ADDR:PORT --curve-keys-dir DIR, and on each worker host")
        print("tokenmill worker --connect tcp://GATEWAY:PORT --keys DIR/workers/NAME (a copy of that folder).")
        return 0
    for path in make_keys(args.directory):
        print(path)
    print("Give the scheduler scheduler.key_secret (tokenmill simulate-scheduler --curve-secret-key-file ...),")
    print("and tokenmill serve --curve-keys-dir DIR (it reads scheduler.key and client.key_secret).")
    return 0
