"""The simulated scheduler, driven over a real ZeroMQ DEALER as a front end would.

Each scheduler runs in its own process (``python -m tokenmill.engines.simulated``) bound to
an ipc:// endpoint in a temporary directory. Every wait is bounded; nothing asserts
wall-clock durations, only the order of events.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from protocol_client import AsyncProtocolClient, ProtocolClient

from tokenmill.scheduler_client.protocol import (
    FEATURES,
    PROTOCOL_VERSION,
    STRUCTURED_FEATURES,
    STRUCTURED_OPTION_FEATURES,
    Abort,
    Error,
    Generate,
    Hello,
    ImageItem,
    Outputs,
    SamplingParams,
    Stats,
    Structured,
    Welcome,
    bytes_to_floats,
    frame_to_ids,
    ids_to_frame,
)
from tokenmill.tokenizer_workers.images.shared_memory import SharedPixels

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 30.0  # a cold interpreter on a busy 2-core machine
WAIT = 10.0  # any single expected message
_ids = itertools.count()


class Scheduler:
    """A simulated scheduler subprocess."""

    def __init__(self, *options: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tmsim-"))  # short: ipc paths are limited to ~100 bytes
        self.path = self.dir / "scheduler.sock"
        self.endpoint = f"ipc://{self.path}"
        self.log_path = self.dir / "scheduler.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.engines.simulated", "--bind", self.endpoint, *options],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.ctx = zmq.Context()
        self.clients: list[Client] = []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, handshake: bool = True) -> Client:
        client = Client(self)
        self.clients.append(client)
        if handshake:
            client.handshake()
        return client

    def wait_ready(self) -> None:
        """Handshake once, allowing for interpreter startup."""
        probe = Client(self)
        try:
            probe.hello()
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"the scheduler exited with {self.proc.returncode}:\n{self.log()}")
                message = probe.poll(0.1)
                if message is not None:
                    assert isinstance(message, Welcome)
                    return
            raise AssertionError(f"the scheduler did not answer Hello in {STARTUP_TIMEOUT}s:\n{self.log()}")
        finally:
            probe.close()

    def stop(self) -> int:
        for client in self.clients:
            client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(WAIT)
        self.ctx.term()
        self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Client(ProtocolClient):
    """A front end's DEALER on the simulated scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler.endpoint, ctx=scheduler.ctx, log=scheduler.log)
        self.scheduler = scheduler

    def generate(self, prompt: list[int], max_new_tokens: int, request_id: str | None = None, **fields) -> str:
        request_id = request_id or f"req-{next(_ids)}"
        self.send_generate(request_id, prompt, max_new_tokens=max_new_tokens, **fields)
        return request_id


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for t in frame_to_ids(out.token_ids)]


def check_stream(outputs, prompt_tokens: int) -> None:
    """Cumulative completion_tokens, prompt_tokens everywhere, exactly one final output."""
    total = 0
    for out in outputs:
        total += len(out.token_ids) // 4
        assert len(out.token_ids) % 4 == 0
        assert out.completion_tokens == total, (out, total)
        assert out.prompt_tokens == prompt_tokens
    assert [o.finish_reason is not None for o in outputs].count(True) == 1
    assert outputs[-1].finish_reason is not None


def _start(*options: str):
    scheduler = Scheduler(*options)
    try:
        scheduler.wait_ready()
    except BaseException:
        scheduler.stop()
        scheduler.cleanup()
        raise
    return scheduler


@pytest.fixture(scope="module")
def sched():
    """Random mode, fast decode steps."""
    scheduler = _start("--inter-token-latency-ms", "2", "--stats-interval-s", "0.2")
    yield scheduler
    assert scheduler.stop() == 0, scheduler.log()
    assert "Traceback" not in scheduler.log(), scheduler.log()
    scheduler.cleanup()


@pytest.fixture(scope="module")
def echo():
    scheduler = _start("--mode", "echo", "--inter-token-latency-ms", "1")
    yield scheduler
    assert scheduler.stop() == 0, scheduler.log()
    scheduler.cleanup()


# --------------------------------------------------------------------------- handshake


def test_handshake(sched):
    client = sched.client(handshake=False)
    welcome = client.handshake()
    assert welcome.protocol_version == PROTOCOL_VERSION
    assert welcome.scheduler_name
    assert welcome.max_running_requests == 256


def test_version_mismatch(sched):
    client = sched.client(handshake=False)
    client.send(Hello(protocol_version=PROTOCOL_VERSION + 99))
    error = client.recv_not_stats()
    assert isinstance(error, Error)
    assert error.code == "version_mismatch"
    assert error.request_id is None
    # Generate after a rejected handshake is refused too, with its request_id.
    rid = client.generate([1, 2, 3], 4)
    error = client.recv_not_stats()
    assert isinstance(error, Error) and error.code == "version_mismatch" and error.request_id == rid
    # A supported Hello on the same connection recovers it.
    client.handshake()
    rid = client.generate([1, 2, 3], 2)
    assert client.collect([rid])[rid][-1].finish_reason == "length"


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("max_new_tokens", [1, 7, 50])
def test_length(sched, max_new_tokens):
    client = sched.client()
    prompt = [11, 22, 33, 44, 55]
    rid = client.generate(prompt, max_new_tokens)
    outputs = client.collect([rid])[rid]
    check_stream(outputs, len(prompt))
    assert len(tokens_of(outputs)) == max_new_tokens
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].completion_tokens == max_new_tokens
    assert outputs[-1].error is None
    assert all(0 <= t < 129280 for t in tokens_of(outputs))


def test_concurrent_requests_batched(sched):
    """Many requests of one front end: one Outputs per step carries several requests."""
    client = sched.client()
    rids = [client.generate([7, 8, 9], 20) for _ in range(10)]
    batch_sizes = []
    outputs = client.collect(
        rids, on_message=lambda m: batch_sizes.append(len(m.outputs)) if isinstance(m, Outputs) else None
    )
    for rid in rids:
        check_stream(outputs[rid], 3)
        assert len(tokens_of(outputs[rid])) == 20
    assert max(batch_sizes) > 1


def test_seed_determinism(sched):
    client = sched.client()
    prompt = [100, 200, 300]

    def run(**sampling):
        rid = client.generate(prompt, 30, sampling=SamplingParams(**sampling))
        return tokens_of(client.collect([rid])[rid])

    first = run(seed=1234, temperature=0.8)
    assert run(seed=1234, temperature=0.8) == first
    assert run(seed=4321, temperature=0.8) != first
    # seed None and temperature 0: deterministic from the prompt
    greedy = run(temperature=0.0)
    assert run(temperature=0.0) == greedy
    # seed None and temperature > 0: random
    assert run(temperature=1.0) != run(temperature=1.0)


def test_echo_mode(echo):
    client = echo.client()
    rid = client.generate([5, 6, 7], 3)
    outputs = client.collect([rid])[rid]
    check_stream(outputs, 3)
    assert tokens_of(outputs) == [5, 6, 7]
    assert outputs[-1].finish_reason == "length"
    # Past the prompt's end it cycles.
    rid = client.generate([5, 6, 7], 8)
    assert tokens_of(client.collect([rid])[rid]) == [5, 6, 7, 5, 6, 7, 5, 6]


def test_stop_token(echo):
    client = echo.client()
    rid = client.generate([10, 11, 12, 13, 14], 100, stop_token_ids=[99, 12])
    outputs = client.collect([rid])[rid]
    check_stream(outputs, 5)
    assert tokens_of(outputs) == [10, 11, 12]  # the stop token is included
    assert outputs[-1].finish_reason == "stop"
    # A generated stop token ends the request even with ignore_eos.
    rid = client.generate([10, 11, 12, 13, 14], 100, stop_token_ids=[13], ignore_eos=True)
    outputs = client.collect([rid])[rid]
    assert tokens_of(outputs) == [10, 11, 12, 13]
    assert outputs[-1].finish_reason == "stop"


def test_eos_probability():
    scheduler = _start("--eos-probability", "1.0", "--inter-token-latency-ms", "1")
    try:
        client = scheduler.client()
        rid = client.generate([1, 2, 3], 50, stop_token_ids=[77, 78])
        outputs = client.collect([rid])[rid]
        check_stream(outputs, 3)
        assert tokens_of(outputs) == [77]
        assert outputs[-1].finish_reason == "stop"
        # ignore_eos: no simulated EOS, and a stop token is never drawn by chance.
        rid = client.generate([1, 2, 3], 50, stop_token_ids=[77], ignore_eos=True)
        outputs = client.collect([rid])[rid]
        assert len(tokens_of(outputs)) == 50 and 77 not in tokens_of(outputs)
        assert outputs[-1].finish_reason == "length"
        # Without stop ids there is nothing to emit.
        rid = client.generate([1, 2, 3], 5)
        assert client.collect([rid])[rid][-1].finish_reason == "length"
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        scheduler.cleanup()


def test_palette_model_default():
    """--model default: tokens come from readable English text of the embedded tokenizer."""
    from tokenizers import Tokenizer

    from tokenmill.tokenizer_workers.model import default_model_dir

    scheduler = _start("--model", "default", "--inter-token-latency-ms", "1")
    try:
        client = scheduler.client()
        rid = client.generate([1, 2, 3], 40, sampling=SamplingParams(seed=7))
        outputs = client.collect([rid])[rid]
        assert len(tokens_of(outputs)) == 40
        tokenizer = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
        text = tokenizer.decode(tokens_of(outputs))
        words = text.split()
        assert len(words) >= 10
        assert sum(w.strip(".,").isalpha() and w.isascii() for w in words) >= len(words) - 2, text
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        scheduler.cleanup()


# --------------------------------------------------------------------------- abort


def test_abort_mid_decode():
    scheduler = _start("--inter-token-latency-ms", "10")
    try:
        client = scheduler.client()
        rid = client.generate([1, 2, 3], 100_000)
        other = client.generate([1, 2, 3], 5)
        got = []
        while not any(out.request_id == rid and out.token_ids for out in got):
            message = client.recv_not_stats()
            assert isinstance(message, Outputs)
            got.extend(message.outputs)
        client.send(Abort(request_ids=[rid, "never-heard-of-it"]))
        final = None
        while final is None:
            message = client.recv_not_stats()
            assert isinstance(message, Outputs), message
            for out in message.outputs:
                got.append(out)
                if out.request_id == rid and out.finish_reason is not None:
                    final = out
        assert final.finish_reason == "abort"
        mine = [o for o in got if o.request_id == rid]
        check_stream(mine, 3)
        assert 0 < final.completion_tokens < 100_000
        # Nothing more for it (and no Error for the unknown id); the other one is unaffected.
        later = client.quiet(0.5)
        for message in later:
            assert isinstance(message, Outputs), message
            assert all(o.request_id != rid for o in message.outputs)
        others = [o for o in got if o.request_id == other] + [
            o for m in later for o in m.outputs if o.request_id == other
        ]
        assert others[-1].finish_reason == "length"
        # Aborting again (now finished) is ignored silently.
        client.send(Abort(request_ids=[rid]))
        assert client.quiet(0.3) == []
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        scheduler.cleanup()


def test_abort_waiting_request():
    """Abort of a request still waiting for a slot: a final 'abort' with no tokens."""
    scheduler = _start("--max-running", "1", "--inter-token-latency-ms", "10")
    try:
        client = scheduler.client()
        running = client.generate([1], 100_000)
        waiting = client.generate([2], 10)
        client.send(Abort(request_ids=[waiting]))
        message = client.recv_not_stats()
        while not any(o.request_id == waiting for o in message.outputs):
            message = client.recv_not_stats()
        (final,) = [o for o in message.outputs if o.request_id == waiting]
        assert final.finish_reason == "abort" and final.token_ids == b"" and final.completion_tokens == 0
        client.send(Abort(request_ids=[running]))
        outputs = client.collect([running])[running]
        assert outputs[-1].finish_reason == "abort"
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        scheduler.cleanup()


# --------------------------------------------------------------------------- queueing


def test_max_running_queues_the_rest():
    scheduler = _start("--max-running", "2", "--inter-token-latency-ms", "10", "--stats-interval-s", "0.05")
    try:
        client = scheduler.client()
        rids = [client.generate([1, 2, 3], 40) for _ in range(4)]
        events: list[tuple[str, str]] = []  # ("first"|"final", request_id) in arrival order
        stats: list[Stats] = []
        seen = set()

        def record(message):
            if isinstance(message, Stats):
                stats.append(message)
                return
            for out in message.outputs:
                if out.request_id not in seen:
                    seen.add(out.request_id)
                    events.append(("first", out.request_id))
                if out.finish_reason is not None:
                    events.append(("final", out.request_id))

        outputs = client.collect(rids, on_message=record)
        for rid in rids:
            check_stream(outputs[rid], 3)
            assert len(tokens_of(outputs[rid])) == 40
        # The first two run; the others start only after a slot frees up.
        assert {rid for kind, rid in events[:2]} == set(rids[:2])
        first_final = next(i for i, (kind, _) in enumerate(events) if kind == "final")
        for rid in rids[2:]:
            assert events.index(("first", rid)) > first_final
        assert all(s.num_running <= 2 for s in stats)
        assert any(s.num_waiting > 0 for s in stats) or len(stats) == 0
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        scheduler.cleanup()


# --------------------------------------------------------------------------- images (1.2)


def test_image_items_are_checked_against_their_frames(sched):
    """A generate carrying images: one pixel frame per item after the prompt, of the item's dtype and shape,
    its placeholder inside the prompt; a valid one (float32 or the workers' uint8) generates as usual."""
    client = sched.client()
    prompt = [5, 9, 9, 9, 9, 6, 7]
    item = ImageItem("qwen2_vl", "float32", [16, 1176], [1, 4, 4], offset=1, length=4, content_hash="h")
    pixels = bytes(16 * 1176 * 4)

    def send(rid, items, *frames):
        client.send(
            Generate(request_id=rid, prompt_token_count=len(prompt), max_new_tokens=3, images=items),
            ids_to_frame(prompt),
            *frames,
        )

    send("ok", [item], pixels)
    assert client.collect(["ok"])["ok"][-1].finish_reason == "length"
    send("u8", [msgspec.structs.replace(item, dtype="uint8")], bytes(16 * 1176))  # what the workers send
    assert client.collect(["u8"])["u8"][-1].finish_reason == "length"
    for rid, items, frames in (
        ("missing", [item], ()),
        ("extra", [item], (pixels, pixels)),
        ("short", [item], (pixels[:-4],)),
        ("dtype", [msgspec.structs.replace(item, dtype="int64")], (pixels,)),
        ("outside", [msgspec.structs.replace(item, offset=5)], (pixels,)),
        ("overlap", [item, msgspec.structs.replace(item, offset=3, length=2)], (pixels, bytes(16 * 1176 * 4))),
    ):
        send(rid, items, *frames)
        error = client.recv_not_stats()
        assert isinstance(error, Error) and error.request_id == rid and error.code == "bad_request", (rid, error)
        assert error.param == (None if rid in ("missing", "extra") else "images"), (rid, error)


def test_image_items_may_name_a_shared_memory_file_instead(sched):
    """Protocol 1.2 images.shm: an item with an empty frame naming a file in /dev/shm is read from the
    file; a file that is not there (or holds another size) is image_missing, so the front end sends
    the pixels; a name outside tokenmill's pattern (a path) is refused; a filled frame wins over a name."""
    client = sched.client()
    prompt = [5, 9, 9, 9, 9, 6, 7]
    shared = SharedPixels()  # written as a worker writes it: owned, so no gateway's sweep takes it meanwhile
    pixels = np.frombuffer(bytes(range(256)) * (16 * 1176 // 256) + bytes(16 * 1176 % 256), np.uint8)
    name, _ = shared.write("0" * 64, pixels.reshape(16, 1176))
    item = ImageItem("qwen2_vl", "uint8", [16, 1176], [1, 4, 4], 1, 4, "0" * 64, shm=name)
    try:
        assert "images.shm" in client.handshake().features
        for rid, items, frame, code in (
            ("mapped", [item], b"", None),
            ("framed", [msgspec.structs.replace(item, shm="tokenmill-img-gone")], bytes(16 * 1176), None),
            (
                "gone",
                [msgspec.structs.replace(item, shm="tokenmill-img-gone", content_hash="1" * 64)],
                b"",
                "image_missing",
            ),
            (
                "size",
                [msgspec.structs.replace(item, shape=[4, 1176], grid_thw=[1, 2, 2], content_hash="2" * 64)],
                b"",
                "image_missing",
            ),
            ("path", [msgspec.structs.replace(item, shm="../" + name, content_hash="3" * 64)], b"", "bad_request"),
        ):
            client.send(
                Generate(request_id=rid, prompt_token_count=len(prompt), max_new_tokens=3, images=items),
                ids_to_frame(prompt),
                frame,
            )
            if code is None:
                assert client.collect([rid])[rid][-1].finish_reason == "length", rid
            else:
                error = client.recv_not_stats()
                assert isinstance(error, Error) and (error.request_id, error.code, error.param) == (rid, code, "images")
    finally:
        shared.close()


# --------------------------------------------------------------------------- bad input


def test_malformed_messages(sched):
    client = sched.client()

    def expect_error(code=None, request_id=None):
        message = client.recv_not_stats()
        assert isinstance(message, Error), message
        assert message.request_id == request_id
        if code is not None:
            assert message.code == code
        assert message.message
        return message

    client.sock.send(b"\xc1 not msgpack")
    expect_error("bad_request")
    client.sock.send(b"")
    expect_error("bad_request")
    client.sock.send(msgspec.msgpack.encode({"type": "teleport", "request_id": "x"}))
    expect_error("unknown_message", "x")
    client.sock.send(msgspec.msgpack.encode([1, 2, 3]))
    expect_error("bad_request")
    # A Generate with a wrongly typed field, its request_id still readable.
    client.sock.send_multipart(
        [msgspec.msgpack.encode({"type": "generate", "request_id": "bad-type", "prompt_token_count": "3"}), b""]
    )
    expect_error("bad_request", "bad-type")
    # Missing prompt frame.
    client.send(Generate(request_id="no-frame", prompt_token_count=2, max_new_tokens=3))
    expect_error("bad_request", "no-frame")
    # Prompt frame of the wrong length.
    client.send(Generate(request_id="short", prompt_token_count=3, max_new_tokens=3), ids_to_frame([1, 2]))
    expect_error("bad_request", "short")
    client.send(Generate(request_id="odd", prompt_token_count=1, max_new_tokens=3), b"\x01\x00\x00")
    expect_error("bad_request", "odd")
    # Extra frames.
    client.send(Generate(request_id="extra", prompt_token_count=1, max_new_tokens=3), ids_to_frame([1]), b"x")
    expect_error("bad_request", "extra")
    client.send(Hello(protocol_version=PROTOCOL_VERSION), b"x")
    expect_error("bad_request")
    # Invalid fields.
    client.generate([1, 2], 0, request_id="zero")
    expect_error("bad_request", "zero")
    client.send(Generate(request_id="empty", prompt_token_count=0, max_new_tokens=3), b"")
    expect_error("bad_request", "empty")
    client.generate([1, 2], 3, request_id="neg-temp", sampling=SamplingParams(temperature=-1.0))
    expect_error("bad_request", "neg-temp")
    client.generate([129280], 3, request_id="oov")
    expect_error("bad_request", "oov")
    # Duplicate in-flight request_id: the original runs on, untouched.
    rid = client.generate([1, 2], 30, request_id="dup")
    client.generate([3, 4], 30, request_id="dup")
    outputs = []
    error = None
    while not outputs or outputs[-1].finish_reason is None:
        message = client.recv_not_stats()
        if isinstance(message, Error):
            assert error is None
            error = message
        else:
            outputs.extend(message.outputs)
    assert error is not None and error.code == "duplicate_request_id" and error.request_id == "dup"
    check_stream(outputs, 2)
    assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == 30
    # Once finished, the id may be used again.
    rid = client.generate([1, 2], 2, request_id="dup")
    assert client.collect([rid])[rid][-1].finish_reason == "length"
    # Still serving, other clients too.
    other = sched.client()
    rid = other.generate([5], 3)
    assert other.collect([rid])[rid][-1].finish_reason == "length"
    assert sched.proc.poll() is None


def test_outputs_go_to_their_front_end(sched):
    a, b = sched.client(), sched.client()
    ra = a.generate([1], 10, request_id="same-id")
    rb = b.generate([2], 15, request_id="same-id")  # request ids are scoped per connection
    outs_a = a.collect([ra])[ra]
    outs_b = b.collect([rb])[rb]
    assert len(tokens_of(outs_a)) == 10 and len(tokens_of(outs_b)) == 15
    assert a.quiet(0.2) == [] and b.quiet(0.2) == []


def test_stats_sent_periodically(sched):
    client = sched.client()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        message = client.recv()
        if isinstance(message, Stats):
            assert message.num_running >= 0 and message.num_waiting >= 0
            return
    raise AssertionError("no Stats")


def test_disconnected_front_end_is_forgotten(sched):
    """A front end that goes away mid-request does not disturb the scheduler."""
    client = sched.client()
    client.generate([1, 2, 3], 1_000_000)
    client.recv_not_stats()
    client.close()
    sched.clients.remove(client)
    other = sched.client()
    rid = other.generate([4], 5)
    assert other.collect([rid])[rid][-1].finish_reason == "length"
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:  # the abandoned request is freed
        message = other.recv()
        if isinstance(message, Stats) and message.num_running == 0:
            break
    else:
        raise AssertionError("the abandoned request was never freed")


# --------------------------------------------------------------------------- process


def test_sigterm_exits_cleanly_and_removes_socket():
    scheduler = _start()
    try:
        assert scheduler.path.exists()
        client = scheduler.client()
        client.generate([1], 1_000_000)
        assert scheduler.stop() == 0, scheduler.log()
        assert not scheduler.path.exists()
        assert "Traceback" not in scheduler.log()
    finally:
        scheduler.cleanup()


def test_bad_arguments_fail_fast():
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.engines.simulated", "--bind", "ipc:///tmp/x", "--max-running", "0"],
        cwd=ROOT,
        capture_output=True,
        timeout=STARTUP_TIMEOUT,
    )
    assert proc.returncode == 2
    assert b"max_running" in proc.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="comm names are Linux")
def test_process_name():
    scheduler = _start()
    try:
        comm = Path(f"/proc/{scheduler.proc.pid}/comm").read_text().strip()
        assert comm == "tm-scheduler"
        assert "simulated" in " ".join(
            os.fsdecode(a) for a in Path(f"/proc/{scheduler.proc.pid}/cmdline").read_bytes().split(b"\0")
        )
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        scheduler.cleanup()


def test_in_process_api():
    """SimulatedScheduler served inside an event loop, on a tcp port chosen by the OS."""
    import asyncio

    from tokenmill.engines.simulated import SimulatedScheduler

    async def main():
        scheduler = SimulatedScheduler(inter_token_latency_s=0.0, mode="echo", max_running=4)
        serving = asyncio.create_task(scheduler.serve("tcp://127.0.0.1:0"))
        endpoint = await asyncio.wait_for(scheduler.wait_ready(), WAIT)
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        front = AsyncProtocolClient(endpoint)
        try:
            await front.send(Hello(protocol_version=PROTOCOL_VERSION))
            welcome = await front.next()
            assert isinstance(welcome, Welcome) and welcome.max_running_requests == 4
            await front.send_generate("a", [3, 4], max_new_tokens=5)
            tokens = []
            while True:
                reply = await front.next()
                if isinstance(reply, Stats):
                    continue
                assert isinstance(reply, Outputs)
                tokens += tokens_of(reply.outputs)
                if reply.outputs[-1].finish_reason:
                    break
            assert tokens == [3, 4, 3, 4, 3]
        finally:
            front.close()
            await asyncio.wait_for(scheduler.close(), WAIT)
            await asyncio.wait_for(serving, WAIT)
        await scheduler.close()  # idempotent

    asyncio.run(main())


# --------------------------------------------------------------------------- protocol 1.1

EOS = 1  # the embedded default model's EOS, as a front end would pass it in stop_token_ids


@pytest.fixture(scope="module")
def model_sched():
    """--model default: the tokenizer makes structured outputs possible."""
    scheduler = _start("--model", "default", "--inter-token-latency-ms", "1", "--tokens-per-step", "4")
    yield scheduler
    assert scheduler.stop() == 0, scheduler.log()
    assert "Traceback" not in scheduler.log(), scheduler.log()
    scheduler.cleanup()


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    from tokenmill.tokenizer_workers.model import default_model_dir

    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))


def expect_error(client, request_id):
    message = client.recv_not_stats()
    assert isinstance(message, Error), message
    assert message.request_id == request_id
    return message


def test_welcome_lists_features(sched, model_sched):
    welcome = sched.client(handshake=False).handshake()
    # priority (1.2) only with --scheduling priority
    assert welcome.features == sorted(
        set(FEATURES) - set(STRUCTURED_FEATURES) - set(STRUCTURED_OPTION_FEATURES) - {"priority"}
    )
    assert welcome.max_logprobs == 20
    welcome = model_sched.client(handshake=False).handshake()
    assert welcome.features == sorted(set(FEATURES) - {"priority"})


def test_allowed_token_ids_and_bad_words_in_random_mode(sched):
    """1.2 without a palette: every token is an allowed one, no banned sequence is ever completed (30
    never; 20 never right after 10), stop tokens are masked like the rest; out-of-range values and a
    field the scheduler does not list are refused naming the field."""
    client = sched.client()
    allowed = [10, 20, 30, 7]
    rid = client.generate(
        [1, 2, 3],
        200,
        sampling=SamplingParams(seed=3, allowed_token_ids=allowed, bad_words=[[10, 20], [30]]),
        stop_token_ids=[99],
    )
    outputs = client.collect([rid])[rid]
    check_stream(outputs, 3)
    tokens = tokens_of(outputs)
    assert len(tokens) == 200 and outputs[-1].finish_reason == "length"
    assert set(tokens) <= {10, 20, 7} and {10, 20} <= set(tokens)
    assert all(not (a == 10 and b == 20) for a, b in zip(tokens, tokens[1:]))
    for sampling, param in (
        (SamplingParams(allowed_token_ids=[]), "sampling.allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[10**7]), "sampling.allowed_token_ids"),
        (SamplingParams(bad_words=[[]]), "sampling.bad_words"),
    ):
        client.generate([1], 3, request_id="bad", sampling=sampling)
        error = client.recv_not_stats()
        assert isinstance(error, Error) and error.param == param and error.request_id == "bad", error
    client.generate([1], 3, request_id="prio", priority=2)  # not --scheduling priority
    error = client.recv_not_stats()
    assert isinstance(error, Error) and error.code == "unsupported" and error.param == "priority", error


def structured_text(client, tokenizer, structured, max_new_tokens=500, **fields):
    """(decoded text before the stop token, the outputs) of one structured request."""
    rid = client.generate([5, 6, 7], max_new_tokens, structured=structured, stop_token_ids=[EOS], **fields)
    outputs = client.collect([rid])[rid]
    check_stream(outputs, 3)
    tokens = tokens_of(outputs)
    if outputs[-1].finish_reason == "stop":
        assert tokens[-1] == EOS
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=False), outputs


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age", "home"],
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}


def test_structured_json_schema(model_sched, tokenizer):
    jsonschema = pytest.importorskip("jsonschema")
    client = model_sched.client()
    spec = Structured(kind="json_schema", spec=json.dumps(PERSON))
    texts = set()
    for seed in range(4):
        text, outputs = structured_text(client, tokenizer, spec, sampling=SamplingParams(seed=seed))
        assert outputs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
        texts.add(text)
        again, _ = structured_text(client, tokenizer, spec, sampling=SamplingParams(seed=seed))
        assert again == text  # deterministic for (seed, prompt)
    assert len(texts) > 1
    # max_new_tokens still cuts it
    text, outputs = structured_text(client, tokenizer, spec, max_new_tokens=3, sampling=SamplingParams(seed=1))
    assert outputs[-1].finish_reason == "length" and len(tokens_of(outputs)) == 3


def test_structured_regex_choice_grammar(model_sched, tokenizer):
    client = model_sched.client()
    pattern = r"[A-Z]{2}-\d{3,5}( ok)?"
    for seed in range(3):
        text, _ = structured_text(
            client, tokenizer, Structured(kind="regex", spec=pattern), sampling=SamplingParams(seed=seed)
        )
        assert re.fullmatch(pattern, text), text
        text, _ = structured_text(
            client,
            tokenizer,
            Structured(kind="choice", choices=["positive", "négatif"]),
            sampling=SamplingParams(seed=seed),
        )
        assert text in ("positive", "négatif")
        grammar = 'root ::= answer " " [0-9]{1,3}\nanswer ::= "yes" | "no"'
        text, _ = structured_text(
            client, tokenizer, Structured(kind="grammar", spec=grammar), sampling=SamplingParams(seed=seed)
        )
        assert re.fullmatch(r"(yes|no) [0-9]{1,3}", text), text
    # an invalid spec is refused with the field named
    rid = client.generate([1, 2], 10, structured=Structured(kind="regex", spec="(a)\\1"))
    error = expect_error(client, rid)
    assert error.code == "bad_request" and error.param == "structured" and "backreference" in error.message


def test_structured_min_tokens(model_sched, tokenizer):
    client = model_sched.client()
    # min_tokens holds the stop back while the grammar can go on: the output is longer, and still valid
    spec = Structured(kind="regex", spec=r"[0-9]+")
    for seed in range(3):
        text, outputs = structured_text(client, tokenizer, spec, sampling=SamplingParams(seed=seed, min_tokens=6))
        assert len(tokens_of(outputs)) >= 7 and outputs[-1].finish_reason == "stop"
        assert re.fullmatch(r"[0-9]+", text), text
    spec = Structured(kind="json_schema", spec=json.dumps({"type": "array", "items": {"type": "integer"}}))
    text, outputs = structured_text(client, tokenizer, spec, sampling=SamplingParams(seed=5, min_tokens=4))
    assert len(tokens_of(outputs)) >= 5
    assert isinstance(json.loads(text), list)
    # a grammar that allows nothing more ends the output, min_tokens or not (no engine can honour both)
    text, outputs = structured_text(
        client, tokenizer, Structured(kind="choice", choices=["yes"]), sampling=SamplingParams(seed=3, min_tokens=6)
    )
    assert text == "yes" and outputs[-1].finish_reason == "stop"


def unpack_logprobs(outputs, n):
    """(tokens, logprobs, top ids, top logprobs) over a request's outputs, checking the lengths."""
    tokens, lps, top_ids, top_lps = [], [], [], []
    for out in outputs:
        count = len(out.token_ids) // 4
        assert len(out.logprobs) == 4 * count
        assert len(out.top_ids) == 4 * count * n and len(out.top_logprobs) == 4 * count * n
        tokens += frame_to_ids(out.token_ids)
        lps += bytes_to_floats(out.logprobs)
        ids = list(frame_to_ids(out.top_ids))
        values = list(bytes_to_floats(out.top_logprobs))
        if n:
            top_ids += [ids[i : i + n] for i in range(0, len(ids), n)]
            top_lps += [values[i : i + n] for i in range(0, len(values), n)]
    return tokens, lps, top_ids, top_lps


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_logprobs(sched, n):
    client = sched.client()

    def run(seed):
        rid = client.generate([4, 5, 6], 12, logprobs=n, sampling=SamplingParams(seed=seed))
        outputs = client.collect([rid])[rid]
        check_stream(outputs, 3)
        return unpack_logprobs(outputs, n)

    tokens, lps, top_ids, top_lps = run(11)
    assert len(tokens) == len(lps) == 12
    assert all(-3 < lp <= 0 for lp in lps)
    if n:
        assert len(top_ids) == len(top_lps) == 12
        for token, lp, ids, values in zip(tokens, lps, top_ids, top_lps):
            assert ids[0] == token and values[0] == lp  # the chosen token first, as the best
            assert len(set(ids)) == n and all(0 <= i < 129280 for i in ids)
            assert all(a > b for a, b in zip(values, values[1:]))  # strictly descending
            assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6
    else:
        assert top_ids == []
    assert run(11) == (tokens, lps, top_ids, top_lps)  # deterministic under the seed
    assert run(12)[1] != lps
    # the same tokens as without logprobs
    rid = client.generate([4, 5, 6], 12, sampling=SamplingParams(seed=11))
    plain = client.collect([rid])[rid]
    assert tokens_of(plain) == tokens and all(o.logprobs == b"" and o.top_ids == b"" for o in plain)


def test_logprobs_cover_the_stop_token(echo):
    client = echo.client()
    rid = client.generate([10, 11, 12, 13], 100, stop_token_ids=[12], logprobs=3)
    outputs = client.collect([rid])[rid]
    tokens, lps, top_ids, _ = unpack_logprobs(outputs, 3)
    assert tokens == [10, 11, 12] and outputs[-1].finish_reason == "stop"
    assert len(lps) == 3 and top_ids[-1][0] == 12


def test_logprobs_palette_alternatives(model_sched):
    client = model_sched.client()
    rid = client.generate([4, 5, 6], 10, logprobs=4, sampling=SamplingParams(seed=2))
    tokens, lps, top_ids, top_lps = unpack_logprobs(client.collect([rid])[rid], 4)
    assert len(tokens) == 10 and all(ids[0] == t and len(set(ids)) == 4 for t, ids in zip(tokens, top_ids))


def test_min_tokens_and_logit_bias():
    scheduler = _start("--eos-probability", "1.0", "--inter-token-latency-ms", "1", "--vocab-size", "50")
    try:
        client = scheduler.client()

        def run(prompt=(1, 2, 3), max_new=20, stop=(7,), **sampling):
            rid = client.generate(
                list(prompt), max_new, stop_token_ids=list(stop), sampling=SamplingParams(seed=9, **sampling)
            )
            outputs = client.collect([rid])[rid]
            check_stream(outputs, len(prompt))
            return tokens_of(outputs), outputs[-1].finish_reason

        # --eos-probability 1: the stop token comes right after min_tokens tokens
        assert run() == ([7], "stop")
        tokens, reason = run(min_tokens=5)
        assert len(tokens) == 6 and tokens[-1] == 7 and 7 not in tokens[:-1] and reason == "stop"
        # a banned stop token is never emitted
        tokens, reason = run(logit_bias={7: -100.0})
        assert len(tokens) == 20 and 7 not in tokens and reason == "length"
        # banned tokens are never drawn
        banned = {t: -100.0 for t in range(45)}
        tokens, reason = run(stop=(), logit_bias=banned)
        assert len(tokens) == 20 and all(45 <= t < 50 for t in tokens) and reason == "length"
        # the highest bias >= 100 is always drawn (the lowest ID among equals); weaker ones do nothing
        assert run(logit_bias={12: 100.0, 30: 100.0, 40: 99.0}) == ([12] * 20, "length")
        # forcing the stop token ends at once, unless min_tokens holds it back
        assert run(logit_bias={7: 100.0}) == ([7], "stop")
        tokens, reason = run(min_tokens=3, logit_bias={7: 100.0})
        assert len(tokens) == 4 and tokens[-1] == 7 and reason == "stop"
        # min_p and repetition_penalty are accepted without visible effect
        assert run(min_p=0.1, repetition_penalty=1.3) == ([7], "stop")
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        scheduler.cleanup()


def test_min_tokens_echo(echo):
    client = echo.client()
    rid = client.generate([10, 11, 12], 100, stop_token_ids=[11], sampling=SamplingParams(min_tokens=3))
    outputs = client.collect([rid])[rid]
    assert tokens_of(outputs) == [10, 12, 10, 11] and outputs[-1].finish_reason == "stop"


def test_unsupported_and_out_of_range_11_fields(sched):
    client = sched.client()
    # structured outputs need --model: refused as unsupported, naming the field
    rid = client.generate([1, 2], 5, structured=Structured(kind="choice", choices=["a"]))
    error = expect_error(client, rid)
    assert error.code == "unsupported" and error.param == "structured" and "choice" in error.message
    rid = client.generate([1, 2], 5, structured=Structured(kind="yaml", spec="a: 1"))
    error = expect_error(client, rid)
    assert error.code == "unsupported" and error.param == "structured"
    for fields, param in [
        ({"sampling": SamplingParams(min_p=1.5)}, "sampling.min_p"),
        ({"sampling": SamplingParams(repetition_penalty=0.0)}, "sampling.repetition_penalty"),
        ({"sampling": SamplingParams(min_tokens=-1)}, "sampling.min_tokens"),
        ({"sampling": SamplingParams(logit_bias={5: 150.0})}, "sampling.logit_bias"),
        ({"sampling": SamplingParams(logit_bias={129280: 1.0})}, "sampling.logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ]:
        rid = client.generate([1, 2], 5, **fields)
        error = expect_error(client, rid)
        assert error.code == "bad_request" and error.param == param, (fields, error)
    # still serving
    rid = client.generate([1, 2], 3, logprobs=2)
    assert client.collect([rid])[rid][-1].finish_reason == "length"


def test_prompt_logprobs_and_kv_transfer_params(sched):
    """1.2: the first output carries the prompt's logprobs (one entry per position after the first: a
    logprob, its rank 1..3, and with N > 0 the top N, best first and descending, the prompt token among
    them at its rank), deterministic from the prompt; the final output's kv_transfer_params shows the
    request's kv_transfer_params and extra_args (the simulator has no KV connector); a larger
    prompt_logprobs than max_logprobs is refused naming it."""
    client = sched.client()
    prompt = [5, 17, 17, 900, 3, 42]
    firsts = []
    for _ in range(2):
        rid = client.generate(
            prompt, 3, prompt_logprobs=3, kv_transfer_params={"do_remote_decode": True}, extra_args={"a": [1, "b", 2.5]}
        )
        outputs = client.collect([rid])[rid]
        check_stream(outputs, len(prompt))
        plp = outputs[0].prompt_logprobs
        assert plp is not None and all(o.prompt_logprobs is None for o in outputs[1:])
        assert all(o.kv_transfer_params is None for o in outputs[:-1])
        assert outputs[-1].kv_transfer_params == {
            "simulated": True,
            "kv_transfer_params": {"do_remote_decode": True},
            "extra_args": {"a": [1, "b", 2.5]},
        }
        firsts.append(plp)
    assert firsts[0] == firsts[1]  # deterministic from the prompt
    plp = firsts[0]
    lps, ranks = list(bytes_to_floats(plp.logprobs)), list(frame_to_ids(plp.ranks))
    top_ids, top_lps = list(frame_to_ids(plp.top_ids)), list(bytes_to_floats(plp.top_logprobs))
    assert len(lps) == len(ranks) == len(prompt) - 1 and len(top_ids) == len(top_lps) == 3 * (len(prompt) - 1)
    for i, token in enumerate(prompt[1:]):
        assert 1 <= ranks[i] <= 3 and lps[i] < 0 and (ranks[i] > 1 or lps[i] > -3)
        ids, values = top_ids[3 * i : 3 * i + 3], top_lps[3 * i : 3 * i + 3]
        assert ids[ranks[i] - 1] == token and values[ranks[i] - 1] == lps[i] and len(set(ids)) == 3
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1.0001
    rid = client.generate(prompt, 2, prompt_logprobs=0)
    outputs = client.collect([rid])[rid]
    plp0 = outputs[0].prompt_logprobs
    assert list(bytes_to_floats(plp0.logprobs)) == lps and plp0.top_ids == plp0.top_logprobs == b""
    client.generate(prompt, 2, request_id="too-many", prompt_logprobs=21)
    error = client.recv_not_stats()
    assert isinstance(error, Error) and error.param == "prompt_logprobs" and error.request_id == "too-many", error
