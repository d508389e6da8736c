"""The vLLM stack the vLLM-backed test modules share (tests/engines/test_vllm_engine.py,
tests/engines/test_vllm_field_parity.py, tests/engines/test_vllm_responses_parity.py,
tests/engines/test_vllm_failover.py, among others): one tiny random-weight Llama (tokenmill/tiny_model.py) served by vLLM's
own OpenAI server and by `tokenmill engine --backend vllm` behind `tokenmill serve`.

It is started once per test session, as soon as pytest has collected the tests (conftest calls each
module's start_early), and stopped when the last module that uses it releases it (each module's
`stack` fixture: `stack = vllm_stack.module_fixture()`), or at the end of the session (conftest's
pytest_sessionfinish calls shutdown) if a module never got to it.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from conftest import ROOT, Server, free_port, http
from tokenizers import Tokenizer
from vllm_env import VLLM_PYTHON

NAME = "tiny-llama"
MAX_MODEL_LEN = 4096
VOCAB = 129280
EOS, EOS_TEXT = 1, "<｜end▁of▁sentence｜>"
STARTUP_TIMEOUT = 420.0  # each vLLM start takes ~40 s here, ~2 min when compiling; leave room for a busy machine
MAKE_MODEL = ["-m", "tokenmill.tiny_model"]

# Identical engine settings in both vLLMs. enforce_eager skips torch.compile (a minute of start-up
# on 2 cores); without a prefix cache a request's numerics do not depend on earlier requests.
# enable_log_requests: the engine log (shown when a test fails) lists every request vLLM adds and ends.
# The output parsers that fit the tiny model's chat template (tokenmill's default), on both sides: deepseek_v3
# reasons only when the template's thinking is on (vLLM's deepseek_r1, which `auto` picks in tokenmill, takes a
# whole non-streamed answer for reasoning whatever the prompt says), so that tool calls and reasoning are parsed alike; --enable-scale-out adds vLLM's
# /v1/messages/render and /v1/responses/render (the prompt token IDs the agent-API parity rows compare).
PARSERS = ["--tool-call-parser", "deepseek_v31", "--reasoning-parser", "deepseek_v3"]
VLLM_SERVER_FLAGS = [
    "--enforce-eager",
    "--no-enable-prefix-caching",
    "--enable-auto-tool-choice",
    "--enable-scale-out",
    # ordered by priority (equal priorities: first come first served, as by default), so that a request's
    # priority has an effect on this server and `tokenmill serve --engine-url` passes it on when told so
    "--scheduling-policy",
    "priority",
    *PARSERS,
]
ENGINE_FLAGS = [
    "--engine-arg",
    "enforce_eager=true",
    "--engine-arg",
    "enable_prefix_caching=false",
    "--engine-arg",
    "enable_log_requests=true",
]
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: 2M tokens of this model's cache, plenty
    # the model runs inside the engine-core process, not in a worker process of its own: vLLM's CPU build
    # otherwise starts one, and the two wait for each other spinning (shm_broadcast's busy loop), so a
    # request cost twice the CPU (measured: 22.6 CPU-s for 1,000 tokens instead of 34.3, a start 41 instead
    # of 55); on this suite's 2-core machine that CPU is the other tests' time. Outputs are the same.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",  # as vLLM's worker process binds it here: one thread (the tiny model gains nothing from two)
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",  # vLLM logs to stdout: the tests read the log file as it grows
}


# ---- processes ------------------------------------------------------------------------------------


_PRCTL = ctypes.CDLL(None).prctl  # looked up here: the child, between fork and exec, only calls it


def _die_with_the_tests(nice: int) -> None:
    """In the child, before exec: SIGTERM when the test process dies (even by SIGKILL), so that a killed
    pytest leaves no vLLM behind (SIGTERM lets vLLM stop its own engine-core and worker processes); and
    the CPU priority asked for."""
    _PRCTL(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if nice:
        os.nice(nice)


class Proc:
    """A vLLM-venv subprocess in its own process group (vLLM's engine-core and worker processes
    included), logging to a file; stop() ends the whole group."""

    def __init__(self, args: list[str], log_path: Path, nice: int = 0, env: dict | None = None) -> None:
        self.log_path = log_path
        self._terminated = False
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, **VLLM_ENV, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: _die_with_the_tests(nice),
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.log()[-6000:]}")

    def terminate(self) -> None:
        """SIGTERM, once: stop() waits for it to take effect."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group: vLLM's children, orphans of a killed parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class VLLMServer(Proc):
    def __init__(self, model: Path, log_path: Path, nice: int = 0, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            [
                str(VLLM_PYTHON),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--served-model-name",
                NAME,
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *VLLM_SERVER_FLAGS,
                *extra,
            ],
            log_path,
            nice,
        )

    def ready(self) -> bool:
        self.check_alive("vLLM's server")
        try:
            return http("GET", self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)


class Engine(Proc):
    def __init__(self, model: Path, endpoint: str, log_path: Path, nice: int = 0) -> None:
        self.endpoint = endpoint
        self._seen = len(log_path.read_text(errors="replace")) if log_path.exists() else 0  # a restart appends
        super().__init__(
            [
                str(VLLM_PYTHON),
                "-m",
                "tokenmill.cli",
                "engine",
                "--backend",
                "vllm",
                "--model",
                str(model),
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--bind",
                endpoint,
                "--stats-interval-s",
                "0.2",
                *ENGINE_FLAGS,
            ],
            log_path,
            nice,
        )

    def ready(self) -> bool:
        self.check_alive("tokenmill engine --backend vllm")
        return "listening on" in self.log()[self._seen :]


def wait_all(*procs, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        pending = [p for p in pending if not p.ready()]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f} s:\n" + "\n".join(p.log()[-4000:] for p in pending))
        time.sleep(0.5)


def front_end(model: Path, *engine: str) -> Server:
    """`tokenmill serve` of the stack's model with the stack's settings, in front of ``engine`` (its flags)."""
    return Server(
        "--model", str(model), *engine, "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
        "--workers", "1", *PARSERS, timeout=120,
    )  # fmt: skip


@dataclass
class Stack:
    dir: Path
    model: Path
    vllm: VLLMServer
    engine: Engine
    front: Server
    tokenizer: Tokenizer
    started_s: float
    standby: Engine | None = None  # a second engine, started with the stack, for the kill test to bring in
    lora: VLLMServer | None = None  # a second vLLM server with a LoRA adapter (LORA), for the LoRA test
    _http_front: Server | None = None

    def __post_init__(self) -> None:
        self.v = self.vllm.client()  # one client each: their connections are reused
        self.t = self.front.client()

    @property
    def http_front(self) -> Server:
        """`tokenmill serve --engine-url` in front of the stack's own vLLM server (its token-in API,
        --enable-scale-out), with the same settings as `front`; started on first use."""
        if self._http_front is None:
            self._http_front = front_end(
                self.model, "--engine-url", self.vllm.url, "--engine-scheduling-policy", "priority"
            )
            EARLY.procs.append(self._http_front)
        return self._http_front


#: the LoRA adapter's name, and the test that starts a vLLM server serving it (acquire)
LORA = "tiny-sql"
LORA_TEST = "test_a_lora_adapter_of_the_server_is_a_model_here_answering_as_vllm"


def make_lora_adapter(path: Path) -> Path:
    """A rank-8 LoRA adapter (PEFT's files) for the tiny model's attention, random and large enough that
    its outputs differ from the base model's."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    tensors = {}
    for layer in range(2):
        for proj, (inputs, outputs) in {"q_proj": (128, 128), "v_proj": (128, 64), "o_proj": (128, 128)}.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[prefix + ".lora_A.weight"] = (rng.standard_normal((8, inputs)) * 0.5).astype(np.float32)
            tensors[prefix + ".lora_B.weight"] = (rng.standard_normal((outputs, 8)) * 0.5).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**config, "bias": "none", "task_type": "CAUSAL_LM"}))
    return path


#: sampling defaults in the stack's generation_config.json, as real models ship them: vLLM's servers apply
#: them to a request that leaves them out, and so must tokenmill (the greedy rows then differ from the
#: model's plain argmax: a repetition penalty changes them; top_k and top_p leave greedy choices alone)
SAMPLING_DEFAULTS = {"repetition_penalty": 1.3, "top_k": 3, "top_p": 0.9}


def _add_sampling_defaults(model: Path) -> None:
    path = model / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **SAMPLING_DEFAULTS}, indent=2))


class _EarlyStart:
    """Makes the model and starts both vLLMs while the test modules before this one run (conftest
    calls start_early once collection is done): a vLLM start is ~40 s, mostly imports, and the
    earlier tests leave much of the machine idle while they wait for servers and sockets.

    They start at a lower CPU priority, so that they take the CPU the other tests leave idle rather
    than slow them down (a test process may raise its children's nice value, not lower it again).
    The starting happens in a thread that lives as long as the processes do: PR_SET_PDEATHSIG (see
    _die_with_the_tests) fires when the thread that started a child ends, not the process."""

    NICE = 10

    def __init__(self) -> None:
        self.standby = False  # the kill test will want a replacement engine
        self.lora = False  # the LoRA test will want a server with an adapter
        self.users: set[str] = set()  # the modules whose tests use the stack (start_early), until they release it
        self.stack: Stack | None = None
        self.t0 = 0.0
        self.thread: threading.Thread | None = None
        self.started = threading.Event()
        self.finished = threading.Event()
        self.root: Path | None = None
        self.procs: list = []
        self.error: BaseException | None = None

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="vllm-stack", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self.root = Path(tempfile.mkdtemp(prefix="tmvllm-"))  # short: ipc paths are limited to ~100 bytes
            model = self.root / NAME
            made = subprocess.run(
                ["nice", "-n", str(self.NICE), str(VLLM_PYTHON), *MAKE_MODEL, str(model)],
                cwd=ROOT,
                env={**os.environ, **VLLM_ENV},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert made.returncode == 0, f"tokenmill.tiny_model failed:\n{made.stdout}{made.stderr}"
            _add_sampling_defaults(model)
            self.procs.append(VLLMServer(model, self.root / "vllm.log", nice=self.NICE))
            self.procs.append(Engine(model, f"ipc://{self.root}/engine.sock", self.root / "engine.log", nice=self.NICE))
        except BaseException as exc:  # the fixture raises it
            self.error = exc
        finally:
            self.started.set()
        self.finished.wait()  # keep the processes' parent-death signal armed until they are stopped

    def take(self) -> tuple[Path, list]:
        self.start()  # not yet started when this module's tests were picked some other way
        self.started.wait()
        return self.root, self.procs


EARLY = _EarlyStart()


def start_early(items) -> None:
    """Called by conftest once collection is done, once per module that uses the stack (see _EarlyStart):
    the stack is started once, and stopped when the last of those modules is done with it (release)."""
    EARLY.standby = EARLY.standby or any(item.name == "test_engine_killed_mid_stream_then_restarted" for item in items)
    EARLY.lora = EARLY.lora or any(item.name == LORA_TEST for item in items)
    EARLY.users |= {item.module.__name__ for item in items}
    EARLY.start()


def acquire() -> Stack:
    """The shared stack, started (and waited for) by the first module that needs it."""
    if EARLY.stack is not None:
        return EARLY.stack
    EARLY.t0 = time.monotonic()
    root, procs = EARLY.take()
    if EARLY.error is not None:
        raise EARLY.error
    try:
        wait_all(*procs)
        model = root / NAME
        front = front_end(model, "--scheduler", procs[1].endpoint)
        procs.append(front)
        s = Stack(
            root,
            model,
            procs[0],
            procs[1],
            front,
            Tokenizer.from_file(str(model / "tokenizer.json")),
            time.monotonic() - EARLY.t0,
        )
        if EARLY.standby:  # it starts while the tests before the kill test run (not earlier: beside the
            # CPU-bound bench tests, a third vLLM start cost them more than it saves here)
            s.standby = Engine(model, f"ipc://{root}/standby.sock", root / "standby.log", nice=_EarlyStart.NICE)
            procs.append(s.standby)
        if EARLY.lora:  # likewise: vLLM with LoRA on costs ~1.5x the CPU per request, so not the shared server
            adapter = make_lora_adapter(root / "lora")
            flags = ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={adapter}")
            s.lora = VLLMServer(model, root / "lora.log", nice=_EarlyStart.NICE, extra=flags)
            procs.append(s.lora)
    except BaseException as exc:
        EARLY.error = exc  # the next module fails at once instead of waiting again
        shutdown()
        raise
    print(f"\nvLLM stack ready {s.started_s:.1f} s after the first test that needs it began")
    EARLY.stack = s
    return s


def stop_all(procs: list) -> list:
    """Stops processes started in this order, the newest first: [(process, exit status)]. The tokenmill
    front ends stop first, one by one, then every vLLM-venv process (vLLM, engine bridges) on one SIGTERM
    together: each takes seconds to stop, and one after the other those seconds added up."""
    statuses = [(p, p.stop()) for p in reversed(procs) if not isinstance(p, Proc)]
    engines = [p for p in reversed(procs) if isinstance(p, Proc)]
    for p in engines:
        p.terminate()
    return statuses + [(p, p.stop()) for p in engines]


def shutdown() -> list:
    """Stops every process of the stack (the newest first): [(process, exit status)]."""
    procs, s = EARLY.procs, EARLY.stack
    if s is not None and s.engine not in procs:
        procs.append(s.engine)  # the kill test started a new one
    statuses = stop_all(procs)
    procs.clear()
    EARLY.finished.set()
    if EARLY.root is not None:
        shutil.rmtree(EARLY.root, ignore_errors=True)
    return statuses


def release(module: str) -> None:
    """A module is done with the stack: the last one stops it and checks that every process shut down
    cleanly on SIGTERM."""
    EARLY.users.discard(module)
    if EARLY.users or not EARLY.procs:
        return
    statuses = shutdown()
    for p, status in statuses:
        assert status == 0 or getattr(p, "killed", False), f"{type(p).__name__} exited with {status}"
    print(f"\nvLLM stack wall time {time.monotonic() - EARLY.t0:.1f} s")


def module_fixture():
    """A module's `stack` fixture: the shared stack, released when the module's tests are done."""

    @pytest.fixture(scope="module")
    def stack(request):
        yield acquire()
        release(request.module.__name__)

    return stack
