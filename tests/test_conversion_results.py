"""How a conversion's result reaches its caller: WorkerPool.convert's ``then`` step.

The gateway starts a converted request at the scheduler inside the callback that read the
worker's answer (gateway/app.py), not after its handler's task wakes. These tests drive the
pool's answer handling with its workers' links replaced by a record of what they were sent;
the whole path runs with real workers in test_api.py and test_faults.py.
"""

from __future__ import annotations

import asyncio

from gateway.worker_pool import ConversionRejected, ConvertResult
from test_dispatch_policy import _pool
from tokenizer_workers import messages as m

BODY = b'{"messages": [{"role": "user", "content": "hi"}]}'


class _Recorder:
    """A worker's link that keeps what it was sent."""

    def __init__(self, sent: list):
        self.sent = sent

    def send(self, frames) -> None:
        self.sent.append(frames)


def _answer(pool, job_id: int, request_id: str) -> None:
    """The worker's ConvertDone for a job, as the pool's reader callback hands it on."""
    worker = next(w for w in pool.workers if job_id in w.quick or (w.job and w.job.job_id == job_id))
    done = m.ConvertDone(job_id, choices=[m.ChoicePlan(request_id, 3)])
    pool._on_done(worker, done, [b"header", b"tokens"])


def test_then_runs_as_the_answer_is_read_and_its_value_is_the_result():
    async def body():
        pool, sent = _pool()
        seen = []

        def then(result: ConvertResult):
            seen.append((result.done.choices[0].request_id, bytes(result.frames[0]), future.done()))
            return "started"

        future = pool.convert("chat", "chatcmpl-1", BODY, then=then)
        assert sent == [(0, "chatcmpl-1")] and not seen
        _answer(pool, 1, "chatcmpl-1-0")
        # called in the reader's callback itself: no loop iteration has passed, the future was not yet done
        assert seen == [("chatcmpl-1-0", b"header", False)]
        assert future.result() == "started"
        await pool.close()

    asyncio.run(body())


def test_a_refusal_raised_by_then_is_what_the_caller_gets():
    async def body():
        pool, _ = _pool()
        refusal = ConversionRejected(m.ApiError(503, "The server is shutting down.", code="shutdown"), 5)

        def then(result):
            raise refusal

        future = pool.convert("chat", "chatcmpl-2", BODY, then=then)
        _answer(pool, 1, "chatcmpl-2-0")
        assert future.exception() is refusal
        await pool.close()

    asyncio.run(body())


def test_then_is_not_called_for_a_conversion_given_up_and_its_decoder_state_is_released():
    async def body():
        pool, sent = _pool()
        called = []
        future = pool.convert("chat", "chatcmpl-3", BODY, then=called.append)
        future.cancel()  # the client left while the worker converted
        await asyncio.sleep(0)  # the pool hears of it in the future's done callback
        after = []
        pool.workers[0].link = _Recorder(after)
        _answer(pool, 1, "chatcmpl-3-0")
        assert called == []
        assert [m.to_worker.decode(frames[0]) for frames in after] == [m.Release(["chatcmpl-3-0"])]
        await pool.close()

    asyncio.run(body())
