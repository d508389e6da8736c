"""The transformers backend: HuggingFace transformers 5.x continuous batching.

The model is served by transformers' ``ContinuousBatchingManager``
(``model.init_continuous_batching(...)``): a background thread that schedules requests
into one paged-attention batch per step. This module feeds it with
``add_request(input_ids, request_id=..., max_new_tokens=..., streaming=True,
eos_token_id=<stop_token_ids>, temperature=..., top_k=..., top_p=...)``, receives every
step's outputs through ``register_result_handler`` (delivered on the engine server's event
loop with ``call_soon_threadsafe``) and cancels with ``cancel_request``.

Sampling (see docs/engines/tokenmill-engine.md for the table): the manager is built with ``do_sample=True``
and per-request temperature, top-k and top-p processors, and every request sets all three:

* ``temperature`` 0 (greedy) -> temperature 1, top-k 1, top-p 1: only the arg-max token
  survives, so sampling picks it — the same tokens as ``model.generate(do_sample=False)``;
* ``temperature`` > 0 -> that temperature, ``top_k`` (0: the whole vocabulary), ``top_p``;
* ``stop_token_ids`` -> the request's EOS set; ``max_new_tokens`` -> ``max_new_tokens``;
* ``seed`` with temperature > 0 is **rejected**: the manager draws every request's token
  from one torch generator shared by the whole batch, so a per-request seed cannot be
  honoured (``--seed`` seeds that generator and the random weights);
* ``presence_penalty`` / ``frequency_penalty`` other than 0 are **rejected** (continuous
  batching has no per-request penalties).

Protocol 1.1: ``logprobs`` is honoured (Welcome.features ``["logprobs"]``, max_logprobs 20);
``structured``, ``min_p``, ``repetition_penalty``, ``min_tokens`` and ``logit_bias`` are refused
with ``unsupported`` by the engine server. transformers 5.24's continuous batching has
per-request processors only for temperature, top-k and top-p (its
``CLASSIC_TO_CB_PROCESSORS_MAP``; any other processor would apply to the whole batch with one
value) and no constrained decoding.

Logprobs are the model's raw ones, as vLLM's default ``logprobs_mode="raw_logprobs"``:
log_softmax of the logits before temperature, top-k and top-p. transformers' own
``ContinuousBatchingConfig(return_logprobs=True)`` is not that: manager-wide, the sampled
token only, and from the *processed* distribution (0.0 for every greedy token, top-k 1 here).
So :func:`_install_raw_logprobs` gives the batch processor a model runner whose step, once
transformers has run the forward pass, the processors and the sampler, also writes per logits
row the chosen token's raw logprob and the top ``MAX_LOGPROBS`` (IDs, logprobs) into extra
rows of the step's static ``output_ids`` tensor. transformers already carries that tensor to
the host (synchronously, or double-buffered in its async mode) and ``update_batch`` maps row i
to the i-th request with a new token; our ``prepare_batch_update`` hands it each row's
``(chosen, top_ids, top_logprobs)`` as the "logprob" it appends to that request's
``logprobs``. So each request gets its own rows, in step with its ``generated_tokens``,
whatever else is in the batch, and since it is all tensor ops on static buffers, CUDA graphs
and torch.compile capture it with the rest of the step (torch.compile checked on CPU; CUDA
graphs and async batching not yet run on a GPU).

``--random-weights`` builds a tiny Llama with random weights (:func:`build_random_model`)
over the vocabulary of the model tokenmill serves, so that the whole path — prompt token
IDs in, real forward passes, token IDs out — runs anywhere, CPU included, in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engines import require
from tokenmill.engines.bridge import Backend, Chunk, EngineInfo, EngineLoad, EngineRequest
from tokenmill.scheduler_client.protocol import FEATURE_LOGPROBS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Generate
from tokenmill.scheduler_client.scheduler_side import Rejected

log = logging.getLogger("tokenmill.engine.transformers")

# The tiny random model (--random-weights): a Llama over the served model's vocabulary.
RANDOM_DEFAULTS = {
    "layers": 2,
    "hidden_size": 64,
    "heads": 4,
    "kv_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "seed": 0,
}
# CPU defaults for the paged cache (transformers would otherwise size it from 60% of RAM).
CPU_CACHE_DEFAULTS = {"num_blocks": 256, "page_size": 32, "max_batch_tokens": 512, "max_running": 16}
# The top N logprobs computed for every generated token (Welcome.max_logprobs), as vLLM's default.
MAX_LOGPROBS = 20


def _require() -> None:
    require("transformers", "torch", "transformers")


def vocab_size_of(model: str | None) -> int:
    """The vocabulary size of the model tokenmill serves (``None``/"default": the embedded one)."""
    from tokenmill.tokenizer_workers.model import load_model

    directory = None if model in (None, "default") else model
    return load_model(directory).vocab_size


def build_random_model(
    vocab_size: int,
    *,
    layers: int = RANDOM_DEFAULTS["layers"],
    hidden_size: int = RANDOM_DEFAULTS["hidden_size"],
    heads: int = RANDOM_DEFAULTS["heads"],
    kv_heads: int | None = RANDOM_DEFAULTS["kv_heads"],
    intermediate_size: int = RANDOM_DEFAULTS["intermediate_size"],
    max_position_embeddings: int = RANDOM_DEFAULTS["max_position_embeddings"],
    seed: int = RANDOM_DEFAULTS["seed"],
):
    """A ``LlamaForCausalLM`` with deterministic random weights (float32, CPU, eval mode).

    Defaults: 2 layers, hidden size 64, 4 attention heads (4 KV heads, head dim 16), MLP
    width 128, RoPE, untied input/output embeddings. Over DeepSeek's 129,280-token
    vocabulary that is ~16.6M parameters, almost all of them in the two embedding
    matrices. The same arguments give bit-identical weights in any process (the
    initialisation draws from a private RNG state seeded with ``seed``).
    """
    _require()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % heads:
        raise ValueError(f"hidden size {hidden_size} is not a multiple of {heads} heads")
    kv = heads if kv_heads is None else kv_heads
    if heads % kv:
        raise ValueError(f"{heads} heads are not a multiple of {kv} KV heads")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def _install_raw_logprobs(processor, top_n: int) -> None:
    """Make a ContinuousBatchProcessor produce raw logprobs (see the module docstring).

    Done before its first step (warm-up and CUDA graph capture included), in the generation
    thread; ``output_ids`` row 0 stays the tokens, row 1 the chosen token's logprob (float32
    bits), then ``top_n`` rows of top IDs and ``top_n`` of their logprobs.
    """
    import torch
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    if getattr(processor, "_tokenmill_logprobs", False):  # the manager reuses a processor after reset()
        return

    class RawLogprobsRunner(ModelRunner):
        def _forward_process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids):
            raw = []

            def forward(**kwargs):  # the model, keeping its logits before any processor
                out = model(**kwargs)
                raw.append(out.logits)
                return out

            super()._forward_process_and_sample(forward, batch_data, carry_over_ids, prev_output_ids, output_ids)
            logits = raw[0]
            if "logits_to_keep" not in batch_data:
                logits = logits[:, batch_data["logits_indices"], :]
            logits = logits[0].float()  # [rows, vocab], one row per request with a new token
            rows = logits.size(0)
            norm = logits.logsumexp(-1, keepdim=True)
            chosen = logits.gather(1, output_ids[0, :rows].long().unsqueeze(1)) - norm
            top_values, top_ids = logits.topk(top_n, dim=-1)
            output_ids[1, :rows].copy_(chosen.squeeze(1).view(torch.int32))
            output_ids[2 : 2 + top_n, :rows].copy_(top_ids.T)
            output_ids[2 + top_n :, :rows].copy_((top_values - norm).T.view(torch.int32))

    old = processor.model_runner
    processor.model_runner = RawLogprobsRunner(
        logit_processor=old.logit_processor,
        cb_config=old.cb_config,
        inputs_and_outputs=old.inputs_and_outputs,
        cache=old.cache,
        do_sample=old.do_sample,
        return_logprobs=False,
    )

    def reader(io):
        def prepare_batch_update():
            """Per logits row: (token) and (chosen logprob, top IDs, top logprobs)."""
            out = io.output_ids[:, : io.num_request_in_batch].cpu()
            chosen = out[1].view(torch.float32).tolist()
            top_ids = out[2 : 2 + top_n].T.tolist()
            top_values = out[2 + top_n :].view(torch.float32).T.tolist()
            return io.requests_in_batch, out[0].tolist(), list(zip(chosen, top_ids, top_values, strict=True))

        return prepare_batch_update

    ios = processor.inputs_and_outputs
    pairs = getattr(ios, "io_pairs", None)  # async batching: a (host, device) pair per buffer
    for io in [ios] if pairs is None else [x for pair in pairs for x in (pair.host_io, pair.device_io)]:
        old_ids = io.output_ids
        io.output_ids = torch.zeros(
            (2 + 2 * top_n, old_ids.size(1)),
            dtype=old_ids.dtype,
            device=old_ids.device,
            pin_memory=old_ids.is_pinned(),
        )
        io.prepare_batch_update = reader(io)  # the async wrapper reads its host side's
    processor._tokenmill_logprobs = True


def _pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _pick_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


class TransformersBackend(Backend):
    """One model under transformers' continuous batching manager."""

    name = "transformers"

    def __init__(
        self,
        *,
        model: Any = None,
        model_path: str | None = None,
        random_weights: bool = False,
        vocab_model: str | None = None,
        random_options: dict | None = None,
        device: str = "auto",
        dtype: str = "auto",
        attn_implementation: str | None = None,
        max_running: int | None = None,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        page_size: int | None = None,
        max_batch_tokens: int | None = None,
        seed: int = 0,
    ) -> None:
        if model is None and not random_weights and not model_path:
            raise ValueError("the transformers backend needs --model DIR or --random-weights")
        self._model = model
        self.model_path = model_path
        self.random_weights = random_weights
        self.vocab_model = vocab_model
        self.random_options = {**RANDOM_DEFAULTS, **(random_options or {})}
        self.device_choice = device
        self.dtype_choice = dtype
        self.attn_implementation = attn_implementation
        self.max_running = max_running
        self.max_model_len_limit = max_model_len
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.seed = seed
        self.max_logprobs = MAX_LOGPROBS
        self.manager = None
        self._info: EngineInfo | None = None
        self._vocab_size = 0
        self._closing = False
        # cancellations issued and not yet confirmed by the engine's own state: rid -> times seen gone
        self._cancelling: dict[str, int] = {}
        self._cancelled_total = 0
        self._peak_running = 0
        self._confirm_task: asyncio.Task | None = None
        self._failed: Any = None  # RequestStatus.FAILED

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TransformersBackend:
        random_options = {
            "layers": args.random_layers,
            "hidden_size": args.random_hidden_size,
            "heads": args.random_heads,
            "kv_heads": args.random_kv_heads,
            "intermediate_size": args.random_intermediate_size,
            "max_position_embeddings": args.random_max_position_embeddings,
            "seed": args.seed,
        }
        return cls(
            model_path=None if args.random_weights else args.model,
            random_weights=args.random_weights,
            vocab_model=args.model if args.random_weights else None,
            random_options=random_options,
            device=args.device,
            dtype=args.dtype,
            attn_implementation=args.attn_implementation,
            max_running=args.max_running,
            max_model_len=args.max_model_len,
            num_blocks=args.num_blocks,
            page_size=args.page_size,
            max_batch_tokens=args.max_batch_tokens,
            seed=args.seed,
        )

    # ------------------------------------------------------------------ lifecycle

    def prepare(self) -> None:
        _require()
        import torch
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        device = _pick_device(self.device_choice)
        dtype = _pick_dtype(self.dtype_choice, device)
        started = time.perf_counter()
        if self._model is not None:
            model, label = self._model, type(self._model).__name__
        elif self.random_weights:
            vocab = vocab_size_of(self.vocab_model)
            model = build_random_model(vocab, **self.random_options)
            label = "random-llama-{layers}x{hidden_size}-seed{seed}".format(**self.random_options)
            if self.attn_implementation:
                model.set_attn_implementation(self.attn_implementation)
        else:
            from transformers import AutoModelForCausalLM

            kwargs: dict[str, Any] = {"dtype": dtype}
            if device != "cpu" and importlib.util.find_spec("accelerate") is not None:
                kwargs["device_map"] = device  # load straight onto the GPU
            if self.attn_implementation:
                kwargs["attn_implementation"] = self.attn_implementation
            model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs)
            label = str(self.model_path)
        model = model.to(device=device, dtype=dtype).eval()
        self._model = model
        config = model.config.get_text_config()
        self._vocab_size = int(config.vocab_size)
        self.max_logprobs = min(MAX_LOGPROBS, self._vocab_size)
        n_params = sum(p.numel() for p in model.parameters())
        log.info(
            "model %s: %.1fM parameters, %s on %s, attention %s, loaded in %.1f s",
            label,
            n_params / 1e6,
            str(dtype).replace("torch.", ""),
            device,
            model.config._attn_implementation,
            time.perf_counter() - started,
        )

        cpu = device == "cpu"
        if not cpu and "OMP_NUM_THREADS" not in os.environ:
            # On a GPU the generation thread's CPU tensor work is tiny, and a pool of spinning
            # intra-op threads (one per core) stalls whenever another process (the gateway, a
            # tokenizer worker) wakes on one of those cores. vLLM sets one thread for the same reason.
            torch.set_num_threads(1)
            log.info("torch intra-op threads: 1 (set OMP_NUM_THREADS to choose)")
        defaults = CPU_CACHE_DEFAULTS if cpu else {}
        cb_config = ContinuousBatchingConfig(
            num_blocks=self.num_blocks if self.num_blocks is not None else defaults.get("num_blocks"),
            page_size=self.page_size or defaults.get("page_size", 256),
            max_batch_tokens=self.max_batch_tokens
            if self.max_batch_tokens is not None
            else defaults.get("max_batch_tokens"),
            max_requests_per_batch=self.max_running if self.max_running is not None else defaults.get("max_running"),
            per_request_processors=True,
            seed=self.seed,
        )
        # Sampling processors exist only for values that differ from "off"; every request
        # overrides all three, so these placeholders never apply.
        generation_config = GenerationConfig(
            do_sample=True, temperature=0.5, top_k=1, top_p=0.5, max_new_tokens=16, eos_token_id=-1, pad_token_id=0
        )
        from transformers.generation.continuous_batching.requests import RequestStatus

        self._failed = RequestStatus.FAILED
        with torch.inference_mode():
            manager = model.init_continuous_batching(
                generation_config=generation_config, continuous_batching_config=cb_config
            )
            create = manager._create_batch_processor  # called by the generation thread before its first step

            def create_with_logprobs():
                processor = create()
                _install_raw_logprobs(processor, self.max_logprobs)
                return processor

            manager._create_batch_processor = create_with_logprobs
            manager.start()
        self.manager = manager
        try:
            self._describe(config, label)
        except BaseException:
            manager.stop(block=True, timeout=10, hard_stop=True)  # its thread would keep the process alive
            raise

    def _describe(self, config, label: str) -> None:
        """Wait for the generation thread to build its batch processor, then read the capacity."""
        manager = self.manager
        deadline = time.monotonic() + 120
        while manager.batch_processor is None:
            if not manager.is_running() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the continuous batching loop did not start: {manager.background_thread_status.fatal_error}"
                )
            time.sleep(0.01)
        processor = manager.batch_processor
        resolved = manager.continuous_batching_config
        cache_tokens = self._single_request_capacity(processor.cache)
        limits = [
            int(getattr(config, "max_position_embeddings", 0) or 0) or None,
            cache_tokens,
            self.max_model_len_limit,
        ]
        max_model_len = min(x for x in limits if x) if any(limits) else None
        self._info = EngineInfo(
            name=f"transformers:{label}",
            vocab_size=self._vocab_size,
            max_running_requests=int(resolved.max_requests_per_batch),
            max_model_len=max_model_len,
            features=frozenset({FEATURE_LOGPROBS}),
            max_logprobs=self.max_logprobs,
        )
        log.info(
            "continuous batching: %d requests per batch, %d tokens per batch, %d cache blocks of %d tokens, max_model_len %s",
            resolved.max_requests_per_batch,
            processor.cache.max_batch_tokens,
            processor.cache.num_blocks,
            resolved.page_size,
            max_model_len,
        )

    @staticmethod
    def _single_request_capacity(cache) -> int | None:
        try:
            from transformers.generation.continuous_batching.model_runner import infer_max_single_request_tokens

            return int(infer_max_single_request_tokens(cache))
        except Exception:  # an internal helper; the model's limit still applies
            return None

    async def start(self) -> None:
        self._confirm_task = asyncio.create_task(self._confirm_cancellations())

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self._closing:
                await asyncio.Event().wait()
            manager = self.manager
            if manager is None or not manager.is_running():
                error = manager.background_thread_status.fatal_error if manager is not None else None
                log.error("the continuous batching loop stopped: %s", error)
                return

    async def close(self) -> None:
        self._closing = True
        if self._confirm_task is not None:
            self._confirm_task.cancel()
        manager = self.manager
        if manager is not None and manager.is_running():
            await asyncio.to_thread(manager.stop, block=True, timeout=10, hard_stop=True)

    # ------------------------------------------------------------------ requests

    def check(self, gen: Generate) -> None:
        s = gen.sampling
        if s.seed is not None and s.temperature > 0:
            raise Rejected(
                "the transformers engine cannot seed a single request: its continuous batching samples every "
                "request in the batch from one shared torch generator. Leave seed unset, or use temperature 0"
            )
        if s.presence_penalty != 0 or s.frequency_penalty != 0:
            raise Rejected(
                "the transformers engine does not support presence_penalty or frequency_penalty; leave them at 0"
            )

    def _sampling_kwargs(self, request: EngineRequest) -> dict:
        s = request.sampling
        if s.temperature == 0:  # greedy: keep only the arg-max token
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        return {
            "temperature": float(s.temperature),
            "top_k": int(s.top_k) if s.top_k > 0 else self._vocab_size,
            "top_p": float(s.top_p),
        }

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        manager = self.manager
        rid = request.rid
        outputs: asyncio.Queue = asyncio.Queue()
        stop_ids = frozenset(request.stop_token_ids)
        manager.register_result_handler(rid, outputs.put_nowait)
        finished = False
        try:
            added = manager.add_request(
                request.prompt,
                request_id=rid,
                max_new_tokens=request.max_new_tokens,
                streaming=True,
                eos_token_id=list(request.stop_token_ids),
                **self._sampling_kwargs(request),
            )
            if added is None:
                reason = manager.background_thread_status.can_accept_new_requests() or "the engine is not running"
                finished = True
                yield Chunk(finish=FINISH_ERROR, error=f"the transformers engine did not take the request: {reason}")
                return
            sent = 0
            while True:
                out = await outputs.get()
                self._note_running()
                tokens = out.generated_tokens
                delta, sent, new_logprobs = tokens[sent:], len(tokens), out.logprobs[sent:]
                logprobs = self._logprobs(request.logprobs, new_logprobs)
                if out.status == self._failed:
                    finished = True
                    yield Chunk(delta, FINISH_ERROR, out.error or "generation failed", **logprobs)
                    return
                if out.is_finished():
                    finished = True
                    reason = FINISH_STOP if tokens and tokens[-1] in stop_ids else FINISH_LENGTH
                    yield Chunk(delta, reason, **logprobs)
                    return
                if delta:
                    yield Chunk(delta, **logprobs)
        finally:
            self._unregister(rid)
            if not finished:
                self._cancel(rid)

    @staticmethod
    def _logprobs(n: int | None, rows: list) -> dict:
        """Chunk fields for a request's new ``(chosen, top_ids, top_logprobs)`` rows: the top ``n``, best first."""
        if n is None:
            return {}
        fields: dict[str, list] = {"logprobs": [row[0] for row in rows]}
        if n:
            fields["top_ids"] = [i for row in rows for i in row[1][:n]]
            fields["top_logprobs"] = [v for row in rows for v in row[2][:n]]
        return fields

    async def abort(self, rid: str) -> None:
        if self.manager is None:
            return
        with self.manager.output_router._lock:
            known = rid in self.manager.output_router.result_handlers
        if known:  # still streaming (normally its generate() has already cancelled it)
            self._unregister(rid)
            self._cancel(rid)

    def _cancel(self, rid: str) -> None:
        if rid not in self._cancelling:
            self._cancelling[rid] = 0
            self.manager.cancel_request(rid)

    def _unregister(self, rid: str) -> None:
        router = self.manager.output_router
        with router._lock:
            router.result_handlers.pop(rid, None)

    # ------------------------------------------------------------------ engine state

    def _scheduler(self):
        processor = self.manager.batch_processor if self.manager is not None else None
        return processor.scheduler if processor is not None else None

    def _note_running(self) -> None:
        scheduler = self._scheduler()
        if scheduler is not None:
            self._peak_running = max(self._peak_running, len(scheduler.active_requests))

    def _engine_holds(self, rid: str) -> bool:
        """Whether the engine still knows the request: queued, marked for cancellation, waiting or active."""
        manager = self.manager
        with manager.input_queue.mutex:
            if any(state.request_id == rid for state in manager.input_queue.queue):
                return True
        with manager.cancel_queue.mutex:
            if rid in manager.cancel_queue.queue:
                return True
        scheduler = self._scheduler()
        if scheduler is None:
            return True
        return (
            rid in scheduler._requests_to_cancel
            or rid in scheduler.active_requests
            or rid in scheduler.waiting_requests
        )

    async def _confirm_cancellations(self) -> None:
        """Count a cancellation once the engine's scheduler has dropped the request (seen twice, 50 ms apart)."""
        while True:
            await asyncio.sleep(0.05)
            self._note_running()
            for rid in list(self._cancelling):
                try:
                    gone = not self._engine_holds(rid)
                except Exception:  # internal structures of a different transformers version
                    gone = True
                if not gone:
                    self._cancelling[rid] = 0
                elif self._cancelling[rid] >= 1:
                    del self._cancelling[rid]
                    self._cancelled_total += 1
                    log.info("request %s cancelled in the engine", rid)
                else:
                    self._cancelling[rid] += 1

    def load(self) -> EngineLoad:
        scheduler = self._scheduler()
        running = len(scheduler.active_requests) if scheduler is not None else 0
        waiting = len(scheduler.waiting_requests) if scheduler is not None else 0
        if self.manager is not None:
            waiting += self.manager.input_queue.qsize()
        self._peak_running = max(self._peak_running, running)
        return EngineLoad(
            num_running=running,
            num_waiting=waiting,
            peak_running=self._peak_running,
            cancelled_total=self._cancelled_total,
        )


# --------------------------------------------------------------------------- command line


def from_args(args: argparse.Namespace) -> TransformersBackend:
    """The backend ``tokenmill engine --backend ...`` asked for."""
    return TransformersBackend.from_args(args)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--random-weights",
        action="store_true",
        help="serve a tiny random-weight Llama over the vocabulary of --model (default: the embedded model) "
        "instead of loading a checkpoint",
    )
    group.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when torch sees a GPU, else cpu)"
    )
    group.add_argument(
        "--attn-implementation",
        default=None,
        help="e.g. sdpa, paged|eager, flash_attention_2 (default: transformers' choice)",
    )
    group.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="paged KV cache blocks (default: 256 on CPU, sized from free memory on GPU)",
    )
    group.add_argument(
        "--page-size", type=int, default=None, help="tokens per cache page (default: 32 on CPU, 256 on GPU)"
    )
    group.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="tokens per forward pass (default: 512 on CPU, transformers' on GPU)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="random weights and the sampler's generator (default %(default)s)"
    )
    r = RANDOM_DEFAULTS
    group.add_argument("--random-layers", type=int, default=r["layers"], help="(default %(default)s)")
    group.add_argument("--random-hidden-size", type=int, default=r["hidden_size"], help="(default %(default)s)")
    group.add_argument("--random-heads", type=int, default=r["heads"], help="(default %(default)s)")
    group.add_argument("--random-kv-heads", type=int, default=r["kv_heads"], help="(default %(default)s)")
    group.add_argument(
        "--random-intermediate-size", type=int, default=r["intermediate_size"], help="(default %(default)s)"
    )
    group.add_argument(
        "--random-max-position-embeddings", type=int, default=r["max_position_embeddings"], help="(default %(default)s)"
    )


__all__ = ["from_args", "TransformersBackend", "build_random_model", "vocab_size_of", "add_arguments"]
