"""How the gateway runs and feeds its tokenizer workers: one object, built once from ServeSettings.

The pool (worker_pool.py), its local process supervision (worker_supervision.py) and the remote
workers' listener (remote_workers.py) each read the part they need.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolSettings:
    size: int = 1  # local worker processes (0: a gateway whose workers all join it, --gateways N's others)
    # admission: conversions waiting for a worker, in count and in body bytes, before a 429
    max_queued: int = 1024
    max_queued_bytes: int = 1 << 30
    conversion_timeout: float = 60.0  # one conversion's deadline in a worker; its worker is restarted past it
    # each local worker process: memory cap, conversion threads and their niceness, its scheduling group's
    # niceness (autogroup), SCHED_FIFO priority of its IO thread (0: none)
    memory_limit_mb: int = 0
    conversion_threads: int = 2
    tokenizer_threads: int = 0  # the tokenizers library's thread pool (RAYON_NUM_THREADS; 0: the library's, every CPU)
    conversion_nice: int = 0
    group_nice: int = 0
    io_rt_priority: int = 0
    # dispatch (dispatch.py): keep a conversation on the worker that holds its prefix; which bodies count
    # as quick (sent to a worker's IO thread ahead of long conversions) and how many may queue there
    affinity: bool = True
    quick_bytes: int = 8192
    quick_depth: int = 16
    quick_turn_bytes: int = 65536
    # workers on other hosts (or the node's other gateways' workers) join at this endpoint; one silent
    # this long is lost and its streams move
    remote_endpoint: str | None = None
    remote_timeout: float = 5.0
    attach: tuple[str, ...] = ()  # the node's other gateways (--gateways N), which each local worker joins too
