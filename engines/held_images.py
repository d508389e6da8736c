"""Which images a scheduler holds, by content hash, under a byte budget (protocol 1.2 ``images.by_hash``).

A front end sends an image the scheduler already holds as its hash alone (an empty pixel frame); the
scheduler must then know whether it still has it. An engine with a cache of its own answers from that
(the vLLM bridge asks vLLM's processor cache); this table is for one without (the simulated scheduler,
which keeps no pixels at all, only what it would hold: each image's size, least recently used out first).
"""

from __future__ import annotations

from collections import OrderedDict


class HeldImages:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def use(self, content_hash: str, nbytes: int = 0) -> None:
        """An image a request used: received with its pixels (``nbytes`` > 0: kept if it fits the budget,
        evicting the least recently used), or by hash (made the most recently used)."""
        sizes = self._sizes
        if content_hash in sizes:
            sizes.move_to_end(content_hash)
            return
        if not nbytes or nbytes > self.budget:
            return
        sizes[content_hash] = nbytes
        self.bytes += nbytes
        while self.bytes > self.budget:
            self.bytes -= sizes.popitem(last=False)[1]
