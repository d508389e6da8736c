"""A tokenizer worker process.

Two threads, so that streams keep flowing while a long prompt converts:
- the IO thread owns the ZeroMQ DEALER to the gateway, answers detokenization
  batches at once (they are small), converts the jobs the gateway marks quick (small
  bodies: handing them to the other thread would cost more than converting them), and
  forwards finished conversions;
- the conversion thread renders and tokenizes the other requests, one at a time.
  ``encode_batch`` releases the GIL, so the IO thread runs while a 250k-token prompt is
  being encoded.

The conversion thread runs at a lower CPU priority (nice, per thread), and so do the
tokenizers thread-pool threads it creates: on a busy node the gateway, the scheduler and
this worker's IO thread win the CPU, and conversion uses what is left.

Started by the gateway as ``python -m tokenizer_workers.worker --connect EP --index N``
with its settings in the TOKENMILL_WORKER_SETTINGS environment variable, or on another host
as ``tokenmill worker --connect tcp://...``, which takes its settings from the gateway and
sends heartbeats (remote_link.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time

import msgspec
import zmq

from tokenmill.transport_security import secure_worker_socket
from tokenizer_workers import messages as m
from tokenizer_workers.converter import Converter, ConverterSettings
from tokenizer_workers.detokenizer import Detokenizer
from tokenizer_workers.remote_link import RemoteWorkerLink
from tokenmill.procutil import die_with_supervisor, limit_memory, set_process_name

log = logging.getLogger("tokenmill.worker")
SETTINGS_ENV = "TOKENMILL_WORKER_SETTINGS"
_HEARTBEAT = m.encoder.encode(m.Heartbeat())
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # ints: pyzmq's enums cost a call


class Worker:
    CONVERSION_NICE = 10

    def __init__(self, index: int, endpoint: str, settings: ConverterSettings | None, ctx: zmq.Context | None = None,
                 remote: RemoteWorkerLink | None = None):
        self.index = index
        self.endpoint = endpoint
        self.settings = settings  # None for a remote worker until the gateway sends its own
        self.remote = remote  # keys, identity and model override of a worker on another host
        self.converter: Converter | None = None
        self.detokenizer: Detokenizer | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self.ctx = ctx or zmq.Context.instance()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_addr = f"inproc://worker-wake-{id(self)}"
        self._beat_at = 0.0

    def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.remote is None:
            sock.setsockopt(zmq.IDENTITY, f"w{self.index}".encode())
            secure_worker_socket(sock)
        else:
            self.remote.prepare(sock)
        sock.connect(self.endpoint)
        if self.remote is not None:
            self._join(sock)
        wake_rx = self.ctx.socket(zmq.PAIR)
        wake_rx.bind(self._wake_addr)
        threading.Thread(target=self._convert_loop, name="conversion", daemon=True).start()
        while not self._loaded.wait(self.remote.HEARTBEAT_S if self.remote else None):
            self._beat(sock)  # loading a model takes seconds: the gateway must not think us gone
        if self._load_error is not None:
            raise self._load_error
        self.detokenizer = Detokenizer(self.converter.tokenizer)
        self.quick_converter = self.converter.without_cache()  # the cache belongs to the conversion thread
        self._fingerprint = self.converter.fingerprint() if self.settings.fingerprint or self.remote else ""
        self._send_ready(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_rx, zmq.POLLIN)
        recv, get = sock.recv, sock.get
        timeout = 1000 * self.remote.HEARTBEAT_S if self.remote else None
        while True:
            for ready, _ in poller.poll(timeout):
                if ready is wake_rx:
                    while wake_rx.get(_EVENTS) & _POLLIN:
                        wake_rx.recv(_NOBLOCK)
                    self._send_results(sock)
                    continue
                while get(_EVENTS) & _POLLIN:  # everything waiting, before polling again
                    frame = recv(_NOBLOCK, copy=False)
                    frames = [frame]
                    while frame.more:
                        frame = recv(_NOBLOCK, copy=False)
                        frames.append(frame)
                    if not self._handle(sock, frames):
                        return
            if self.remote is not None and time.monotonic() - self._beat_at >= self.remote.HEARTBEAT_S:
                self._beat(sock)

    def _beat(self, sock) -> None:
        self._beat_at = time.monotonic()
        try:
            sock.send(_HEARTBEAT, _NOBLOCK)  # never block on a link that is down: it reconnects by itself
        except zmq.Again:
            pass

    def _send_ready(self, sock) -> None:
        parsers = self.converter.parsers
        sock.send(m.encoder.encode(m.WorkerReady(self.index, os.getpid(), self.converter.max_model_len,
                                              self.converter.segments.enabled, self.converter.segments.self_test_reason,
                                              parsers.tool_name, parsers.reasoning_name, self.converter.vocab_size,
                                              self._fingerprint)))

    def _join(self, sock) -> None:
        """A remote worker says hello until the gateway answers with its place and settings."""
        settings, self.index = self.remote.join(sock, self.endpoint)
        if self.remote.model_dir:
            settings.model_dir = self.remote.model_dir  # the same model, where this host keeps it
        if self.settings is None:
            self.settings = settings
        elif settings != self.settings:
            raise SystemExit("the gateway's converter settings changed since this worker loaded its model; "
                             "exiting so that a restart loads them")
        self._beat_at = time.monotonic()

    def _handle(self, sock, frames) -> bool:
        try:
            msg = m.to_worker.decode(frames[0].buffer)
        except msgspec.DecodeError:
            log.error("worker %d: undecodable message from the gateway", self.index)
            return True
        if isinstance(msg, m.DetokBatch):
            t0 = time.perf_counter()
            deltas = self.detokenizer.step(msg.items)
            out = m.DetokOut(deltas, time.perf_counter() - t0, self.detokenizer.take_failures())
            sock.send(m.encoder.encode(out))
        elif isinstance(msg, m.ConvertJob):
            body = frames[1].bytes if len(frames) > 1 else b""
            if msg.quick:
                self._send(sock, self._convert(self.quick_converter, msg, body, time.perf_counter()))
            else:
                self.jobs.put((msg, body, time.perf_counter()))
        elif isinstance(msg, m.Release):
            self.detokenizer.release(msg.request_ids)
        elif isinstance(msg, m.Limits):
            self.converter.limit_context(msg)
            self.quick_converter.limit_context(msg)
        elif isinstance(msg, m.Shutdown):
            if msg.reason:
                raise SystemExit(f"the gateway refused this worker: {msg.reason}")
            return False
        elif isinstance(msg, m.Rejoin) and self.remote is not None:
            log.warning("worker %d: the gateway no longer counts this worker; joining again", self.index)
            self.detokenizer = Detokenizer(self.converter.tokenizer)  # its streams were failed there
            self._join(sock)
            self._send_ready(sock)
        return True

    def _convert_loop(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self._wake_addr)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.CONVERSION_NICE)
        except (OSError, AttributeError):
            pass
        try:  # the model loads here, so the tokenizers thread pool is born with this thread's priority
            self.converter = Converter(self.settings)
        except BaseException as exc:
            self._load_error = exc
            return
        finally:
            self._loaded.set()
        while True:
            job, body, received = self.jobs.get()
            self.results.put(self._convert(self.converter, job, body, received))
            wake.send(b"")

    def _convert(self, converter: Converter, job: m.ConvertJob, body: bytes, received: float):
        started = time.perf_counter()
        try:
            conversion = converter.convert(job, body)
        except Exception as exc:  # a bug must answer the request, not kill the worker
            log.exception("worker %d: conversion failed", self.index)
            conversion = converter._error(job, 500, f"Internal error while converting the request: {exc}")
            conversion.done.error.type = "InternalServerError"
        conversion.done.queue_s = started - received
        return conversion

    def _send_results(self, sock) -> None:
        while True:
            try:
                conversion = self.results.get_nowait()
            except queue.Empty:
                return
            self._send(sock, conversion)

    def _send(self, sock, conversion) -> None:
        for spec in conversion.detok:
            self.detokenizer.open(spec)
        sock.send_multipart([m.encoder.encode(conversion.done), *conversion.frames], copy=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenizer worker")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--title", default=None, help="What ps shows for this process.")
    parser.add_argument("--memory-limit-mb", type=int, default=0)
    args = parser.parse_args(argv)
    die_with_supervisor()
    limit_memory(args.memory_limit_mb)
    set_process_name(f"tm-worker-{args.index}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tokenizer worker {args.index} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group; the gateway decides
    # Hand the GIL between the conversion thread and the IO thread every millisecond (not 5):
    # detokenization of running streams waits at most that long behind a conversion.
    sys.setswitchinterval(0.001)
    settings = msgspec.json.decode(os.environ.get(SETTINGS_ENV, "{}"), type=ConverterSettings)
    Worker(args.index, args.connect, settings).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
