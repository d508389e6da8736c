"""The segment tokenization cache inside a serving worker: a conversation's turns hit it, with no mismatch
against whole-prompt encoding (--verify-tokenize-cache), whichever conversion thread takes each turn. The
cache's exactness on its own is tests/unit/test_segment_cache.py."""

from __future__ import annotations

import json

from conftest import Server, http


def test_multiturn_hits_the_cache_with_zero_mismatches(default_tokenizer):
    # bodies this small would be converted at once on a worker's IO thread, beside the cache (and not in it)
    srv = Server(
        "--workers",
        "2",
        "--verify-tokenize-cache",
        "--sim-inter-token-latency-ms",
        "1",
        "--quick-conversion-bytes",
        "0",
    )
    try:
        client = srv.client()
        history = [{"role": "system", "content": "You are a coding agent. " * 40}]
        cached_by_turn = []
        for turn in range(5):
            history.append(
                {"role": "user", "content": f"Tool output {turn}: " + ("def f(x):\n    return x * 2\n" * 60)}
            )
            raw = client.chat.completions.with_raw_response.create(model="deepseek-v4", messages=history, max_tokens=3)
            resp = raw.parse()
            cached_by_turn.append(int(raw.headers["x-tokenmill-cached-prompt-tokens"]))
            assert "tokenize;dur=" in raw.headers["server-timing"]
            status, _, tok = http("POST", srv.url + "/tokenize", {"messages": history})
            assert resp.usage.prompt_tokens == tok["count"]
            history.append({"role": "assistant", "content": resp.choices[0].message.content})
        print("cached prompt tokens by turn:", cached_by_turn)
        assert cached_by_turn[0] == 0 and all(c > 0 for c in cached_by_turn[1:])  # affinity: same worker each turn
        assert cached_by_turn == sorted(cached_by_turn)
        _, _, metrics = http("GET", srv.url + "/metrics")
        text = metrics.decode()
        assert 'tokenmill_tokenize_cache_mismatches_total{model_name="deepseek-v4"} 0.0' in text
        assert 'tokenmill_tokenize_cache_enabled{model_name="deepseek-v4"} 1.0' in text
    finally:
        srv.stop()


def test_an_agents_turns_share_one_cache_whichever_thread_converts_them(default_tokenizer):
    """An agent's short turns convert on the worker's IO thread (bodies under
    --quick-conversion-bytes), a turn that adds a long tool output on a conversion thread, and
    the next short turns on the IO thread again (a cheap turn of a conversation the worker holds,
    --quick-turn-bytes). All go through the worker's one cache: every turn after the first reuses
    the ones before, exactly (verified), and /metrics counts each path."""
    srv = Server("--workers", "1", "--verify-tokenize-cache", "--sim-inter-token-latency-ms", "1")
    try:
        client = srv.client()
        history = [{"role": "system", "content": "You are a terse assistant for a lighthouse keeper. " * 8}]
        cached_by_turn, sizes = [], []
        for turn in range(6):
            output = ("lamp log: beam steady, lens clean\n" * 400) if turn == 3 else ""
            history.append({"role": "user", "content": f"Turn {turn}: what should I check next? {output}"})
            raw = client.chat.completions.with_raw_response.create(model="deepseek-v4", messages=history, max_tokens=3)
            resp = raw.parse()
            sizes.append(len(json.dumps(history)))
            cached_by_turn.append(int(raw.headers["x-tokenmill-cached-prompt-tokens"]))
            history.append({"role": "assistant", "content": resp.choices[0].message.content})
        print("cached prompt tokens by turn:", cached_by_turn, "body sizes:", sizes)
        assert max(sizes[:3]) < 8192 < min(sizes[3:]) and max(sizes) < 65536
        assert cached_by_turn[0] == 0 and all(c > 0 for c in cached_by_turn[1:])
        assert cached_by_turn[3] > cached_by_turn[2] and cached_by_turn[4] > 3000  # across the two threads
        text = http("GET", srv.url + "/metrics")[2].decode()
        assert 'tokenmill_conversions_total{model_name="deepseek-v4",path="io_thread"} 5.0' in text, text
        assert 'tokenmill_conversions_total{model_name="deepseek-v4",path="conversion_thread"} 1.0' in text
        assert 'tokenmill_tokenize_cache_mismatches_total{model_name="deepseek-v4"} 0.0' in text
        status, _, tok = http("POST", srv.url + "/tokenize", {"messages": history[:-1]})
        assert status == 200 and resp.usage.prompt_tokens == tok["count"]
    finally:
        srv.stop()
