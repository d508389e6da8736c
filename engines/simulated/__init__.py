"""A simulated GPU scheduler: the scheduler side of docs/engines/scheduler-protocol.md without a GPU.

It binds a ZeroMQ ROUTER, answers Hello with Welcome, and "generates" tokens for Generate
requests with a simple performance model, so that tests and benchmarks can run the whole front
end without one. Run it as ``tokenmill simulate-scheduler --bind ENDPOINT`` or
``python -m tokenmill.engines.simulated --bind ENDPOINT``.

One concern per module, each depending only on those listed before it:

* :mod:`.request` — one request's state (what it asked for, waiting / prefilling / decoding, its cursors);
* :mod:`.prefix_cache` — the model of an engine's prefix cache (``--prefix-cache-tokens``, ``cache_salt``);
* :mod:`.replies` — the model directory whose tokenizer it serves, and scripted replies (``--replies``);
* :mod:`.sampling` — which token comes next: the palette, echo, scripts, structured outputs, and the
  sampling fields (``min_tokens``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``);
* :mod:`.logprobs` — made-up, deterministic logprobs for generated and prompt tokens;
* :mod:`.scheduler` — :class:`SimulatedScheduler`: admission, prefill and decode steps, aborts,
  sessions, and the timing model its docstring describes;
* :mod:`.cli` — the command line (``add_arguments``, ``run``, ``main``); ``__main__`` runs it.
"""

from __future__ import annotations

from tokenmill.engines.simulated.cli import add_arguments, main, run, scheduler_from_args
from tokenmill.engines.simulated.prefix_cache import PrefixCache
from tokenmill.engines.simulated.replies import ScriptedReplies, resolve_model_dir
from tokenmill.engines.simulated.sampling import PALETTE_TEXT
from tokenmill.engines.simulated.scheduler import DEFAULT_VOCAB_SIZE, SCHEDULER_NAME, SimulatedScheduler
from tokenmill.scheduler_client.scheduler_side import (
    ERR_BAD_REQUEST,
    ERR_DUPLICATE,
    ERR_UNKNOWN_MESSAGE,
    ERR_UNSUPPORTED,
    ERR_VERSION_MISMATCH,
)

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "PALETTE_TEXT",
    "SCHEDULER_NAME",
    "PrefixCache",
    "ScriptedReplies",
    "SimulatedScheduler",
    "add_arguments",
    "main",
    "resolve_model_dir",
    "run",
    "scheduler_from_args",
    # the error codes this scheduler sends (docs/engines/scheduler-protocol.md lists them)
    "ERR_BAD_REQUEST",
    "ERR_DUPLICATE",
    "ERR_UNKNOWN_MESSAGE",
    "ERR_UNSUPPORTED",
    "ERR_VERSION_MISMATCH",
]
