"""The gateway-worker socket pair (tokenmill/transport/pipe_link.py): framing, large messages, a closed end."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys

import pytest
import uvloop
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.transport.pipe_link import FrameReader, LinkDown, PipeLink, pack_header

messages = st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=5), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(messages, st.lists(st.integers(1, 700), min_size=1, max_size=20))
def test_any_cut_of_the_stream_gives_back_the_messages(msgs, cuts):
    stream = b"".join(pack_header(m) + b"".join(m) for m in msgs)
    reader, got, pos, i = FrameReader(), [], 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        got += [[bytes(f) for f in m] for m in reader.feed(stream[pos : pos + step])]
        pos, i = pos + step, i + 1
    assert got == msgs


@settings(max_examples=300, deadline=None)
@given(messages, st.lists(st.integers(1, 700), min_size=1, max_size=20), st.integers(4, 64), st.integers(8, 400))
def test_reads_into_its_buffers_give_back_the_messages(msgs, cuts, chunk, big_at):
    """As a socket read fills buffer(): small messages through the scratch chunk, a message of
    big_at bytes or more straight into a buffer of its own, never read past its end."""
    stream = b"".join(pack_header(m) + b"".join(m) for m in msgs)
    reader, got, pos, i = FrameReader(chunk=chunk, big_at=big_at), [], 0, 0
    while pos < len(stream):
        buffer = reader.buffer()
        step = min(cuts[i % len(cuts)], len(buffer), len(stream) - pos)
        buffer[:step] = stream[pos : pos + step]
        got += [[bytes(f) for f in m] for m in reader.filled(step)]
        pos, i = pos + step, i + 1
    assert got == msgs
    assert len(reader.buffer()) == chunk  # nothing half-read left behind


def test_a_large_message_is_read_into_one_buffer_of_its_size():
    big = bytes(range(256)) * 1024  # 256 KiB
    stream = pack_header([b"head", big]) + b"head" + big + pack_header([b"next"]) + b"next"
    reader = FrameReader(chunk=1000, big_at=64 << 10)
    reader.buffer()[:1000] = stream[:1000]
    assert reader.filled(1000) == []
    rest = reader.buffer()
    assert len(rest) == len(pack_header([b"head", big])) + 4 + len(big) - 1000  # exactly the message's remainder
    rest[:] = stream[1000 : 1000 + len(rest)]
    (frames,) = reader.filled(len(rest))
    assert bytes(frames[0]) == b"head" and frames[1] == big
    assert frames[1].obj is rest.obj  # the frame is a view into the buffer the socket filled, not a copy
    tail = stream[1000 + len(rest) :]
    reader.buffer()[: len(tail)] = tail
    assert [[bytes(f) for f in m] for m in reader.filled(len(tail))] == [[b"next"]]


def test_a_huge_claimed_size_is_not_allocated_up_front():
    """A garbled prefix (a bug on the other end) claiming gigabytes allocates nothing ahead:
    past 256 MiB a message is gathered as its bytes arrive, as small ones are."""
    reader = FrameReader(chunk=1000)
    prefix = struct.pack("<II", 1, 1 << 31)  # one frame of 2 GiB
    assert reader.feed(prefix + b"some") == []
    assert len(reader.buffer()) == 1000  # still the scratch chunk, not a 2 GiB buffer


# A worker-like process: echoes every message back with its frames reversed, through its PipePeer.
ECHO = """
import select, sys
from tokenmill.transport.pipe_link import PipePeer
peer = PipePeer(int(sys.argv[1]))
while True:
    select.select([peer.fileno()], [], [])
    try:
        msgs = peer.receive()
    except EOFError:
        print("eof", flush=True)
        sys.exit(0)
    for frames in msgs:
        peer.send_multipart([bytes(f) for f in reversed(frames)])
"""


def test_a_worker_process_gets_and_answers_small_and_large_messages():
    big = bytes(range(256)) * 16384  # 4 MiB: more than a socket buffer holds, so it crosses in pieces

    async def body():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = subprocess.Popen(
            [sys.executable, "-c", ECHO, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        theirs.close()
        answers: asyncio.Queue = asyncio.Queue()
        link = await PipeLink.open(ours, lambda _link, frames: answers.put_nowait([bytes(f) for f in frames]))
        sent = [[b"header", b"body"], [b"x"], [b"", b"empty frame first"], [b"job", big], [b"after the big one"]]
        for frames in sent:
            link.send(frames)
        got = [await asyncio.wait_for(answers.get(), 30) for _ in sent]
        assert got == [list(reversed(frames)) for frames in sent]
        link.close()
        with pytest.raises(LinkDown):  # a send on a closed link fails at once, as a ZeroMQ one would
            link.send([b"late"])
        return proc

    proc = uvloop.run(body())
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.strip() == "eof"  # the worker sees the gateway's end close


def test_a_large_message_goes_out_in_slices_with_the_loop_turning_between_them():
    """A request body of megabytes is handed to the kernel at most _WRITE_SLICE at a time, one slice
    per loop turn: one writev of it all lasted as long as the worker took to read it, and the loop
    (/health with it) waited that long. Messages sent after it still arrive after it, whole."""
    import os

    from tokenmill.transport.pipe_link import _WRITE_SLICE

    big = os.urandom(6 << 20)
    body_in_pieces = [big[i : i + 100_000] for i in range(0, len(big), 100_000)]  # as a request body arrives

    async def scenario():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = subprocess.Popen(
            [sys.executable, "-c", ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),), cwd=ROOT
        )
        theirs.close()
        answers: asyncio.Queue = asyncio.Queue()
        link = await PipeLink.open(ours, lambda _link, frames: answers.put_nowait([bytes(f) for f in frames]))
        real, writes, turns = link.transport, [], [0]

        class Recording:  # the real transport, each write's size and loop turn noted
            def __getattr__(self, name):
                return getattr(real, name)

            def writelines(self, parts):
                writes.append((sum(map(len, parts)), turns[0]))
                real.writelines(parts)

        link.transport = Recording()
        loop = asyncio.get_running_loop()

        def turn():  # counts loop turns until the answers are in (bounded)
            turns[0] += 1
            if turns[0] < 1_000_000 and not done.is_set():
                loop.call_soon(turn)

        done = asyncio.Event()
        loop.call_soon(turn)
        link.send([b"job", body_in_pieces])
        link.send([b"small, after the big one"])
        got = [await asyncio.wait_for(answers.get(), 60) for _ in range(2)]
        done.set()
        link.close()
        return proc, got, writes

    proc, got, writes = uvloop.run(scenario())
    proc.wait(30)
    assert got == [[big, b"job"], [b"small, after the big one"]]
    assert sum(size for size, _ in writes) == len(pack_header([b"job", big])) + 3 + len(big) + len(
        pack_header([b"x"])
    ) + len(b"small, after the big one")
    assert max(size for size, _ in writes) <= _WRITE_SLICE
    assert len(writes) >= len(big) // _WRITE_SLICE
    turns_seen = [turn for _, turn in writes]
    assert turns_seen == sorted(turns_seen) and len(set(turns_seen)) >= len(writes) // 2  # one slice a turn, or so


def test_a_worker_answers_detokenization_before_conversions_that_arrived_with_it():
    """A worker's IO thread converts small requests itself (a few hundred microseconds each): a
    detokenization batch that arrives in the same read as a conversion job is answered first, so a
    running stream's text does not wait behind a conversion."""
    import msgspec

    from tokenmill.process.procutil import child_env
    from tokenmill.tokenizer_workers import messages as m
    from tokenmill.tokenizer_workers.settings import SETTINGS_ENV, ConverterSettings

    body = b'{"model": "deepseek-v4", "max_tokens": 1, "messages": [{"role": "user", "content": "Hello there"}]}'

    async def scenario():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {
            **child_env(),
            SETTINGS_ENV: msgspec.json.encode(ConverterSettings(served_model_name="deepseek-v4")).decode(),
        }
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.tokenizer_workers.worker",
                "--link-fd",
                str(theirs.fileno()),
                "--index",
                "0",
            ],
            pass_fds=(theirs.fileno(),),
            cwd=ROOT,
            env=env,
        )
        theirs.close()
        replies: asyncio.Queue = asyncio.Queue()
        link = await PipeLink.open(ours, lambda _link, frames: replies.put_nowait(m.from_worker.decode(frames[0])))
        try:
            assert isinstance(await asyncio.wait_for(replies.get(), 120), m.WorkerReady)
            job = m.encoder.encode(m.ConvertJob(1, "chat", "chatcmpl-a", quick=True))
            detok = m.encoder.encode(m.DetokBatch([m.DetokItem("chatcmpl-b-0", b"\0\0\0\0", True)]))
            link.transport.writelines([pack_header([job, body]), job, body, pack_header([detok]), detok])  # one write
            first = await asyncio.wait_for(replies.get(), 60)
            second = await asyncio.wait_for(replies.get(), 60)
            assert isinstance(first, m.DetokOut) and first.items[0].request_id == "chatcmpl-b-0"
            assert isinstance(second, m.ConvertDone) and second.job_id == 1 and second.error is None
        finally:
            link.close()
        return proc

    proc = uvloop.run(scenario())
    assert proc.wait(30) == 0  # the worker exits when the gateway's end closes (the loop has closed it now)


def test_a_large_message_buffer_is_reused_once_its_frames_are_let_go():
    """Messages of a MiB and more are read into anonymous mappings; one whose frames are all gone (sent
    on, answered) is read into again, its pages already faulted in, and one still pointed into is not."""
    import os

    def receive(reader: FrameReader, payload: bytes) -> list[memoryview]:
        data = pack_header([b"h", payload]) + b"h" + payload
        (message,) = reader.feed(data[:100]) or [None]
        assert message is None
        buffer = reader.buffer()
        buffer[: len(data) - 100] = data[100:]
        (message,) = reader.filled(len(data) - 100)
        assert bytes(message[1]) == payload
        return message

    reader = FrameReader()
    first = receive(reader, os.urandom(3 << 20))
    held = id(first[1].obj)  # (an id: a reference would keep it busy)
    second = receive(reader, os.urandom(3 << 20))
    assert id(second[1].obj) != held  # the first's frames are alive: its buffer is not touched
    del first
    third = receive(reader, os.urandom(3 << 20))
    assert id(third[1].obj) == held  # let go: taken again
