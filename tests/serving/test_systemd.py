"""deploy/systemd: the units pass `systemd-analyze verify` and `security`, their settings fit
tokenmill's, and a real `tokenmill serve` speaks the notify protocol a Type=notify unit needs.

systemd-analyze comes from Debian's `systemd` package; scripts/test.sh installs it when it is
missing and the suite runs as root. Outside CI, a machine without it skips those checks.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, Server, http

from tokenmill import settings as settings_mod
from tokenmill.gateway.settings import ServeSettings
from tokenmill.process import systemd_notify

UNITS_DIR = ROOT / "deploy" / "systemd"
UNITS = sorted(UNITS_DIR.glob("*.service"))
INSTALLED_EXE = "/opt/tokenmill/.venv/bin/tokenmill"


# ---- helpers ---------------------------------------------------------------------------------


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        message = "systemd-analyze is missing (Debian package systemd; scripts/test.sh installs it as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def tokenmill_exe() -> str:
    """The `tokenmill` script of the environment running the tests (verify wants ExecStart to exist)."""
    exe = Path(sys.executable).with_name("tokenmill")
    if not exe.exists():
        found = shutil.which("tokenmill")
        assert found, "the tokenmill console script is not installed (pip install -e .)"
        exe = Path(found)
    return str(exe)


def local_copy(unit: Path, directory: Path, text: str | None = None) -> Path:
    """The unit with its ExecStart pointed at this environment's tokenmill, under the same name."""
    text = unit.read_text() if text is None else text
    copy = directory / unit.name
    copy.write_text(text.replace(INSTALLED_EXE, tokenmill_exe()))
    return copy


def verify_problems(unit: Path) -> list[str]:
    """Every line `systemd-analyze verify` prints about the unit, plus its exit status if non-zero.

    verify exits 0 for unknown keys and unparsable values ("ignoring"), so any output at all counts.
    """
    proc = subprocess.run(
        [systemd_analyze(), "verify", "--man=no", "--recursive-errors=no", unit.name],
        cwd=unit.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    if proc.returncode != 0:
        lines.append(f"systemd-analyze verify exited with {proc.returncode}")
    return lines


def security_exposure(unit: Path, threshold: int = 25) -> tuple[bool, str]:
    """(exposure within threshold, summary line); threshold is tenths: 25 means 2.5, still "OK"."""
    proc = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", f"--threshold={threshold}", "--no-pager", unit.name],
        cwd=unit.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = [line for line in proc.stdout.splitlines() if "Overall exposure level" in line]
    return proc.returncode == 0, (summary[-1] if summary else proc.stdout + proc.stderr)


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values in order (keys like SystemCallFilter= may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: not a setting: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(span: str) -> float:
    """A systemd time span ("60s", "1min 30s", "90") in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * units[unit or "s"]
    return total


def env_file(path: Path, include_commented: bool = False) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile (with commented-out examples when asked)."""
    values = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if include_commented and re.match(r"#\s*TOKENMILL_\w+=", line):
            line = line.lstrip("#").strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {raw!r}"
        values.setdefault(key.strip(), value.strip().strip('"'))
    return values


# ---- systemd-analyze -------------------------------------------------------------------------


def test_units_exist():
    assert {u.name for u in UNITS} >= {"tokenmill.service", "tokenmill-scheduler.service"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_verifies_clean(unit, tmp_path):
    problems = verify_problems(local_copy(unit, tmp_path))
    assert problems == [], "systemd-analyze verify:\n" + "\n".join(problems)


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_is_hardened(unit, tmp_path):
    ok, summary = security_exposure(local_copy(unit, tmp_path))
    assert ok, f"exposure above 2.5: {summary}"


@pytest.mark.parametrize(
    "breakage",
    [
        ("[Service]\n", "[Service]\nRestartOnTuesdays=yes\n"),  # unknown key: verify still exits 0
        ("Restart=on-failure", "Restart=sometimes"),  # unparsable value: "ignoring", exit 0
        ("KillMode=mixed", "KillMode=gently"),
        ("LimitNOFILE=65536", "LimitNOFILE=lots"),
        (INSTALLED_EXE, "/nonexistent/bin/tokenmill"),  # ExecStart that cannot run
    ],
    ids=["unknown-key", "bad-restart", "bad-killmode", "bad-limit", "missing-exec"],
)
def test_verify_check_catches_broken_unit(breakage, tmp_path):
    unit = UNITS_DIR / "tokenmill.service"
    old, new = breakage
    text = unit.read_text()
    assert old in text
    # replace after pointing ExecStart at the venv, so "missing-exec" really is missing
    copy = local_copy(unit, tmp_path)
    copy.write_text(copy.read_text().replace(old.replace(INSTALLED_EXE, tokenmill_exe()), new, 1))
    assert verify_problems(copy), "a broken unit passed the check"


def test_security_check_catches_unhardened_unit(tmp_path):
    unit = UNITS_DIR / "tokenmill.service"
    text = unit.read_text()
    bare = text[: text.index("NoNewPrivileges=yes")] + text[text.index("[Install]") :]
    copy = local_copy(unit, tmp_path, bare)
    assert verify_problems(copy) == []
    ok, summary = security_exposure(copy)
    assert not ok, f"an unhardened unit passed: {summary}"


# ---- what the units say, against what tokenmill does -----------------------------------------


def test_gateway_unit_settings():
    unit = parse_unit(UNITS_DIR / "tokenmill.service")
    service = {k: v[-1] for k, v in unit["Service"].items()}
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "Restart": "on-failure",
        "KillMode": "mixed",
        "User": "tokenmill",
        "Group": "tokenmill",
        "RuntimeDirectory": "tokenmill",
        "RuntimeDirectoryMode": "0700",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }
    assert {k: service.get(k) for k in expected} == expected
    assert int(service["LimitNOFILE"]) >= 65536
    assert seconds(service["RestartSec"]) > 0
    assert 2 <= seconds(service["WatchdogSec"]) <= 120
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # the event loop may run real-time at its default priority (gateway/settings.py loop_rt_priority)
    assert int(service["LimitRTPRIO"]) >= ServeSettings().loop_rt_priority >= 1
    assert service.get("RestrictRealtime", "no") == "no"
    # the workers may lower their scheduling group's niceness as far as the default asks
    assert int(service["LimitNICE"]) <= ServeSettings().worker_group_nice < 0
    # libzmq aborts if sched_setscheduler() fails, so @resources must stay allowed
    assert not any("@resources" in f and f.startswith("~") for f in unit["Service"].get("SystemCallFilter", []))

    argv = shlex.split(service["ExecStart"])
    assert argv[:2] == [INSTALLED_EXE, "serve"]
    parser = argparse.ArgumentParser()
    settings_mod.add_arguments(parser)
    args = parser.parse_args(argv[2:])
    assert args.config == "/etc/tokenmill/tokenmill.toml"
    assert unit["Service"]["EnvironmentFile"] == ["-/etc/tokenmill/tokenmill.env"]


def test_examples_are_valid_settings_and_fit_the_unit(tmp_path):
    """The example files load as `tokenmill serve` would load them, and stopping has time to drain."""
    env_example = UNITS_DIR / "tokenmill.env.example"
    toml_example = UNITS_DIR / "tokenmill.toml.example"
    known = {"TOKENMILL_" + name.upper() for name in settings_mod.OPTIONS}
    everything = env_file(env_example, include_commented=True)
    assert set(everything) <= known, f"unknown variables: {sorted(set(everything) - known)}"

    parser = argparse.ArgumentParser()
    settings_mod.add_arguments(parser)
    args = parser.parse_args(["--config", str(toml_example)])
    settings = settings_mod.resolve(args, environ=env_file(env_example))
    assert settings.host == "0.0.0.0" and settings.port == 8000

    # the commented-out model lines must be valid too once an operator uncomments them
    uncommented = re.sub(r"(?m)^#(\w+ = )", r"\1", toml_example.read_text())
    (tmp_path / "t.toml").write_text(uncommented)
    full = settings_mod.resolve(parser.parse_args(["--config", str(tmp_path / "t.toml")]), environ={})
    assert full.served_model_name and full.max_model_len

    service = {k: v[-1] for k, v in parse_unit(UNITS_DIR / "tokenmill.service")["Service"].items()}
    # drain, then up to 5 s to stop the simulator and workers, then a margin
    assert seconds(service["TimeoutStopSec"]) >= settings.shutdown_timeout + 15
    assert seconds(service["TimeoutStartSec"]) > 120  # Gateway.wait_ready gives up after 120 s


def test_scheduler_unit_matches_its_endpoint():
    unit = parse_unit(UNITS_DIR / "tokenmill-scheduler.service")
    service = {k: v[-1] for k, v in unit["Service"].items()}
    argv = shlex.split(service["ExecStart"])
    assert argv[:2] == [INSTALLED_EXE, "simulate-scheduler"]
    from tokenmill.engines import simulated

    parser = argparse.ArgumentParser()
    simulated.add_arguments(parser)
    parser.parse_args(argv[2:])  # the flags still exist
    endpoint = argv[argv.index("--bind") + 1]
    assert endpoint == f"ipc:///run/{service['RuntimeDirectory']}/scheduler.sock"
    assert "TOKENMILL_SCHEDULER=" + endpoint in (UNITS_DIR / "tokenmill.env.example").read_text()


# ---- the notify protocol, through a real NOTIFY_SOCKET ---------------------------------------


class NotifyListener:
    """The systemd side of sd_notify: an AF_UNIX datagram socket read by a thread, as PID 1 reads it.

    Reading promptly matters: the kernel queues only net.unix.max_dgram_qlen (often 10)
    datagrams, and the sender blocks once they are unread.
    """

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tm-notify-", dir="/tmp")  # sun_path is 108 bytes at most
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.changed = threading.Condition()
        self.reading = threading.Event()
        self.reading.set()
        self.closed = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.closed:
            if not self.reading.wait(0.05):
                continue
            try:
                data = self.sock.recv(4096)
            except (socket.timeout, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self.changed:
                self.messages.append((time.monotonic(), fields))
                self.changed.notify_all()

    def wait_for(self, key: str, timeout: float, since: float = 0.0) -> dict[str, str] | None:
        """The first message with key (received at or after since), waiting up to timeout."""
        with self.changed:
            self.changed.wait_for(lambda: self.find(key, since) is not None, timeout)
            return self.find(key, since)

    def find(self, key: str, since: float = 0.0) -> dict[str, str] | None:
        return next((m for at, m in self.messages if key in m and at >= since), None)

    def count(self, key: str, since: float = 0.0) -> int:
        with self.changed:
            return sum(1 for at, m in self.messages if key in m and at >= since)

    def close(self):
        self.closed = True
        self.reading.set()
        self.thread.join(5)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_notify_ready_watchdog_stopping(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    listener = NotifyListener()
    srv = Server("--workers", "1", ready=False, env={"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "200000"})
    try:
        ready = listener.wait_for("READY", timeout=90)
        if ready is None:
            srv.stop()
            pytest.fail(f"no READY=1 within 90 s:\n{srv.read_output()}")
        # READY=1 means serving: /ready must already say so
        status, _, body = http("GET", srv.url + "/ready", timeout=5)
        assert status == 200 and body["ready"] is True, body
        assert ready["READY"] == "1"
        assert ready.get("MAINPID") == str(srv.proc.pid)
        assert "serving" in ready.get("STATUS", "")
        assert listener.count("STOPPING") == 0

        # WATCHDOG_USEC=200000: a pet every 0.1 s from the event loop
        ready_at = time.monotonic()
        time.sleep(1.5)
        pets = listener.count("WATCHDOG", since=ready_at)
        assert pets >= 5, f"only {pets} WATCHDOG=1 in 1.5 s"
        assert all(m["WATCHDOG"] == "1" for _, m in listener.messages if "WATCHDOG" in m)

        srv.proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for("STOPPING", timeout=10)
        assert stopping is not None and stopping["STOPPING"] == "1"
        try:
            code = srv.proc.wait(timeout=40)  # idle: no drain to wait for
        except subprocess.TimeoutExpired:
            srv.stop(timeout=1)
            pytest.fail(f"tokenmill still running 40 s after SIGTERM:\n{srv.read_output()[-4000:]}")
        assert code == 0, srv.read_output()[-4000:]
        assert listener.count("READY") == 1
    finally:
        srv.stop()
        listener.close()


def test_watchdog_pid_of_another_process_means_no_pets(monkeypatch):
    """systemd sets WATCHDOG_PID to the main PID; children and other processes must not pet."""
    listener = NotifyListener()
    env = {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}
    srv = Server("--workers", "1", ready=False, env=env)
    try:
        assert listener.wait_for("READY", timeout=90) is not None, "no READY=1 within 90 s"
        time.sleep(0.5)
        assert listener.count("WATCHDOG") == 0
    finally:
        srv.stop()
        listener.close()


def test_a_slow_notify_reader_does_not_stall_the_loop(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    listener = NotifyListener()
    srv = Server("--workers", "1", ready=False, env={"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "200000"})
    try:
        assert listener.wait_for("READY", timeout=90) is not None, "no READY=1 within 90 s"
        listener.reading.clear()  # PID 1 busy (daemon-reload, a storm of units): nobody reads
        time.sleep(2.5)  # 25 pets due; the kernel queues max_dgram_qlen of them
        try:
            status = http("GET", srv.url + "/health", timeout=3)[0]
        except OSError as exc:
            status = repr(exc)
        assert status == 200, f"/health while the notify socket was not read: {status}"
    finally:
        listener.reading.set()
        srv.stop()
        listener.close()


def test_no_notifications_without_systemd(monkeypatch):
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    assert systemd_notify.notify("READY=1") is False
    assert systemd_notify.watchdog_interval() is None


def test_watchdog_is_for_the_main_pid_only():
    assert systemd_notify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    mine = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert systemd_notify.watchdog_interval(mine) == 15.0
    other = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert systemd_notify.watchdog_interval(other) is None


def test_notify_abstract_socket():
    name = f"tokenmill-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert systemd_notify.notify("STATUS=hello", {"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(100) == b"STATUS=hello"
