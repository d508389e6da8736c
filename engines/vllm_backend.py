"""The vLLM backend: ``vllm.v1.engine.async_llm.AsyncLLM`` fed with token IDs.

The engine is built with ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=...,
skip_tokenizer_init=True, ...))``. ``AsyncLLM`` is an asyncio client of vLLM's engine-core
process and is meant to be driven from one event loop, concurrently: every request is one
``generate({"prompt_token_ids": ids}, SamplingParams(..., detokenize=False,
output_kind=RequestOutputKind.DELTA), request_id)`` async generator on the engine server's
own loop, and ``abort(request_id)`` cancels it inside the engine (so does closing the
generator early: AsyncLLM aborts a request whose generator is cancelled or closed).

Sampling parameters (docs/engines.md has the table) map one to one: temperature (0 is
greedy), top_p, top_k (0 -> -1, "disabled"), seed (per request), presence/frequency
penalties, ``max_new_tokens`` -> ``max_tokens``, ``stop_token_ids``. The bridge always sets
``ignore_eos=True``: the front end already put the model's EOS IDs into ``stop_token_ids``
(unless the client asked for ``ignore_eos``), and vLLM's ``ignore_eos`` leaves
``stop_token_ids`` working, so the request stops exactly at ``stop_token_ids`` as the
protocol says. vLLM's own validation errors (prompt too long, a token ID outside the
vocabulary, a parameter out of range) become protocol errors carrying the request_id.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from engines import engine_kwargs, require
from engines.server import Backend, Chunk, EngineInfo, EngineLoad, EngineRejected, EngineRequest
from scheduler_client.protocol import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP

log = logging.getLogger("tokenmill.engine.vllm")

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


def vllm_sampling_params(**kwargs: Any):
    """vLLM's SamplingParams for token-ID streaming: no detokenization, delta outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA, **kwargs)


def _is_client_error(exc: BaseException) -> bool:
    """vLLM's request-validation errors (VLLMClientError/VLLMValidationError, ValueError in older versions)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, (ValueError, TypeError)) or bool(names & {"VLLMClientError", "VLLMValidationError"})


class VLLMBackend(Backend):
    """vLLM's AsyncLLM on the engine server's event loop."""

    name = "vllm"

    def __init__(
        self,
        *,
        engine: Any = None,
        engine_args: dict[str, Any] | None = None,
        engine_factory: Callable[[dict[str, Any]], Any] | None = None,
        make_sampling_params: Callable[..., Any] | None = None,
        label: str | None = None,
    ) -> None:
        args = dict(engine_args or {})
        if args.get("skip_tokenizer_init") is False:
            raise ValueError("the vllm backend feeds token IDs: skip_tokenizer_init must stay true")
        args["skip_tokenizer_init"] = True
        self.engine_args = args
        self.engine = engine
        self._factory = engine_factory
        self._make_params = make_sampling_params or vllm_sampling_params
        self.label = label or str(args.get("model") or "model")
        self._info: EngineInfo | None = None
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._peak = 0
        self._cancelled = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VLLMBackend:
        engine_args = engine_kwargs(args, "vllm", "model", "max_model_len", "max_num_seqs")
        return cls(engine_args=engine_args, label=args.model)

    # ------------------------------------------------------------------ lifecycle

    def prepare(self) -> None:
        if self.engine is None:
            factory = self._factory or _default_factory
            # Outside the event loop: AsyncLLM starts its output handler lazily, on the
            # first generate(), in the loop that calls it.
            self.engine = factory(self.engine_args)
        self._info = self._describe()

    def _describe(self) -> EngineInfo:
        engine = self.engine
        config = getattr(engine, "vllm_config", None)
        model_config = getattr(engine, "model_config", None) or getattr(config, "model_config", None)
        scheduler_config = getattr(config, "scheduler_config", None)
        vocab = None
        if model_config is not None and hasattr(model_config, "get_vocab_size"):
            vocab = int(model_config.get_vocab_size())
        max_model_len = getattr(model_config, "max_model_len", None)
        max_running = getattr(scheduler_config, "max_num_seqs", None)
        log.info("vllm engine ready: max_model_len %s, vocab %s, max_num_seqs %s", max_model_len, vocab, max_running)
        return EngineInfo(
            name=f"vllm:{self.label}", vocab_size=vocab, max_running_requests=max_running, max_model_len=max_model_len
        )

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if getattr(self.engine, "errored", False):
                log.error("the vLLM engine died: %s", getattr(self.engine, "dead_error", None))
                return

    async def close(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)

    # ------------------------------------------------------------------ requests

    def sampling_params(self, request: EngineRequest):
        s = request.sampling
        return self._make_params(
            n=1,
            max_tokens=request.max_new_tokens,
            temperature=float(s.temperature),
            top_p=float(s.top_p),
            top_k=int(s.top_k) if s.top_k > 0 else -1,
            seed=s.seed,
            presence_penalty=float(s.presence_penalty),
            frequency_penalty=float(s.frequency_penalty),
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=True,  # stop exactly at stop_token_ids (the front end put EOS there)
            skip_special_tokens=False,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        rid = request.rid
        try:
            params = self.sampling_params(request)
        except Exception as exc:
            if _is_client_error(exc):
                raise EngineRejected(f"vLLM rejected the sampling parameters: {exc}") from exc
            raise
        self._running.add(rid)
        self._peak = max(self._peak, len(self._running))
        stream = self.engine.generate({"prompt_token_ids": request.prompt}, params, rid)
        produced = finished = False
        try:
            async for out in stream:
                completion = out.outputs[0] if out.outputs else None
                tokens = list(completion.token_ids) if completion is not None else []
                finish = error = None
                if out.finished:
                    reason = completion.finish_reason if completion is not None else None
                    finish = _FINISH.get(reason)
                    if finish is None:
                        finish, error = FINISH_ERROR, f"vLLM finished the request with {reason!r}"
                    # vLLM's generator ends right after its finished output; closing it before that
                    # counts (and logs) as an abort, so let it end first
                    async for _ in stream:
                        pass
                    finished = True
                produced = True
                yield Chunk(tokens, finish, error, getattr(out, "num_cached_tokens", None))
                if finish is not None:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if not finished and rid not in self._aborted:  # stopped from outside: closing the stream aborts it
                self._cancelled += 1
            raise
        except Exception as exc:
            if not produced and _is_client_error(exc):
                raise EngineRejected(str(exc)) from exc
            cause = exc.__cause__ or exc
            raise RuntimeError(f"{type(cause).__name__}: {cause}") from exc
        finally:
            await _aclose(stream)  # AsyncLLM aborts a request whose generator is closed early
            self._running.discard(rid)
            self._aborted.discard(rid)

    async def abort(self, rid: str) -> None:
        if rid not in self._running or rid in self._aborted:
            return
        self._aborted.add(rid)
        await self.engine.abort(rid)
        self._cancelled += 1

    def load(self) -> EngineLoad:
        running = len(self._running)
        self._peak = max(self._peak, running)
        return EngineLoad(num_running=running, num_waiting=0, peak_running=self._peak, cancelled_total=self._cancelled)


async def _aclose(stream) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # an engine already torn down
            log.debug("closing a vLLM stream failed", exc_info=True)


def _default_factory(engine_args: dict[str, Any]):
    require("vllm", "vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))


# --------------------------------------------------------------------------- command line


def from_args(args: argparse.Namespace) -> VLLMBackend:
    """The backend ``tokenmill engine --backend ...`` asked for."""
    return VLLMBackend.from_args(args)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.description = (
        "--model, --max-model-len (max_model_len), --max-running (max_num_seqs), --dtype, and "
        "--engine-arg KEY=VALUE for any other AsyncEngineArgs field, e.g. tensor_parallel_size=2, "
        "gpu_memory_utilization=0.9"
    )


__all__ = ["from_args", "VLLMBackend", "vllm_sampling_params", "add_arguments"]
