"""The tokenizer workers' dispatch policy on its own (tokenmill.gateway.dispatch.Dispatcher), driven through its public calls.

No processes and no event loop: a recorder stands in for the pool, noting which worker each job is
delivered to and when the policy asks to run again, and a clock that stands still dates the jobs.
Which jobs an idle worker takes from a busy worker's lane and which it leaves for their owner
(rent or buy), quick jobs on the workers' IO threads, conversion threads, lost workers. The same
policy runs with real workers in test_loop_isolation.py and test_segment_cache_served.py.
"""

from __future__ import annotations

import itertools

from tokenmill.gateway.dispatch import Dispatcher, Job
from tokenmill.tokenizer_workers.messages import CacheReport, ConvertDone, Timing

_ids = itertools.count(1)


class _Clock:
    """Stands still unless a test moves it: jobs are dated, and their ages given, on it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Pool:
    """Stands in for the pool: records which worker got which request (and whether quick), and the
    delays after which the policy asked to run again. Workers in ``down`` refuse deliveries."""

    def __init__(self):
        self.sent: list[tuple[int, str]] = []
        self.quick: list[tuple[str, bool]] = []
        self.wakes: list[float] = []
        self.down: set[int] = set()

    def deliver(self, index: int, job: Job) -> bool:
        if index in self.down:
            return False
        self.sent.append((index, job.request_id))
        self.quick.append((job.request_id, job.quick))
        return True


def _policy(ready=(0, 1), slots: int = 1, **options) -> tuple[Dispatcher, _Pool]:
    """Two workers, those in ``ready`` ready with ``slots`` conversion threads each."""
    pool = _Pool()
    policy = Dispatcher(2, pool.deliver, pool.wakes.append, clock=_Clock(), **options)
    for index in ready:
        policy.worker_ready(index, slots)
    assert policy.cold_s_per_byte == 1e-6  # 1 MB converts cold in 1 s
    return policy, pool


def _submit(
    policy: Dispatcher, name: str, nbytes: int, key: int | None = None, age_s: float = 0.0, quick_ok: bool = False
) -> Job:
    """A job; by default one for a conversion thread (quick_ok=True: classified as the pool's are)."""
    job = Job(next(_ids), "chat", name, b"x" * nbytes, policy.clock() - age_s, affinity=key)
    policy.submit(job, quick_ok=quick_ok)
    return job


def _done(policy: Dispatcher, job: Job, **fields) -> None:
    policy.finished(job.worker, ConvertDone(job.job_id, **fields))


def _busy(policy: Dispatcher, index: int) -> Job:
    """Worker ``index`` starts converting a job (the next free worker takes it: the test sees to it)."""
    job = _submit(policy, f"busy-{index}", 10)
    assert job.worker == index
    return job


def _converted(policy: Dispatcher, key: int, nbytes: int, on: int) -> None:
    """A conversation's last turn, of this size, converted by worker ``on``: that worker holds it now."""
    job = _submit(policy, f"history-{key}", nbytes, key=key)
    assert job.worker == on
    _done(policy, job)
    assert policy.homes[key] == (on, nbytes)


def _key_on(policy: Dispatcher, index: int, nth: int = 0) -> int:
    """A conversation key (the nth) that the hash ring gives worker ``index``."""
    keys = (k for k in range(0, 2**32, 2**20) if policy.ring_worker(k) == index)
    return next(itertools.islice(keys, nth, None))


def _lane(policy: Dispatcher, index: int) -> list[str]:
    return [job.request_id for job in policy.workers[index].lane]


def test_a_long_conversation_waits_for_its_worker_a_short_request_does_not():
    policy, pool = _policy(ready=(1,))
    _converted(policy, 1, 1_000_000, on=1)  # both conversations were converted by worker 1
    _converted(policy, 2, 2_000, on=1)
    policy.worker_ready(0, 1)
    busy0, busy1 = _busy(policy, 0), _busy(policy, 1)
    _submit(policy, "long-turn", 1_000_000, key=1)
    short = _submit(policy, "short-turn", 2_000, key=2, age_s=0.01)  # older than its 2 ms cold cost
    assert _lane(policy, 1) == ["long-turn", "short-turn"]
    pool.sent.clear()
    _done(policy, busy0)  # worker 0 is free
    assert pool.sent == [(0, "short-turn")]  # behind the long job, but cheap to convert anywhere
    pool.sent.clear()
    _done(policy, short)
    assert pool.sent == []  # the long turn waits: its worker may be free before a cold conversion would end
    assert pool.wakes  # ... but not longer than that
    assert 0.5 < pool.wakes[-1] <= 1.0
    _done(policy, busy1)  # its worker frees up first: it converts the turn with its cache
    assert pool.sent == [(1, "long-turn")]


def test_a_long_conversation_moves_once_waiting_would_cost_more_than_converting():
    policy, pool = _policy(ready=(1,))
    _converted(policy, 1, 1_000_000, on=1)
    _busy(policy, 1)
    policy.worker_ready(0, 1)
    pool.sent.clear()
    _submit(policy, "long-turn", 1_000_000, key=1, age_s=1.5)  # waited longer than 1 s of cold work
    assert pool.sent == [(0, "long-turn")]
    assert policy.homes[1] == (0, 1_000_000)  # the conversation now lives with worker 0


def test_a_conversation_no_worker_has_seen_is_taken_at_once():
    policy, pool = _policy()
    busy0 = _busy(policy, 0)
    _busy(policy, 1)
    key = _key_on(policy, 1)
    _submit(policy, "first-turn", 1_000_000, key=key)
    assert _lane(policy, 1) == ["first-turn"]  # placed with worker 1 by the hash ring, nothing cached anywhere
    pool.sent.clear()
    _done(policy, busy0)
    assert pool.sent == [(0, "first-turn")] and policy.homes[key] == (0, 1_000_000)


def test_the_cold_rate_follows_observed_cold_conversions():
    policy, _ = _policy()
    for i in range(30):
        job = _submit(policy, f"cold-{i}", 100_000, key=100 + i)
        _done(policy, job, timing=Timing(render_s=0.05, tokenize_s=0.25, cache=CacheReport(0, 1, 0, 25_000, 0, 0, 0)))
    assert abs(policy.cold_s_per_byte - 3e-6) < 1e-7  # 0.3 s per 100 kB


def _quick(policy: Dispatcher, name: str) -> Job:
    job = _submit(policy, name, 300, quick_ok=True)
    assert job.quick
    return job


def test_quick_jobs_go_out_at_once_spread_over_workers_and_bounded_per_worker():
    """A small body does not wait for a free worker: the IO thread of the worker with the fewest
    quick jobs in flight converts it, even beside a long conversion, up to quick_depth each."""
    policy, pool = _policy(quick_depth=2)
    _busy(policy, 0)
    _busy(policy, 1)  # both converting long prompts
    pool.sent.clear()
    for i in range(5):
        _quick(policy, f"q{i}")
    assert sorted(pool.sent) == [(0, "q0"), (0, "q2"), (1, "q1"), (1, "q3")]
    assert [j.request_id for j in policy.quick_queue] == ["q4"] and policy.queued == 1
    assert all(quick for name, quick in pool.quick if name.startswith("q"))
    pool.sent.clear()
    q1 = next(iter(policy.workers[1].quick.values()))
    _done(policy, q1)  # one answered: room again
    assert pool.sent == [(1, "q4")] and not policy.quick_queue


def test_a_worker_takes_as_many_jobs_as_it_has_conversion_threads():
    """A second long prompt starts beside the first on a worker with two conversion threads
    (WorkerReady says how many) instead of waiting for it; a third waits for one to finish."""
    policy, pool = _policy(ready=())
    policy.worker_ready(0, 2)  # one worker, two conversion threads
    jobs = [_submit(policy, f"long-{i}", 1_000_000) for i in range(3)]
    assert pool.sent == [(0, "long-0"), (0, "long-1")]
    assert policy.queued == 1 and len(policy.workers[0].running) == 2 and policy.busy == 1
    pool.sent.clear()
    _done(policy, jobs[1])
    assert pool.sent == [(0, "long-2")] and policy.queued == 0


def test_a_dead_workers_quick_jobs_are_dispatched_again():
    policy, pool = _policy()
    for i in range(3):
        _quick(policy, f"q{i}")
    lost = {j.request_id for j in policy.workers[0].quick.values()}
    assert lost
    pool.sent.clear()
    assert policy.worker_lost(0) == []  # none given up: each tried once
    assert sorted(name for _, name in pool.sent) == sorted(lost)
    assert all(index == 1 for index, _ in pool.sent)  # the survivor takes them


def test_jobs_spread_over_idle_workers_before_doubling_up():
    """With two workers of two conversion threads each, two long prompts go one to each worker
    (nothing shared) rather than both to the first; the third and fourth then fill second threads."""
    policy, pool = _policy(slots=2)
    for i in range(2):
        _submit(policy, f"long-{i}", 1_000_000)
    assert sorted(index for index, _ in pool.sent) == [0, 1]
    for i in range(2, 5):
        _submit(policy, f"long-{i}", 1_000_000)
    assert sorted(index for index, _ in pool.sent) == [0, 0, 1, 1] and policy.queued == 1


def _turn(policy: Dispatcher, name: str, nbytes: int, key: int) -> Job:
    return _submit(policy, name, nbytes, key=key, quick_ok=True)


def test_a_cheap_next_turn_goes_quick_to_the_worker_holding_its_conversation():
    """A 20 KB conversation's next turn, 1 KB longer, is converted by the IO thread of the worker that
    converted the last turn (most of it is in that worker's cache), even when the other worker has
    fewer quick jobs; a turn that adds more than --quick-conversion-bytes, a body over
    --quick-turn-bytes, and a conversation no worker holds go to conversion threads."""
    policy, pool = _policy(ready=(1,))
    _converted(policy, 1, 20_000, on=1)
    _converted(policy, 2, 20_000, on=1)
    _converted(policy, 3, 60_000, on=1)
    for i in range(3):
        _quick(policy, f"small-{i}")  # worker 1 is the busier of the two
    policy.worker_ready(0, 1)
    pool.sent.clear()
    turns = [_turn(policy, "next-turn", 21_000, key=1)]
    assert pool.sent == [(1, "next-turn")] and policy.homes[1] == (1, 21_000)
    turns.append(_turn(policy, "big-addition", 20_000 + 9_000, key=2))  # 9 KB of new text: a conversion thread
    turns.append(_turn(policy, "over-the-cap", 70_000, key=3))
    turns.append(_turn(policy, "unknown", 21_000, key=4))
    quick = {job.request_id: job.quick for job in turns}
    assert quick == {"next-turn": True, "big-addition": False, "over-the-cap": False, "unknown": False}


def test_a_quick_turn_whose_worker_is_full_or_gone_goes_to_a_conversion_thread():
    policy, pool = _policy(ready=(1,), quick_depth=1)
    _converted(policy, 1, 20_000, on=1)
    _quick(policy, "small")  # worker 1's IO thread is full
    _busy(policy, 1)
    policy.worker_ready(0, 1)
    pool.sent.clear()
    _turn(policy, "home-full", 21_000, key=1)
    assert pool.sent == [] and _lane(policy, 1) == ["home-full"]
    assert not policy.workers[1].lane[0].quick  # waits for worker 1's conversion thread

    policy, pool = _policy(ready=(0,))
    _converted(policy, 2, 20_000, on=0)
    policy.worker_ready(1, 1)
    pool.sent.clear()
    pool.down.add(0)  # worker 0 died (its cache with it) before the gateway heard: its link refuses
    _turn(policy, "home-gone", 21_000, key=2)
    assert pool.sent == [(1, "home-gone")] and not policy.workers[0].ready
    assert pool.quick[-1] == ("home-gone", False)


def test_a_held_conversation_waits_for_its_worker_however_busy_a_new_one_goes_where_there_is_room():
    """The load bound places new conversations only. A turn of a conversation worker 0 holds waits
    in worker 0's lane while both its threads are busy and worker 1 idles (worker 1 takes it once
    waiting has cost as much as converting it afresh: rent or buy). Moving it at once would
    re-tokenize its whole history: with the bound applied to held conversations, the agent
    benchmark lost 1% of its cache hits that way (0.9252 against a 0.9359 bound)."""
    policy, pool = _policy(ready=(0,), slots=2)
    _converted(policy, 1, 400_000, on=0)
    for _i in range(2):
        _busy(policy, 0)  # worker 0 converts two, worker 1 none
    policy.worker_ready(1, 2)
    pool.sent.clear()
    _submit(policy, "held-turn", 400_000, key=1)
    assert pool.sent == [] and _lane(policy, 0) == ["held-turn"]
    assert pool.wakes and abs(pool.wakes[-1] - 0.4) < 1e-9  # worker 1 takes it at 0.4 s, unless worker 0 frees up first
    new_key = _key_on(policy, 0)
    _submit(policy, "new-conversation", 400_000, key=new_key)
    assert pool.sent == [(1, "new-conversation")]  # worker 0 is over its share: no cache to lose elsewhere


def test_new_conversations_go_to_their_ring_worker_up_to_a_quarter_over_its_share():
    """Conversations no worker holds go to their hash-ring worker's lane while its load (jobs running
    and waiting) stays under 1.25 times the average load counting the shared queue and the new job;
    past that, to the shared queue, for whichever worker is free first."""
    policy, pool = _policy()
    _busy(policy, 0)
    _busy(policy, 1)
    for i in range(4):
        _submit(policy, f"new-{i}", 100_000, key=_key_on(policy, 0, nth=i))
    # worker 0's load 1, 2, 3 against bounds ceil(1.25 * 3/2) = 2, 3, 4; then 4 against ceil(1.25 * 6/2) = 4
    assert _lane(policy, 0) == ["new-0", "new-1", "new-2"]
    assert [job.request_id for job in policy.queue] == ["new-3"]


def test_a_small_request_goes_to_its_conversations_worker_unless_that_one_is_busier():
    policy, pool = _policy(ready=(1,))
    _converted(policy, 5, 300, on=1)
    policy.worker_ready(0, 1)
    pool.sent.clear()
    _turn(policy, "first", 300, key=5)
    _turn(policy, "second", 300, key=5)  # worker 1 has one in flight now, worker 0 none
    assert pool.sent == [(1, "first"), (0, "second")]


def test_an_idle_worker_takes_its_own_lane_before_another_steals_it():
    """A new conversation placed with worker 1 by the hash ring, both workers idle: worker 1 takes
    it, though worker 0 comes first in the dispatch loop (it would have stolen it: nothing cached)."""
    policy, pool = _policy()
    key = _key_on(policy, 1)
    _submit(policy, "new-conversation", 100_000, key=key)
    assert pool.sent == [(1, "new-conversation")]


def test_the_conversation_key_follows_a_conversation_and_tells_apart_those_sharing_a_system_prompt():
    import json

    from tokenmill.gateway.apis import conversation_key

    system = {"role": "system", "content": "You are a coding agent. Follow the repository's rules. " * 200}  # 11 KB

    def body(first: str, turns: int) -> bytes:
        messages = [system, {"role": "user", "content": first}]
        for t in range(turns):
            messages += [{"role": "assistant", "content": f"step {t}"}, {"role": "user", "content": f"output {t}"}]
        return json.dumps({"model": "m", "messages": messages, "max_tokens": 5}).encode()

    a = [conversation_key(body("Fix the failing test in parser.py", t)) for t in range(4)]
    b = conversation_key(body("Add a --verbose flag to the CLI", 0))
    assert len(set(a)) == 1 and a[0] is not None  # every turn of one conversation
    assert b != a[0]  # another conversation behind the same 11 KB system prompt
    short = [
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}]
                + [{"role": "assistant", "content": f"hello {t}"} for t in range(turns)],
            }
        ).encode()
        for turns in range(3)
    ]
    assert len({conversation_key(b) for b in short}) == 1  # a short chat's later turns fall inside 2 KB
    assert conversation_key(json.dumps({"model": "m", "messages": [system]}).encode()) is not None
    assert conversation_key(b'{"model": "m", "prompt": "hello"}') is None


def test_the_messages_conversation_key_hashes_the_system_field_and_the_first_user_turn():
    """Anthropic's Messages body carries its system prompt in "system" (Claude Code: after
    "messages"): the key follows a conversation's turns and tells apart system prompts and tasks."""
    import json

    from tokenmill.gateway.apis import conversation_key

    def body(system: str, task: str, turns: int) -> bytes:
        messages = [{"role": "user", "content": [{"type": "text", "text": task}]}]
        for t in range(turns):
            messages += [{"role": "assistant", "content": f"step {t}"}, {"role": "user", "content": f"output {t}"}]
        return json.dumps({"model": "m", "messages": messages, "system": [{"type": "text", "text": system}]}).encode()

    turns = {conversation_key(body("Agent A.", "Fix the test", t), True) for t in range(4)}
    assert len(turns) == 1 and None not in turns
    assert conversation_key(body("Agent B.", "Fix the test", 0), True) not in turns
    assert conversation_key(body("Agent A.", "Add a flag", 0), True) not in turns


def test_a_conversation_whose_stream_moved_goes_to_its_new_worker_converted_afresh():
    """Worker 0 dies while streaming a 20 KB conversation's answer; the stream moves to worker 1
    (rehome). The next turn goes to worker 1, not to the ring's choice or the dead worker's
    replacement, and to a conversion thread: worker 1 holds none of the conversation's segments yet,
    so it is not a cheap turn for its IO thread."""
    policy, pool = _policy()
    key = _key_on(policy, 0)
    _converted(policy, key, 20_000, on=0)
    policy.worker_lost(0)
    assert key not in policy.homes
    policy.rehome(key, 1)
    policy.worker_ready(0, 1)  # the replacement, where the ring still points
    pool.sent.clear()
    job = _turn(policy, "next-turn", 21_000, key=key)
    assert pool.sent == [(1, "next-turn")] and not job.quick
    assert policy.homes[key] == (1, 21_000)
    policy, _ = _policy(affinity=False)
    policy.rehome(key, 1)
    assert not policy.homes  # no affinity: nothing to repoint


def test_the_workers_conversation_key_follows_an_image_chat_without_encoding_its_images():
    """The scheduler-rank key a worker gives a chat (its messages up to the first user turn): every
    turn of one conversation gets one key, another first turn another, also when the first turns
    differ only in a multi-megabyte data: URL that the key reads by its ends."""
    import base64
    import os

    from tokenmill.tokenizer_workers.conversion.chat import conversation_key

    def url(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode()

    def chat(image: str, turns: int) -> list[dict]:
        parts = [{"type": "text", "text": "Compare."}, {"type": "image_url", "image_url": {"url": image}}]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
        for t in range(turns):
            messages += [{"role": "assistant", "content": f"step {t}"}, {"role": "user", "content": f"more {t}"}]
        return messages

    one, two = os.urandom(3_000_000), os.urandom(3_000_000)
    keys = {conversation_key(chat(url(one), t)) for t in range(3)}
    assert len(keys) == 1
    assert conversation_key(chat(url(two), 0)) not in keys
    same_ends = one[:1_000_000] + two[1_000_000:2_000_000] + one[2_000_000:]
    assert conversation_key(chat(url(same_ends), 0)) in keys  # only the ends of a long string count
    assert conversation_key([{"role": "user", "content": "a"}]) != conversation_key([{"role": "user", "content": "b"}])
    assert conversation_key([{"role": "user", "content": ["a"]}]) != conversation_key(
        [{"role": "user", "content": "a"}]
    )
