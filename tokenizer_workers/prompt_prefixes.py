"""Recent prompts of a worker, so that an agent's next turn reuses the IDs of its last one.

An agent resends its whole history each turn, and the new prompt usually begins with the
whole previous prompt (or most of it, where a template rewrites the last turns). Looking
that prefix up by content costs one memcmp, where the segment cache would have to scan the
whole prompt for added tokens, hash every piece and join their IDs again.

Each remembered prompt keeps its IDs and, for every added token in it, where the token
starts and ends in the text and how many IDs precede its end. A new prompt can take the
IDs up to the end of an added token that the added-token scan (leftmost-longest) provably
finds in the new text too: the pieces before it are then the same pieces, with the same
IDs. A token that starts at least one longest-added-token before the shared prefix ends
needs no check; a later one is checked by searching the few characters where a longer or
earlier rival could begin.
"""

from __future__ import annotations

import re
import sys
from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass

HEAD_CHARS = 256  # prompts are grouped by their first characters
CANDIDATES = 256  # newest prompts compared per group (one memcmp each, stopping at the first difference)
PARTIAL_CANDIDATES = 8  # newest prompts searched for a partly shared prefix when none is a whole prefix
REWRITTEN_TAIL_CHARS = 1024  # how much of a prompt's end its next turn may render differently


@dataclass(slots=True, eq=False)
class Prompt:
    text: str
    ids: array  # uint32 IDs of the whole text
    starts: array  # per added token: start in text
    ends: array  # per added token: end in text
    tokens: array  # per added token: number of IDs up to and including it
    size: int = 0  # nbytes() when remembered: what dropping it gives back

    def nbytes(self) -> int:
        """Its memory now. It can grow after the fact: a str keeps its UTF-8 form once something asked
        for it (the tokenizer does), so the accounting keeps the size it added."""
        arrays = (self.ids, self.starts, self.ends, self.tokens)
        return sys.getsizeof(self.text) + sum(len(a) * a.itemsize for a in arrays) + 200


@dataclass(slots=True)
class Reuse:
    prompt: Prompt
    chars: int  # the new text's first `chars` characters ...
    marks: int  # ... hold the first `marks` added tokens of `prompt`, and
    tokens: int  # the IDs prompt.ids[:tokens]
    shared: int  # characters the two texts have in common from the start

    @property
    def supersedes(self) -> bool:
        """The new prompt continues this one (its next turn, a retry, or a template that rewrites the
        generation prompt or the last turn's end), rather than being another conversation that only
        shares a system prompt with it."""
        return self.shared >= len(self.prompt.text) - REWRITTEN_TAIL_CHARS


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection over memcmp (no per-character loop)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptPrefixes:
    """The newest prompts under a byte budget, least recently used evicted first."""

    def __init__(self, budget_bytes: int, longest_token: int, added_tokens: re.Pattern | None):
        self.budget = budget_bytes
        self.longest_token = longest_token
        self.added_tokens = added_tokens  # the encoder's leftmost-longest added-token matcher
        self.lru: OrderedDict[int, Prompt] = OrderedDict()  # id(prompt) -> prompt
        self.by_head: dict[str, list[Prompt]] = {}
        self.bytes_used = 0

    def find(self, text: str) -> Reuse | None:
        """The remembered prompt sharing the longest usable prefix with text, if any."""
        group = self.by_head.get(text[:HEAD_CHARS])
        if not group:
            return None
        best, best_len = None, 0
        for prompt in reversed(group):  # at most CANDIDATES, newest last
            n = len(prompt.text)  # its last characters first: they tell conversations apart cheaply
            if n > best_len and text.startswith(prompt.text[-64:], max(0, n - 64)) and text.startswith(prompt.text):
                best, best_len = prompt, n
        if best is None:
            for prompt in reversed(group[-PARTIAL_CANDIDATES:]):
                shared = common_prefix_len(text, prompt.text)
                if shared > best_len:
                    best, best_len = prompt, shared
        if best is None:
            return None
        self.lru.move_to_end(id(best))
        if best_len == len(text) == len(best.text):  # the same prompt again (a retry, n>1 fan-out)
            return Reuse(best, best_len, len(best.starts), len(best.ids), best_len)
        k = bisect_right(best.ends, best_len) - 1  # the last added token inside the shared part ...
        while k >= 0 and not self._same_match(text, best, k, best_len):
            k -= 1  # ... that the new text's scan provably matches too
        if k < 0:
            return None
        return Reuse(best, best.ends[k], k + 1, best.tokens[k], best_len)

    def _same_match(self, text: str, prompt: Prompt, k: int, shared: int) -> bool:
        """Whether scanning text finds prompt's k-th added token, given the first `shared` characters agree.

        Before position q (the end of the token before it, or `shared` minus the longest added
        token, whichever is later) any match lies wholly inside the shared part and so is one
        the old scan found: there are none between the two tokens. From q on, a match may reach
        past the shared part, so search there: the first match must be the same token.
        """
        start, end = prompt.starts[k], prompt.ends[k]
        q = max(prompt.ends[k - 1] if k else 0, shared - self.longest_token)
        if q > start:  # it and every rival it could have lie inside the shared part
            return True
        match = self.added_tokens.search(text, q, min(len(text), start + self.longest_token))
        return match is not None and match.start() == start and match.end() == end

    def remember(self, prompt: Prompt, reuse: Reuse | None = None) -> None:
        """Keep prompt; drop the one it continues (its conversation has moved past it)."""
        if reuse is not None and reuse.supersedes:
            self._drop(reuse.prompt)
        size = prompt.size = prompt.nbytes()
        if size > self.budget:
            return
        self.lru[id(prompt)] = prompt
        group = self.by_head.setdefault(prompt.text[:HEAD_CHARS], [])
        group.append(prompt)
        if len(group) > CANDIDATES:
            self._drop(group[0])
        self.bytes_used += size
        while self.bytes_used > self.budget and self.lru:
            self._drop(next(iter(self.lru.values())))

    def _drop(self, prompt: Prompt) -> None:
        if self.lru.pop(id(prompt), None) is None:
            return
        self.bytes_used -= prompt.size
        head = prompt.text[:HEAD_CHARS]
        group = self.by_head[head]
        group.remove(prompt)
        if not group:
            del self.by_head[head]

    def __len__(self) -> int:
        return len(self.lru)
