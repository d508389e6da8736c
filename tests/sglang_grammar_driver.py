"""Runs specs through the SGLang bridge's admission check with SGLang's real grammar backends; for
tests/engines/test_structured_sglang.py, in .venv-vllm with SGLang's wheel on PYTHONPATH.

    python tests/sglang_grammar_driver.py < {"backends": [...], "specs": [{"id", "kind", "spec", "choices"}]}

The bridge (engines/sglang_backend.SGLangBackend) is prepared on a stand-in for ``sglang.Engine`` that
carries SGLang's own ``ServerArgs``, the served model's tokenizer and vocabulary, and an engine that
records what reaches it and ends each request after one token: no model runs. Prints one JSON line:
per backend, per spec id, {"refused": SGLang's message or null, "param", "reached": sampling params}.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from sglang.srt.server_args import ServerArgs
from transformers import AutoTokenizer

from tokenmill.engines.bridge import EngineRejected, EngineRequest
from tokenmill.engines.sglang_backend import SGLangBackend
from tokenmill.scheduler_client.protocol import SamplingParams, Structured
from tokenmill.tiny_model import EOS, VOCAB, write_tokenizer


class StandInEngine:
    """What the bridge uses of sglang.Engine: its loop, ServerArgs, tokenizer manager and async_generate."""

    def __init__(self, model_path: str, tokenizer, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        args = {k: v for k, v in kwargs.items() if k in ServerArgs.__struct_fields__}
        self.server_args = ServerArgs(model_path=model_path, **args)
        self.tokenizer_manager = SimpleNamespace(
            tokenizer=tokenizer,
            model_config=SimpleNamespace(vocab_size=VOCAB, hf_eos_token_id={EOS}),
            context_len=4096,
            get_internal_state=self._state,
            abort_request=lambda rid=None, abort_all=False: None,
        )
        self.reached: dict[str, dict] = {}

    async def _state(self) -> list[dict]:
        return [{"max_running_requests": 8}]

    async def async_generate(self, input_ids, sampling_params, stream, rid, **_):
        self.reached[rid] = dict(sampling_params)

        async def one_token():
            yield {"output_ids": [5], "meta_info": {"completion_tokens": 1, "finish_reason": {"type": "length"}}}

        return one_token()

    def shutdown(self) -> None:
        pass


async def _run(backend: SGLangBackend, engine: StandInEngine, specs: list[dict]) -> dict:
    verdicts = {}
    for spec in specs:
        structured = Structured(spec["kind"], spec.get("spec"), choices=spec.get("choices"))
        request = EngineRequest(spec["id"], [3, 4], 1, SamplingParams(), [], False, structured=structured)
        refused = param = None
        try:
            async for _ in backend.generate(request):
                pass
        except EngineRejected as exc:
            refused, param = str(exc), exc.param
        verdicts[spec["id"]] = {"refused": refused, "param": param, "reached": engine.reached.get(spec["id"])}
    return verdicts


def _bridge(name: str, model: Path, tokenizer) -> tuple[SGLangBackend, StandInEngine]:
    """The SGLang bridge prepared on a stand-in engine whose ServerArgs name ``name`` as grammar_backend."""
    made: list[StandInEngine] = []

    def factory(model_path, **kwargs):
        made.append(StandInEngine(model_path, tokenizer, grammar_backend=name, **kwargs))
        return made[-1]

    backend = SGLangBackend(
        engine_kwargs={"model_path": str(model), "skip_tokenizer_init": False}, engine_factory=factory
    )
    backend.prepare()
    return backend, made[0]


def main() -> None:
    job = json.load(sys.stdin)
    tmp = tempfile.mkdtemp(prefix="tmsgl-")
    model = Path(tmp) / "model"
    write_tokenizer(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    out = {}
    for name in job["backends"]:
        backend, engine = _bridge(name, model, tokenizer)
        result = {
            "check": type(backend.grammar.backend).__name__ if backend.grammar else None,
            "features": sorted(backend.info().features),
            "specs": asyncio.run(_run(backend, engine, job["specs"])),
        }
        if job.get("slow") and name == job["backends"][0]:
            # a compile outlasting a short timeout, then one that compiles
            backend.grammar.timeout_s = job["slow"]["timeout_s"]
            result["slow"] = asyncio.run(_run(backend, engine, [job["slow"], job["after_slow"]]))
        asyncio.run(backend.close())
        out[name] = result
    print(json.dumps(out), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)  # a timed-out compile may still run in SGLang's thread pool


if __name__ == "__main__":
    main()
