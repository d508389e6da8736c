"""Where the CPU went, thread by thread: a census of every thread of the processes under a stack.

For each thread (``/proc/PID/task/TID``): CPU time (``stat`` utime + stime), the time it sat
runnable waiting for a core (``schedstat``'s second field: run-queue delay), voluntary and
involuntary context switches (``status``), its niceness and scheduling policy. Two snapshots
around a measurement give each thread's share of it, and :func:`by_role` folds threads of the
same kind (a worker's conversion threads, vLLM's OpenMP threads) into one row, so that two
stacks in front of the same engine can be read side by side: who ran, who waited, who spun.

A thread that spins while idle shows as CPU with few voluntary switches; a thread that is
starved shows as run-queue delay well above its CPU time.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tokenmill.bench.common import process_tree

_TICK = os.sysconf("SC_CLK_TCK")
_POLICIES = {0: "other", 1: "fifo", 2: "rr", 3: "batch", 5: "idle", 6: "deadline"}


@dataclass(frozen=True, slots=True)
class ThreadSample:
    """One thread's counters at one moment (times in seconds)."""

    pid: int
    tid: int
    process: str  # the process's name (comm)
    thread: str  # the thread's name (comm)
    cpu: float  # user + system
    wait: float  # runnable, waiting for a core
    voluntary: int  # switches because it blocked (sleep, I/O, a lock)
    involuntary: int  # switches because the kernel took the core away
    nice: int
    policy: str


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def sample_thread(pid: int, tid: int, process: str) -> ThreadSample | None:
    """One thread's counters, or None once it is gone."""
    base = f"/proc/{pid}/task/{tid}"
    stat, schedstat, status = _read(f"{base}/stat"), _read(f"{base}/schedstat"), _read(f"{base}/status")
    if stat is None or status is None:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is the state (stat's 3rd field): utime is the 14th, nice the 19th, policy the 41st
    cpu = (int(fields[11]) + int(fields[12])) / _TICK
    nice, policy = int(fields[16]), _POLICIES.get(int(fields[38]), fields[38])
    wait = 0.0
    if schedstat:
        run_ns, wait_ns, _ = schedstat.split()
        cpu = int(run_ns) / 1e9  # nanoseconds: finer than the tick counts
        wait = int(wait_ns) / 1e9
    voluntary = int(re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M).group(1))
    involuntary = int(re.search(r"^nonvoluntary_ctxt_switches:\s*(\d+)", status, re.M).group(1))
    return ThreadSample(pid, tid, process, name, cpu, wait, voluntary, involuntary, nice, policy)


def census(roots: list[int]) -> dict[int, ThreadSample]:
    """Every thread of every process under ``roots``: tid -> sample."""
    out: dict[int, ThreadSample] = {}
    for root in roots:
        for pid, process in process_tree(root).items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                sample = sample_thread(pid, int(tid), process)
                if sample is not None:
                    out[sample.tid] = sample
    return out


@dataclass(slots=True)
class ThreadShare:
    """What one thread, or a group of them, did between two censuses (seconds, counts)."""

    process: str
    thread: str
    threads: int
    cpu: float
    wait: float
    voluntary: int
    involuntary: int
    nice: str
    policy: str

    def as_dict(self) -> dict:
        return {
            "process": self.process,
            "thread": self.thread,
            "threads": self.threads,
            "cpu_s": round(self.cpu, 3),
            "wait_s": round(self.wait, 3),
            "voluntary": self.voluntary,
            "involuntary": self.involuntary,
            "nice": self.nice,
            "policy": self.policy,
        }


def delta(before: dict[int, ThreadSample], after: dict[int, ThreadSample]) -> list[ThreadShare]:
    """Each thread alive at ``after``: what it did since ``before`` (all of it, for a thread born since)."""
    shares = []
    for tid, a in after.items():
        b = before.get(tid)
        if b is not None and b.pid != a.pid:
            b = None
        shares.append(
            ThreadShare(
                a.process,
                a.thread,
                1,
                a.cpu - (b.cpu if b else 0.0),
                a.wait - (b.wait if b else 0.0),
                a.voluntary - (b.voluntary if b else 0),
                a.involuntary - (b.involuntary if b else 0),
                str(a.nice),
                a.policy,
            )
        )
    return shares


_NUMBERED = re.compile(r"[-_:]?\d+$")


def role(name: str) -> str:
    """A thread or process name without its trailing number: ``conversion-1`` -> ``conversion``,
    ``tm-worker-0`` -> ``tm-worker``, ``omp_thread_3`` -> ``omp_thread``."""
    return _NUMBERED.sub("", name) or name


def by_role(shares: list[ThreadShare]) -> list[ThreadShare]:
    """Threads of the same process role and thread role summed into one row, most CPU first."""
    rows: dict[tuple[str, str], ThreadShare] = {}
    for s in shares:
        key = (role(s.process), role(s.thread))
        row = rows.get(key)
        if row is None:
            rows[key] = ThreadShare(key[0], key[1], 1, s.cpu, s.wait, s.voluntary, s.involuntary, s.nice, s.policy)
            continue
        row.threads += 1
        row.cpu += s.cpu
        row.wait += s.wait
        row.voluntary += s.voluntary
        row.involuntary += s.involuntary
        if s.nice not in row.nice.split("/"):
            row.nice += "/" + s.nice
        if s.policy not in row.policy.split("/"):
            row.policy += "/" + s.policy
    return sorted(rows.values(), key=lambda r: -(r.cpu + r.wait))


def table(shares: list[ThreadShare], seconds: float, limit: int = 20) -> str:
    """Rows as text: CPU and run-queue wait in seconds and as a share of ``seconds`` of wall time."""
    lines = [
        f"{'process':<18} {'thread':<22} {'n':>3} {'cpu s':>8} {'cpu%':>6} {'wait s':>8} {'wait%':>6} "
        f"{'vol':>8} {'invol':>7} {'nice':>6} policy"
    ]
    for s in shares[:limit]:
        if s.cpu < 0.005 and s.wait < 0.005:
            continue
        lines.append(
            f"{s.process[:18]:<18} {s.thread[:22]:<22} {s.threads:>3} {s.cpu:>8.2f} {100 * s.cpu / seconds:>5.0f}% "
            f"{s.wait:>8.2f} {100 * s.wait / seconds:>5.0f}% {s.voluntary:>8} {s.involuntary:>7} {s.nice:>6} {s.policy}"
        )
    return "\n".join(lines)


def table_of_dicts(rows: list[dict], seconds: float, limit: int = 20) -> str:
    """:func:`table` of rows as a report stores them (:meth:`ThreadShare.as_dict`)."""
    shares = [
        ThreadShare(
            r["process"],
            r["thread"],
            r["threads"],
            r["cpu_s"],
            r["wait_s"],
            r["voluntary"],
            r["involuntary"],
            r["nice"],
            r["policy"],
        )
        for r in rows
    ]
    return table(shares, seconds, limit)
