"""A process that starts processes of its own (tokenmill engine, whose vLLM or SGLang starts
engine-core and worker processes) takes them along when it is killed, even by kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import ROOT

ENGINE_LIKE = textwrap.dedent("""
    import subprocess, sys, time
    from tokenmill.process.procutil import take_descendants_along
    take_descendants_along(0.2)
    # like an engine library's worker: its own session, nobody asked the kernel to kill it with us
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_descendants_die_with_a_process_killed_by_sigkill():
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_LIKE], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(engine.stdout.readline())
    try:
        time.sleep(1.0)  # the watcher has looked at least once
        assert _alive(child)
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the worker of a killed engine lived on"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        engine.stdout.close()
