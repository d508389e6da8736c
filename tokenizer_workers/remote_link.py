"""How a tokenizer worker on another host joins a gateway's pool (``tokenmill worker --connect``).

The gateway does not start such a worker, so it cannot watch its process: the worker says
hello, gets its place in the pool and the gateway's converter settings (so it converts
exactly as local workers do), and then sends a heartbeat every second. Over tcp:// the
link is CURVE-encrypted and the gateway admits only worker keys it lists; a refused key
ends this process with a message that says so, instead of retrying silently forever.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.settings import ConverterSettings

log = logging.getLogger("tokenmill.worker")


class RemoteWorkerLink:
    HEARTBEAT_S = 1.0  # the gateway gives up on a worker after --remote-worker-timeout of silence
    HELLO_EVERY_S = 3.0  # a hello sent while the gateway was down is lost: say it again

    def __init__(self, keys_dir: str | None, model_dir: str | None = None):
        self.host = socket.gethostname()
        self.identity = f"r-{self.host[:64]}-{os.getpid()}-{secrets.token_hex(4)}".encode()
        self.model_dir = model_dir
        self.keys = None
        if keys_dir:
            server_public, _ = zmq.auth.load_certificate(Path(keys_dir) / "gateway.key")
            public, secret = zmq.auth.load_certificate(Path(keys_dir) / "worker.key_secret")
            if secret is None:
                raise SystemExit(f"{keys_dir}/worker.key_secret holds no secret key")
            self.keys = (server_public, public, secret)
        self.monitor = None

    @property
    def public_key(self) -> str:
        return self.keys[1].decode() if self.keys else ""

    def prepare(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.IDENTITY, self.identity)
        # a dead TCP path (no FIN) must end in a reconnect, not in a socket that waits forever
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if self.keys:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.keys
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

    def join(self, sock: zmq.Socket, endpoint: str = "") -> tuple[ConverterSettings, int]:
        """Say hello until the gateway answers with this worker's index and settings."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        hello = m.encoder.encode(m.WorkerHello(os.getpid(), self.host))
        started = sent = time.monotonic()
        sock.send(hello)
        warned = started
        while True:
            events = dict(poller.poll(500))
            if self.monitor in events:
                event = recv_monitor_message(self.monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    raise SystemExit(
                        f"the gateway refused this worker's CURVE key {self.public_key} (status "
                        f"{event['value']}): add its public key to the gateway's authorized_workers "
                        "directory (docs/operations/security.md)"
                    )
                log.error(
                    "CURVE handshake with the gateway failed (%s): is gateway.key the gateway's public key?",
                    event["event"],
                )
            if sock in events:
                frames = sock.recv_multipart()
                try:
                    msg = m.to_worker.decode(frames[0])
                except msgspec.DecodeError:
                    continue
                if isinstance(msg, m.WorkerSettings):
                    return msgspec.json.decode(msg.settings, type=ConverterSettings), msg.worker_index
                if isinstance(msg, m.Shutdown):
                    raise SystemExit(f"the gateway told this worker to stop: {msg.reason or 'no reason given'}")
                continue  # anything else belonged to a session the gateway has forgotten
            now = time.monotonic()
            if now - sent >= self.HELLO_EVERY_S:
                sock.send(hello)
                sent = now
            if now - warned >= 10:
                log.warning("no answer from the gateway at %s after %.0f s; still trying", endpoint, now - started)
                warned = now
