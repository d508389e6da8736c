"""Processed images by content hash under a byte budget (least recently used goes first).

An agent resends the same screenshots every turn; a hit skips decoding and preprocessing
entirely. Shared by a worker's conversion threads, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from tokenmill.tokenizer_workers.images.base import ProcessedImage


class ImageCache:
    def __init__(self, budget_bytes: int, on_drop: Callable[[ProcessedImage], None] | None = None):
        self.budget = budget_bytes
        self.on_drop = on_drop  # told of every item that leaves (evicted, or replaced under its key)
        self.items: OrderedDict[str, ProcessedImage] = OrderedDict()
        self.bytes_used = 0
        self.hits = self.misses = self.evictions = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> ProcessedImage | None:
        with self.lock:
            item = self.items.get(key)
            if item is None:
                self.misses += 1
                return None
            self.items.move_to_end(key)
            self.hits += 1
            return item

    def holds(self, key: str) -> bool:
        return key in self.items

    def put(self, key: str, item: ProcessedImage) -> None:
        if item.nbytes > self.budget:
            if self.on_drop is not None:
                self.on_drop(item)
            return
        dropped = []
        with self.lock:
            old = self.items.pop(key, None)
            if old is not None:
                self.bytes_used -= old.nbytes
                dropped.append(old)
            self.items[key] = item
            self.bytes_used += item.nbytes
            while self.bytes_used > self.budget:
                _, evicted = self.items.popitem(last=False)
                self.bytes_used -= evicted.nbytes
                self.evictions += 1
                dropped.append(evicted)
        if self.on_drop is not None:
            for gone in dropped:
                self.on_drop(gone)
