"""Linux process hygiene: children that die with their parent and names an operator can read in ps."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, arg) -> None:
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` (SIGKILL) to this process when its parent dies, even by kill -9."""
    _prctl(_PR_SET_PDEATHSIG, sig)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the request took effect


def set_process_name(name: str) -> None:
    """The kernel's comm name (15 bytes, shown by ps -e, top and pgrep)."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


PARENT_ENV = "TOKENMILL_PARENT_PID"
# a tokenizer worker's matrix products (image resizing) run on the thread that asks: the pool of
# workers is the parallelism, and BLAS's own threads (one per core, at numpy's import) would only
# take cores from the engine. Read when BLAS loads, so set before numpy is imported.
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def child_env(environ=None) -> dict:
    """Environment for a supervised child: it learns who its parent is, to die with it."""
    env = dict(os.environ if environ is None else environ)
    env[PARENT_ENV] = str(os.getpid())
    return env


def die_with_supervisor(sig: int = signal.SIGKILL) -> None:
    """In a child started with child_env(): be sent ``sig`` (SIGKILL) when the supervising process dies."""
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit():
        die_with_parent(int(parent), sig)


def supervisor_gone() -> bool:
    """In a child started with child_env(): whether the process that started it has died."""
    parent = os.environ.get(PARENT_ENV)
    return bool(parent and parent.isdigit() and os.getppid() != int(parent))


def limit_memory(megabytes: int) -> None:
    """Cap this process's address space, so a runaway allocation raises MemoryError here."""
    if megabytes and megabytes > 0:
        import resource

        limit = megabytes << 20
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass


def _processes() -> tuple[dict[int, int], dict[int, str]]:
    """(pid -> parent pid, pid -> start time) of every process, from /proc."""
    parents, starts = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        starts[int(entry)] = fields[19]
    return parents, starts


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time, for every process below root."""
    parents, starts = _processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = starts[pid]
                frontier.append(pid)
    return found


def take_descendants_along(interval: float = 1.0) -> None:
    """Fork a small watcher that kills this process's descendants when this process dies, even by kill -9.

    An engine library (vLLM, SGLang) starts its own worker processes, and nobody asked the kernel to
    kill those with us: after a kill -9 of ``tokenmill engine`` they lived on, holding the GPU. The
    watcher dies with us too (PR_SET_PDEATHSIG) but first, on that signal, kills every descendant it
    saw at its last look (every ``interval`` seconds; a pid reused since is left alone). Call it
    first thing, while this process has no threads.
    """
    if sys.platform != "linux":
        return
    parent = os.getpid()
    if os.fork():
        return
    try:
        set_process_name("tm-reaper")
        seen: dict[int, str] = {}

        def reap(*_) -> None:
            current = _processes()[1]  # start times of everything alive, to skip reused pids
            for pid, started in seen.items():
                if pid != os.getpid() and current.get(pid) == started:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            os._exit(0)

        signal.signal(signal.SIGTERM, reap)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the engine decides
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            reap()
        while True:
            seen = {pid: started for pid, started in _descendants(parent).items() if pid != os.getpid()}
            time.sleep(interval)
            if os.getppid() != parent:  # missed the signal somehow
                reap()
    finally:
        os._exit(0)


_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


def request_latency_slice(microseconds: int) -> bool:
    """Ask the kernel for a short time slice for the calling thread (``sched_setattr``'s
    ``sched_runtime`` for SCHED_OTHER, honoured by the EEVDF scheduler of Linux 6.12 and later).

    Why: a waking thread whose slice is shorter than the running one's preempts it, so an event loop
    that sleeps most of the time answers within a fraction of a millisecond even while an engine
    keeps every core busy; its share of the CPU is unchanged (that is what niceness changes, and
    raising it needs a privilege; this does not). Threads and processes started afterwards get the
    kernel's default (SCHED_FLAG_RESET_ON_FORK): a conversion thread or a worker with a short slice
    would preempt, and be preempted, ten times as often. Returns whether the kernel took it (an
    older kernel, or another OS, keeps its default)."""
    import platform
    import struct

    number = _SYS_SCHED_SETATTR.get(platform.machine())
    if not microseconds or sys.platform != "linux" or number is None:
        return False
    # struct sched_attr (v1, 56 bytes): size, policy, flags, nice, priority, runtime, deadline, period,
    # util_min, util_max; policy SCHED_OTHER and this thread's niceness kept; flags: reset on fork
    attr = struct.pack("IIQiIQQQII", 56, 0, 1, os.getpriority(os.PRIO_PROCESS, 0), 0, microseconds * 1000, 0, 0, 0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(number, 0, ctypes.create_string_buffer(attr, len(attr)), 0) == 0
    except (OSError, AttributeError):
        return False


def request_realtime(priority: int) -> bool:
    """Run the calling thread under SCHED_FIFO at ``priority`` (1 is the lowest), if this process may
    (CAP_SYS_NICE, or RLIMIT_RTPRIO at least ``priority``: systemd's ``LimitRTPRIO=``).

    Why: a short EEVDF slice (``request_latency_slice``) lets a waking thread preempt only while the
    fair scheduler finds its group *eligible*; an event loop that has just run a burst (megabyte
    image bodies) is not, and perf showed the gateway's loop runnable for 25 ms behind an engine's
    10 ms stretches of vision-tower math. A real-time thread preempts any fair one the moment it
    wakes. The loop never computes (that is the architecture: conversion is in the workers), so it
    takes little; the kernel still keeps 5% of each core for fair threads if it ever spun. Threads
    and processes started afterwards get SCHED_OTHER (SCHED_RESET_ON_FORK). Returns whether it took."""
    if not priority or sys.platform != "linux" or not hasattr(os, "SCHED_RESET_ON_FORK"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(priority))
    except OSError:  # no privilege (the usual case for a service user without LimitRTPRIO), or a cgroup
        return False  # with the cpu controller on a kernel that gives real-time threads no budget there
    return True


def realtime_zmq_threads(priority: int) -> None:
    """Start the I/O threads of this process's ZeroMQ contexts (pyzmq's two singletons) under SCHED_FIFO
    at ``priority``. Call only once :func:`request_realtime` has taken for this process: libzmq aborts
    the process if the kernel then refuses.

    Why: every frame between a real-time event loop and its engine passes through ZeroMQ's I/O thread,
    which is otherwise an ordinary thread; beside an engine that keeps every core busy, perf sched showed
    it runnable for 226 ms while the loop waited on it (a stream's tokens with it). It only moves frames."""
    if not priority:
        return
    import zmq
    import zmq.asyncio

    for ctx in (zmq.Context.instance(), zmq.asyncio.Context.instance()):
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_FIFO)
        ctx.set(zmq.THREAD_PRIORITY, priority)


def set_group_nice(nice: int) -> bool:
    """The niceness of this process's scheduling group (its session's autogroup, /proc/self/autogroup).
    A lower value needs CAP_SYS_NICE or RLIMIT_NICE (systemd's ``LimitNICE=``). Returns whether it took.

    Why: under Linux autogroups (on in most distributions) the fair scheduler shares a core between
    sessions first and threads second, so a tokenizer worker in a session of its own weighs as much as
    a whole engine. vLLM's engine threads wait for each other by spinning on ``sched_yield``, which
    hands the core to threads of their own group only: beside that engine on 2 cores the workers' group
    got 7% of the CPU (their threads runnable 97 s of 56), not the half its weight says. A heavier group
    takes its share when it has work and costs nothing when idle. Where the process lives in a cgroup
    with the cpu controller (a systemd unit with CPUWeight=), autogroups do not apply and this changes
    nothing: the unit's CPUWeight= is the knob there."""
    if not nice or sys.platform != "linux":
        return False
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        return False
    return True


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(trim_bytes: int = 128 << 20) -> None:
    """Have glibc serve large allocations from its heap and keep up to ``trim_bytes`` of freed heap.

    Why: by default a buffer over glibc's mmap threshold (a 5 MB request body joined from its chunks) is
    a fresh mapping, and every page of it is faulted in and zeroed by the kernel as it is written, then
    unmapped when freed: in the gateway, half of a resent image turn's CPU (perf: clear_page, page
    faults, unmap). From the heap, the next body reuses pages already there. The price is up to
    ``trim_bytes`` of freed memory kept resident by this process."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest; larger allocations stay mappings
        libc.mallopt(_M_TRIM_THRESHOLD, trim_bytes)
    except (OSError, AttributeError):
        pass
