"""The simulated scheduler's made-up logprobs: plausible, deterministic numbers without a model.

* ``logprobs`` (protocol 1.1): every generated token (a final stop token included) gets a logprob in
  (-3, 0), a hash of the request's key (seed and prompt, or random when unseeded) and its
  position; with N > 0 the top N are the chosen token first, then N-1 other distinct IDs
  (from the palette, else the vocabulary) with strictly lower, descending logprobs whose
  probabilities sum with the chosen one's to at most 1. Requests without logprobs take the
  unchanged fast path.
* ``prompt_logprobs`` (protocol 1.2): deterministic from the prompt alone (:meth:`MadeUpLogprobs.for_prompt`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence

from tokenmill.engines.simulated.request import SimulatedRequest
from tokenmill.engines.simulated.sampling import UNSEEDED, TokenSource
from tokenmill.scheduler_client.protocol import Generate, PromptLogprobs, floats_to_bytes, ids_to_frame

_M64 = (1 << 64) - 1
_LN2 = math.log(2.0)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def logprob_key(generate: Generate, prompt_bytes: bytes) -> int:
    """Deterministic where the tokens are (seed and prompt; prompt with seed None and temperature 0)."""
    seed = generate.sampling.seed
    if seed is None and generate.sampling.temperature != 0:
        return UNSEEDED.getrandbits(64)
    salt = b"greedy" if seed is None else seed.to_bytes(16, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(b"logprobs" + salt + prompt_bytes, digest_size=8).digest(), "little")


def _distinct_ids(pool: list[int], vocab: int, start: int, chosen: int) -> Iterator[int]:
    """Alternatives to ``chosen``, each once: through the palette from ``start``, then the vocabulary."""
    taken = {chosen}
    j = 0
    while True:
        other = pool[(start + j) % len(pool)] if j < len(pool) else (start + j) % vocab
        j += 1
        if other not in taken:
            taken.add(other)
            yield other


class MadeUpLogprobs:
    """Logprobs for generated and prompt tokens, their alternatives drawn from the served palette (else vocabulary)."""

    def __init__(self, tokens: TokenSource) -> None:
        self.tokens = tokens
        # distinct token IDs the top-N alternatives come from (the palette's, else the vocabulary)
        self.alternatives = list(dict.fromkeys(t for sentence in tokens.sentences for t in sentence))

    def for_token(self, req: SimulatedRequest, token: int, lps: list, top_ids: list, top_lps: list) -> None:
        """The chosen token's logprob, and the top N, for the token at position req.generated."""
        h = _mix64(req.lp_key ^ _mix64(req.generated))
        u = (h >> 11) * (1.0 / (1 << 53))
        chosen = -(0.001 + 2.99 * u * u)  # in (-3, 0), mostly near 0 as a confident model's
        lps.append(chosen)
        n = req.logprobs
        if not n:
            return
        top_ids.append(token)
        top_lps.append(chosen)
        # the others share what the chosen token leaves, each at most half the one before
        p = math.exp(chosen)
        lp = math.log(min(p, 1.0 - p))
        pool = self.alternatives
        vocab = self.tokens.vocab_size
        others = _distinct_ids(pool, vocab, h % (len(pool) if pool else vocab), token)
        for _ in range(n - 1):
            h = _mix64(h)
            lp -= _LN2 + 0.7 * ((h >> 11) * (1.0 / (1 << 53)))
            top_ids.append(next(others))
            top_lps.append(lp)

    def for_prompt(self, prompt: Sequence[int], n: int) -> PromptLogprobs:
        """1.2's prompt logprobs, deterministic from the prompt alone: at each position after the first, a
        descending run of logprobs (the first in (-3, 0), each next one at most half as likely) of which the
        prompt token takes place 1, 2 or 3 (a hash of the prompt up to there), the other places going to
        distinct IDs from the palette (else the vocabulary), as in :meth:`for_token`."""
        lps: list[float] = []
        ranks: list[int] = []
        top_ids: list[int] = []
        top_lps: list[float] = []
        pool = self.alternatives
        vocab = self.tokens.vocab_size
        h = int.from_bytes(hashlib.blake2b(b"prompt_logprobs", digest_size=8).digest(), "little")
        for i in range(1, len(prompt)):
            token = prompt[i]
            h = _mix64(h ^ _mix64(prompt[i - 1] + 1))  # chained: a hash of the prompt up to this position
            g = _mix64(h ^ token)
            rank = 1 + g % 3
            u = (g >> 11) * (1.0 / (1 << 53))
            values = [-(0.001 + 2.99 * u * u)]
            p = math.exp(values[0])
            lp = math.log(min(p, 1.0 - p))
            for _ in range(max(n, rank) - 1):
                g = _mix64(g)
                lp -= _LN2 + 0.7 * ((g >> 11) * (1.0 / (1 << 53)))
                values.append(lp)
            lps.append(values[rank - 1])
            ranks.append(rank)
            if not n:
                continue
            others = _distinct_ids(pool, vocab, g % (len(pool) if pool else vocab), token)
            for place in range(1, n + 1):
                top_ids.append(token if place == rank else next(others))
                top_lps.append(values[place - 1])
        return PromptLogprobs(
            floats_to_bytes(lps),
            ids_to_frame(ranks),
            ids_to_frame(top_ids) if n else b"",
            floats_to_bytes(top_lps) if n else b"",
        )
