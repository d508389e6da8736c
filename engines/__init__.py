"""Real inference engines behind the tokenmill scheduler protocol (docs/engines/tokenmill-engine.md).

``tokenmill engine --backend {transformers,sglang,vllm} --bind ENDPOINT`` runs one engine
in its own process and serves the scheduler side of docs/engines/scheduler-protocol.md, so that
``tokenmill serve --scheduler ENDPOINT`` can use it exactly like the simulated scheduler.

* :mod:`tokenmill.engines.bridge` — the protocol side shared by every backend (sessions, validation,
  output batching, finish reasons, aborts, Stats) and the command line;
* :mod:`tokenmill.engines.transformers_backend` — HuggingFace transformers continuous batching
  (runs on CPU; ``--random-weights`` builds a tiny model for tests and demos);
* :mod:`tokenmill.engines.sglang_backend` — ``sglang.Engine`` driven on its own event-loop thread;
* :mod:`tokenmill.engines.vllm_backend` — vLLM's ``AsyncLLM``;
* :mod:`tokenmill.engines.http_backend` — an unmodified ``vllm serve --enable-scale-out`` over its
  token-in/token-out HTTP API (``tokenmill serve --engine-url`` starts one per server), and
  :mod:`tokenmill.engines.http_sglang`, SGLang's own server over its ``/generate``
  (:mod:`tokenmill.engines.http_flavours` picks one).

Each backend's library is an optional extra (``pip install 'tokenmill[transformers]'``,
``'tokenmill[sglang]'``, ``'tokenmill[vllm]'``) and is imported only when that backend is
chosen.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

#: backend name -> (module, the pip extra that installs its engine)
BACKENDS: dict[str, tuple[str, str]] = {
    "transformers": ("tokenmill.engines.transformers_backend", "transformers"),
    "sglang": ("tokenmill.engines.sglang_backend", "sglang"),
    "vllm": ("tokenmill.engines.vllm_backend", "vllm"),
    # an unmodified engine server over HTTP: no engine library here, aiohttp is a dependency of tokenmill
    "http": ("tokenmill.engines.http_flavours", ""),
}


class MissingBackend(RuntimeError):
    """The chosen backend's engine library is not installed."""

    def __init__(self, backend: str, missing: str) -> None:
        extra = BACKENDS[backend][1]
        super().__init__(
            f"the {backend} backend needs {missing}, which is not installed: pip install 'tokenmill[{extra}]'"
        )
        self.backend = backend
        self.missing = missing


def backend_module(name: str):
    """The module implementing backend ``name`` (cheap: engine libraries load later)."""
    try:
        module, _extra = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}") from None
    return importlib.import_module(module)


def require(backend: str, *modules: str) -> None:
    """Import ``modules`` or raise :class:`MissingBackend` naming the extra to install."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if exc.name is not None and exc.name.split(".")[0] != name.split(".")[0]:
                raise  # the library is there but one of its own dependencies is broken
            raise MissingBackend(backend, name) from exc


def parse_engine_args(pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> keyword arguments; values are JSON when they parse as JSON, else strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg takes KEY=VALUE, not {pair!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.replace("-", "_")] = value
    return out


def engine_kwargs(args, backend: str, model_key: str, max_len_key: str, max_running_key: str) -> dict[str, Any]:
    """The common ``tokenmill engine`` options under one engine's own argument names, then --engine-arg."""
    if not args.model:
        raise ValueError(f"the {backend} backend needs --model (a HuggingFace directory or hub name)")
    kwargs: dict[str, Any] = {model_key: args.model}
    if args.max_model_len is not None:
        kwargs[max_len_key] = args.max_model_len
    if args.max_running is not None:
        kwargs[max_running_key] = args.max_running
    if args.dtype != "auto":
        kwargs["dtype"] = args.dtype
    kwargs.update(parse_engine_args(args.engine_arg))
    return kwargs
