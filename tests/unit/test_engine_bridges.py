"""The SGLang and vLLM bridges (engines/sglang_backend.py, engines/vllm_backend.py) and the shared
engine server (engines/bridge.py), against fakes that keep the real engines' contracts.
Neither SGLang nor vLLM needs to be installed.

* FakeSGLangEngine behaves like ``sglang.Engine``: its constructor makes ``engine.loop`` (the
  loop its tokenizer manager is bound to), its synchronous ``generate`` drives that loop with
  ``run_until_complete`` (so it fails with "This event loop is already running" once the loop
  runs elsewhere), ``async_generate`` and ``tokenizer_manager.abort_request`` refuse to run
  anywhere but on that loop, and ``async_generate`` returns only once 8 requests are in flight
  together — a bridge that serialised requests would time out.
* FakeAsyncLLM behaves like vLLM's ``AsyncLLM``: ``generate`` is an async generator of DELTA
  outputs, ``abort(request_id)`` ends a request with finish_reason "abort", closing or
  cancelling the generator aborts the request (as AsyncLLM does), and request validation
  errors are raised from the generator before its first output.

Protocol 1.1 in the fakes, with the shapes the real engines use:

* vLLM 0.32 (vllm/logprobs.py, vllm/v1/engine/logprobs.py): with ``SamplingParams.logprobs`` N
  each DELTA output's ``CompletionOutput.logprobs`` covers its new tokens. With
  ``flat_logprobs=True`` it is a ``FlatLogprobs``: position i's entries run from
  ``start_indices[i]`` to ``end_indices[i]`` in ``token_ids`` / ``logprobs`` / ``ranks`` — the
  sampled token first (its own rank), then ranks 1..N; otherwise a list of
  ``{token_id: Logprob(logprob, rank, decoded_token)}`` dicts, the sampled token's entry merged
  with its top-N entry when it is among them (N entries, else N + 1).
* SGLang (python/sglang/srt/managers/tokenizer_manager.py): ``async_generate(...,
  return_logprob=True, top_logprobs_num=N)`` puts into ``meta_info``
  ``output_token_logprobs``, a list of ``(logprob, token_id, text_or_None)`` per output
  token, and ``output_top_logprobs``, per output token a best-first list of N such tuples (or
  None). With ``incremental_streaming_output`` both hold the chunk's new tokens only; with the
  older ``stream_output`` they are cumulative (every token so far) while ``output_ids`` is
  incremental — the fake does either (``cumulative_logprobs``).
* The fakes' "model" ranks its next token first with logprob -0.25, then token + k with
  -0.25 - k (:func:`fake_top`).
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
from protocol_client import AsyncProtocolClient

from tokenmill.engines import MissingBackend, backend_module
from tokenmill.engines.bridge import Backend, Chunk, EngineInfo, EngineLoad, EngineRejected, EngineRequest, EngineServer
from tokenmill.engines.sglang_backend import SGLangBackend, choice_grammar, parse_engine_args, structured_params
from tokenmill.engines.vllm_backend import VLLMBackend, convert_logprobs, convert_prompt_logprobs, structured_outputs
from tokenmill.scheduler_client.protocol import (
    FEATURES,
    FEATURES_12,
    PROTOCOL_VERSION,
    STRUCTURED_FEATURES,
    STRUCTURED_OPTION_FEATURES,
    Abort,
    Error,
    Generate,
    Hello,
    Outputs,
    SamplingParams,
    Stats,
    Structured,
    Welcome,
    bytes_to_floats,
    encode,
    frame_to_ids,
    ids_to_frame,
)
from tokenmill.scheduler_client.scheduler_side import Rejected

WAIT = 10.0
IN_FLIGHT_GOAL = 8


def next_token(prompt: list[int], generated: list[int]) -> int:
    """The fakes' "model": deterministic tokens from the prompt."""
    return (sum(prompt) * 31 + 7 * len(generated) + 3) % 1000 + 10


def fake_top(best: int, n: int) -> list[tuple[float, int]]:
    """The fakes' top-n (logprob, token ID) at a position whose most likely token is ``best``, best first."""
    return [(-0.25 - k, best + k) for k in range(n)]


# ---------------------------------------------------------------------------- fake SGLang


# SGLang 0.5.23's scheduler messages (sglang/srt/constrained/grammar_manager.py), by the regex that gets them
LATE_ABORTS = {
    "late(": "Failed to compile regex grammar: Regex parsing error at position 5: The parenthesis is not closed.",
    "slow": "Grammar preprocessing timed out: req.grammar_key=('regex', 'slow')",
    "busy": "Request rejected: the waiting queue is full",  # not about the grammar
}


class FakeTokenizerManager:
    def __init__(self, engine: FakeSGLangEngine) -> None:
        self.engine = engine
        self.context_len = 1024
        self.model_config = SimpleNamespace(vocab_size=5000)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.engine.on_engine_loop("abort_request")
        self.engine.aborted.append(rid)
        self.engine.abort_events.setdefault(rid, asyncio.Event()).set()

    async def get_internal_state(self) -> list[dict]:
        self.engine.on_engine_loop("get_internal_state")
        return [{"max_running_requests": 48}]


class FakeSGLangEngine:
    """sglang.Engine's threading contract, with a toy model."""

    def __init__(self, in_flight_goal: int = IN_FLIGHT_GOAL, **kwargs) -> None:
        self.kwargs = kwargs
        self.in_flight_goal = in_flight_goal
        try:  # as Engine.__init__: the running loop, else a new one for this engine
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.server_args = SimpleNamespace(
            enable_deterministic_inference=kwargs.get("enable_deterministic_inference", False),
            max_running_requests=None,
            context_length=None,
            skip_tokenizer_init=kwargs.get("skip_tokenizer_init", False),
            grammar_backend=kwargs.get("grammar_backend", "xgrammar"),
        )
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.abort_events: dict[str, asyncio.Event] = {}
        self.violations: list[str] = []
        self.shutdown_while_loop_ran: bool | None = None
        self.cumulative_logprobs = False  # older SGLang's stream_output: logprob lists hold every token so far
        self._all_in: asyncio.Event | None = None

    def on_engine_loop(self, what: str) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self.loop:
            self.violations.append(what)
            raise RuntimeError(f"{what} called outside the engine's event loop")

    def generate(self, input_ids=None, sampling_params=None, stream=False, rid=None, **logprob_args):
        """The synchronous API: drives the engine's loop itself, like sglang.Engine.generate."""
        call = self.async_generate(input_ids, sampling_params, stream=False, rid=rid, **logprob_args)
        try:
            return self.loop.run_until_complete(call)
        finally:
            call.close()

    async def async_generate(
        self, input_ids=None, sampling_params=None, stream=False, rid=None, return_logprob=False, top_logprobs_num=None
    ):
        self.on_engine_loop("async_generate")
        assert stream is True, "the bridge streams"
        if len(input_ids) > 100:
            raise ValueError(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length (100 tokens)."
            )
        if "min_new_tokens" in sampling_params and self.kwargs.get("skip_tokenizer_init"):
            raise ValueError("min_new_tokens=1 is unavailable when skip_tokenizer_init=True")  # as SGLang says
        if sampling_params.get("regex") == "(unclosed":  # as a grammar backend refusing at submission
            raise ValueError("Invalid regex: (unclosed")
        self.requests[rid] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num,
        }
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self._all_in is None:
            self._all_in = asyncio.Event()
        if self.in_flight >= self.in_flight_goal:
            self._all_in.set()
        try:  # only once enough requests are in the engine together
            await asyncio.wait_for(self._all_in.wait(), 5.0)
        except TimeoutError:
            self.in_flight -= 1
            raise RuntimeError(
                f"only {self.in_flight + 1} request(s) in flight: the bridge serialises requests"
            ) from None
        top_n = (top_logprobs_num or 0) if return_logprob else None
        return self._stream(rid, list(input_ids), dict(sampling_params), top_n)

    async def _stream(self, rid, prompt, params, top_n=None):
        token_logprobs: list[tuple] = []  # every token's (logprob, token_id, None) so far
        top_logprobs: list[list[tuple] | None] = []
        try:
            generated: list[int] = []
            stop = set(params.get("stop_token_ids") or [])
            ignore_eos = params.get("ignore_eos", False)
            aborted = self.abort_events.setdefault(rid, asyncio.Event())
            late = LATE_ABORTS.get(params.get("regex"))
            if late is not None:  # as SGLang's scheduler ends a request whose grammar it could not use
                reason = {"type": "abort", "message": late, "status_code": 400, "err_type": "BadRequestError"}
                meta = {"prompt_tokens": len(prompt), "completion_tokens": 0, "finish_reason": reason}
                yield {"output_ids": [], "meta_info": meta}
                return
            while True:
                self.on_engine_loop("streaming")
                try:
                    await asyncio.wait_for(aborted.wait(), 0.002)
                except TimeoutError:
                    pass
                meta = {"prompt_tokens": len(prompt), "cached_tokens": 0}
                if aborted.is_set():
                    meta.update(
                        completion_tokens=len(generated),
                        finish_reason={"type": "abort", "message": "Abort in waiting queue"},
                    )
                    yield {"output_ids": [], "meta_info": meta}
                    return
                best = next_token(prompt, generated)
                token = params.get("force_tokens", {}).get(len(generated)) or best
                generated.append(token)
                meta["completion_tokens"] = len(generated)
                if top_n is not None:
                    ranked = fake_top(best, max(top_n, 1))
                    chosen = next((lp for lp, t in ranked if t == token), -30.0)
                    token_logprobs.append((chosen, token, None))
                    top_logprobs.append([(lp, t, None) for lp, t in ranked[:top_n]] if top_n else None)
                    first = 0 if self.cumulative_logprobs else len(generated) - 1
                    meta["output_token_logprobs"] = token_logprobs[first:]
                    if top_n:
                        meta["output_top_logprobs"] = top_logprobs[first:]
                reason = None
                if not ignore_eos and token in stop:  # SGLang's ignore_eos switches stop_token_ids off too
                    reason = {"type": "stop", "matched": token}
                elif len(generated) >= params["max_new_tokens"]:
                    reason = {"type": "length", "length": len(generated)}
                meta["finish_reason"] = reason
                yield {"output_ids": [token], "meta_info": meta}  # stream_output=True: new tokens only
                if reason:
                    return
        finally:
            self.in_flight -= 1

    def shutdown(self) -> None:
        self.shutdown_while_loop_ran = self.loop.is_running()


def sglang_backend(**engine_kwargs) -> tuple[SGLangBackend, FakeSGLangEngine]:
    made: list[FakeSGLangEngine] = []

    def factory(**kwargs):
        made.append(FakeSGLangEngine(**kwargs))
        return made[0]

    backend = SGLangBackend(engine_kwargs={"model_path": "fake/model", **engine_kwargs}, engine_factory=factory)
    backend.prepare()  # on this (main) thread, outside any running loop, as `tokenmill engine` does
    return backend, made[0]


def request(
    rid: str,
    prompt=(1, 2, 3),
    n: int = 5,
    stop=(),
    ignore_eos: bool = False,
    logprobs=None,
    structured=None,
    priority: int = 0,
    cache_salt: str | None = None,
    **sampling,
) -> EngineRequest:
    return EngineRequest(
        rid=rid,
        prompt=list(prompt),
        max_new_tokens=n,
        sampling=SamplingParams(**sampling),
        stop_token_ids=list(stop),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        structured=structured,
        priority=priority,
        cache_salt=cache_salt,
    )


async def collect(stream) -> tuple[list[int], str | None, str | None]:
    tokens, finish, error = [], None, None
    async for chunk in stream:
        tokens += list(chunk.token_ids)
        finish, error = chunk.finish, chunk.error
    return tokens, finish, error


def expected_tokens(prompt, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(list(prompt), out))
    return out


# ---------------------------------------------------------------------------- SGLang bridge


def test_sglang_requests_run_concurrently_on_the_engine_loop():
    backend, engine = sglang_backend()
    try:
        assert engine.kwargs["skip_tokenizer_init"] is True and engine.kwargs["stream_output"] is True
        info = backend.info()
        assert (info.max_model_len, info.vocab_size, info.max_running_requests) == (1024, 5000, 48)
        assert info.name == "sglang:fake/model"

        async def main():
            prompts = [(i, i + 1, i + 2) for i in range(IN_FLIGHT_GOAL)]
            results = await asyncio.wait_for(
                asyncio.gather(*(collect(backend.generate(request(f"r{i}", p, n=6))) for i, p in enumerate(prompts))),
                WAIT,
            )
            for p, (tokens, finish, _) in zip(prompts, results, strict=True):
                assert (tokens, finish) == (expected_tokens(p, 6), "length")
            assert backend.load().peak_running == IN_FLIGHT_GOAL

        asyncio.run(main())
        assert engine.max_in_flight == IN_FLIGHT_GOAL
        assert engine.violations == []
        # why the bridge needs its own thread: the engine's loop is busy there, so the
        # synchronous API fails exactly as sglang.Engine.generate does for a second caller
        with pytest.raises(RuntimeError, match="already running"):
            engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1}, rid="sync")
    finally:
        asyncio.run(backend.close())
    assert engine.shutdown_while_loop_ran is True  # the engine first ...
    assert not backend._thread.is_alive()  # ... then the loop thread


def test_sglang_abort_cancels_inside_the_engine():
    backend, engine = sglang_backend()
    engine.in_flight_goal = 1
    try:

        async def main():
            stream = backend.generate(request("long", n=10_000))
            got = []
            async for chunk in stream:
                got += chunk.token_ids
                if len(got) >= 3:
                    break
            await backend.abort("long")
            assert engine.aborted == ["long"]
            await stream.aclose()
            assert backend.load().cancelled_total == 1
            await backend.abort("long")  # idempotent, and unknown IDs are ignored
            await backend.abort("never-was")
            assert engine.aborted == ["long"]

            # closing the stream early aborts the request too
            early = backend.generate(request("early", n=10_000))
            await early.__anext__()
            await early.aclose()
            assert engine.aborted == ["long", "early"]
            assert backend.load().num_running == 0

        asyncio.run(main())
        assert engine.violations == []
    finally:
        asyncio.run(backend.close())


def test_sglang_sampling_params_and_seed():
    backend, engine = sglang_backend()
    engine.in_flight_goal = 1
    try:
        greedy = SGLangBackend.sampling_params(request("g", n=9, stop=(5, 6), temperature=0.0, top_k=0))
        assert greedy == {
            "max_new_tokens": 9,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": [5, 6],
        }
        sampled = SGLangBackend.sampling_params(
            request("s", stop=(5,), ignore_eos=True, temperature=0.7, top_p=0.9, top_k=40, presence_penalty=0.5)
        )
        assert sampled["ignore_eos"] is True and "stop_token_ids" not in sampled
        assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["presence_penalty"]) == (
            0.7,
            0.9,
            40,
            0.5,
        )

        def gen(**sampling):
            return Generate(request_id="x", prompt_token_count=1, max_new_tokens=1, sampling=SamplingParams(**sampling))

        with pytest.raises(Rejected, match="enable_deterministic_inference"):
            backend.check(gen(temperature=0.5, seed=3))
        backend.check(gen(temperature=0.0, seed=3))  # greedy needs no seed
    finally:
        asyncio.run(backend.close())

    seeded, _ = sglang_backend(enable_deterministic_inference=True)
    try:
        seeded.check(
            Generate(
                request_id="x", prompt_token_count=1, max_new_tokens=1, sampling=SamplingParams(temperature=0.5, seed=3)
            )
        )
        assert SGLangBackend.sampling_params(request("s", temperature=0.5, seed=3))["sampling_seed"] == 3
    finally:
        asyncio.run(seeded.close())


def test_sglang_validation_error_is_a_rejection():
    backend, engine = sglang_backend()
    engine.in_flight_goal = 1
    try:

        async def main():
            with pytest.raises(EngineRejected, match="longer than the model's context length") as info:
                await collect(backend.generate(request("big", prompt=range(101))))
            assert info.value.param is None
            # a grammar refusal names the constraint: the client's 400 names the request field it came from
            bad = Structured(kind="regex", spec="(unclosed")
            with pytest.raises(EngineRejected, match="Invalid regex") as info:
                await collect(backend.generate(request("bad", structured=bad)))
            assert info.value.param == "structured"

        asyncio.run(main())
    finally:
        asyncio.run(backend.close())


def test_sglang_late_grammar_abort_is_a_rejection():
    """A grammar SGLang's scheduler refuses after admission ends the request with an abort before any
    token: the bridge refuses it naming ``structured`` (the client's 400), as SGLang's own server
    answers 400; an abort of a constrained request that is not about its grammar stays an abort."""
    backend, engine = sglang_backend()
    engine.in_flight_goal = 1
    try:

        async def main():
            for spec in ("late(", "slow"):
                with pytest.raises(EngineRejected) as info:
                    await collect(backend.generate(request(spec, structured=Structured(kind="regex", spec=spec))))
                assert (info.value.param, str(info.value)) == ("structured", LATE_ABORTS[spec])
            busy = request("busy", structured=Structured(kind="regex", spec="busy"))
            assert await collect(backend.generate(busy)) == ([], "abort", LATE_ABORTS["busy"])

        asyncio.run(main())
        assert backend.load().num_running == 0
    finally:
        asyncio.run(backend.close())


class StandInCheck:
    """tokenmill.engines.sglang_grammar.GrammarCheck's contract, for the bridge's wiring; the real check, with
    SGLang's own grammar backends, runs in tests/engines/test_structured_sglang.py."""

    def __init__(self) -> None:
        self.asked: list[dict] = []

    async def refusal(self, params: dict) -> str | None:
        self.asked.append(params)
        await asyncio.sleep(0)
        return "Failed to compile regex grammar: unclosed" if params.get("regex") == "(x" else None


def test_sglang_admission_check_refuses_before_the_engine():
    backend, engine = sglang_backend(skip_tokenizer_init=False)
    engine.in_flight_goal = 1
    # the fake has no tokenizer, so no SGLang grammar backend is built for it (nor imported)
    assert backend.grammar is None and "structured.regex" in backend.info().features
    backend.grammar = check = StandInCheck()
    try:

        async def main():
            bad = request("bad", structured=Structured(kind="regex", spec="(x"))
            with pytest.raises(EngineRejected, match="Failed to compile regex grammar") as info:
                await collect(backend.generate(bad))
            assert info.value.param == "structured"
            assert "bad" not in engine.requests  # refused before SGLang saw it
            good = request("good", n=2, structured=Structured(kind="regex", spec="[a-z]+"))
            assert (await collect(backend.generate(good)))[1] == "length"
            assert engine.requests["good"]["sampling_params"]["regex"] == "[a-z]+"
            assert (await collect(backend.generate(request("plain", n=1))))[1] == "length"

        asyncio.run(main())
        assert [p.get("regex") for p in check.asked] == ["(x", "[a-z]+"]  # unconstrained requests skip it
    finally:
        asyncio.run(backend.close())


SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
STRUCTURED = {
    "json_schema": Structured(kind="json_schema", spec=SCHEMA),
    "json_object": Structured(kind="json_object"),
    "regex": Structured(kind="regex", spec="[a-z]+"),
    "grammar": Structured(kind="grammar", spec='root ::= "x" | "y"'),
    "choice": Structured(kind="choice", choices=["yes", "no"]),
    "structural_tag": Structured(kind="structural_tag", spec='{"type": "structural_tag", "format": {}}'),
}


# what the vLLM bridge does not list by default: priority under FCFS, kv_transfer_params without a KV
# connector, disable_any_whitespace without the engine-wide option, whitespace_pattern ever, images (by hash
# or not) for a text model
VLLM_UNLISTED = {
    "priority",
    "kv_transfer_params",
    "images",
    "images.by_hash",
    "images.shm",
    *STRUCTURED_OPTION_FEATURES,
}


def test_sglang_protocol_1_1_params_and_features():
    backend, _ = sglang_backend()
    try:  # token IDs only (the default): no min_new_tokens, no grammar backend in SGLang
        info = backend.info()
        assert info.features == {"logprobs", "min_p", "repetition_penalty", "logit_bias"}
        assert info.max_logprobs == 20
    finally:
        asyncio.run(backend.close())
    params = SGLangBackend.sampling_params(
        request("x", n=4, min_p=0.05, repetition_penalty=1.3, min_tokens=9, logit_bias={7: -100.0, 42: 2.5})
    )
    assert (params["min_p"], params["repetition_penalty"], params["min_new_tokens"]) == (0.05, 1.3, 4)  # capped
    assert params["logit_bias"] == {"7": -100.0, "42": 2.5}  # SGLang keys logit_bias by token ID strings
    plain = SGLangBackend.sampling_params(request("y"))
    assert not {
        "min_p",
        "repetition_penalty",
        "min_new_tokens",
        "logit_bias",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
    } & set(plain)
    assert {kind: SGLangBackend.sampling_params(request("s", structured=st)) for kind, st in STRUCTURED.items()} == {
        kind: {**plain, **extra}
        for kind, extra in {
            "json_schema": {"json_schema": SCHEMA},
            "json_object": {"json_schema": '{"type": "object"}'},
            "regex": {"regex": "[a-z]+"},
            "grammar": {"ebnf": 'root ::= "x" | "y"'},
            "choice": {"ebnf": 'root ::= "yes" | "no"'},
            "structural_tag": {"structural_tag": '{"type": "structural_tag", "format": {}}'},
        }.items()
    }
    assert structured_params(STRUCTURED["regex"]) == {"regex": "[a-z]+"}

    with_tokenizer, _ = sglang_backend(skip_tokenizer_init=False)
    no_grammar, _ = sglang_backend(skip_tokenizer_init=False, grammar_backend="none")
    try:
        assert with_tokenizer.info().features == set(FEATURES) - set(FEATURES_12)  # none of protocol 1.2's
        assert no_grammar.info().features == set(FEATURES) - set(STRUCTURED_FEATURES) - set(FEATURES_12)
    finally:
        asyncio.run(with_tokenizer.close())
        asyncio.run(no_grammar.close())


def test_choice_grammar_escapes_its_literals():
    choices = ["yes", 'say "hi"', "a\\b", "two\nlines", "tab\there", "bell\x07", "café ☕"]
    assert choice_grammar(choices) == (
        'root ::= "yes" | "say \\"hi\\"" | "a\\\\b" | "two\\nlines" | "tab\\there" | "bell\\u0007" | "café ☕"'
    )


@pytest.mark.parametrize("cumulative", [False, True], ids=["incremental", "cumulative"])
def test_sglang_logprobs(cumulative):
    """meta_info's output_token_logprobs / output_top_logprobs become each chunk's arrays, whether SGLang
    sends the new tokens' entries (incremental_streaming_output) or every token's so far (stream_output)."""
    backend, engine = sglang_backend()
    engine.in_flight_goal = 1
    engine.cumulative_logprobs = cumulative
    prompt = (4, 5, 6)
    tokens = expected_tokens(prompt, 4)
    try:

        async def chunks(rid: str, **kw) -> list[Chunk]:
            return [c async for c in backend.generate(request(rid, prompt, n=4, **kw))]

        async def main():
            top3 = await chunks("top3", logprobs=3)
            assert [t for c in top3 for t in c.token_ids] == tokens and len(top3) == 4
            assert [v for c in top3 for v in c.logprobs] == [-0.25] * 4
            assert [t for c in top3 for t in c.top_ids] == [t + k for t in tokens for k in range(3)]
            assert [v for c in top3 for v in c.top_logprobs] == [-0.25, -1.25, -2.25] * 4
            assert (engine.requests["top3"]["return_logprob"], engine.requests["top3"]["top_logprobs_num"]) == (True, 3)
            chosen = await chunks("chosen", logprobs=0)
            assert [v for c in chosen for v in c.logprobs] == [-0.25] * 4
            assert all(list(c.top_ids) == [] == list(c.top_logprobs) for c in chosen)
            none = await chunks("none")
            assert all(c.logprobs is None for c in none)
            assert engine.requests["none"]["return_logprob"] is False

        asyncio.run(main())
    finally:
        asyncio.run(backend.close())


def test_parse_engine_args():
    assert parse_engine_args(["tp_size=2", "mem-fraction-static=0.85", "attention_backend=triton", "x=true"]) == {
        "tp_size": 2,
        "mem_fraction_static": 0.85,
        "attention_backend": "triton",
        "x": True,
    }
    with pytest.raises(ValueError):
        parse_engine_args(["no-equals-sign"])


# ---------------------------------------------------------------------------- fake vLLM


class FakeValidationError(ValueError):
    """vLLM's VLLMValidationError: a ValueError naming the parameter at fault."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


FakeValidationError.__name__ = "VLLMValidationError"


class FakeAsyncLLM:
    """vLLM's AsyncLLM contract: generate() is an async generator of DELTA outputs; abort()."""

    def __init__(self, policy: str = "fcfs", **model_config_fields) -> None:
        fields = {"max_model_len": 2048, "get_vocab_size": lambda: 6000, "max_logprobs": 20, **model_config_fields}
        model_config = SimpleNamespace(**fields)
        self.vllm_config = SimpleNamespace(
            model_config=model_config, scheduler_config=SimpleNamespace(max_num_seqs=32, policy=policy)
        )
        self.prompts: dict[str, dict] = {}
        self.priorities: dict[str, int] = {}
        self.model_config = model_config
        self.errored = False
        self.aborted: list[tuple[str, bool]] = []
        self.params: dict[str, dict] = {}
        self._abort: dict[str, asyncio.Event] = {}
        self.shut_down = False

    async def generate(self, prompt, sampling_params, request_id, *, priority: int = 0):
        assert set(prompt) <= {"prompt_token_ids", "cache_salt"}  # a TokensPrompt
        self.prompts[request_id], self.priorities[request_id] = prompt, priority
        ids = list(prompt["prompt_token_ids"])
        params = sampling_params
        assert params["detokenize"] is False and params["output_kind"] == "DELTA"
        if len(ids) > 100:  # vLLM validates in add_request, i.e. at the first __anext__
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum number of tokens per batch"
            )
        if (params.get("logprobs") or 0) > 10:  # as vLLM with --max-logprobs 10
            raise FakeValidationError(
                "Requested sample logprobs of 11, which is greater than max allowed: 10", parameter="logprobs"
            )
        structured = params.get("structured_outputs") or {}
        if structured.get("json") == "{not json":  # as xgrammar's schema check in vLLM's input processor
            raise ValueError("Invalid JSON grammar specification.")
        self.params[request_id] = params
        aborted = self._abort.setdefault(request_id, asyncio.Event())
        generated: list[int] = []
        try:
            while True:
                try:
                    await asyncio.wait_for(aborted.wait(), 0.002)
                except TimeoutError:
                    pass
                if aborted.is_set():
                    yield _out([], "abort")
                    return
                token = next_token(ids, generated)
                generated.append(token)
                logprobs = (
                    None
                    if params.get("logprobs") is None
                    else vllm_logprobs(token, params["logprobs"], params.get("flat_logprobs", False))
                )
                if not params["ignore_eos"] and token == 999:
                    reason = "stop"
                elif token in params["stop_token_ids"]:
                    reason = "stop"
                elif len(generated) >= params["max_tokens"]:
                    reason = "length"
                else:
                    reason = None
                out = _out([token], reason, logprobs)
                if len(generated) == 1 and params.get("prompt_logprobs") is not None:  # the first output's
                    out.prompt_logprobs = vllm_prompt_logprobs(
                        ids, params["prompt_logprobs"], params.get("flat_logprobs", False)
                    )
                kv = (params.get("extra_args") or {}).get("kv_transfer_params")
                if reason and kv:  # a KV connector's answer
                    out.kv_transfer_params = {"remote_block_ids": [1, 2], "asked": kv}
                yield out
                if reason:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id, internal=True)  # as AsyncLLM.generate does
            raise

    async def abort(self, request_id, internal: bool = False) -> None:
        self.aborted.append((request_id, internal))
        self._abort.setdefault(request_id, asyncio.Event()).set()

    def shutdown(self) -> None:
        self.shut_down = True


def vllm_logprobs(token: int, n: int, flat: bool, best: int | None = None):
    """One position's sample logprobs as vLLM 0.32 returns them (the sampled ``token``, the top n)."""
    ranked = fake_top(token if best is None else best, max(n, 1) + 5)
    rank = next((r for r, (_, t) in enumerate(ranked, 1) if t == token), 99)
    chosen = ranked[rank - 1][0] if rank <= len(ranked) else -30.0
    entries = [(token, chosen, rank)] + [(t, lp, r) for r, (lp, t) in enumerate(ranked[:n], 1)]
    if flat:
        return SimpleNamespace(
            start_indices=[0],
            end_indices=[len(entries)],
            token_ids=[e[0] for e in entries],
            logprobs=[e[1] for e in entries],
            ranks=[e[2] for e in entries],
        )
    return [{t: SimpleNamespace(logprob=lp, rank=r, decoded_token=None) for t, lp, r in entries}]


def vllm_prompt_logprobs(prompt, n: int, flat: bool):
    """A prompt's logprobs as vLLM 0.32 returns them: nothing for the first token, then per position the
    prompt token (rank 1, 2, 3 in turn) and the top n."""
    positions = [vllm_logprobs(token, n, flat, best=token - (i - 1) % 3) for i, token in enumerate(prompt) if i]
    if not flat:
        return [None] + [p[0] for p in positions]
    out = SimpleNamespace(start_indices=[0], end_indices=[0], token_ids=[], logprobs=[], ranks=[])
    for p in positions:
        out.start_indices.append(len(out.token_ids))
        out.token_ids += p.token_ids
        out.logprobs += p.logprobs
        out.ranks += p.ranks
        out.end_indices.append(len(out.token_ids))
    return out


def _out(tokens: list[int], reason: str | None, logprobs=None):
    completion = SimpleNamespace(token_ids=tokens, finish_reason=reason, stop_reason=None, logprobs=logprobs)
    return SimpleNamespace(outputs=[completion], finished=reason is not None, num_cached_tokens=0)


def vllm_backend(
    engine_args: dict | None = None, policy: str = "fcfs", **model_config
) -> tuple[VLLMBackend, FakeAsyncLLM]:
    engine = FakeAsyncLLM(policy, **model_config)
    backend = VLLMBackend(
        engine=engine,
        engine_args={"model": "fake/model", **(engine_args or {})},
        make_sampling_params=lambda **kw: {**kw, "detokenize": False, "output_kind": "DELTA"},
    )
    backend.prepare()
    return backend, engine


def test_vllm_tokens_finish_reasons_and_params():
    backend, engine = vllm_backend()
    info = backend.info()
    assert (info.max_model_len, info.vocab_size, info.max_running_requests) == (2048, 6000, 32)
    assert backend.engine_args["skip_tokenizer_init"] is False  # structured outputs need vLLM's tokenizer

    async def main():
        prompt = (4, 5, 6)
        full = expected_tokens(prompt, 8)
        tokens, finish, _ = await collect(backend.generate(request("a", prompt, n=8, temperature=0.0)))
        assert (tokens, finish) == (full, "length")
        tokens, finish, _ = await collect(backend.generate(request("b", prompt, n=8, stop=(full[3],), temperature=0.0)))
        assert (tokens, finish) == (full[:4], "stop")  # the stop token included
        params = engine.params["b"]
        assert params["ignore_eos"] is True and params["stop_token_ids"] == [full[3]]
        assert (params["temperature"], params["top_k"], params["max_tokens"], params["n"]) == (0.0, -1, 8, 1)
        await collect(
            backend.generate(
                request(
                    "c",
                    prompt,
                    n=3,
                    temperature=0.8,
                    top_k=20,
                    top_p=0.5,
                    seed=42,
                    presence_penalty=0.1,
                    frequency_penalty=-0.2,
                )
            )
        )
        params = engine.params["c"]
        assert (
            params["seed"],
            params["top_k"],
            params["top_p"],
            params["presence_penalty"],
            params["frequency_penalty"],
        ) == (42, 20, 0.5, 0.1, -0.2)

    asyncio.run(main())
    asyncio.run(backend.close())
    assert engine.shut_down


def test_vllm_abort_and_early_close():
    backend, engine = vllm_backend()

    async def main():
        stream = backend.generate(request("long", n=10_000))
        await stream.__anext__()
        await backend.abort("long")
        rest = [chunk async for chunk in stream]
        assert rest[-1].finish == "abort"
        assert engine.aborted[0] == ("long", False)
        assert backend.load().cancelled_total == 1
        await backend.abort("long")  # finished: ignored
        assert backend.load().cancelled_total == 1

        early = backend.generate(request("early", n=10_000))
        await early.__anext__()
        await early.aclose()  # AsyncLLM aborts a request whose generator is closed
        assert ("early", True) in engine.aborted
        assert backend.load().num_running == 0

    asyncio.run(main())


def test_vllm_protocol_1_1_params_and_features():
    backend, _ = vllm_backend()
    info = backend.info()
    # vLLM's default FCFS; no KV connector
    assert info.features == set(FEATURES) - VLLM_UNLISTED and info.max_logprobs == 20
    params = backend.sampling_params(
        request(
            "p",
            n=8,
            min_p=0.05,
            repetition_penalty=1.3,
            min_tokens=50,
            logit_bias={5: -100.0},
            logprobs=2,
            structured=STRUCTURED["regex"],
        )
    )
    assert (params["min_p"], params["repetition_penalty"], params["min_tokens"]) == (0.05, 1.3, 8)  # capped
    assert params["logit_bias"] == {5: -100.0}
    assert (params["logprobs"], params["flat_logprobs"]) == (2, True)
    assert params["structured_outputs"] == {"regex": "[a-z]+"}
    plain = backend.sampling_params(request("q"))
    assert (plain["min_p"], plain["repetition_penalty"]) == (0.0, 1.0)
    assert (plain["min_tokens"], plain["logit_bias"]) == (0, None)
    assert not {"logprobs", "flat_logprobs", "structured_outputs"} & set(plain)
    assert {kind: structured_outputs(st) for kind, st in STRUCTURED.items()} == {
        "json_schema": {"json": SCHEMA},
        "json_object": {"json_object": True},
        "regex": {"regex": "[a-z]+"},
        "grammar": {"grammar": 'root ::= "x" | "y"'},
        "choice": {"choice": ["yes", "no"]},
        "structural_tag": {"structural_tag": '{"type": "structural_tag", "format": {}}'},
    }

    no_tokenizer, _ = vllm_backend({"skip_tokenizer_init": True})  # vLLM refuses structured outputs then
    assert no_tokenizer.info().features == set(FEATURES) - set(STRUCTURED_FEATURES) - VLLM_UNLISTED
    assert no_tokenizer.engine_args["skip_tokenizer_init"] is True
    whole_vocab, _ = vllm_backend(max_logprobs=-1)  # vLLM's -1: as many as the vocabulary has
    assert whole_vocab.info().max_logprobs == 6000


def test_vllm_images_go_through_shared_memory_where_dev_shm_has_room(tmp_path, caplog):
    """The bridge asks vLLM for its shared-memory processor cache (no multi-megabyte socket write per
    image) unless the operator chose a cache type, turned the cache off, or /dev/shm cannot hold it."""
    import os

    from tokenmill.engines.vllm_backend import images_in_shared_memory

    fs = os.statvfs(tmp_path)
    room_gb = fs.f_bavail * fs.f_frsize / 2**30
    assert images_in_shared_memory({"model": "m"}, room_gb / 2, str(tmp_path)) == {
        "model": "m",
        "mm_processor_cache_type": "shm",
    }
    chosen = {"model": "m", "mm_processor_cache_type": "lru"}
    assert images_in_shared_memory(chosen, room_gb / 2, str(tmp_path)) == chosen
    assert images_in_shared_memory({"model": "m", "mm_processor_cache_gb": 0}, 4, str(tmp_path)) == {
        "model": "m",
        "mm_processor_cache_gb": 0,
    }
    with caplog.at_level("WARNING", logger="tokenmill.engine.vllm"):
        too_big = {"model": "m", "mm_processor_cache_gb": room_gb * 2 + 1}
        assert images_in_shared_memory(too_big, 4, str(tmp_path)) == too_big
    assert "mm_processor_cache_type lru" in caplog.text
    assert images_in_shared_memory({"model": "m"}, 4, str(tmp_path / "absent")) == {"model": "m"}


def test_vllm_protocol_1_2_params_and_features():
    """priority -> generate(priority=), cache_salt -> the TokensPrompt's cache_salt, allowed_token_ids ->
    SamplingParams.allowed_token_ids, bad_words' token sequences -> the ones vLLM bans. The priority
    feature only when vLLM schedules by priority (with "fcfs" vLLM 0.32 ignores a priority)."""
    fcfs, _ = vllm_backend()
    assert "priority" not in fcfs.info().features
    assert {"cache_salt", "allowed_token_ids", "bad_words"} <= fcfs.info().features
    backend, engine = vllm_backend(policy="priority")
    assert backend.info().features == (set(FEATURES) - VLLM_UNLISTED) | {"priority"}
    params = backend.sampling_params(request("p", allowed_token_ids=[5, 9], bad_words=[[7, 8], [3]]))
    assert params["allowed_token_ids"] == [5, 9] and params["bad_words_token_ids"] == [[7, 8], [3]]
    plain = backend.sampling_params(request("q"))
    assert not {"allowed_token_ids", "bad_words_token_ids"} & set(plain)

    async def main():
        await collect(backend.generate(request("salted", (4, 5), n=2, priority=-7, cache_salt="alice")))
        assert engine.prompts["salted"] == {"prompt_token_ids": [4, 5], "cache_salt": "alice"}
        assert engine.priorities["salted"] == -7
        await collect(backend.generate(request("plain", (4, 5), n=2)))
        assert engine.prompts["plain"] == {"prompt_token_ids": [4, 5]} and engine.priorities["plain"] == 0

    asyncio.run(main())


def test_vllm_images_feature_only_for_a_qwen2_vl_model_with_device_normalisation():
    """images: listed for a Qwen2-VL-family model (its vLLM class reads the workers' qwen2_vl pixels) that
    rescales and normalises the workers' uint8 pixels on the device (vLLM's default, which the bridge
    leaves alone). The real engine: tests/engines/test_vllm_images.py."""
    assert "mm_device_do_normalize" not in vllm_backend()[0].engine_args

    def listed(architectures, **mm) -> bool:
        mm_config = SimpleNamespace(get_limit_per_prompt=lambda modality: 999, **mm)
        backend, _ = vllm_backend(architectures=architectures, multimodal_config=mm_config)
        return "images" in backend.info().features

    assert listed(["Qwen2VLForConditionalGeneration"], mm_device_do_normalize=True)
    assert listed(["Qwen2_5_VLForConditionalGeneration"], mm_device_do_normalize=True)
    assert not listed(["Qwen2VLForConditionalGeneration"], mm_device_do_normalize=False)
    assert not listed(["Gemma3ForConditionalGeneration"], mm_device_do_normalize=True)  # another family
    text_only, _ = vllm_backend(architectures=["LlamaForCausalLM"], multimodal_config=None)  # as vLLM has it
    assert "images" not in text_only.info().features


def test_vllm_structured_whitespace_options():
    """Structured.disable_any_whitespace and whitespace_pattern -> StructuredOutputsParams' fields beside
    the constraint. vLLM 0.32's grammar backends read neither per request, only the engine-wide
    structured_outputs_config.disable_any_whitespace, so the bridge lists that feature only with it, and
    the whitespace_pattern one never; the engine server refuses an unlisted one naming the field."""
    options = {"disable_any_whitespace": True, "whitespace_pattern": r"[ ]?"}
    assert structured_outputs(Structured("json_schema", SCHEMA, **options)) == {"json": SCHEMA, **options}
    assert structured_outputs(Structured("json_object", disable_any_whitespace=True)) == {
        "json_object": True,
        "disable_any_whitespace": True,
    }
    assert structured_outputs(Structured("regex", "a+", whitespace_pattern="")) == {
        "regex": "a+",
        "whitespace_pattern": "",
    }
    assert structured_outputs(STRUCTURED["choice"]) == {"choice": ["yes", "no"]}  # defaults: not passed

    engine = FakeAsyncLLM()
    engine.vllm_config.structured_outputs_config = SimpleNamespace(backend="xgrammar", disable_any_whitespace=True)
    compact = VLLMBackend(
        engine=engine,
        engine_args={"model": "fake/model"},
        make_sampling_params=lambda **kw: {**kw, "detokenize": False, "output_kind": "DELTA"},
    )
    compact.prepare()
    assert "structured.disable_any_whitespace" in compact.info().features
    assert "structured.whitespace_pattern" not in compact.info().features
    params = compact.sampling_params(request("p", structured=Structured("json_object", disable_any_whitespace=True)))
    assert params["structured_outputs"] == {"json_object": True, "disable_any_whitespace": True}
    no_tokenizer, _ = vllm_backend({"skip_tokenizer_init": True})
    assert not set(STRUCTURED_OPTION_FEATURES) & no_tokenizer.info().features

    plain, _ = vllm_backend()

    async def main():
        server, task, endpoint = await serving(plain)
        fe = Frontend(endpoint)
        try:
            await fe.hello()
            await fe.generate("compact", (1, 2), 2, structured=Structured("json_object", disable_any_whitespace=True))
            await fe.generate("pattern", (1, 2), 2, structured=Structured("regex", "a+", whitespace_pattern=" "))
            done = await fe.results(["compact", "pattern"])
            assert (done["compact"][2].code, done["compact"][2].param) == (
                "unsupported",
                "structured.disable_any_whitespace",
            )
            assert (done["pattern"][2].code, done["pattern"][2].param) == (
                "unsupported",
                "structured.whitespace_pattern",
            )
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())


def test_vllm_structured_options_reach_the_engine_core():
    """With vLLM installed: the real StructuredOutputsParams keeps both options through the msgpack trip."""
    pytest.importorskip("vllm")
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from tokenmill.engines.vllm_backend import vllm_sampling_params

    so = structured_outputs(Structured("json_object", disable_any_whitespace=True, whitespace_pattern=r"\n?"))
    params = vllm_sampling_params(max_tokens=3, structured_outputs=so)
    back = MsgpackDecoder(type(params)).decode(MsgpackEncoder().encode(params))
    assert back.structured_outputs.json_object is True
    assert (
        back.structured_outputs.disable_any_whitespace is True and back.structured_outputs.whitespace_pattern == r"\n?"
    )


def test_vllm_sampling_params_carry_bad_words_token_ids():
    """With vLLM installed: the real SamplingParams keeps the sequences where its sampler reads them
    (bad_words_token_ids), through the msgpack trip to the engine core, and update_from_tokenizer
    leaves them alone (bad_words, the strings, stay empty)."""
    pytest.importorskip("vllm")
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from tokenmill.engines.vllm_backend import vllm_sampling_params

    params = vllm_sampling_params(max_tokens=3, allowed_token_ids=[1, 2], bad_words_token_ids=[[5, 6], [7]])
    params.update_from_tokenizer(None)  # returns at once: no strings to tokenize
    assert params.bad_words_token_ids == [[5, 6], [7]] and params.allowed_token_ids == [1, 2]
    back = MsgpackDecoder(type(params)).decode(MsgpackEncoder().encode(params))
    assert back.bad_words_token_ids == [[5, 6], [7]]


def test_vllm_logprobs_conversion():
    """Both of vLLM's forms: the chosen token's logprob, then the top N in rank order, whether or not the
    chosen token is among them."""
    top3 = ([100, 101, 102], [-0.25, -1.25, -2.25])
    for flat in (True, False):
        assert convert_logprobs(vllm_logprobs(100, 3, flat), [100], 3) == ([-0.25], *top3)  # the best
        assert convert_logprobs(vllm_logprobs(101, 3, flat, best=100), [101], 3) == ([-1.25], *top3)
        assert convert_logprobs(vllm_logprobs(104, 3, flat, best=100), [104], 3) == ([-4.25], *top3)  # 5th
        assert convert_logprobs(vllm_logprobs(100, 0, flat), [100], 0) == ([-0.25], [], [])
        assert convert_logprobs(None, [], 3) == ([], [], [])
    # several positions in one delta (a slow consumer): FlatLogprobs' start/end indices
    a, b = vllm_logprobs(100, 2, True), vllm_logprobs(205, 2, True, best=200)
    both = SimpleNamespace(
        start_indices=[0, 3],
        end_indices=[3, 6],
        token_ids=a.token_ids + b.token_ids,
        logprobs=a.logprobs + b.logprobs,
        ranks=a.ranks + b.ranks,
    )
    assert convert_logprobs(both, [100, 205], 2) == ([-0.25, -5.25], [100, 101, 200, 201], [-0.25, -1.25] * 2)
    a, b = vllm_logprobs(100, 2, False), vllm_logprobs(205, 2, False, best=200)
    assert convert_logprobs(a + b, [100, 205], 2) == ([-0.25, -5.25], [100, 101, 200, 201], [-0.25, -1.25] * 2)
    # a slow consumer's deltas merged by vLLM's RequestOutput.add: FlatLogprobs.extend re-appends each
    # position through a dict, so a sampled token among the top N is stored once, with its top-N rank
    merged = SimpleNamespace(
        start_indices=[0, 2, 5],
        end_indices=[2, 5, 7],
        token_ids=[100, 101] + [205, 200, 201] + [301, 300],
        logprobs=[-0.25, -1.25] + [-5.25, -0.25, -1.25] + [-1.25, -0.25],
        ranks=[1, 2] + [6, 1, 2] + [2, 1],
    )
    assert convert_logprobs(merged, [100, 205, 301], 2) == (
        [-0.25, -5.25, -1.25],
        [100, 101, 200, 201, 300, 301],
        [-0.25, -1.25] * 3,
    )


def test_vllm_logprobs_stream():
    backend, engine = vllm_backend()

    async def main():
        prompt = (4, 5, 6)
        chunks = [c async for c in backend.generate(request("lp", prompt, n=3, logprobs=2))]
        tokens = expected_tokens(prompt, 3)
        assert engine.params["lp"]["flat_logprobs"] is True
        assert [t for c in chunks for t in c.token_ids] == tokens
        assert [v for c in chunks for v in c.logprobs] == [-0.25] * 3
        assert [t for c in chunks for t in c.top_ids] == [t + k for t in tokens for k in range(2)]
        none = [c async for c in backend.generate(request("none", prompt, n=2))]
        assert all(c.logprobs is None for c in none) and "logprobs" not in engine.params["none"]

    asyncio.run(main())


def test_vllm_validation_error_is_a_rejection():
    backend, _ = vllm_backend()

    async def main():
        with pytest.raises(EngineRejected, match="longer than"):
            await collect(backend.generate(request("big", prompt=range(101))))
        assert backend.load().num_running == 0

    asyncio.run(main())


# ---------------------------------------------------------------------------- the engine server


class Frontend(AsyncProtocolClient):
    """A DEALER talking the protocol to an in-process EngineServer."""

    async def generate(
        self, rid: str, prompt, n: int, stop=(), ignore_eos=False, logprobs=None, structured=None, **sampling
    ) -> None:
        await self.send_generate(
            rid,
            prompt,
            max_new_tokens=n,
            sampling=SamplingParams(**sampling),
            stop_token_ids=list(stop),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            structured=structured,
        )

    async def results(self, rids) -> dict[str, tuple[list[int], str, object]]:
        """rid -> (tokens, finish reason or "rejected", final output or Error); each request's logprobs
        (chosen, top IDs, top logprobs, all outputs joined) go to ``self.logprobs``."""
        tokens = {rid: [] for rid in rids}
        self.logprobs = {rid: ([], [], []) for rid in rids}
        done: dict[str, tuple] = {}
        while len(done) < len(rids):
            message = await self.recv()
            if isinstance(message, Error):
                done[message.request_id] = ([], "rejected", message)
                continue
            assert isinstance(message, Outputs), message
            for out in message.outputs:
                tokens[out.request_id] += frame_to_ids(out.token_ids)
                chosen, top_ids, top_values = self.logprobs[out.request_id]
                chosen += bytes_to_floats(out.logprobs)
                top_ids += frame_to_ids(out.top_ids)
                top_values += bytes_to_floats(out.top_logprobs)
                assert out.completion_tokens == len(tokens[out.request_id])
                if out.finish_reason:
                    done[out.request_id] = (tokens[out.request_id], out.finish_reason, out)
        return done


async def serving(backend):
    server = EngineServer(backend, stats_interval_s=0.05)
    task = asyncio.create_task(server.serve("tcp://127.0.0.1:0"))
    endpoint = await asyncio.wait_for(server.wait_ready(), WAIT)
    return server, task, endpoint


async def stop_serving(server, task) -> None:
    await asyncio.wait_for(server.close(), WAIT)
    await asyncio.wait_for(task, WAIT)


def test_engine_server_with_sglang_end_to_end():
    """The protocol through the SGLang bridge: 8 requests together, enforced stop IDs, aborts, errors."""
    backend, engine = sglang_backend()

    async def main():
        await backend.start()
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            welcome = await fe.hello()
            assert (welcome.scheduler_name, welcome.max_model_len, welcome.max_running_requests) == (
                "sglang:fake/model",
                1024,
                48,
            )
            prompts = {f"r{i}": (i, 2 * i, 3) for i in range(IN_FLIGHT_GOAL)}
            stop_at = expected_tokens(prompts["r1"], 6)[2]
            for rid, prompt in prompts.items():
                if rid == "r1":  # ignore_eos: SGLang would not stop; the server must, at the stop ID
                    await fe.generate(rid, prompt, 6, stop=(stop_at,), ignore_eos=True)
                else:
                    await fe.generate(rid, prompt, 6, temperature=0.0)
            done = await fe.results(list(prompts))
            for rid, prompt in prompts.items():
                tokens, reason, out = done[rid]
                if rid == "r1":
                    assert (tokens, reason) == (expected_tokens(prompt, 3), "stop")
                else:
                    assert (tokens, reason) == (expected_tokens(prompt, 6), "length")
                assert out.prompt_tokens == 3
            assert engine.max_in_flight == IN_FLIGHT_GOAL
            for _ in range(100):  # the engine-side abort of r1 lands shortly after its final output
                if engine.aborted:
                    break
                await asyncio.sleep(0.01)
            (r1_rid,) = [rid for rid, r in engine.requests.items() if r["input_ids"] == list(prompts["r1"])]
            assert engine.aborted == [r1_rid]  # only r1 went on in the engine after its final output
            assert engine.requests[r1_rid]["sampling_params"]["ignore_eos"] is True

            # an abort from the front end stops the request inside the engine at once
            engine.in_flight_goal = 1
            await fe.generate("long", (9, 9), 100_000)
            first = await fe.recv(Outputs)
            assert first.outputs[0].request_id == "long" and first.outputs[0].finish_reason is None
            await fe.send(Abort(request_ids=["long", "unknown"]))
            # one message may carry several of its outputs (all queued before one flush)
            assert {o.request_id for o in first.outputs} == {"long"}
            got = sum(len(o.token_ids) // 4 for o in first.outputs)
            assert got == first.outputs[-1].completion_tokens
            while True:
                message = await fe.recv(Outputs)
                final = [o for o in message.outputs if o.finish_reason]
                got += sum(len(o.token_ids) // 4 for o in message.outputs)
                if final:
                    assert final[0].finish_reason == "abort" and final[0].completion_tokens == got
                    break
            stats = await fe.recv(Stats)
            while stats.cancelled_total < 2 or stats.num_running:
                stats = await fe.recv(Stats)
            assert stats.peak_running >= IN_FLIGHT_GOAL

            # an engine-side validation error is a protocol error carrying the request_id
            await fe.generate("big", list(range(1, 102)), 4)
            error = await fe.recv()
            assert isinstance(error, Error) and error.request_id == "big" and "context length" in error.message
            # a prompt token outside the engine's vocabulary never reaches it
            await fe.generate("oov", (1, 5000), 4)
            error = await fe.recv()
            assert isinstance(error, Error) and error.request_id == "oov" and "vocabulary size 5000" in error.message
        finally:
            fe.close()
            await stop_serving(server, task)
            await backend.close()
        assert engine.violations == []

    asyncio.run(main())


class ScriptedBackend(Backend):
    """A backend whose chunks the test scripts; records aborts and closed streams."""

    name = "scripted"

    def __init__(self, script, features=(), max_logprobs: int = 20) -> None:
        self.script = script
        self.features = frozenset(features)
        self.max_logprobs = max_logprobs
        self.aborted: list[str] = []
        self.closed_streams: list[str] = []
        self.requests: dict[str, EngineRequest] = {}

    def info(self) -> EngineInfo:
        return EngineInfo(
            name="scripted",
            vocab_size=100,
            max_running_requests=4,
            max_model_len=50,
            features=self.features,
            max_logprobs=self.max_logprobs,
        )

    async def generate(self, request: EngineRequest):
        self.requests[request.rid] = request
        try:
            async for chunk in self.script(request):
                yield chunk
        finally:
            self.closed_streams.append(request.rid)

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def load(self) -> EngineLoad:
        return EngineLoad(num_running=0)


def test_engine_server_finish_rules_and_failures():
    async def script(req: EngineRequest):
        kind = req.prompt[0]
        if kind == 1:  # an engine that ignores max_new_tokens and stops only when told
            for t in range(10, 90):
                yield Chunk([t, t])
        elif kind == 2:  # fails after some tokens
            yield Chunk([11])
            raise RuntimeError("CUDA error: device-side assert triggered")
        elif kind == 3:  # ends without a finish reason
            yield Chunk([12])
        elif kind == 4:  # the engine's own stop, reported with the stop token
            yield Chunk([13, 14], "stop")
        elif kind == 5:  # the engine gives up on the request before any token
            yield Chunk([], "abort", "out of KV cache")
        elif kind == 6:  # the engine reports an error
            yield Chunk([15], "error", "NaN in logits")
        await asyncio.sleep(0)

    backend = ScriptedBackend(script)

    async def main():
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            welcome = await fe.hello()
            assert welcome.max_model_len == 50 and welcome.max_running_requests == 4
            await fe.generate("len", (1,), 5)
            await fe.generate("stop", (1, 1), 100, stop=(21,))
            await fe.generate("clamped", (1, 1, 1), 100)  # max_model_len 50: 47 tokens at most
            await fe.generate("fail", (2,), 5)
            await fe.generate("noend", (3,), 5)
            await fe.generate("own-stop", (4,), 5, stop=(99,))
            await fe.generate("gave-up", (5,), 5)
            await fe.generate("err", (6,), 5)
            await fe.generate("too-long", tuple([1] * 50), 5)
            done = await fe.results(
                ["len", "stop", "clamped", "fail", "noend", "own-stop", "gave-up", "err", "too-long"]
            )
            assert done["len"][:2] == ([10, 10, 11, 11, 12], "length")
            assert done["stop"][:2] == (
                [10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15, 16, 16, 17, 17, 18, 18, 19, 19, 20, 20, 21],
                "stop",
            )
            assert len(done["clamped"][0]) == 47 and done["clamped"][1] == "length"
            assert (
                done["fail"][0] == [11] and done["fail"][1] == "error" and "device-side assert" in done["fail"][2].error
            )
            assert done["noend"][1] == "error" and "without a finish reason" in done["noend"][2].error
            assert done["own-stop"][:2] == ([13, 14], "stop")
            assert done["gave-up"][1] == "rejected" and done["gave-up"][2].message == "out of KV cache"
            assert done["err"][:2] == ([15], "error") and done["err"][2].error == "NaN in logits"
            assert done["too-long"][1] == "rejected" and "at most 50 tokens" in done["too-long"][2].message
            # requests the server ended while the engine went on were aborted inside it
            for _ in range(200):
                if len(backend.aborted) >= 3 and len(backend.closed_streams) >= 8:
                    break
                await asyncio.sleep(0.01)
            assert len(backend.aborted) == 3
            assert len(backend.closed_streams) == 8  # every stream was closed
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())


def scripted_logprobs(tokens, top_n: int, first: float = -0.5, floor_at: int | None = None) -> Chunk:
    """A chunk of ``tokens`` with logprobs: token i gets ``first - i`` (-inf at ``floor_at``); its top
    ``top_n`` are token + k with ``first - i - k``."""
    chosen = [float("-inf") if i == floor_at else first - i for i in range(len(tokens))]
    ids = [t + k for t in tokens for k in range(top_n)]
    values = [first - i - k for i in range(len(tokens)) for k in range(top_n)]
    return Chunk(tokens, logprobs=chosen, top_ids=ids, top_logprobs=values)


def test_engine_server_packs_and_cuts_logprobs():
    """Logprobs travel as float32 / uint32 bytes, N per token best first, -inf as -9999.0, and are cut
    with the tokens at a stop token or the length limit; counts that do not fit the tokens fail the
    request; Welcome carries the backend's features."""

    async def script(req: EngineRequest):
        n = req.logprobs or 0
        kind = req.prompt[0]
        if kind == 1:  # five tokens in one step: the server stops at the stop token, the third
            yield scripted_logprobs([20, 21, 22, 23, 24], n, floor_at=1)
            await asyncio.Event().wait()
        elif kind == 2:  # two tokens a step: the length limit cuts the second chunk in half
            yield scripted_logprobs([30, 31], n)
            yield scripted_logprobs([32, 33], n, first=-3.0)
            await asyncio.Event().wait()
        elif kind == 3:  # an engine that returns fewer logprobs than tokens
            yield Chunk([40, 41], logprobs=[-1.0], top_ids=[], top_logprobs=[])
        elif kind == 4:  # fewer top entries than asked for
            yield Chunk([42], logprobs=[-1.0], top_ids=[42], top_logprobs=[-1.0])
        elif kind == 5:  # the engine's own finish, nothing more to cut
            yield scripted_logprobs([50], n)
            chunk = scripted_logprobs([51], n)
            chunk.finish = "stop"
            yield chunk

    backend = ScriptedBackend(script, features={"logprobs"}, max_logprobs=5)

    async def main():
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            welcome = await fe.hello()
            assert (welcome.features, welcome.max_logprobs) == (["logprobs"], 5)
            await fe.generate("stop", (1,), 10, stop=(22,), logprobs=2)
            await fe.generate("length", (2,), 3, logprobs=2)
            await fe.generate("chosen", (2,), 3, logprobs=0)
            await fe.generate("short", (3,), 5, logprobs=0)
            await fe.generate("few-top", (4,), 5, logprobs=2)
            await fe.generate("own-stop", (5,), 5, logprobs=1)
            await fe.generate("none", (2,), 3)
            done = await fe.results(["stop", "length", "chosen", "short", "few-top", "own-stop", "none"])
            lp = fe.logprobs
            assert done["stop"][:2] == ([20, 21, 22], "stop")
            assert lp["stop"] == ([-0.5, -9999.0, -2.5], [20, 21, 21, 22, 22, 23], [-0.5, -1.5, -1.5, -2.5, -2.5, -3.5])
            assert done["length"][:2] == ([30, 31, 32], "length")
            assert lp["length"] == ([-0.5, -1.5, -3.0], [30, 31, 31, 32, 32, 33], [-0.5, -1.5, -1.5, -2.5, -3.0, -4.0])
            assert done["chosen"][:2] == ([30, 31, 32], "length") and lp["chosen"] == ([-0.5, -1.5, -3.0], [], [])
            assert done["short"][1] == "error" and "1 logprobs for 2 tokens" in done["short"][2].error
            assert done["few-top"][1] == "error" and "expected 2 per token" in done["few-top"][2].error
            assert done["own-stop"][:2] == ([50, 51], "stop")
            assert lp["own-stop"] == ([-0.5, -0.5], [50, 51], [-0.5, -0.5])
            assert done["none"][:2] == ([30, 31, 32], "length") and lp["none"] == ([], [], [])
            assert backend.requests[next(r for r, q in backend.requests.items() if q.prompt == [1])].logprobs == 2
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())


def test_engine_server_refuses_what_the_backend_cannot_honour():
    """A 1.1 field the backend does not list in its features: an ``unsupported`` error naming the field,
    before the backend sees the request; out-of-range values: ``bad_request`` naming it; an engine's
    EngineRejected carries its param too."""

    async def script(req: EngineRequest):
        if req.sampling.min_p > 0.5:
            raise EngineRejected("min_p too high for this engine", param="sampling.min_p")
        chunk = scripted_logprobs([10], req.logprobs or 0)
        chunk.finish = "length"
        yield chunk

    partial = ScriptedBackend(script, features={"logprobs", "min_p", "structured.json_schema"}, max_logprobs=5)
    bare = ScriptedBackend(script)

    async def main():
        server, task, endpoint = await serving(partial)
        fe = Frontend(endpoint)
        try:
            welcome = await fe.hello()
            assert (welcome.features, welcome.max_logprobs) == (["logprobs", "min_p", "structured.json_schema"], 5)
            await fe.generate("bias", (1,), 3, logit_bias={5: 1.0})
            await fe.generate("regex", (1,), 3, structured=Structured(kind="regex", spec="a+"))
            await fe.generate("rep", (1,), 3, repetition_penalty=1.2)
            await fe.generate("min-tokens", (1,), 3, min_tokens=2)
            await fe.generate("too-many", (1,), 3, logprobs=6)
            await fe.generate("engine-says", (1,), 3, min_p=0.9)
            await fe.generate("schema", (1,), 3, min_p=0.1, logprobs=5, structured=STRUCTURED["json_schema"])
            done = await fe.results(["bias", "regex", "rep", "min-tokens", "too-many", "engine-says", "schema"])
            errors = {rid: (r[2].code, r[2].param) for rid, r in done.items() if r[1] == "rejected"}
            assert errors == {
                "bias": ("unsupported", "sampling.logit_bias"),
                "regex": ("unsupported", "structured"),
                "rep": ("unsupported", "sampling.repetition_penalty"),
                "min-tokens": ("unsupported", "sampling.min_tokens"),
                "too-many": ("bad_request", "logprobs"),
                "engine-says": ("bad_request", "sampling.min_p"),
            }
            assert "regex" in done["regex"][2].message
            assert done["schema"][1] == "length"  # everything it uses is listed
            assert len(partial.requests) == 2  # only "engine-says" and "schema" reached the backend
            (schema,) = [r for r in partial.requests.values() if r.structured is not None]
            assert (schema.structured, schema.logprobs, schema.sampling.min_p) == (STRUCTURED["json_schema"], 5, 0.1)
        finally:
            fe.close()
            await stop_serving(server, task)

        server, task, endpoint = await serving(bare)
        fe = Frontend(endpoint)
        try:
            welcome = await fe.hello()
            assert (welcome.features, welcome.max_logprobs) == ([], None)  # a 1.1 engine that honours none
            await fe.generate("lp", (1,), 3, logprobs=0)
            done = await fe.results(["lp"])
            assert (done["lp"][2].code, done["lp"][2].param) == ("unsupported", "logprobs")
            assert bare.requests == {}
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())


def test_engine_server_with_sglang_logprobs():
    """Through the SGLang bridge: logprobs of a request the server stops (ignore_eos: SGLang would go on)."""
    backend, engine = sglang_backend()
    engine.in_flight_goal = 1
    prompt = (7, 8, 9)
    full = expected_tokens(prompt, 6)

    async def main():
        await backend.start()
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            welcome = await fe.hello()
            assert welcome.features == ["logit_bias", "logprobs", "min_p", "repetition_penalty"]
            await fe.generate("lp", prompt, 6, stop=(full[2],), ignore_eos=True, logprobs=2, logit_bias={3: -5.0})
            done = await fe.results(["lp"])
            assert done["lp"][:2] == (full[:3], "stop")
            assert fe.logprobs["lp"] == ([-0.25] * 3, [t + k for t in full[:3] for k in range(2)], [-0.25, -1.25] * 3)
            (params,) = [r for r in engine.requests.values() if r["input_ids"] == list(prompt)]
            assert params["sampling_params"]["logit_bias"] == {"3": -5.0} and params["top_logprobs_num"] == 2
        finally:
            fe.close()
            await stop_serving(server, task)
            await backend.close()

    asyncio.run(main())


def test_vllm_errors_name_the_field():
    """vLLM's validation errors reach the front end as protocol errors naming the field: its own
    parameter name mapped to the protocol's, or "structured" for a grammar it cannot compile."""
    backend, _ = vllm_backend()

    async def main():
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            welcome = await fe.hello()
            assert welcome.features == sorted(set(FEATURES) - VLLM_UNLISTED)
            assert welcome.max_logprobs == 20
            await fe.generate("many", (1, 2), 3, logprobs=11)  # within Welcome's 20, beyond this vLLM's 10
            await fe.generate("schema", (1, 2), 3, structured=Structured(kind="json_schema", spec="{not json"))
            await fe.generate(
                "ok",
                (1, 2),
                2,
                logprobs=1,
                min_p=0.1,
                min_tokens=1,
                logit_bias={7: 2.0},
                repetition_penalty=1.1,
                structured=STRUCTURED["choice"],
            )
            done = await fe.results(["many", "schema", "ok"])
            assert (done["many"][2].code, done["many"][2].param) == ("bad_request", "logprobs")
            assert "greater than max allowed" in done["many"][2].message
            assert (done["schema"][2].code, done["schema"][2].param) == ("bad_request", "structured")
            assert done["ok"][1] == "length" and len(fe.logprobs["ok"][0]) == 2 == len(fe.logprobs["ok"][1])
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())


def test_a_vanished_front_end_frees_its_requests_in_the_engine():
    backend, engine = vllm_backend()

    async def main():
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            await fe.hello()
            await fe.generate("a", (1, 2), 100_000)
            await fe.recv(Outputs)
            await fe.send(Hello(protocol_version=PROTOCOL_VERSION))  # a new session: "a" is stale
            await fe.recv(Welcome)
            for _ in range(200):
                if engine.aborted:
                    break
                await asyncio.sleep(0.01)
            assert [rid for rid, _ in engine.aborted] == [next(iter(engine.params))]
            assert backend.load().num_running == 0
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())


def test_missing_backend_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # "not installed", even where it is
    backend = SGLangBackend(engine_kwargs={"model_path": "x"})
    with pytest.raises(MissingBackend, match=r"pip install 'tokenmill\[sglang\]'"):
        backend.prepare()
    with pytest.raises(ValueError, match="unknown backend"):
        backend_module("tensorrt")


def test_vllm_prompt_logprobs_kv_transfer_params_and_extra_args():
    """Protocol 1.2's rest: prompt_logprobs -> SamplingParams.prompt_logprobs, and vLLM's first output's
    prompt logprobs (flat or dicts) -> the packed arrays of the first RequestOutput; kv_transfer_params
    and extra_args -> SamplingParams.extra_args as vLLM's server builds it, the finished output's
    kv_transfer_params -> the final RequestOutput's. kv_transfer_params is listed only with a KV connector."""
    engine = FakeAsyncLLM()
    engine.vllm_config.kv_transfer_config = SimpleNamespace(kv_connector="NixlConnector")
    backend = VLLMBackend(
        engine=engine,
        engine_args={"model": "fake/model"},
        make_sampling_params=lambda **kw: {**kw, "detokenize": False, "output_kind": "DELTA"},
    )
    backend.prepare()
    assert {"prompt_logprobs", "kv_transfer_params", "extra_args"} <= backend.info().features
    assert "kv_transfer_params" not in vllm_backend()[0].info().features  # no connector
    req = request("p", (4, 5, 6, 7), n=2)
    req.prompt_logprobs, req.kv_transfer_params, req.extra_args = 2, {"do_remote_decode": True}, {"a": [1, "x"]}
    params = backend.sampling_params(req)
    assert params["prompt_logprobs"] == 2
    assert params["extra_args"] == {"a": [1, "x"], "kv_transfer_params": {"do_remote_decode": True}}
    assert not {"prompt_logprobs", "extra_args"} & set(backend.sampling_params(request("q")))
    only_kv = request("k")
    only_kv.kv_transfer_params = {"x": 1}
    assert backend.sampling_params(only_kv)["extra_args"] == {"kv_transfer_params": {"x": 1}}
    # both of vLLM's forms: the prompt token's logprob and rank (1, 2, 3 in turn), then the top 2 in rank order
    prompt = [40, 50, 60, 70]
    expected = ([-0.25, -1.25, -2.25], [1, 2, 3], [50, 51, 59, 60, 68, 69], [-0.25, -1.25] * 3)
    for flat in (True, False):
        assert convert_prompt_logprobs(vllm_prompt_logprobs(prompt, 2, flat), prompt, 2) == expected
        assert convert_prompt_logprobs(vllm_prompt_logprobs(prompt, 0, flat), prompt, 0) == (*expected[:2], [], [])

    async def main():
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            await fe.hello()
            gen = Generate(
                request_id="r",
                prompt_token_count=4,
                max_new_tokens=3,
                prompt_logprobs=2,
                kv_transfer_params={"do_remote_decode": True},
                extra_args={"a": 1},
            )
            await fe.sock.send_multipart([encode(gen), ids_to_frame(prompt)])
            outputs = []
            while not outputs or outputs[-1].finish_reason is None:
                message = await fe.recv()
                assert isinstance(message, Outputs), message
                outputs += message.outputs
            first = outputs[0].prompt_logprobs
            assert first is not None and all(o.prompt_logprobs is None for o in outputs[1:])
            assert list(bytes_to_floats(first.logprobs)) == expected[0] and list(frame_to_ids(first.ranks)) == [1, 2, 3]
            assert list(frame_to_ids(first.top_ids)) == expected[2]
            assert list(bytes_to_floats(first.top_logprobs)) == expected[3]
            assert outputs[-1].kv_transfer_params == {"remote_block_ids": [1, 2], "asked": {"do_remote_decode": True}}
            assert all(o.kv_transfer_params is None for o in outputs[:-1])
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())


def test_engine_server_checks_prompt_logprobs_against_the_prompt():
    """A backend whose prompt logprobs do not fit the prompt fails the request, as mismatched logprobs do."""

    async def script(req: EngineRequest):
        yield Chunk([9], prompt_logprobs=([-1.0], [1], [], []))  # one position; the prompt has two
        await asyncio.Event().wait()

    backend = ScriptedBackend(script, features={"prompt_logprobs"})

    async def main():
        server, task, endpoint = await serving(backend)
        fe = Frontend(endpoint)
        try:
            await fe.hello()
            gen = Generate(request_id="bad", prompt_token_count=3, max_new_tokens=3, prompt_logprobs=0)
            await fe.sock.send_multipart([encode(gen), ids_to_frame([1, 2, 3])])
            done = await fe.results(["bad"])
            assert done["bad"][1] == "error" and "prompt positions" in done["bad"][2].error
        finally:
            fe.close()
            await stop_serving(server, task)

    asyncio.run(main())
