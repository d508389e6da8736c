"""Process handles for the benchmarks and the test suite: a subprocess with its output kept, a
readiness wait that notices the process dying, and a stop that leaves nothing behind; and
``tokenmill serve`` with the simulated scheduler as the benchmarks start it. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from tokenmill.bench.common import free_port, try_get

ROOT = Path(__file__).resolve().parents[2]


class ProcessHandle:
    """A subprocess whose output (stdout and stderr together) goes to ``log`` (a file, appended), to a
    pipe (``pipe=True``: read once it has exited), or to an anonymous temporary file. ``quiet_stdout``
    discards stdout and keeps stderr. ``new_session``: its own process group, which stop() can end whole."""

    TAIL = 4000  # characters of output an error message quotes

    def __init__(
        self,
        name: str,
        args: list[str],
        *,
        log: Path | None = None,
        pipe: bool = False,
        quiet_stdout: bool = False,
        env: dict | None = None,
        cwd: Path | str | None = None,
        new_session: bool = False,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log
        self.new_session = new_session
        self._log = None
        self._piped: list[str] = []
        if pipe:
            stdout, stderr = subprocess.PIPE, subprocess.STDOUT
        else:
            self._log = open(log, "ab") if log is not None else tempfile.TemporaryFile()
            stdout, stderr = (subprocess.DEVNULL, self._log) if quiet_stdout else (self._log, subprocess.STDOUT)
        self.proc = subprocess.Popen(
            args,
            cwd=cwd,
            env=None if env is None else {**os.environ, **env},
            stdout=stdout,
            stderr=stderr,
            text=pipe or None,
            start_new_session=new_session,
            preexec_fn=preexec_fn,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """What the process has written (with a pipe: nothing until it has exited)."""
        if self._log is None:
            if self.proc.poll() is not None and self.proc.stdout and not self.proc.stdout.closed:
                self._piped.append(self.proc.stdout.read())
            return "".join(self._piped)
        if self.log_path is not None:
            try:
                return self.log_path.read_text(errors="replace")
            except OSError:
                return ""
        try:
            self._log.seek(0)
            return self._log.read().decode(errors="replace")
        except (OSError, ValueError):  # closed
            return ""

    def tail(self) -> str:
        return self.output()[-self.TAIL :]

    def check_alive(self) -> None:
        """Raise RuntimeError, with the output's tail, if the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def wait_until(self, ready: Callable[[], bool], timeout: float, interval: float = 0.2) -> None:
        """Poll ``ready()`` until it is true; a ``ready`` that cannot connect yet (OSError, HTTPException,
        ValueError) counts as not ready. Raises RuntimeError, after stopping the process, when it
        exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if ready():
                    return
            except (OSError, ValueError, http.client.HTTPException):
                pass
            time.sleep(interval)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready within {timeout:g} s:\n{self.tail()}")

    def stop(self, timeout: float = 30.0, *, leftovers: bool = False) -> int | None:
        """SIGTERM, then SIGKILL (to the whole group where it has one) if it has not exited after
        ``timeout`` s. ``leftovers``: SIGKILL its group afterwards in any case, for what it started and
        left behind. Returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
                self.proc.wait()
        if leftovers:
            self._kill()
            if self.proc.poll() is None:
                self.proc.wait(10)
        self.output()  # a pipe is read now, before it closes
        if self._log is not None and self.log_path is not None:
            self._log.close()
        return self.proc.returncode

    def _kill(self) -> None:
        try:
            if self.new_session:  # the group outlives its reaped leader while anything in it runs
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass


class ServeProcess(ProcessHandle):
    """``tokenmill serve`` in one conversion mode with the simulated scheduler (``itl_ms`` between tokens,
    prefill free), as the benchmarks start it, ready when constructed; ``model`` is the served name."""

    def __init__(self, mode: str, workers: int | None, itl_ms: float, extra: tuple = ()) -> None:
        self.port = free_port()
        args = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--port",
            str(self.port),
            "--conversion-mode",
            mode,
            "--sim-inter-token-latency-ms",
            str(itl_ms),
            "--sim-prefill-tokens-per-s",
            "1e12",
            "--log-level",
            "warning",
            "--max-queued-conversions",
            "100000",
        ]
        if workers and mode == "pool":
            args += ["--workers", str(workers)]
        args += list(extra)
        super().__init__(f"tokenmill serve ({mode})", args, quiet_stdout=True)
        self.wait_until(lambda: self.get("/ready")[0] == 200, 120, interval=0.02)
        self.model = self.get("/v1/models")[1]["data"][0]["id"]

    def get(self, path: str):
        """(status, the JSON answer parsed, or its raw bytes), or (None, None) where nothing answered."""
        status, data = try_get(self.port, path)
        if status is None:
            return None, None
        return status, json.loads(data) if data.startswith(b"{") else data

    def close(self) -> None:
        self.stop(30)
