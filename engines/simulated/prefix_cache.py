"""The simulated scheduler's model of an engine's prefix cache (``--prefix-cache-tokens``).

Prompt tokens it finds cached skip prefill and are reported as ``cached_tokens``. A ``cache_salt``
(protocol 1.2) starts the chain of block hashes, so only prompts with the same salt share blocks.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    """A model of an engine's prefix cache (vLLM's automatic prefix caching), for data-parallel tests.

    Prompts are cut into blocks of ``BLOCK`` tokens; a block is cached when the same block with the
    same prefix was prefilled before (a chained hash), and the least recently used blocks go first
    once ``capacity_tokens`` are held. ``admit`` returns the prompt tokens served from the cache and
    caches the rest; the simulator prefills only those that were not.
    """

    BLOCK = 16

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(1, capacity_tokens // self.BLOCK)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def admit(self, prompt_bytes: bytes, salt: str | None = None) -> int:
        step = 4 * self.BLOCK
        # a cache_salt (1.2) starts the chain elsewhere: only prompts with the same salt share blocks
        chain, hit, counting = (0 if salt is None else hash(("salt", salt))), 0, True
        for start in range(0, len(prompt_bytes) - step + 1, step):
            chain = hash((chain, prompt_bytes[start : start + step]))
            if counting and chain in self.blocks:
                self.blocks.move_to_end(chain)
                hit += self.BLOCK
                continue
            counting = False
            self.blocks[chain] = None
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit
