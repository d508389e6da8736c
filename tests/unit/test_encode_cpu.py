"""Tokenization CPU per request (tokenize-cpu in Server-Timing, tokenmill_tokenize_cpu_seconds) when
a worker's threads encode at once: the process's CPU is divided among them, not charged to each."""

from __future__ import annotations

import json
import threading
import time

from tokenmill.bench.common import corpus
from tokenmill.tokenizer_workers import messages as m
from tokenmill.tokenizer_workers.conversion.core import EncodeCpu
from tokenmill.tokenizer_workers.converter import Converter
from tokenmill.tokenizer_workers.settings import ConverterSettings


def test_overlapping_encodings_share_the_process_cpu():
    now = [0.0]
    cpu = EncodeCpu(clock=lambda: now[0])
    a = cpu.start()  # t=0: A alone
    now[0] = 2.0
    b = cpu.start()  # t=2: A and B
    now[0] = 4.0
    assert cpu.stop(a) == 3.0  # 2 s alone, half of 2 s shared
    now[0] = 7.0
    assert cpu.stop(b) == 4.0  # half of 2 s shared, 3 s alone
    now[0] = 9.0  # idle CPU (the IO thread's) is nobody's encoding
    c = cpu.start()
    now[0] = 10.0
    assert cpu.stop(c) == 1.0


def test_two_threads_converting_at_once_are_not_each_charged_both():
    """Two ~100k-token chats converted at once by two threads of one converter, as a worker's
    conversion threads do: what they report adds up to no more than the process spent meanwhile.
    (Read around each encoding, the process clock charged each about what both cost.)"""
    converter = Converter(ConverterSettings(tokenize_cache_bytes=0))
    text = corpus(800_000)
    bodies = [
        json.dumps(
            {
                "model": converter.model_name,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": text[i * 400_000 : (i + 1) * 400_000]}],
            }
        ).encode()
        for i in range(2)
    ]
    converter.convert(m.ConvertJob(0, "chat", "warm", False), bodies[0][:2000] + b'"}]}')
    reported, start = [], threading.Barrier(2)

    def convert(i: int) -> None:
        start.wait()
        conversion = converter.convert(m.ConvertJob(i + 1, "chat", f"r{i}", False), bodies[i])
        assert conversion.done.error is None, conversion.done.error
        reported.append(conversion.done.timing.tokenize_cpu_s)

    threads = [threading.Thread(target=convert, args=(i,)) for i in range(2)]
    before = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = time.process_time() - before
    print(f"reported {reported}, process CPU meanwhile {spent:.3f} s")
    assert len(reported) == 2 and all(r > 0 for r in reported)
    assert sum(reported) <= spent + 0.005
