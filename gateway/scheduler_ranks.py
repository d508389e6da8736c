"""Several schedulers (data-parallel engine ranks) behind one gateway, and which one gets a request.

Each rank is a :class:`~tokenmill.scheduler_client.client.SchedulerClient` session of its own. A request
goes to one rank for all its choices. Where it goes decides whether the engine finds the
conversation's history in its prefix cache or recomputes it, so the policy is KV-cache affinity
with bounded load, as the worker pool does for its tokenization cache:

* a conversation (the worker's hash of its messages up to the first user message, the same on
  every turn) goes to the rank that served its previous turn; a new one to the least loaded rank;
* unless that rank already has more than 1.25x its share of the load, plus two (the requests in
  flight, or the rank's own running + waiting count where higher) or is not connected: then the least
  loaded rank takes it, and the conversation's home moves there.

With ``--gateways N`` a conversation's turns may come through different gateways, each with its own
memory of homes. The worker that converts a conversation is the same whichever gateway asks, so it
keeps the rank each turn went to (``Placed``) and tells the next turn's gateway (``ConvertDone
.home_rank``), which takes it over its own memory.

``least_loaded`` and ``round_robin`` are the baselines ``tokenmill bench dp`` compares with.
A rank that disconnects gets none until it says welcome again (its requests move to another rank
where they can go on exactly, or fail: Generations.on_rank_lost);
a rank whose vocabulary is smaller than the served tokenizer's, or whose vocabulary size or
context length differs from the other ranks', is refused at welcome.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from tokenmill.scheduler_client import protocol
from tokenmill.scheduler_client.client import SchedulerClient, SchedulerUnavailable
from tokenmill.tokenizer_workers.messages import Limits

log = logging.getLogger("tokenmill.ranks")

POLICIES = ("affinity", "least_loaded", "round_robin")


@dataclass(eq=False)
class Rank:
    index: int
    endpoint: str
    client: SchedulerClient = field(repr=False)
    in_flight: int = 0  # scheduler requests of this gateway on it, not finished
    refused: str = ""  # why its welcome was refused (its vocabulary or context length differs)
    requests: int = 0  # scheduler requests sent since start
    errors: int = 0  # of which ended in an error, or were lost with the rank
    prompt_tokens: int = 0  # prompt tokens of the finished ones
    cached_tokens: int = 0  # of which the engine served from its prefix cache

    @property
    def ready(self) -> bool:
        return self.client.connected and not self.refused

    @property
    def load(self) -> int:
        """Requests on the rank: this gateway's in flight, or the rank's own count (which includes other
        front ends' requests, as of its last stats, about a second old) where that is higher."""
        stats = self.client.stats
        return max(self.in_flight, stats.num_running + stats.num_waiting) if stats is not None else self.in_flight


class SchedulerRanks:
    def __init__(
        self,
        endpoints: list[str],
        on_outputs: Callable,
        on_rank_lost: Callable[[int, str], None],
        on_error: Callable,
        on_limits: Callable[[Limits], None],
        curve: dict | None = None,
        policy: str = "affinity",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.policy = policy
        self.on_rank_lost = on_rank_lost
        self.on_limits = on_limits
        self.ranks: list[Rank] = []
        for i, endpoint in enumerate(endpoints):
            rank = Rank(i, endpoint, None)  # type: ignore[arg-type]
            rank.client = SchedulerClient(
                endpoint,
                on_outputs,
                lambda why, r=rank: self._lost(r, why),
                on_error,
                on_welcome=lambda w, r=rank: self._welcome(r, w),
                curve=curve,
            )
            self.ranks.append(rank)
        self.homes: dict[int, int] = {}  # conversation key -> the rank that served it last (bounded, insertion-ordered)
        self.model_vocab_size = 0  # the served tokenizer's, once the workers have said (check_vocabulary)
        self._next = 0  # round robin

    # ---- what the gateway asks -------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return any(r.ready for r in self.ranks)

    @property
    def stats(self) -> protocol.Stats | None:
        """The ranks' queue figures added up (None before any has reported)."""
        got = [r.client.stats for r in self.ranks if r.ready and r.client.stats is not None]
        if not got:
            return None
        return protocol.Stats(sum(s.num_running for s in got), sum(s.num_waiting for s in got))

    def pick(self, key: int | None, hint: int = -1) -> Rank:
        """The rank for a request whose conversation hashes to ``key`` (None: no conversation). ``hint``:
        where the node's gateways last put the conversation, as its worker remembers (--gateways N),
        which beats this gateway's own memory: the previous turn may have come through another gateway."""
        ready = [r for r in self.ranks if r.ready]
        if not ready:
            raise SchedulerUnavailable("no scheduler rank is connected")
        if len(ready) == 1:
            chosen = ready[0]
        elif self.policy == "round_robin":
            chosen = ready[self._next % len(ready)]
            self._next += 1
        elif self.policy == "least_loaded" or key is None:
            chosen = self._least_loaded(ready)
        else:
            chosen = self._home(key, ready, hint)
        if key is not None and self.policy == "affinity":
            self.homes.pop(key, None)
            self.homes[key] = chosen.index
            if len(self.homes) > 65536:
                del self.homes[next(iter(self.homes))]
        return chosen

    def _home(self, key: int, ready: list[Rank], hint: int = -1) -> Rank:
        index = hint if 0 <= hint < len(self.ranks) else self.homes.get(key)
        if index is None:  # a new conversation: where there is most room (a hash ring split a few unevenly)
            return self._least_loaded(ready)
        home = self.ranks[index]
        total = sum(r.load for r in ready) + 1
        # 1.25x a fair share, and never less than 2 requests more than that: with a few requests in
        # flight a bound near the mean would move a conversation (its whole history recomputed on a
        # rank without it) for a momentary imbalance of one request
        bound = math.ceil(1.25 * total / len(ready)) + 2
        if home.ready and home.load < bound:
            return home
        return self._least_loaded(ready)

    def _least_loaded(self, ready: list[Rank]) -> Rank:
        start = self._next % len(ready)  # ties go round, not always to the first rank
        self._next += 1
        order = ready[start:] + ready[:start]
        return min(order, key=lambda r: r.load)

    def generate(self, rank: Rank, header: bytes, prompt_frame: bytes, *image_frames) -> None:
        rank.client.generate(header, prompt_frame, *image_frames)
        rank.in_flight += 1
        rank.requests += 1

    def resend(self, rank: int, header: bytes, prompt_frame: bytes, *image_frames) -> None:
        """A Generate the rank refused (image_missing) sent again: already counted as in flight."""
        self.ranks[rank].client.generate(header, prompt_frame, *image_frames)

    def abort(self, rank: int, request_ids: list[str]) -> None:
        self.ranks[rank].client.abort(request_ids)

    def finished(self, rank: int, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """A scheduler request ended (its final output came), or the gateway stopped waiting for it."""
        r = self.ranks[rank]
        r.in_flight = max(0, r.in_flight - 1)
        r.prompt_tokens += prompt_tokens
        r.cached_tokens += cached_tokens

    def state(self) -> list[dict]:
        return [
            {
                "rank": r.index,
                "endpoint": r.endpoint,
                "connected": r.client.connected,
                "refused": r.refused or None,
                "in_flight": r.in_flight,
            }
            for r in self.ranks
        ]

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        for r in self.ranks:
            await r.client.start()

    async def wait_connected(self, timeout: float, grace: float = 2.0) -> bool:
        """Until one rank has said welcome (at most ``timeout``), then up to ``grace`` more for the
        others: the gateway serves with the ranks that answer, and /ready lists the missing ones."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.connected and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if not self.connected:
            return False
        until = min(deadline, loop.time() + grace)
        while not all(r.ready or r.refused for r in self.ranks) and loop.time() < until:
            await asyncio.sleep(0.02)
        missing = [r.endpoint for r in self.ranks if not r.ready]
        if missing and self.connected:
            log.warning(
                "serving with %d of %d scheduler ranks; not (yet) connected: %s",
                len(self.ranks) - len(missing),
                len(self.ranks),
                ", ".join(missing),
            )
        return self.connected

    async def close(self) -> None:
        for r in self.ranks:
            await r.client.close()

    # ---- from the ranks --------------------------------------------------------------------

    def check_vocabulary(self, vocab_size: int) -> None:
        """The served tokenizer's vocabulary size: a rank whose engine has fewer token IDs is refused."""
        self.model_vocab_size = vocab_size
        welcomed = [r for r in self.ranks if r.client.welcome is not None]
        for rank in welcomed:  # judge again, in order, now that the model is known
            rank.refused = "pending"
        for rank in welcomed:
            self._welcome(rank, rank.client.welcome)

    def _welcome(self, rank: Rank, welcome: protocol.Welcome) -> None:
        rank.refused = ""
        # (with one scheduler there is nothing to choose: its own validation answers for a mismatch)
        if len(self.ranks) > 1 and welcome.vocab_size is not None and welcome.vocab_size < self.model_vocab_size:
            self._refuse(
                rank,
                f"vocab_size {welcome.vocab_size} is smaller than the served tokenizer's "
                f"({self.model_vocab_size}): it serves another model",
            )
            return
        others = [r for r in self.ranks if r is not rank and r.ready and r.client.welcome is not None]
        for other in others:
            w = other.client.welcome
            for name in ("vocab_size", "max_model_len"):
                mine, theirs = getattr(welcome, name), getattr(w, name)
                if mine != theirs:
                    self._refuse(
                        rank,
                        f"{name} {mine} differs from rank {other.index}'s ({theirs} at "
                        f"{other.endpoint}): data-parallel ranks must serve the same model",
                    )
                    return
        if len(self.ranks) > 1:
            log.info("scheduler rank %d (%s) ready at %s", rank.index, welcome.scheduler_name, rank.endpoint)
        self.on_limits(self.limits())

    def _refuse(self, rank: Rank, why: str) -> None:
        rank.refused = why
        log.error("scheduler rank %d at %s refused: %s", rank.index, rank.endpoint, why)
        self.on_rank_lost(rank.index, why)  # nothing should be running there, but if it is, it fails

    def limits(self) -> Limits:
        """What every accepted rank honours: the features they all list, the smallest logprobs limit."""
        welcomes = [r.client.welcome for r in self.ranks if not r.refused and r.client.welcome is not None]
        if not welcomes:
            return Limits()
        features = None
        if all(w.features is not None for w in welcomes):
            common = set.intersection(*(set(w.features) for w in welcomes))
            if not all(on_this_host(r.endpoint) for r in self.ranks):  # a file here is no use to another host
                common.discard(protocol.FEATURE_IMAGES_SHM)
            features = sorted(common)
        lengths = [w.max_model_len for w in welcomes if w.max_model_len]
        logprobs = [w.max_logprobs for w in welcomes if w.max_logprobs is not None]
        # a request may go to any rank: only the adapters every one serves
        adapters = sorted(set.intersection(*(set(w.adapters or ()) for w in welcomes)))
        return Limits(
            min(lengths) if lengths else None, features, min(logprobs) if logprobs else None, adapters or None
        )

    def _lost(self, rank: Rank, why: str) -> None:
        rank.in_flight = 0
        self.on_rank_lost(rank.index, why)


def on_this_host(endpoint: str) -> bool:
    """Whether a scheduler endpoint is on this host (an ipc:// socket file, or TCP to a loopback
    address), so that it can map the shared-memory files this host's workers write (images.shm)."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")
