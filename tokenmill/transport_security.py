"""ZeroMQ transport security: ipc:// in a private directory, tcp:// only with CURVE.

- ipc:// sockets live in a runtime directory of mode 0700, so only the service user
  can connect to them.
- A tcp:// worker endpoint gets fresh CURVE keys at every start: the gateway is the
  CURVE server, its workers (which it spawns itself, handing them the keys through
  their environment) the only clients a ZAP authenticator lets in.
- A tcp:// scheduler needs keys made with ``tokenmill curve-keys DIR``: the gateway
  authenticates the scheduler by its public key and presents its own client key.
``--insecure-tcp`` lifts the requirement, for a trusted network only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

WORKER_CURVE_ENV = "TOKENMILL_WORKER_CURVE"


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
            f"docs/security.md; `tokenmill curve-keys DIR` makes them), or --insecure-tcp on a trusted network."
        )


class WorkerLinkSecurity:
    """Ephemeral CURVE keys for a tcp:// gateway<->worker link."""

    def __init__(self, ctx: zmq.asyncio.Context):
        self.server_public, self.server_secret = zmq.curve_keypair()
        self.client_public, self.client_secret = zmq.curve_keypair()
        self.auth = AsyncioAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback("*", self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key == self.client_public

    def secure_server(self, sock) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public

    def worker_env(self) -> str:
        return b" ".join((self.server_public, self.client_public, self.client_secret)).decode()  # Z85 has no space

    def stop(self) -> None:
        self.auth.stop()


def secure_worker_socket(sock, environ=os.environ) -> None:
    """In a worker: apply the keys the gateway handed down, if any."""
    value = environ.get(WORKER_CURVE_ENV)
    if value:
        server_public, public, secret = (part.encode() for part in value.split(" "))
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret


def scheduler_client_keys(keys_dir: str | None) -> dict | None:
    """CURVE keys for the scheduler link: scheduler.key (its public key) and client.key_secret."""
    if not keys_dir:
        return None
    d = Path(keys_dir)
    server_public, _ = zmq.auth.load_certificate(d / "scheduler.key")
    public, secret = zmq.auth.load_certificate(d / "client.key_secret")
    return {"server": server_public, "public": public, "secret": secret}


def make_keys(keys_dir: str) -> list[str]:
    """Create the scheduler's and the gateway's CURVE certificates (tokenmill curve-keys DIR)."""
    private_dir(keys_dir)
    made = []
    for name in ("scheduler", "client"):
        public_file, secret_file = zmq.auth.create_certificates(keys_dir, name)
        os.chmod(secret_file, 0o600)
        made += [public_file, secret_file]
    return made
