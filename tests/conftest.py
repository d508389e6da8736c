"""Shared test helpers: real `tokenmill serve` processes on loopback (on the benchmarks' process handle,
tokenmill/bench/servers.py), and the shared fixtures folder."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import parallel
import pytest

from tokenmill.bench.common import free_port
from tokenmill.bench.servers import ProcessHandle

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures"


KINDS = ("unit", "serving", "bench", "engines")  # the folders under tests/, one marker each


def pytest_collection_modifyitems(config, items) -> None:
    """Each test is marked with its folder's kind: unit (no process that serves), serving (tokenmill with
    the simulated scheduler), bench (benchmarks run end to end), engines (real engines, vLLM's oracles)."""
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))
        if hasattr(getattr(item, "module", None), "start_early") and not parallel.pinned(item.nodeid):
            raise pytest.UsageError(
                f"{item.nodeid}: its module starts something early, so it must run on the worker that does "
                "(tests/parallel.py pins tests/engines/*vllm* modules to it)"
            )


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``-n N --dist loadscope`` (what ./scripts/test.sh runs): modules for units, the vLLM modules
    one unit on gw0 (tests/parallel.py)."""
    if config.getvalue("dist") == "loadscope":
        return parallel.ModuleScheduling(config, log)
    return None


def pytest_collection_finish(session) -> None:
    """Test modules with something slow to start (test_output_parsers_vs_vllm: vLLM's parsers;
    test_vllm_engine and test_vllm_field_parity: the two vLLMs they share, tests/vllm_stack.py) start
    it now, so it loads while the tests before them run. Under xdist only gw0 runs those modules."""
    if not parallel.starts_shared_processes():
        return
    modules = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_early"):
            modules.setdefault(module, []).append(item)
    for module, items in modules.items():
        module.start_early(items)


def pytest_sessionfinish(session) -> None:
    """The shared vLLM stack stops when its last module is done; this catches a run stopped before that."""
    stack = sys.modules.get("vllm_stack")
    if stack is not None and stack.EARLY.procs:
        stack.shutdown()
    for module in {
        getattr(item, "module", None) for item in getattr(session, "items", ())
    }:  # test_vllm_images' own two vLLMs
        if module is not None and hasattr(module, "stop_early"):
            module.stop_early()


def run_bench(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[dict, str]:
    """`tokenmill bench ARGS --json FILE` in its own process: (the JSON report, what it printed)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "bench", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    report = json.loads(out.read_text())
    problems = insane_figures(report)
    assert not problems, "figures that cannot be right:\n" + "\n".join(problems)
    return report, proc.stdout


def insane_figures(report, path: str = "report") -> list[str]:
    """What no measurement can give, wherever it stands in a bench report: a latency, duration, share or
    rate below zero, or percentiles out of order (p50 <= p90 <= p99 <= max of one figure)."""
    problems = []
    if isinstance(report, dict):
        for key, value in report.items():
            where = f"{path}.{key}"
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if value != value:
                    problems.append(f"{where} is NaN")
                elif key.endswith(("_ms", "_s", "_per_s", "_share", "_ratio", "_mib")) and value < 0:
                    problems.append(f"{where} = {value} < 0")
            else:
                problems += insane_figures(value, where)
        for key in [k for k in report if "p99" in k]:  # gap_p99_ms, p99_ms, ...
            head, tail = key.split("p99", 1)
            ordered = [
                (name, report[name])
                for name in (f"{head}p50{tail}", f"{head}p90{tail}", key, f"{head}max{tail}")
                if isinstance(report.get(name), (int, float))
            ]
            for (a, x), (b, y) in zip(ordered, ordered[1:]):
                if x > y * 1.0001 + 1e-9:
                    problems.append(f"{path}: {a} = {x} > {b} = {y}")
    elif isinstance(report, list):
        for i, item in enumerate(report):
            problems += insane_figures(item, f"{path}[{i}]")
    return problems


def http(method: str, url: str, body=None, headers=None, timeout: float = 30.0):
    """(status, headers, parsed JSON or raw bytes) without raising on 4xx/5xx."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, hdrs = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        raw, status, hdrs = err.read(), err.code, dict(err.headers)
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw


class Server(ProcessHandle):
    """A `tokenmill serve` subprocess in its own session, its output on a pipe; stop() sends SIGTERM and waits."""

    TAIL = 1 << 30  # a failure quotes everything it wrote

    def __init__(self, *args: str, env: dict | None = None, ready: bool = True, timeout: float = 90.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *args]
        self.workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
        super().__init__(
            "tokenmill",
            [sys.executable, "-m", "tokenmill.cli", "serve", *self.args],
            pipe=True,
            env=env or {},
            cwd=ROOT,
            new_session=True,
        )
        if ready:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 90.0) -> None:
        def ready() -> bool:
            status, _, body = http("GET", self.url + "/ready", timeout=2)
            # at least its own workers: a remote worker may join before they are all ready
            return status == 200 and body["workers_alive"] >= self.workers

        self.wait_until(ready, timeout, interval=0.02)

    def read_output(self) -> str:
        return self.output()

    def client(self, **kw):
        import openai

        # plain HTTP on loopback: without verify=False each client loads the CA bundle, ~30 ms of CPU
        kw.setdefault("http_client", openai.DefaultHttpxClient(verify=False))
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw
        )

    def async_client(self, **kw):
        import openai

        kw.setdefault("http_client", openai.DefaultAsyncHttpxClient(verify=False))
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw
        )

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def stop(self, timeout: float = 30.0) -> int:
        return super().stop(timeout)


@pytest.fixture(scope="session")
def server():
    """The default model on the simulated scheduler, fast decode, small limits for the bad-input tests."""
    srv = Server(
        "--workers",
        "2",
        "--sim-inter-token-latency-ms",
        "1",
        "--max-model-len",
        "8192",
        "--max-body-bytes",
        str(1 << 20),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def echo_server():
    """The simulated scheduler echoes prompt tokens: outputs are known in advance."""
    srv = Server("--workers", "1", "--sim-mode", "echo", "--sim-inter-token-latency-ms", "0")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def default_tokenizer():
    from tokenmill.tokenizer_workers.model import load_model

    return load_model(None).tokenizer


def require_shared() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"{FIXTURES} is absent (a user's clone has no ../shared); CI always has it")
    return FIXTURES
