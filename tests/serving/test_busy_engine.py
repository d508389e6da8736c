"""A busy engine: the simulator's busy cores, the conversion threads' priority, a send that never waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, Server, http

from tokenmill.gateway.settings import ServeSettings


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _named(parent: int, name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    pids = []
    for pid in map(int, out.split()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    pids.append(pid)
        except FileNotFoundError:
            pass
    return pids


def _child(server: Server, module: bytes) -> int:
    """The gateway's child process running ``python -m MODULE``."""
    for pid in server.children():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if module in f.read():
                return pid
    raise AssertionError(f"no {module.decode()} among the gateway's children")


def test_busy_cores_spin_while_requests_run_sleep_when_idle_and_die_with_the_simulator():
    server = Server("--sim-busy-cores", "2", "--sim-inter-token-latency-ms", "20")
    try:
        sim = _child(server, b"tokenmill.engines.simulated")
        deadline = time.monotonic() + 30
        while len(spinners := _named(sim, "tm-sim-busy")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(spinners) == 2, spinners
        time.sleep(0.5)  # past their start-up
        idle_before = sum(map(_cpu_s, spinners))
        time.sleep(1.0)
        assert sum(map(_cpu_s, spinners)) - idle_before < 0.1, "spinners burn CPU with nothing to run"

        busy_before = sum(map(_cpu_s, spinners))
        client = server.client()
        reply = client.chat.completions.create(
            model="deepseek-v4",
            messages=[{"role": "user", "content": "go"}],
            max_tokens=100,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == 100  # 100 steps of 20 ms: two seconds of work
        assert sum(map(_cpu_s, spinners)) - busy_before > 0.2, "spinners stayed idle while the engine worked"

        time.sleep(0.3)  # the step loop has seen that nothing runs
        after = sum(map(_cpu_s, spinners))
        time.sleep(1.0)
        assert sum(map(_cpu_s, spinners)) - after < 0.1, "spinners kept burning after the last request"

        os.kill(sim, signal.SIGKILL)  # even a simulator killed outright takes its spinners along
        deadline = time.monotonic() + 10
        while any(map(_alive, spinners)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, spinners)), "spinners outlived their simulator"
    finally:
        server.stop()


def _thread_nices(pid: int) -> list[int]:
    nices = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            nices.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    return nices


def test_conversion_threads_take_conversion_nice_and_the_io_thread_keeps_the_process_priority():
    niced = Server("--conversion-nice", "7", "--conversion-threads", "2")
    plain = Server()
    try:
        for server in (niced, plain):  # a long prompt: the first conversion thread has started the tokenizers pool
            server.client().chat.completions.create(
                model="deepseek-v4", max_tokens=1, messages=[{"role": "user", "content": "word " * 20000}]
            )
        worker = _child(niced, b"tokenmill.tokenizer_workers.worker")
        with open(f"/proc/{worker}/stat") as f:  # the main (IO) thread keeps the process's niceness
            base = int(f.read().rsplit(")", 1)[1].split()[16])
        nices = _thread_nices(worker)
        lowered = min(19, base + 7)
        assert base < lowered and nices.count(lowered) >= 2, (base, nices)  # both conversion threads (and their pool)
        assert base in nices, nices  # the IO thread, which detokenizes streams, is not lowered
        plain_worker = _child(plain, b"tokenmill.tokenizer_workers.worker")
        assert set(_thread_nices(plain_worker)) == {_thread_nices(plain_worker)[0]}, "the default shares the CPU evenly"
    finally:
        niced.stop()
        plain.stop()


def _slices(pid: int) -> dict[int, int]:
    """Each thread's scheduler time slice in ns (se.slice of /proc/PID/task/TID/sched)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    out[int(tid)] = int(line.split(":")[1])
    return out


def _kernel_takes_slices() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 12) and os.path.exists("/proc/self/sched")


def test_the_gateway_loop_asks_for_a_short_slice_and_the_workers_have_a_scheduling_group_of_their_own():
    """Not real-time (--loop-rt-priority 0), the event-loop thread alone asks for --loop-slice-us (so it
    preempts an engine that keeps the cores busy, the moment a request comes); its helper threads and the
    workers keep the kernel's default. The workers run in sessions of their own (Linux autogroups): their
    conversions are not charged to the gateway's scheduling group; and their BLAS (image resizing) runs on
    the calling thread, with no pool of BLAS threads per worker to take cores from the engine."""
    server = Server("--loop-slice-us", "200", "--loop-rt-priority", "0")
    try:
        gateway = server.proc.pid
        worker = _child(server, b"tokenmill.tokenizer_workers.worker")
        assert os.getsid(worker) != os.getsid(gateway) and os.getsid(worker) == worker
        with open(f"/proc/{worker}/environ", "rb") as f:
            assert b"OPENBLAS_NUM_THREADS=1" in f.read().split(b"\0")
        if not _kernel_takes_slices():
            pytest.skip("this kernel has no per-thread time slices (Linux 6.12+)")
        slices = _slices(gateway)
        assert slices.pop(gateway) == 200_000, slices
        assert slices and 200_000 not in slices.values(), slices  # ZeroMQ's and the loop's helper threads
        assert 200_000 not in _slices(worker).values()
    finally:
        server.stop()


def _policies(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread's scheduling policy and real-time priority."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = (os.sched_getscheduler(int(tid)), os.sched_getparam(int(tid)).sched_priority)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return out


def _comm(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        return f.read().strip()


def _group_nice(pid: int) -> int:
    """The niceness of the process's autogroup (/proc/PID/autogroup: "/autogroup-N nice K")."""
    with open(f"/proc/{pid}/autogroup") as f:
        return int(f.read().split()[-1])


def test_the_threads_that_move_streams_run_real_time_where_permitted_and_conversion_does_not():
    """By default the event-loop thread runs SCHED_FIFO at priority 1 where the gateway may (root or
    CAP_SYS_NICE here; the systemd unit's LimitRTPRIO=1), so it preempts an engine's threads at once, and
    so do ZeroMQ's threads, which carry its frames to and from the engine, and each worker's IO thread,
    which detokenizes every stream. The loop's other helper threads and the conversion threads stay
    SCHED_OTHER; each worker's scheduling group (its session) weighs more than an engine's
    (--worker-group-nice). Where real-time is not permitted, the loop falls back to the short slice
    (the test above) and nothing else changes."""
    probe = subprocess.run(
        [sys.executable, "-c", "from tokenmill.process.procutil import request_realtime as r; print(r(1))"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    server = Server("--loop-rt-priority", "1")
    try:
        gateway = server.proc.pid
        # before any request: pyzmq's zero-copy garbage collector later starts a thread and a context of
        # its own, which only frees sent buffers and stays SCHED_OTHER
        policies = _policies(gateway)
        loop = policies.pop(gateway)
        server.client().chat.completions.create(  # a long prompt: the conversion threads and their pool are up
            model="deepseek-v4", max_tokens=1, messages=[{"role": "user", "content": "word " * 20000}]
        )
        worker = _child(server, b"tokenmill.tokenizer_workers.worker")
        worker_policies = _policies(worker)
        if probe.stdout.strip() != "True":
            assert loop[0] & ~os.SCHED_RESET_ON_FORK == os.SCHED_OTHER
            assert set(worker_policies.values()) == {(os.SCHED_OTHER, 0)}
            pytest.skip("this process may not use SCHED_FIFO (no CAP_SYS_NICE, RLIMIT_RTPRIO 0)")
        assert loop == (os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, 1)  # what it starts runs SCHED_OTHER
        zmq_threads = {tid: p for tid, p in policies.items() if _comm(gateway, tid).startswith("ZMQbg/")}
        others = {tid: p for tid, p in policies.items() if tid not in zmq_threads}
        assert zmq_threads and set(zmq_threads.values()) == {(os.SCHED_FIFO, 1)}, zmq_threads
        assert all(policy == (os.SCHED_OTHER, 0) for policy in others.values()), others
        assert worker_policies.pop(worker) == (os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, 1)  # the IO thread
        converting = {tid: p for tid, p in worker_policies.items() if _comm(worker, tid).startswith("tm-convert")}
        assert len(converting) >= 2 and set(converting.values()) == {(os.SCHED_OTHER, 0)}, worker_policies
        if os.path.exists(f"/proc/{worker}/autogroup"):
            assert _group_nice(worker) == ServeSettings().worker_group_nice < 0 and _group_nice(gateway) == 0
        assert http("GET", server.url + "/health")[0] == 200
    finally:
        server.stop()


def test_worker_group_nice_zero_leaves_the_kernels_and_out_of_range_is_refused():
    server = Server("--worker-group-nice", "0")
    try:
        worker = _child(server, b"tokenmill.tokenizer_workers.worker")
        if not os.path.exists(f"/proc/{worker}/autogroup"):
            pytest.skip("this kernel has no autogroups")
        assert _group_nice(worker) == 0
    finally:
        server.stop()
    refused = Server("--worker-group-nice", "-21", ready=False)
    assert refused.proc.wait(60) != 0
    assert "worker_group_nice: -20 to 19" in refused.read_output()


def test_conversion_nice_out_of_range_is_refused_at_start():
    server = Server("--conversion-nice", "20", ready=False)
    assert server.proc.wait(60) != 0
    assert "conversion_nice: 0 to 19" in server.read_output()


def test_a_send_to_an_engine_that_does_not_read_fails_at_once_instead_of_waiting(tmp_path):
    """The gateway's loop never waits for the engine: with the queue to a scheduler that stopped reading
    full, a multipart Generate (header + prompt frame) raises zmq.Again on its first frame, whole or not
    at all, instead of blocking the loop until the engine reads."""
    import threading

    import zmq

    from tokenmill.transport.loop_socket import LoopSocket

    ctx = zmq.Context()
    engine = ctx.socket(zmq.ROUTER)  # binds and never reads, as an engine stuck in a long step
    engine.setsockopt(zmq.RCVHWM, 16)
    engine.bind(f"ipc://{tmp_path}/engine.sock")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 16)
    dealer.setsockopt(zmq.IMMEDIATE, 1)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"ipc://{tmp_path}/engine.sock")
    sock = LoopSocket(dealer, lambda frames: None)
    outcome: dict = {}

    def fill() -> None:
        sent = 0
        try:
            for _ in range(1_000_000):  # the kernel's socket buffers fill long before this
                sock.send([b"header", b"\0" * 65536])
                sent += 1
        except zmq.Again:
            outcome["again_after"] = sent

    for _ in range(100):  # the connection is up once the engine has read one message (IMMEDIATE queues none before)
        try:
            dealer.send(b"hello", zmq.NOBLOCK)
            break
        except zmq.Again:
            time.sleep(0.05)
    assert engine.poll(10_000), "the engine never heard from the gateway"
    engine.recv_multipart()
    filler = threading.Thread(target=fill, daemon=True)
    filler.start()
    filler.join(60)
    try:
        assert not filler.is_alive(), "a send blocked the caller"
        assert outcome.get("again_after", 0) > 0, outcome
    finally:
        dealer.close(0)
        engine.close(0)
        ctx.term()


def _thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def test_tokenizer_threads_size_each_workers_pool_and_default_to_the_cpus_less_one():
    """The tokenizers pool is born by the first conversion thread (it inherits its name, tm-convert-0):
    with --tokenizer-threads 3 a worker converting a long prompt runs 3 pool threads beside its 2
    conversion threads; by default, one per CPU allowed less one, which stays the engine's."""
    sized = Server("--tokenizer-threads", "3", "--conversion-threads", "2")
    default = Server("--conversion-threads", "1", env={"RAYON_NUM_THREADS": ""})
    try:
        counts = {}
        for name, server in (("sized", sized), ("default", default)):
            server.client().chat.completions.create(
                model="deepseek-v4", max_tokens=1, messages=[{"role": "user", "content": "word " * 20000}]
            )
            worker = _child(server, b"tokenmill.tokenizer_workers.worker")
            counts[name] = sum(n.startswith("tm-convert") for n in _thread_names(worker))
        assert counts["sized"] == 2 + 3, counts
        assert counts["default"] == 1 + max(1, len(os.sched_getaffinity(0)) - 1), counts
    finally:
        sized.stop()
        default.stop()
    refused = Server("--tokenizer-threads", "-1", ready=False)
    assert refused.proc.wait(60) != 0
    assert "tokenizer_threads" in refused.read_output()
