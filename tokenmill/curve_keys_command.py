"""``tokenmill curve-keys DIR``: CURVE certificates for a tcp:// link between tokenmill and its scheduler."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="Where to write scheduler.key(_secret) and client.key(_secret).")


def run(args) -> int:
    from tokenmill.transport_security import make_keys

    for path in make_keys(args.directory):
        print(path)
    print("Give the scheduler scheduler.key_secret (tokenmill simulate-scheduler --curve-secret-key-file ...),")
    print("and tokenmill serve --curve-keys-dir DIR (it reads scheduler.key and client.key_secret).")
    return 0
