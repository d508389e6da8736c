"""Exact segment tokenization with a content-addressed cache.

HuggingFace tokenizers split text at added tokens before normalizing, pre-tokenizing or
running the model, so for tokenizers whose pieces do not influence each other, encoding
the text between added tokens piece by piece and joining gives exactly the IDs of
encoding it whole. Every turn of an agent conversation re-renders the earlier turns to
the same pieces, so their IDs can be looked up by content instead of recomputed.

Whether a tokenizer is separable is decided at load by a self-test (piecewise against
whole on generated texts with unicode and whitespace edges around added tokens). When it
is not (a Metaspace pre-tokenizer that prepends only at the start, a normalizer or
added-token options that look across boundaries), the cache stays off.

The cache keeps compact uint32 arrays under a byte budget with segmented LRU: a new
piece enters on probation and is promoted when seen again, and eviction takes probation
pieces first, so the recurring history of conversations outlives one-off text.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tokenizers import Tokenizer

from tokenmill.tokenizer_workers.model import tokenizer_part
from tokenmill.tokenizer_workers.prompt_prefixes import Prompt, PromptPrefixes, Reuse

log = logging.getLogger("tokenmill.segment_cache")

_ENTRY_OVERHEAD = 120  # bytes per cached piece beyond its IDs: key, array header, dict slot
# A newline followed by an ASCII letter: a pre-tokenizer boundary for the GPT-style split
# regexes of byte-level BPE tokenizers (no pattern spans it). Long pieces are cut there so
# encode_batch can spread one long prompt over cores; the self-test checks it per tokenizer.
_SOFT_BOUNDARY = re.compile(r"\n(?=[A-Za-z])")


@dataclass
class EncodeStats:
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    fresh_tokens: int = 0
    mismatches: int = 0
    prefix_hits: int = 0  # prompts that began with the IDs of an earlier prompt


def _trie_regex(words: list[str]) -> re.Pattern:
    """One regex matching any of the words, longest first at each position (leftmost-longest,
    like tokenizers' added-token matcher). Nested by shared prefixes, so at a candidate
    position the engine follows one branch instead of trying a thousand alternatives."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer word wins

    return re.compile(build(trie))


class SegmentCache:
    """Piece hash -> token IDs, bounded in bytes, segmented LRU (probation, then protected)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.protected_budget = int(budget_bytes * 0.8)
        self.probation: OrderedDict[bytes, array] = OrderedDict()
        self.protected: OrderedDict[bytes, array] = OrderedDict()
        self.bytes_used = 0
        self.protected_bytes = 0
        self.evictions = 0

    @staticmethod
    def _size(ids: array) -> int:
        return len(ids) * ids.itemsize + _ENTRY_OVERHEAD

    def get(self, key: bytes) -> array | None:
        ids = self.protected.get(key)
        if ids is not None:
            self.protected.move_to_end(key)
            return ids
        ids = self.probation.pop(key, None)
        if ids is None:
            return None
        size = self._size(ids)
        self.protected[key] = ids  # seen twice: a recurring piece
        self.protected_bytes += size
        while self.protected_bytes > self.protected_budget and self.protected:
            old_key, old = self.protected.popitem(last=False)  # demote, not drop
            self.protected_bytes -= self._size(old)
            self.probation[old_key] = old
        return ids

    def put(self, key: bytes, ids: array) -> None:
        size = self._size(ids)
        if size > self.budget or key in self.protected or key in self.probation:
            return
        self.probation[key] = ids
        self.bytes_used += size
        while self.bytes_used > self.budget:
            source = self.probation if self.probation else self.protected
            _, old = source.popitem(last=False)
            old_size = self._size(old)
            self.bytes_used -= old_size
            if source is self.protected:
                self.protected_bytes -= old_size
            self.evictions += 1

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)


class SegmentEncoder:
    """Encodes rendered prompts (add_special_tokens=False) piece by piece, through the cache."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        budget_bytes: int,
        min_chars: int = 256,
        verify: bool = False,
        split_chars: int = 32768,
    ):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()  # a worker's threads (conversion and IO) share the cache; encoding runs outside it
        self.min_chars = min_chars
        self.verify = verify
        self.split_chars = 0  # soft splitting is off until the self-test has checked it
        # a quarter of the budget keeps whole recent prompts (one per conversation), the rest pieces
        self.cache = SegmentCache(budget_bytes - budget_bytes // 4)
        self.ids_of: dict[str, int] = {}
        self.splitter = self._splitter()
        self.separable, self.self_test_reason = self.self_test() if self.splitter else (False, "no added tokens")
        if self.separable and self.soft_split_test():
            self.split_chars = split_chars
        self.enabled = budget_bytes > 0 and self.separable
        self.prefixes = PromptPrefixes(budget_bytes // 4, self.longest_token if self.splitter else 0, self.splitter)
        log.info("tokenization cache %s (%s)", "on" if self.enabled else "off", self.self_test_reason)

    def _splitter(self) -> re.Pattern | None:
        tokens = list(self.tokenizer.get_added_tokens_decoder().items())
        normalizer = tokenizer_part(self.tokenizer.normalizer)
        has_normalizer = bool(normalizer and normalizer.get("normalizers", [None]))
        plain = []
        for tid, tok in tokens:
            if tok.lstrip or tok.rstrip or tok.single_word or (tok.normalized and has_normalizer):
                return None  # matching depends on context; piecewise encoding would not be exact
            self.ids_of[tok.content] = tid
            plain.append(tok.content)
        if not plain:
            return None
        self.longest_token = max(map(len, plain))
        return _trie_regex(plain)

    def _added_tokens(self, text: str, pos: int = 0, window: int = 1 << 15):
        """Matches of added tokens, leftmost-longest, scanned window by window.

        One regex call over a megabyte holds the GIL for tens of milliseconds, and the worker's
        IO thread (which detokenizes running streams) needs it; windows keep each hold short.
        """
        n, overlap = len(text), self.longest_token
        search = self.splitter.search
        while pos < n:
            end = min(n, pos + window)
            match = search(text, pos, min(n, end + overlap))
            if match is not None and match.start() < end:
                yield match
                pos = match.end()
            else:
                pos = end

    # ---- the split ---------------------------------------------------------------------------

    def pieces(self, text: str) -> list[str | int]:
        """Text pieces and added-token IDs, in order."""
        return self._split(text)[0]

    def _split(self, text: str, pos: int = 0) -> tuple[list[str | int], array, array]:
        """Pieces of text[pos:], and the start and end in text of each added token among them."""
        out: list[str | int] = []
        starts, ends = array("Q"), array("Q")
        for match in self._added_tokens(text, pos):
            if match.start() > pos:
                out.append(text[pos : match.start()])
            out.append(self.ids_of[match.group()])
            starts.append(match.start())
            ends.append(match.end())
            pos = match.end()
        if pos < len(text):
            out.append(text[pos:])
        if self.split_chars:
            out = [sub for part in out for sub in (self._soft_split(part) if isinstance(part, str) else (part,))]
        return out, starts, ends

    def _soft_split(self, text: str) -> list[str]:
        """Cut a long piece at soft boundaries about split_chars apart (deterministic in its content)."""
        if len(text) < 2 * self.split_chars:
            return [text]
        out, start = [], 0
        while len(text) - start >= 2 * self.split_chars:
            match = _SOFT_BOUNDARY.search(text, start + self.split_chars)
            if match is None:
                break
            out.append(text[start : match.end()])
            start = match.end()
        out.append(text[start:])
        return out

    def _encode_pieces(
        self,
        parts: list[str | int],
        stats: EncodeStats,
        use_cache: bool,
        out: array | None = None,
        marks: array | None = None,
    ) -> array:
        """IDs of the pieces appended to out; marks gets len(out) after each added token."""
        found: dict[int, array] = {}
        todo_idx, todo_text, todo_keys = [], [], []
        keys = [
            hashlib.blake2b(part.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            if use_cache and isinstance(part, str) and len(part) >= self.min_chars
            else None
            for part in parts
        ]
        with self.lock:
            for i, part in enumerate(parts):
                if isinstance(part, int):
                    continue
                key = keys[i]
                if key is not None:
                    ids = self.cache.get(key)
                    if ids is not None:
                        found[i] = ids
                        stats.hits += 1
                        stats.cached_tokens += len(ids)
                        continue
                    stats.misses += 1
                todo_keys.append(key)
                todo_idx.append(i)
                todo_text.append(part)
        if todo_text:  # one call: encode_batch releases the GIL and spreads pieces over cores
            encodings = self.tokenizer.encode_batch_fast(
                todo_text, add_special_tokens=False
            )  # no offsets: less to free
            for n, (i, _key) in enumerate(zip(todo_idx, todo_keys)):
                # Freeing an Encoding holds the GIL (~10 ms for a whole 250k-token prompt's worth): free
                # them one at a time, so the IO thread detokenizing running streams gets the GIL between.
                enc, encodings[n] = encodings[n], None
                ids = array("I", enc.ids)
                del enc
                found[i] = ids
                stats.fresh_tokens += len(ids)
            with self.lock:
                for i, key in zip(todo_idx, todo_keys):
                    if key is not None:
                        self.cache.put(key, found[i])
        out = array("I") if out is None else out
        for i, part in enumerate(parts):
            if isinstance(part, int):
                out.append(part)
                stats.fresh_tokens += 1
                if marks is not None:
                    marks.append(len(out))
            else:
                out.extend(found[i])
        return out

    def _encode_cached(self, text: str, stats: EncodeStats) -> tuple[array, Prompt, Reuse | None]:
        """Through the prompt prefixes, then the segment cache for whatever follows the reused prefix."""
        with self.lock:
            reuse = self.prefixes.find(text)
        if reuse is None:
            base, starts, ends, tokens, at = array("I"), array("Q"), array("Q"), array("I"), 0
        else:
            old = reuse.prompt
            base, tokens = old.ids[: reuse.tokens], old.tokens[: reuse.marks]
            starts, ends, at = old.starts[: reuse.marks], old.ends[: reuse.marks], reuse.chars
            stats.prefix_hits += 1
            stats.cached_tokens += reuse.tokens
        parts, tail_starts, tail_ends = self._split(text, at)
        starts.extend(tail_starts)
        ends.extend(tail_ends)
        ids = self._encode_pieces(parts, stats, use_cache=True, out=base, marks=tokens)
        return ids, Prompt(text, ids, starts, ends, tokens), reuse

    def encode(self, text: str) -> tuple[array, EncodeStats]:
        stats = EncodeStats()
        if not self.enabled and self.split_chars and len(text) >= 2 * self.split_chars:
            return self._encode_pieces(self.pieces(text), stats, use_cache=False), stats
        if not self.enabled:
            ids = array("I", self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
            stats.fresh_tokens = len(ids)
            return ids, stats
        ids, prompt, reuse = self._encode_cached(text, stats)
        if self.verify:
            whole = array("I", self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
            if whole != ids:
                stats.mismatches += 1
                log.error("tokenization cache mismatch on a %d-character prompt; using the whole encoding", len(text))
                return whole, stats
        with self.lock:
            self.prefixes.remember(prompt, reuse)
        return ids, stats

    @property
    def bytes_used(self) -> int:
        return self.cache.bytes_used + self.prefixes.bytes_used

    # ---- the self-tests ----------------------------------------------------------------------

    def soft_split_test(self) -> bool:
        """Encoding cut at every soft boundary equals encoding whole, on text built to stress them."""
        lines = [
            "def f(x):",
            "    return x  ",
            "Hello, world!",
            "x = 12345678",
            "  \t",
            "'s fine",
            "日本語 text",
            "emoji 🙂 ok",
            "a\r",
            "::",
            "",
            " ",
            "Zebra",
            "z",
            "-- dash",
            "#include <stdio.h>",
        ]
        text = "".join(lines[(i * 5 + i // 3) % len(lines)] + ("\n" * (1 + i % 3)) for i in range(400))
        cuts = [m.end() for m in _SOFT_BOUNDARY.finditer(text)]
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        joined = [i for enc in self.tokenizer.encode_batch(pieces, add_special_tokens=False) for i in enc.ids]
        ok = joined == self.tokenizer.encode(text, add_special_tokens=False).ids
        log.info("soft splitting of long pieces %s", "on" if ok else "off (not exact for this tokenizer)")
        return ok

    def self_test(self) -> tuple[bool, str]:
        """Piecewise against whole on texts built to stress piece boundaries."""
        t0 = time.perf_counter()
        specials = list(self.ids_of)[:12] + sorted(self.ids_of, key=len)[:4]
        edges = [
            "",
            " ",
            "  ",
            "\n",
            "\n\n",
            "\t",
            "\r\n",
            " x",
            "x ",
            "héllo wörld",
            "🙂🚀",
            "日本語のテキスト",
            "  indented\n",
            "123456",
            "a.b,c",
            "\u00a0",
            "'s",
            " 's",
            "\u200b",
        ]
        texts = []
        for i, s in enumerate(specials):
            for j, left in enumerate(edges):
                right = edges[(i * 7 + j * 3) % len(edges)]
                texts.append(left + s + right + specials[(i + j) % len(specials)] + left + "end" + right)
        texts.append("".join(specials) + " ".join(edges) + "".join(reversed(specials)))
        stats = EncodeStats()
        whole = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        for text, enc in zip(texts, whole):
            if list(self._encode_pieces(self.pieces(text), stats, use_cache=False)) != enc.ids:
                return False, f"not segment-separable: piecewise differs on {text!r}"
        return True, f"segment-separable on {len(texts)} self-test texts in {time.perf_counter() - t0:.2f}s"
