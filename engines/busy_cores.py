"""Cores kept busy while a simulated engine has work: the CPU side of a GPU engine.

A GPU engine's scheduler process spins a core while anything runs (CUDA's default
synchronisation busy-waits; the step loop never sleeps), and a CPU engine computes on every
core it has. A front end measured beside an idle simulator never meets that. With
``simulate-scheduler --busy-cores N`` (``serve --sim-busy-cores N``), N spinner processes burn
a core each whenever the simulator has a request prefilling or decoding, at the simulator's
own priority, and sleep otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

_SPIN_S = 0.005  # how long a spinner spins before it looks at the flag again


def _spin(busy, parent: int) -> None:
    from tokenmill.process.procutil import die_with_parent, set_process_name

    die_with_parent(parent)
    set_process_name("tm-sim-busy")
    clock = time.perf_counter
    while True:
        busy.wait()  # at once while the engine works; asleep otherwise
        end = clock() + _SPIN_S
        while clock() < end:
            pass


class BusyCores:
    """N spinner processes that burn a core each while :meth:`set` has said the engine is busy."""

    def __init__(self, cores: int) -> None:
        self.cores = cores
        self.busy = False
        ctx = mp.get_context("spawn")
        self._flag = ctx.Event()
        self._procs = [ctx.Process(target=_spin, args=(self._flag, os.getpid()), daemon=True) for _ in range(cores)]
        for proc in self._procs:
            proc.start()

    def set(self, busy: bool) -> None:
        if busy != self.busy:  # a transition: one semaphore operation, not one per step
            self.busy = busy
            (self._flag.set if busy else self._flag.clear)()

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join(5)
        self._procs.clear()
