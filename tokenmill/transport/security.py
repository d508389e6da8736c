"""ZeroMQ transport security: ipc:// in a private directory, tcp:// only with CURVE.

- ipc:// sockets live in a runtime directory of mode 0700, so only the service user
  can connect to them.
- The workers a gateway spawns need none of this: each holds one end of a socket pair
  (tokenmill/transport/pipe_link.py), which nobody else can open.
- A tcp:// scheduler needs keys made with ``tokenmill curve-keys DIR``: the gateway
  authenticates the scheduler by its public key and presents its own client key.
- Remote workers (``--remote-workers``) need keys made with ``tokenmill curve-keys DIR
  --worker NAME``: the gateway serves with DIR/gateway.key_secret and admits only the public
  keys in DIR/authorized_workers/ (read again when an unknown key knocks, so adding a worker
  needs no restart); a refused key is logged and counted.
``--insecure-tcp`` lifts the requirement, for a trusted network only.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

REMOTE_WORKERS_DOMAIN = "tokenmill-remote-workers"
log = logging.getLogger("tokenmill.security")
_authenticators: dict[int, list] = {}  # id(context) -> [authenticator, users]: ZAP allows one per context


def _authenticator(ctx) -> AsyncioAuthenticator:
    entry = _authenticators.get(id(ctx))
    if entry is None:
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        entry = _authenticators[id(ctx)] = [auth, 0]
    entry[1] += 1
    return entry[0]


def _release_authenticator(ctx) -> None:
    entry = _authenticators.get(id(ctx))
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            entry[0].stop()
            del _authenticators[id(ctx)]


class InsecureEndpoint(SystemExit):
    pass


def private_dir(path: str) -> str:
    """Create (or tighten) a directory only its owner can open."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        os.chmod(path, 0o700)
    return path


def require_secure(endpoint: str, what: str, insecure_ok: bool, have_keys: bool) -> None:
    if endpoint.startswith("tcp://") and not (insecure_ok or have_keys):
        raise InsecureEndpoint(
            f"{what} endpoint {endpoint} is tcp:// without CURVE keys. Give --curve-keys-dir (see "
            f"docs/operations/security.md; `tokenmill curve-keys DIR` makes them), or --insecure-tcp on a trusted network."
        )


class RemoteWorkerSecurity:
    """CURVE for the --remote-workers socket: the gateway's own keys, and the worker keys it admits."""

    def __init__(self, ctx, keys_dir: str, on_refused=None):
        self.ctx = ctx
        self.dir = Path(keys_dir)
        public, secret = zmq.auth.load_certificate(self.dir / "gateway.key_secret")
        if secret is None:
            raise SystemExit(f"{self.dir}/gateway.key_secret holds no secret key")
        self.public, self.secret = public, secret
        self.on_refused = on_refused
        self._allowed: set[bytes] = set()
        self._read_at = 0.0
        self._logged: dict[bytes, float] = {}
        self._load()
        _authenticator(ctx).configure_curve_callback(REMOTE_WORKERS_DOMAIN, self)

    def _load(self) -> None:
        self._read_at = time.monotonic()
        folder = self.dir / "authorized_workers"
        self._allowed = set(zmq.auth.load_certificates(folder)) if folder.is_dir() else set()

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self._allowed:
            return True
        if time.monotonic() - self._read_at > 1.0:  # a key added since: no restart needed
            self._load()
            if client_key in self._allowed:
                return True
        now = time.monotonic()
        if now - self._logged.get(client_key, -1e9) > 60:  # a refused worker retries without end: log once a minute
            self._logged[client_key] = now
            log.warning(
                "refused a remote tokenizer worker: its CURVE public key %s is not in %s/authorized_workers",
                client_key.decode(),
                self.dir,
            )
        if self.on_refused:
            try:
                self.on_refused("curve_key")
            except Exception:  # an exception here would stop the ZAP handler, and every handshake with it
                log.exception("counting a refused worker key failed")
        return False

    def secure_server(self, sock) -> None:
        sock.zap_domain = REMOTE_WORKERS_DOMAIN.encode()
        sock.curve_server = True
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public

    def stop(self) -> None:
        _release_authenticator(self.ctx)


def scheduler_client_keys(keys_dir: str | None) -> dict | None:
    """CURVE keys for the scheduler link: scheduler.key (its public key) and client.key_secret."""
    if not keys_dir or not (Path(keys_dir) / "scheduler.key").exists():
        return None  # the directory may hold only remote workers' keys
    d = Path(keys_dir)
    server_public, _ = zmq.auth.load_certificate(d / "scheduler.key")
    public, secret = zmq.auth.load_certificate(d / "client.key_secret")
    return {"server": server_public, "public": public, "secret": secret}


def make_worker_keys(keys_dir: str, name: str) -> list[str]:
    """Keys for one remote worker: DIR/workers/NAME (copy it to the worker's host) holds its secret key
    and the gateway's public key; DIR/authorized_workers/NAME.key admits it. The gateway's own pair,
    DIR/gateway.key(_secret), is made once and shared by all its workers."""
    if not name or "/" in name or name.startswith("."):
        raise SystemExit(f"--worker {name!r}: give a plain name, such as the worker's host name")
    root = Path(private_dir(keys_dir))
    made = []
    if not (root / "gateway.key_secret").exists():
        public_file, secret_file = zmq.auth.create_certificates(root, "gateway")
        os.chmod(secret_file, 0o600)
        made += [public_file, secret_file]
    bundle = Path(private_dir(str(root / "workers" / name)))
    public_file, secret_file = zmq.auth.create_certificates(bundle, "worker")
    os.chmod(secret_file, 0o600)
    shutil.copy(root / "gateway.key", bundle / "gateway.key")
    authorized = Path(private_dir(str(root / "authorized_workers")))
    shutil.copy(public_file, authorized / f"{name}.key")
    os.unlink(public_file)  # the secret file holds the public key too
    return [*made, str(bundle / "worker.key_secret"), str(bundle / "gateway.key"), str(authorized / f"{name}.key")]


def make_keys(keys_dir: str) -> list[str]:
    """Create the scheduler's and the gateway's CURVE certificates (tokenmill curve-keys DIR)."""
    private_dir(keys_dir)
    made = []
    for name in ("scheduler", "client"):
        public_file, secret_file = zmq.auth.create_certificates(keys_dir, name)
        os.chmod(secret_file, 0o600)
        made += [public_file, secret_file]
    return made
