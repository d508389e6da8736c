"""``tokenmill engine --backend http``: the flavour of engine server a URL is, and its backend.

``--engine-flavour vllm`` is :class:`~tokenmill.engines.http_backend.HTTPBackend` (``vllm serve
--enable-scale-out``), ``sglang`` is :class:`~tokenmill.engines.http_sglang.SGLangHTTPBackend` (SGLang's
own server), and ``auto`` waits for the server to answer and asks it (:meth:`HTTPBackend.detect`:
SGLang answers ``/model_info``, vLLM does not). The options are the http backend's.
"""

from __future__ import annotations

import argparse

from tokenmill.engines.http_backend import HTTPBackend, add_arguments
from tokenmill.engines.http_sglang import SGLangHTTPBackend


def from_args(args: argparse.Namespace) -> HTTPBackend:
    """The backend ``--engine-flavour`` names, or with ``auto`` the one the server turns out to be (which
    waits for the server, as long as ``--engine-wait-s`` allows)."""
    backend = HTTPBackend.from_args(args)
    flavour = backend.flavour if backend.flavour != "auto" else backend.detect()
    return SGLangHTTPBackend.from_args(args) if flavour == "sglang" else backend


__all__ = ["from_args", "add_arguments"]
