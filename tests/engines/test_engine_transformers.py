"""A real engine behind tokenmill: `tokenmill serve --scheduler ipc://...` in front of
`tokenmill engine --backend transformers --random-weights`, both real subprocesses, driven by
the official openai client.

The engine serves a tiny random-weight Llama (tokenmill.engines.transformers_backend.build_random_model)
over the default model's vocabulary with transformers' continuous batching, on CPU. The test
process builds the same model with the same function to check that what comes back is what
real forward passes produce: greedy tokens equal plain `model.generate` greedy tokens.

A second DEALER (a "probe", a front end of its own) talks to the engine directly: for token-level
checks (logprobs included: the model's raw log_softmax, checked against the same model's logits
computed here) and to read the engine's Stats, whose optional fields report how many requests the
engine ran at once (peak_running) and how many it cancelled (cancelled_total).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the transformers engine needs torch: pip install 'tokenmill[transformers]'")
pytest.importorskip(
    "transformers", reason="the transformers engine needs transformers: pip install 'tokenmill[transformers]'"
)

import openai  # noqa: E402
from conftest import ROOT, Server  # noqa: E402
from protocol_client import ProtocolClient  # noqa: E402

from tokenmill.scheduler_client.protocol import (  # noqa: E402
    Error,
    Outputs,
    SamplingParams,
    Stats,
    Structured,
    Welcome,
    bytes_to_floats,
    frame_to_ids,
)

STARTUP_TIMEOUT = 90.0
EOS = 1  # the default model's EOS, which the gateway adds to stop_token_ids


class Engine:
    """A `tokenmill engine --backend transformers --random-weights` subprocess."""

    def __init__(self, *options: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tmeng-"))  # ipc paths are limited to ~100 bytes
        self.endpoint = f"ipc://{self.dir}/engine.sock"
        self.log_path = self.dir / "engine.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.cli",
                "engine",
                "--backend",
                "transformers",
                "--random-weights",
                "--bind",
                self.endpoint,
                *options,
            ],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class Probe(ProtocolClient):
    """A front end of our own on the engine: direct Generate, and the engine's Stats."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.endpoint, log=engine.log)
        self.engine = engine
        self.stats: list[Stats] = []
        self.welcome: Welcome | None = None
        self.hello("test-probe")
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while self.welcome is None:
            if self.engine.proc.poll() is not None:
                raise AssertionError(f"the engine exited with {self.engine.proc.returncode}:\n{self.engine.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not answer Hello:\n{self.engine.log()}")
            message = self.poll(0.2)
            if isinstance(message, Welcome):
                self.welcome = message

    def poll(self, timeout: float):
        message = super().poll(timeout)
        if isinstance(message, Stats):
            self.stats.append(message)
        return message

    def latest_stats(self, timeout: float = 5.0) -> Stats:
        """A Stats sent after this call."""
        seen = len(self.stats)
        deadline = time.monotonic() + timeout
        while len(self.stats) == seen:
            assert time.monotonic() < deadline, "no Stats from the engine"
            self.poll(0.1)
        return self.stats[-1]

    def generate(self, rid: str, prompt: list[int], max_new_tokens: int, stop=(), **sampling) -> tuple[list[int], str]:
        self.send_generate(
            rid, prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(**sampling), stop_token_ids=list(stop)
        )
        tokens: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            message = self.poll(0.5)
            if isinstance(message, Error):
                raise AssertionError(f"rejected: {message}")
            if not isinstance(message, Outputs):
                continue
            for out in message.outputs:
                assert out.request_id == rid
                tokens += frame_to_ids(out.token_ids)
                assert out.completion_tokens == len(tokens)
                if out.finish_reason:
                    return tokens, out.finish_reason
        raise AssertionError(f"{rid} did not finish:\n{self.engine.log()}")


@pytest.fixture(scope="module")
def engine():
    eng = Engine("--stats-interval-s", "0.1", "--max-running", "8", "--max-model-len", "4096")
    try:
        yield eng
    finally:
        status = eng.stop()
        log = eng.log()
        shutil.rmtree(eng.dir, ignore_errors=True)
        assert status == 0, log
        assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def probe(engine):
    p = Probe(engine)
    yield p
    p.close()


@pytest.fixture(scope="module")
def front(engine, probe):
    """tokenmill serve in front of the engine (the probe has waited for the engine to load)."""
    srv = Server("--workers", "1", "--scheduler", engine.endpoint, timeout=STARTUP_TIMEOUT)
    yield srv
    status = srv.stop()
    assert status == 0, f"tokenmill serve exited with {status}:\n{srv.read_output()}"


@pytest.fixture(scope="module")
def reference_model():
    """The engine's model, built again in this process."""
    from tokenmill.engines.transformers_backend import build_random_model, vocab_size_of

    return build_random_model(vocab_size_of(None))


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def model_name(front) -> str:
    return front.client().models.list().data[0].id


# ---- the engine itself ------------------------------------------------------------------------


def test_welcome_reports_capacity(probe):
    w = probe.welcome
    assert w.scheduler_name.startswith("transformers:random-llama")
    assert w.max_running_requests == 8
    assert w.max_model_len == 4096


def test_welcome_offers_logprobs_only(probe):
    """Protocol 1.1: transformers' continuous batching honours logprobs (computed by the engine,
    see engines/transformers_backend.py) and none of the other optional fields."""
    assert (probe.welcome.features, probe.welcome.max_logprobs) == (["logprobs"], 20)


def test_1_1_fields_are_refused_as_unsupported(probe):
    """Each optional field other than logprobs gets an ``unsupported`` error naming it, and the engine carries on."""
    cases = {
        "structured": ({"structured": Structured(kind="regex", spec="a+")}, "structured"),
        "min_p": ({"sampling": SamplingParams(min_p=0.1)}, "sampling.min_p"),
        "repetition": ({"sampling": SamplingParams(repetition_penalty=1.2)}, "sampling.repetition_penalty"),
        "min_tokens": ({"sampling": SamplingParams(min_tokens=2)}, "sampling.min_tokens"),
        "logit_bias": ({"sampling": SamplingParams(logit_bias={5: -100.0})}, "sampling.logit_bias"),
    }
    for rid, (fields, param) in cases.items():
        probe.send_generate(rid, [11, 12], max_new_tokens=2, **fields)
        deadline = time.monotonic() + 10
        error = None
        while error is None and time.monotonic() < deadline:
            message = probe.poll(0.5)
            if isinstance(message, Error):
                error = message
        assert error is not None and error.request_id == rid, f"{rid}: no error"
        assert (error.code, error.param) == ("unsupported", param), error
    assert probe.generate("after", [11, 12], 2, temperature=0.0)[1] == "length"


def test_greedy_equals_model_generate(probe, reference_model):
    """Real forward passes: greedy tokens from the engine are model.generate's greedy tokens."""
    prompt, other = [11, 2024, 7, 99, 1500], [11, 2024, 7, 99, 1501]
    a, reason = probe.generate("greedy-a", prompt, 12, temperature=0.0)
    assert reason == "length"
    assert a == greedy_reference(reference_model, prompt, 12)
    b, _ = probe.generate("greedy-b", other, 12, temperature=0.0)
    assert b == greedy_reference(reference_model, other, 12)
    assert a != b  # another prompt, other tokens
    assert probe.generate("greedy-a", prompt, 12, temperature=0.0)[0] == a  # same prompt, same tokens


def generate_together(probe, requests: dict[str, tuple[list[int], dict]]) -> tuple[dict[str, dict], int]:
    """Several requests sent at once (so the engine batches them): rid -> tokens, finish, logprobs,
    top_ids, top_logprobs; and the most requests one engine step (one Outputs) carried tokens for.
    Values: (prompt, Generate keywords with "sampling" a dict)."""
    got, most = {}, 0
    for rid, (prompt, fields) in requests.items():
        fields = dict(fields)
        sampling = SamplingParams(**fields.pop("sampling", {}))
        probe.send_generate(rid, prompt, sampling=sampling, **fields)
        got[rid] = {"tokens": [], "finish": None, "logprobs": [], "top_ids": [], "top_logprobs": []}
    deadline = time.monotonic() + 60
    while any(g["finish"] is None for g in got.values()):
        assert time.monotonic() < deadline, f"not finished: {got}\n{probe.engine.log()}"
        message = probe.poll(0.5)
        if isinstance(message, Error):
            raise AssertionError(f"rejected: {message}")
        if not isinstance(message, Outputs):
            continue
        most = max(most, len({out.request_id for out in message.outputs if out.token_ids}))
        for out in message.outputs:
            g = got[out.request_id]
            g["tokens"] += frame_to_ids(out.token_ids)
            g["logprobs"] += bytes_to_floats(out.logprobs)
            g["top_ids"] += frame_to_ids(out.top_ids)
            g["top_logprobs"] += bytes_to_floats(out.top_logprobs)
            g["finish"] = out.finish_reason
    return got, most


def reference_logprobs(model, prompt: list[int], tokens: list[int]):
    """log_softmax of the model's logits at each generated position, computed here with plain torch."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def check_logprobs(got: dict, reference, n: int) -> None:
    """The chosen token's logprob and the top n (IDs and values, best first) are the model's, within 1e-4."""
    tokens = got["tokens"]
    assert len(got["logprobs"]) == len(tokens)
    assert len(got["top_ids"]) == len(got["top_logprobs"]) == n * len(tokens)
    for i, token in enumerate(tokens):
        row = reference[i]
        assert abs(got["logprobs"][i] - row[token].item()) < 1e-4, (i, got["logprobs"][i], row[token].item())
        ids, values = got["top_ids"][n * i : n * i + n], got["top_logprobs"][n * i : n * i + n]
        assert values == sorted(values, reverse=True)
        best = row.topk(n).values.tolist()
        assert max((abs(a - b) for a, b in zip(values, best, strict=True)), default=0) < 1e-4, (i, values, best)
        assert max((abs(v - row[t].item()) for t, v in zip(ids, values, strict=True)), default=0) < 1e-4  # its ID's


def test_logprobs_are_the_models_raw_logprobs(probe, reference_model):
    """Three requests batched together: greedy with the top 5, sampled (temperature 0.9, top-p 0.95)
    with the top 3, and one without logprobs. The logprobs are log_softmax of the model's logits before
    temperature / top-k / top-p (vLLM's raw_logprobs), each request's own; greedy picks the top entry."""
    greedy_prompt, sampled_prompt, plain_prompt = [11, 2024, 7, 99, 1500], [300, 301, 302], [5, 6, 7, 8, 9, 10, 11]
    got, most = generate_together(
        probe,
        {
            "lp-greedy": (greedy_prompt, {"max_new_tokens": 10, "sampling": {"temperature": 0.0}, "logprobs": 5}),
            "lp-sampled": (
                sampled_prompt,
                {"max_new_tokens": 10, "logprobs": 3, "sampling": {"temperature": 0.9, "top_p": 0.95}},
            ),
            "lp-none": (plain_prompt, {"max_new_tokens": 10, "sampling": {"temperature": 0.0}}),
        },
    )
    assert {rid: g["finish"] for rid, g in got.items()} == dict.fromkeys(got, "length")
    assert most >= 2, "the requests never shared an engine step"

    greedy = got["lp-greedy"]
    assert greedy["tokens"] == greedy_reference(reference_model, greedy_prompt, 10)
    check_logprobs(greedy, reference_logprobs(reference_model, greedy_prompt, greedy["tokens"]), 5)
    for i, token in enumerate(greedy["tokens"]):  # greedy: the chosen token is the top-1 entry
        assert (token, greedy["logprobs"][i]) == (greedy["top_ids"][5 * i], greedy["top_logprobs"][5 * i])

    sampled = got["lp-sampled"]
    check_logprobs(sampled, reference_logprobs(reference_model, sampled_prompt, sampled["tokens"]), 3)
    # sampled, not greedy: some chosen token is below the best one (its raw logprob, not the tempered one)
    assert any(sampled["logprobs"][i] < sampled["top_logprobs"][3 * i] - 1e-6 for i in range(10))

    plain = got["lp-none"]
    assert plain["tokens"] == greedy_reference(reference_model, plain_prompt, 10)
    assert plain["logprobs"] == plain["top_ids"] == plain["top_logprobs"] == []


def test_logprobs_zero_is_the_chosen_token_only(probe, reference_model):
    prompt = [11, 2024, 7, 99, 1501]
    got = generate_together(probe, {"lp0": (prompt, {"max_new_tokens": 6, "logprobs": 0})})[0]["lp0"]
    assert got["top_ids"] == got["top_logprobs"] == []
    check_logprobs(got, reference_logprobs(reference_model, prompt, got["tokens"]), 0)


def test_weights_follow_the_seed():
    """--seed fixes the random weights: same seed, same model and tokens; another seed, others."""
    import torch

    from tokenmill.engines.transformers_backend import build_random_model

    small = dict(layers=1, hidden_size=32, heads=2, kv_heads=2, intermediate_size=64)
    a, b, c = (build_random_model(1000, seed=s, **small) for s in (7, 7, 8))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    prompt = [5, 6, 7]
    assert greedy_reference(a, prompt, 8) == greedy_reference(b, prompt, 8)
    assert greedy_reference(a, prompt, 8) != greedy_reference(c, prompt, 8)
    n = sum(p.numel() for p in build_random_model(129280).parameters())
    assert 16_500_000 < n < 16_700_000  # the documented ~16.6M


def test_stop_token_ends_with_stop(probe, reference_model):
    prompt = [300, 301, 302]
    expected = greedy_reference(reference_model, prompt, 10)
    i = next(i for i in range(2, 10) if expected[i] not in expected[:i])
    tokens, reason = probe.generate("stop", prompt, 10, stop=[expected[i]], temperature=0.0)
    assert (tokens, reason) == (expected[: i + 1], "stop")  # the stop token is included


# ---- through tokenmill, with the openai client --------------------------------------------------


def test_chat_and_completions(front, probe):
    client = front.client()
    model = model_name(front)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 3

    text = client.completions.create(model=model, prompt="The river wound slowly", max_tokens=6, temperature=0)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 6
    again = client.completions.create(model=model, prompt="The river wound slowly", max_tokens=6, temperature=0)
    assert again.choices[0].text == text.choices[0].text  # deterministic: greedy on fixed weights

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Stream, please"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 7

    streamed = list(client.completions.create(model=model, prompt="Once", max_tokens=5, stream=True, temperature=0.8))
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == ["length"]


def test_completion_from_token_ids_matches_the_model(front, reference_model):
    """A token-ID prompt through the gateway: stop_token_ids cut the greedy output where the model says."""
    client = front.client()
    prompt = [11, 2024, 7, 99, 1500]
    expected = greedy_reference(reference_model, prompt, 12)
    i = next(i for i in range(2, 12) if expected[i] not in expected[:i])
    out = client.completions.create(
        model=model_name(front),
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [expected[i]]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == i + 1


def test_logprobs_through_the_openai_api(front, reference_model):
    """completions ``logprobs`` and chat ``logprobs``/``top_logprobs`` through tokenmill: the model's values."""
    client = front.client()
    model = model_name(front)
    prompt = [11, 2024, 7, 99, 1500]
    tokens = greedy_reference(reference_model, prompt, 6)
    reference = reference_logprobs(reference_model, prompt, tokens)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 6
    for i, token in enumerate(tokens):
        assert abs(lp.token_logprobs[i] - reference[i, token].item()) < 1e-4
        assert abs(max(lp.top_logprobs[i].values()) - reference[i].max().item()) < 1e-4

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:  # greedy: the chosen token is the best entry
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)


def test_concurrent_requests_are_batched(front, probe):
    """Several requests run in the engine at once (its scheduler's own count, through Stats)."""
    client = front.async_client()
    model = model_name(front)

    async def one(i: int):
        stream = await client.completions.create(model=model, prompt=f"Request number {i}", max_tokens=16, stream=True)
        text, reasons = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
        return reasons

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(4)))

    before = probe.latest_stats()
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(run_all())
        running = []
        while not task.done():
            loop.run_until_complete(asyncio.sleep(0.05))
            while (message := probe.poll(0)) is not None:
                if isinstance(message, Stats):
                    running.append(message.num_running)
        results = task.result()
    finally:
        loop.run_until_complete(client.close())
        loop.close()
    assert results == [["length"]] * 4
    assert max(running) >= 2, f"the engine never had two requests running together: {running}"
    after = probe.latest_stats()
    assert after.peak_running >= max(2, max(running)) and after.peak_running >= before.peak_running
    assert after.num_running == 0


def test_client_disconnect_cancels_in_the_engine(front, probe):
    before = probe.latest_stats()
    client = front.client()
    stream = client.completions.create(model=model_name(front), prompt="Go on and on", max_tokens=3000, stream=True)
    received = 0
    for _chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()  # the HTTP client goes away mid-generation
    deadline = time.monotonic() + 15
    stats = probe.latest_stats()
    while (stats.cancelled_total == before.cancelled_total or stats.num_running) and time.monotonic() < deadline:
        stats = probe.latest_stats()
    assert stats.cancelled_total == before.cancelled_total + 1, stats
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert "cancelled in the engine" in probe.engine.log()


def test_unsupported_sampling_is_a_clear_400(front):
    client = front.client()
    model = model_name(front)
    with pytest.raises(openai.BadRequestError) as seeded:
        client.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=0.7, seed=1234)
    assert "seed" in str(seeded.value) and "transformers" in str(seeded.value)
    with pytest.raises(openai.BadRequestError) as penalized:
        client.completions.create(model=model, prompt="Hi", max_tokens=4, presence_penalty=0.5)
    assert "presence_penalty" in str(penalized.value)
    # a seed with greedy decoding is fine: greedy is deterministic anyway
    ok = client.completions.create(model=model, prompt="Hi", max_tokens=3, temperature=0, seed=1234)
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.skipif(not os.path.exists("/proc/self/comm"), reason="process names are Linux")
def test_process_name(engine):
    assert Path(f"/proc/{engine.proc.pid}/comm").read_text().strip() == "tm-engine"
