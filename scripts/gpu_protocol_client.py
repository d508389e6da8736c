#!/usr/bin/env python3
"""The engine without tokenmill's gateway: the baseline for scripts/gpu_engine_check.sh.

Drives a ``tokenmill engine`` directly over the scheduler protocol (the gateway's own
SchedulerClient), with the same closed-loop levels as scripts/gpu_load_client.py: random
prompt token IDs of the same length (different from the first token on), max_new_tokens,
ignore_eos, temperature 0. What the HTTP client measures above these figures is what the
gateway, the tokenizer workers and HTTP add.

    python3 scripts/gpu_protocol_client.py --endpoint ipc:///tmp/engine.sock --concurrencies "1 8 32 64" \
        --prompt-tokens 497 --max-tokens 128 --json /tmp/protocol.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time

from tokenizers.decoders import DecodeStream

from tokenmill.scheduler_client import protocol
from tokenmill.scheduler_client.client import SchedulerClient
from tokenmill.tokenizer_workers.model import load_model


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


class Runner:
    def __init__(self, args) -> None:
        self.args = args
        self.waiting: dict[str, asyncio.Queue] = {}
        self.client = SchedulerClient(args.endpoint, self._outputs, lambda why: print("lost:", why, file=sys.stderr))
        self.ids = itertools.count()
        self.rng = random.Random(0)
        self.tokenizer = load_model(None).tokenizer  # the served model's: when the first token becomes text

    def _outputs(self, outputs: list[protocol.RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            queue = self.waiting.get(out.request_id)
            if queue is not None:
                queue.put_nowait((now, out))

    async def one(self, vocab: int) -> dict:
        rid = f"baseline-{next(self.ids)}"
        queue = self.waiting[rid] = asyncio.Queue()
        prompt = [self.rng.randrange(1000, vocab - 1000) for _ in range(self.args.prompt_tokens)]
        header = protocol.Generate(
            request_id=rid,
            prompt_token_count=len(prompt),
            max_new_tokens=self.args.max_tokens,
            sampling=protocol.SamplingParams(temperature=0.0),
            ignore_eos=True,
        )
        start = time.perf_counter()
        self.client.generate(protocol.encode(header), protocol.ids_to_frame(prompt))
        first = last = first_text = None
        tokens, error = 0, None
        stream = DecodeStream(skip_special_tokens=True)
        try:
            while True:
                at, out = await asyncio.wait_for(queue.get(), self.args.request_timeout_s)
                n = len(out.token_ids) // 4
                if n:
                    first = first or at
                    last = at
                    tokens += n
                    if first_text is None:
                        ids = memoryview(out.token_ids).cast("I")
                        if any(stream.step(self.tokenizer, t) for t in ids):
                            first_text = at
                if out.finish_reason is not None:
                    error = out.error
                    break
        except asyncio.TimeoutError:
            error = "timeout"
        finally:
            del self.waiting[rid]
        return {
            "ttft": (first - start) if first else None,
            "tokens": tokens,
            "error": error,
            "ttft_text": (first_text - start) if first_text else None,
            "decode": (tokens - 1) / (last - first) if first and last and last > first else None,
        }

    async def level(self, concurrency: int, vocab: int) -> dict:
        total = max(4, int(concurrency * self.args.requests_factor))
        left = itertools.count()
        results: list[dict] = []

        async def worker():
            while next(left) < total:
                results.append(await self.one(vocab))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        ok = [r for r in results if r["error"] is None]
        ttft = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
        ttft_text = [r["ttft_text"] * 1000 for r in ok if r["ttft_text"] is not None]
        decode = [r["decode"] for r in ok if r["decode"]]
        return {
            "concurrency": concurrency,
            "requests_done": len(ok),
            "errors": len(results) - len(ok),
            "ttft_p50_ms": round(pct(ttft, 0.5) or 0, 1),
            "ttft_p99_ms": round(pct(ttft, 0.99) or 0, 1),
            "first_text_p50_ms": round(pct(ttft_text, 0.5) or 0, 1),  # first token that decodes to text
            "decode_tok_s_per_req_p50": round(pct(decode, 0.5) or 0, 1),
            "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "wall_s": round(wall, 2),
        }

    async def run(self) -> dict:
        await self.client.start()
        if not await self.client.wait_connected(30):
            raise SystemExit("the engine did not answer within 30 s")
        vocab = self.args.vocab
        await self.level(min(64, max(int(c) for c in self.args.concurrencies.split())), vocab)  # warm-up
        levels = []
        for c in self.args.concurrencies.split():
            row = await self.level(int(c), vocab)
            print(f"protocol concurrency {c}: {row}", flush=True)
            levels.append(row)
        await self.client.close()
        return {"levels": levels, "welcome": str(self.client.welcome)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--concurrencies", default="1 8 32 64")
    p.add_argument("--requests-factor", type=float, default=2.0)
    p.add_argument("--prompt-tokens", type=int, default=497)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--vocab", type=int, default=129280)
    p.add_argument("--request-timeout-s", type=float, default=30.0)
    p.add_argument("--json")
    args = p.parse_args()
    report = asyncio.run(Runner(args).run())
    print("\n  conc  done  err  TTFT p50 ms  TTFT p99 ms  1st text p50  dec tok/s/req p50  agg out tok/s  wall s")
    for r in report["levels"]:
        print(
            f"{r['concurrency']:6d}{r['requests_done']:6d}{r['errors']:5d}{r['ttft_p50_ms']:13.1f}{r['ttft_p99_ms']:13.1f}{r['first_text_p50_ms']:14.1f}"
            f"{r['decode_tok_s_per_req_p50']:19.1f}{r['output_tok_s']:15.1f}{r['wall_s']:8.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r["errors"] == 0 for r in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
