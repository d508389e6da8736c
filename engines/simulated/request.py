"""One request inside the simulated scheduler, and the states it moves through.

The scheduler queues and steps it; the sampler reads what it asked for and advances its draw cursors
(the generator, the palette position); the made-up logprobs hash its key and position. Its state lives
in one place that all three share.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.engines.guided import Decoder

WAITING, PREFILLING, DECODING = "waiting", "prefilling", "decoding"


@dataclass(eq=False)
class SimulatedRequest:
    """A Generate as the simulator keeps it: what it asked for, where it stands, and its draw cursors."""

    identity: bytes
    request_id: str
    prompt: Sequence[int]  # array('I')
    max_new_tokens: int
    stop_ids: frozenset[int]
    first_stop_id: int | None  # what --eos-probability emits
    ignore_eos: bool
    rng: random.Random
    script: list[int] | None = None  # a scripted reply's tokens (--replies), or a structured output's
    # 1.1 (defaults: not asked for)
    min_tokens: int = 0
    banned: frozenset[int] = frozenset()  # logit_bias <= -100
    forced: int | None = None  # the token with the highest logit_bias >= 100
    logprobs: int | None = None
    lp_key: int = 0  # what the logprob hash starts from
    # 1.2
    priority: int = 0
    arrival: int = 0  # its place in the --scheduling priority queue
    allowed: tuple[int, ...] | None = None  # sampling.allowed_token_ids
    allowed_set: frozenset[int] | None = None
    bad_words: dict[int, list[tuple[int, ...]]] | None = None  # a banned sequence's last token -> the tokens before it
    history: list[int] | None = None  # generated tokens, kept for bad_words
    prompt_logprobs: int | None = None  # Generate.prompt_logprobs, until the first output has carried them
    kv_out: dict | None = None  # what the final output's kv_transfer_params says (kv_transfer_params, extra_args)
    decoder: Decoder | None = None  # structured: the request's llguidance matcher
    next_token: Callable[[SimulatedRequest], tuple[int | None, str | None]] | None = None  # set at accept
    state: str = WAITING
    generated: int = 0
    cached: int = 0  # prompt tokens found in the prefix cache (--prefix-cache-tokens)
    prefill_start: float = 0.0
    ready_at: float = 0.0
    # palette cursor: (sentence index, position in it)
    sentence: int = -1
    position: int = 0
    key: tuple[bytes, str] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.identity, self.request_id)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)
