"""Conversion on the gateway itself: the two baselines of ``tokenmill bench`` and nothing else.

``inline`` runs the worker's Converter on the event loop (as SGLang did before PR #39771);
``thread`` runs it in ``loop.run_in_executor`` with the default executor (as that PR does).
Same Converter and Detokenizer code as the workers, behind the WorkerPool's interface.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from tokenmill.gateway.request_body import RequestBody
from tokenmill.gateway.worker_pool import ConvertResult
from tokenmill.tokenizer_workers.converter import Converter
from tokenmill.tokenizer_workers.detokenizer import Detokenizer
from tokenmill.tokenizer_workers.messages import ConvertJob, DetokOut
from tokenmill.tokenizer_workers.settings import ConverterSettings


class InProcessConversion:
    alive = 1
    busy = 0
    queued = 0

    def __init__(self, settings: ConverterSettings, on_detok, threaded: bool, metrics=None):
        self.converter = Converter(settings)
        self.detokenizer = Detokenizer(self.converter.tokenizer)
        self.max_model_len = self.converter.max_model_len
        self.vocab_size = self.converter.vocab_size
        parsers = self.converter.parsers
        self.parsers = {
            "tool_call_parser": parsers.tool_name or None,
            "reasoning_parser": parsers.reasoning_name or None,
        }
        self.on_detok = on_detok
        self.on_pixels = None  # Generations.on_pixels, set by the gateway
        self.threaded = threaded
        self.metrics = metrics
        self._ids = itertools.count(1)

    async def start(self) -> None:
        pass

    def limit_context(self, limits) -> None:
        self.converter.limit_context(limits)
        self.max_model_len = self.converter.max_model_len

    def check_capacity(self, nbytes: int) -> None:
        pass  # the baselines have no queue of their own

    def fail_pending(self, error) -> None:
        pass

    async def wait_ready(self, count=None, timeout=None) -> bool:
        return True

    async def close(self) -> None:
        if self.converter.images is not None:  # its shared-memory image files (a scheduler's mappings stay)
            self.converter.images.close()

    async def convert(
        self, kind: str, request_id: str, body: RequestBody, affinity: int | None = None
    ) -> ConvertResult:
        job = ConvertJob(next(self._ids), kind, request_id)
        body = body.joined()
        if self.threaded:
            conversion = await asyncio.get_running_loop().run_in_executor(None, self.converter.convert, job, body)
        else:
            conversion = self.converter.convert(job, body)
        for spec in conversion.detok:
            self.detokenizer.open(spec)
        if self.metrics:
            self.metrics.observe_conversion(conversion.done)
        return ConvertResult(conversion.done, conversion.frames, 0)

    def detokenize(self, owner: int, items) -> None:
        t0 = time.perf_counter()
        deltas = self.detokenizer.step(items)
        self.on_detok(DetokOut(deltas, time.perf_counter() - t0, self.detokenizer.take_failures()))

    def ended(self, owner: int, request_id: str) -> None:
        pass  # the detokenizer forgets a stream at its last text

    def want_pixels(self, owner: int, request_id: str, content_hashes: list[str]) -> None:
        self.on_pixels(request_id, self.converter.pixel_frames(content_hashes))

    def died_since(self, owner: int, deaths: int) -> bool:
        return False  # this process converts and detokenizes: no worker to lose

    def stream_owner(self, exclude: int) -> int | None:
        return None

    def rehome(self, owner: int, affinity: int | None) -> None:
        pass

    def resume(self, owner: int, streams) -> None:
        raise RuntimeError("an in-process converter has no streams to move")

    def release(self, owner: int, request_ids) -> None:
        self.detokenizer.release(request_ids)
