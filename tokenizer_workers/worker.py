"""A tokenizer worker process.

Threads of two kinds, so that streams keep flowing while long prompts convert:
- the IO thread owns the links to the gateways (the spawning gateway's socket pair;
  ZeroMQ DEALERs to a remote gateway or the node's other gateways), answers
  detokenization batches at once (they are small, and go first), converts the jobs the
  gateway marks quick (small bodies and cheap next turns: handing them to another thread
  would cost more than converting them), and forwards
  finished conversions;
- the conversion threads (two by default, ``--conversion-threads``) render and tokenize the
  other requests, one each, through one shared tokenization cache. ``encode_batch`` releases
  the GIL, so the IO thread runs while a 250k-token prompt is being encoded, and one
  thread's Python work (parsing a megabyte of JSON, rendering, splitting, building the ID
  arrays: about a tenth of a long conversion) runs while the other's prompt is encoded on
  every core: with one thread, the cores idled through those parts.

The conversion threads run ``--conversion-nice`` steps below this process's CPU priority
(per thread), and so do the tokenizers thread-pool threads the first creates. The default, 0,
shares the CPU with an engine that keeps cores busy (docs/design/cpu-sharing.md):
below it, a long prompt waited seconds for the leftovers of an engine's busy cores.

Started by the gateway as ``python -m tokenmill.tokenizer_workers.worker --link-fd FD --index N``,
holding one end of a socket pair (tokenmill/transport/pipe_link.py), with its settings in the
TOKENMILL_WORKER_SETTINGS environment variable; or on another host as ``tokenmill worker
--connect tcp://...``, which takes its settings from the gateway over ZeroMQ and sends
heartbeats (remote_link.py).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import msgspec
import zmq

from tokenmill.process.procutil import (
    die_with_supervisor,
    keep_freed_memory,
    limit_memory,
    request_realtime,
    set_group_nice,
    set_process_name,
)
from tokenmill.scheduler_client.protocol import frame_to_ids
from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.converter import Converter
from tokenmill.tokenizer_workers.detokenizer import Detokenizer
from tokenmill.tokenizer_workers.images import shared_memory
from tokenmill.tokenizer_workers.remote_link import RemoteWorkerLink
from tokenmill.tokenizer_workers.resume import decode_spec, encode_spec
from tokenmill.tokenizer_workers.settings import SETTINGS_ENV, ConverterSettings
from tokenmill.transport.pipe_link import PipePeer

log = logging.getLogger("tokenmill.worker")
_HEARTBEAT = m.encoder.encode(m.Heartbeat())
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # ints: pyzmq's enums cost a call


def _wake_pipe() -> tuple[int, int]:
    """A pipe whose every byte wakes the IO thread's poll; both ends non-blocking."""
    rx, tx = os.pipe()
    os.set_blocking(rx, False)
    os.set_blocking(tx, False)
    return rx, tx


@dataclass(eq=False)
class _Link:
    """One gateway this worker serves: the one that spawned it, or one it joined (another gateway
    process of the node, or a gateway on another host)."""

    sock: zmq.Socket | PipePeer
    endpoint: str
    index: int  # this worker's place in that gateway's pool
    joined: bool  # the gateway answered hello (always true for the spawning gateway)
    beats: bool  # a joined gateway cannot watch this process: it hears heartbeats
    said_hello: float = 0.0
    beat_at: float = 0.0
    streams: set = field(default_factory=set)  # request ids whose decoder state this gateway opened


class TokenizerWorker:
    """The worker process itself: its IO thread's loop over the gateways' links, and its conversion threads."""

    HEARTBEAT_S = RemoteWorkerLink.HEARTBEAT_S
    HELLO_EVERY_S = RemoteWorkerLink.HELLO_EVERY_S
    MAX_PLACEMENTS = 65536  # conversations whose scheduler rank this worker remembers (oldest forgotten)

    def __init__(
        self,
        index: int,
        endpoint: str | int,
        settings: ConverterSettings | None,
        ctx: zmq.Context | None = None,
        remote: RemoteWorkerLink | None = None,
        attach: tuple[str, ...] = (),
        conversion_threads: int = 2,
        conversion_nice: int = 0,
    ):
        self.index = index
        self.conversion_threads = max(1, conversion_threads)
        self.conversion_nice = conversion_nice  # added to the process's niceness for the conversion threads
        self.endpoint = endpoint  # a remote worker's gateway address, or the spawning gateway's socket pair (an fd)
        self.settings = settings  # None for a remote worker until the gateway sends its own
        self.remote = remote  # keys, identity and model override of a worker on another host
        self.attach = attach  # the node's other gateway processes, which this worker joins too
        self.links: list[_Link] = []
        self.converter: Converter | None = None
        self.detokenizer: Detokenizer | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self.ctx = ctx or zmq.Context.instance()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_rx, self._wake_tx = _wake_pipe()  # conversion threads say a result is ready
        self._converting: dict[_Link, int] = {}  # conversion threads busy with each gateway's jobs
        self.placements: dict[int, int] = {}  # conversation -> scheduler rank a gateway put it on (m.Placed)

    def _socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def run(self) -> None:
        if self.remote is not None:
            sock = self._socket()
            self.remote.prepare(sock)
            sock.connect(self.endpoint)
            settings, index = self.remote.join(sock, self.endpoint)
            self._take_settings(settings)
            self.links.append(_Link(sock, self.endpoint, index, joined=True, beats=True))
        else:
            self.links.append(
                _Link(PipePeer(self.endpoint), "the spawning gateway", self.index, joined=True, beats=False)
            )
            for endpoint in self.attach:
                sock = self._socket()
                sock.setsockopt(zmq.IDENTITY, f"a{self.index}-{os.getpid()}".encode())
                sock.connect(endpoint)
                self.links.append(_Link(sock, endpoint, -1, joined=False, beats=True))
        for n in range(self.conversion_threads):  # the first loads the model; the others wait for it
            threading.Thread(target=self._convert_loop, args=(n,), name=f"conversion-{n}", daemon=True).start()
        beating = any(link.beats for link in self.links)
        while not self._loaded.wait(self.HEARTBEAT_S if beating else None):
            self._tick()  # loading a model takes seconds: joined gateways must not think us gone
        if self._load_error is not None:
            raise self._load_error
        self.detokenizer = Detokenizer(self.converter.tokenizer)
        # What is loaded now lives as long as the process. Out of the collector's sight, a full
        # collection no longer walks it: it took 5-7 ms, on whichever thread allocated, and every
        # stream's next text waited (at 256 streams the gap p99 went from 25 to 33 ms).
        gc.freeze()
        self._fingerprint = self.converter.fingerprint() if self.settings.fingerprint or beating else ""
        for link in self.links:
            if link.joined:
                self._send_ready(link)
        # Only socket pairs (a worker of one gateway, the default): the plain poll(2), one system
        # call per wake-up. With ZeroMQ links, zmq_poll, which polls twice and asks each ZeroMQ
        # socket for its events.
        plain = all(isinstance(link.sock, PipePeer) for link in self.links)
        poller = select.poll() if plain else zmq.Poller()
        for link in self.links:
            poller.register(link.sock.fileno() if plain else link.sock, select.POLLIN)
        poller.register(self._wake_rx, select.POLLIN)
        # the poller names a ZeroMQ socket by itself and a plain one (the socket pair) by its fd
        by_sock = {link.sock.fileno() if isinstance(link.sock, PipePeer) else link.sock: link for link in self.links}
        timeout = 500 * self.HEARTBEAT_S if beating else None
        wake_rx = self._wake_rx
        while True:
            for ready, _ in poller.poll(timeout):
                if ready == wake_rx:
                    try:
                        os.read(wake_rx, 4096)
                    except BlockingIOError:
                        pass
                    self._send_results()
                    continue
                link = by_sock[ready]
                if isinstance(link.sock, PipePeer):
                    try:
                        messages = link.sock.receive()
                    except EOFError:
                        return  # the gateway is gone
                else:
                    messages = []
                    recv, get = ready.recv, ready.get
                    while get(_EVENTS) & _POLLIN:  # everything waiting, before polling again
                        frame = recv(_NOBLOCK, copy=False)
                        frames = [frame.buffer]
                        while frame.more:
                            frame = recv(_NOBLOCK, copy=False)
                            frames.append(frame.buffer)
                        messages.append(frames)
                if not self._handle_all(link, messages):
                    return
            if beating:
                self._tick()

    def _tick(self) -> None:
        """Heartbeats to joined gateways; hello again to those that have not answered."""
        now = time.monotonic()
        for link in self.links:
            if not link.beats:
                continue
            if link.joined and now - link.beat_at >= self.HEARTBEAT_S:
                link.beat_at = now
                self._send_nowait(link, _HEARTBEAT)
            elif not link.joined and now - link.said_hello >= self.HELLO_EVERY_S:
                link.said_hello = now
                self._send_nowait(link, m.encoder.encode(m.WorkerHello(os.getpid(), socket.gethostname(), self.index)))

    @staticmethod
    def _send_nowait(link: _Link, message: bytes) -> None:
        try:
            link.sock.send(message, _NOBLOCK)  # never block on a link that is down: it reconnects by itself
        except zmq.Again:
            pass

    def _send_ready(self, link: _Link) -> None:
        parsers = self.converter.parsers
        link.sock.send(
            m.encoder.encode(
                m.WorkerReady(
                    link.index,
                    os.getpid(),
                    self.converter.max_model_len,
                    self.converter.segments.enabled,
                    self.converter.segments.self_test_reason,
                    parsers.tool_name,
                    parsers.reasoning_name,
                    self.converter.vocab_size,
                    self._fingerprint,
                    self.conversion_threads,
                )
            )
        )

    def _take_settings(self, settings: ConverterSettings) -> None:
        """A joined gateway's settings: the first ones this worker loads; later ones must be the same."""
        if self.remote is not None and self.remote.model_dir:
            settings.model_dir = self.remote.model_dir  # the same model, where this host keeps it
        if self.remote is not None:
            settings.image_shared_memory = False  # the scheduler is on the gateway's host, not this one
        if self.settings is None:
            self.settings = settings
        elif msgspec.structs.replace(settings, fingerprint=self.settings.fingerprint) != self.settings:
            raise SystemExit(
                "a gateway's converter settings differ from those this worker loaded its model with; "
                "exiting so that a restart loads them"
            )

    def _handle_all(self, link: _Link, messages: list[list[memoryview]]) -> bool:
        """Messages that arrived together: detokenization batches first, then the rest in order. A
        small conversion holds this thread for a few hundred microseconds, and a running stream's
        next text (or a finished request's last) should not wait behind it. (A batch never concerns
        a request converted in the same read: its conversion went back to the gateway first.)"""
        decoded = []
        for frames in messages:
            try:
                decoded.append((m.to_worker.decode(frames[0]), frames))
            except msgspec.DecodeError:
                log.error("worker %d: undecodable message from the gateway", self.index)
        if len(decoded) > 1:
            # stable: the rest keep their order; a Resume goes with the batches, ahead of those that follow it
            decoded.sort(key=lambda pair: not isinstance(pair[0], (m.DetokBatch, m.Resume)))
        for msg, frames in decoded:
            if not self._handle(link, msg, frames):
                return False
        return True

    def _handle(self, link: _Link, msg, frames: list[memoryview]) -> bool:
        if isinstance(msg, m.DetokBatch):
            t0 = time.perf_counter()
            deltas = self.detokenizer.step(msg.items)
            out = m.DetokOut(deltas, time.perf_counter() - t0, self.detokenizer.take_failures())
            link.sock.send(m.encoder.encode(out))
            if link.beats:
                # final: the state is freed (the last tokens, or a stop string before them)
                link.streams.difference_update(d.request_id for d in deltas if d.final)
        elif isinstance(msg, m.Resume):
            t0 = time.perf_counter()
            deltas = []
            for stream in msg.streams:
                deltas += self._resume(link, stream)
            out = m.DetokOut(deltas, time.perf_counter() - t0, self.detokenizer.take_failures())
            link.sock.send(m.encoder.encode(out))
        elif isinstance(msg, m.ConvertJob):
            body = frames[1] if len(frames) > 1 else b""  # a view into the buffer it was read into: not copied
            if msg.quick:
                self._send(link, self._convert(msg, body, time.perf_counter()))
            else:
                self.jobs.put((msg, body, time.perf_counter(), link))
        elif isinstance(msg, m.Placed):
            placements = self.placements
            placements.pop(msg.conversation, None)
            placements[msg.conversation] = msg.rank
            if len(placements) > self.MAX_PLACEMENTS:
                del placements[next(iter(placements))]
        elif isinstance(msg, m.Release):
            self.detokenizer.release(msg.request_ids)
            link.streams.difference_update(msg.request_ids)
        elif isinstance(msg, m.Limits):
            self.converter.limit_context(msg)
        elif isinstance(msg, m.PixelsWanted):
            frames = self.converter.pixel_frames(msg.content_hashes)
            answer = m.encoder.encode(m.Pixels(msg.request_id, frames is not None))
            link.sock.send_multipart([answer, *(frames or ())], copy=False)
        elif isinstance(msg, m.Shutdown):
            if msg.reason:
                raise SystemExit(f"the gateway refused this worker: {msg.reason}")
            return False
        elif isinstance(msg, m.WorkerSettings) and link.beats:
            self._take_settings(msgspec.json.decode(msg.settings, type=ConverterSettings))
            link.index, link.joined, link.beat_at = msg.worker_index, True, time.monotonic()
            if self._loaded.is_set() and self._load_error is None:
                self._send_ready(link)
        elif isinstance(msg, m.Rejoin) and link.beats and link.joined:
            log.warning(
                "worker %d: the gateway at %s no longer counts this worker; joining again", self.index, link.endpoint
            )
            self.detokenizer.release(list(link.streams))  # that gateway failed those streams
            link.streams.clear()
            link.joined, link.said_hello = False, 0.0
            self._tick()
        return True

    def _resume(self, link: _Link, stream: m.ResumeStream) -> list[m.DetokDelta]:
        """A stream another worker held: its state rebuilt from the spec and the answered frames, then
        its unanswered frames detokenized. A stream that cannot be rebuilt fails alone, saying why."""
        detokenizer = self.detokenizer
        rid = stream.request_id
        try:
            spec = decode_spec(stream.spec, self.converter.parsers)
            if spec.request_id != rid:
                raise ValueError(f"the stream state is request {spec.request_id}'s")
            detokenizer.open(spec)
            detokenizer.replay(rid, stream.history, frame_to_ids(stream.chunks))
        except Exception as exc:
            log.warning("worker %d: cannot take over stream %s: %s", self.index, rid, exc)
            detokenizer.release([rid])
            return [m.DetokDelta(rid, "", False, True, error=str(exc) or type(exc).__name__)]
        if link.beats:
            link.streams.add(rid)
        deltas = detokenizer.step(stream.items)
        if link.beats:
            link.streams.difference_update(d.request_id for d in deltas if d.final)
        return deltas

    def _convert_loop(self, n: int) -> None:
        loads = n == 0
        wake_tx = self._wake_tx
        # by name in top, ps -L and the benches' thread census; the tokenizers pool the first one
        # starts inherits it (tm-convert-0)
        set_process_name(f"tm-convert-{n}")

        def wake() -> None:
            try:
                os.write(wake_tx, b"!")
            except BlockingIOError:  # the pipe is full of wake-ups the IO thread has yet to read
                pass

        if self.conversion_nice:
            try:  # niceness is per thread on Linux: this one (and the pool it may create) only
                tid = threading.get_native_id()
                os.setpriority(
                    os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.conversion_nice)
                )
            except (OSError, AttributeError):
                pass
        if loads:
            try:  # the model loads here, so the tokenizers thread pool is born with this thread's priority
                self.converter = Converter(self.settings)
            except BaseException as exc:
                self._load_error = exc
                return
            finally:
                self._loaded.set()
        else:
            self._loaded.wait()
            if self._load_error is not None:
                return
        shared = len(self.links) > 1
        while True:
            job, body, received, link = self.jobs.get()
            if shared:
                self.results.put((True, link))
                wake()
            self.results.put((self._convert(job, body, received), link))
            if shared:
                self.results.put((False, link))
            wake()

    def _convert(self, job: m.ConvertJob, body: bytes, received: float):
        """On a conversion thread, or on the IO thread for a quick job: one converter and one
        tokenization cache for all of them (its lock guards the lookups, not the encoding), so an
        agent's short and long turns reuse each other's pieces."""
        converter = self.converter
        started = time.perf_counter()
        try:
            conversion = converter.convert(job, body)
        except Exception as exc:  # a bug must answer the request, not kill the worker
            log.exception("worker %d: conversion failed", self.index)
            conversion = converter.error(job, 500, f"Internal error while converting the request: {exc}")
            conversion.done.error.type = "InternalServerError"
        if conversion.done.timing is not None:  # (an error has none)
            conversion.done.timing.queue_s = started - received
        return conversion

    def _send_results(self) -> None:
        while True:
            try:
                conversion, link = self.results.get_nowait()
            except queue.Empty:
                return
            if isinstance(conversion, bool):  # a conversion thread took, or finished, a job of this link's gateway
                self._tell_busy(link, 1 if conversion else -1)
                continue
            self._send(link, conversion)

    def _tell_busy(self, link: _Link, change: int) -> None:
        """The other gateways sharing this worker hear when it starts or stops converting jobs that
        are not theirs (WorkerBusy), so that they do not queue long jobs behind those."""
        converting = self._converting
        converting[link] = converting.get(link, 0) + change
        total = sum(converting.values())
        for other in self.links:
            if other is link or not other.joined:
                continue  # a gateway's own jobs never make the worker busy for it
            others = total - converting.get(other, 0)  # threads busy with jobs that are not its own
            if (others > 0) != (others - change > 0):
                self._send_nowait(other, m.encoder.encode(m.WorkerBusy(others > 0)))

    def _send(self, link: _Link, conversion) -> None:
        if self.placements and conversion.done.conversation is not None:
            conversion.done.home_rank = self.placements.get(conversion.done.conversation, -1)
        if conversion.detok:
            conversion.done.resume = [encode_spec(spec) for spec in conversion.detok]
        for spec in conversion.detok:
            self.detokenizer.open(spec)
            if link.beats:
                link.streams.add(spec.request_id)
        link.sock.send_multipart([m.encoder.encode(conversion.done), *conversion.frames], copy=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenizer worker")
    parser.add_argument("--link-fd", type=int, required=True, help="This worker's end of the gateway's socket pair.")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--title", default=None, help="What ps shows for this process.")
    parser.add_argument("--memory-limit-mb", type=int, default=0)
    parser.add_argument("--conversion-threads", type=int, default=2)
    parser.add_argument("--conversion-nice", type=int, default=0)
    parser.add_argument("--group-nice", type=int, default=0, help="This session's autogroup niceness, if permitted.")
    parser.add_argument("--io-rt-priority", type=int, default=0, help="SCHED_FIFO for the IO thread, if permitted.")
    parser.add_argument("--attach", action="append", default=[], help="Another gateway of the node to join.")
    args = parser.parse_args(argv)
    die_with_supervisor()
    limit_memory(args.memory_limit_mb)
    keep_freed_memory()  # an image's decoded, resized and patched arrays (megabytes each) reuse heap pages
    set_process_name(f"tm-worker-{args.index}")
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tokenizer worker {args.index} %(levelname)s %(message)s"
    )
    # The session (a group of the fair scheduler's, under autogroups) weighs more than an engine's, so a
    # long prompt is not left with what an engine spinning on every core leaves (set_group_nice says why);
    # the IO thread, which detokenizes every running stream, preempts the engine and the conversion
    # threads as the gateway's loop does (the threads it starts, the conversion threads, stay fair).
    if args.group_nice and not set_group_nice(args.group_nice):
        logging.getLogger("tokenmill.worker").info("this worker's scheduling group keeps the kernel's niceness")
    request_realtime(args.io_rt_priority)
    signal.signal(signal.SIGTERM, lambda *_: _exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group; the gateway decides
    # Hand the GIL between the conversion thread and the IO thread every millisecond (not 5):
    # detokenization of running streams waits at most that long behind a conversion.
    sys.setswitchinterval(0.001)
    settings = msgspec.json.decode(os.environ.get(SETTINGS_ENV, "{}"), type=ConverterSettings)
    try:
        worker = TokenizerWorker(
            args.index,
            args.link_fd,
            settings,
            attach=tuple(args.attach),
            conversion_threads=args.conversion_threads,
            conversion_nice=args.conversion_nice,
        )
        worker.run()  # returns when the gateway is gone
        code = 0
    except SystemExit as exc:  # refused, or settings that differ: the message says why
        code = exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stderr.flush()
    _exit(code)


def _exit(code: int) -> None:
    """Remove this process's shared-memory image files (a scheduler's mappings of them stay valid), then
    exit at once: a normal exit would wait for ZeroMQ sockets the conversion thread holds."""
    shared_memory.remove_own_files()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
