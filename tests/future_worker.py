"""`tokenmill worker --connect ENDPOINT` that writes the decoder state of a stream whose stop strings
include FUTURE-STATE as a later release would (the next spec version): the stream of the failover test
that no worker of this release can take over (tests/serving/test_stream_failover.py)."""

from __future__ import annotations

import sys

import msgspec

from tokenmill.tokenizer_workers import resume, worker

MARK = "FUTURE-STATE"
_encode = worker.encode_spec


def _encode_later(spec) -> bytes:
    data = _encode(spec)
    if MARK in spec.stop:
        later = msgspec.msgpack.decode(data, type=resume.ResumeSpec)
        later.version = resume.VERSION + 1
        data = msgspec.msgpack.encode(later)
    return data


if __name__ == "__main__":
    worker.encode_spec = _encode_later
    from tokenmill.cli import main

    sys.exit(main(["worker", "--connect", sys.argv[1]]))
