"""Which token a simulated request generates next: drawn, echoed, scripted or guided.

Generated tokens are deterministic for a given ``sampling.seed`` (together with the
prompt), deterministic from the prompt alone with ``seed`` None and temperature 0, and
random otherwise (:func:`make_rng`). With a tokenizer (``--model``) they are drawn sentence by
sentence from a fixed English paragraph (:data:`PALETTE_TEXT`) so that demo output reads as text;
without one, uniformly from ``[0, vocab_size)`` minus the request's stop token IDs. ``--mode echo``
repeats the prompt instead. ``--replies FILE`` scripts the output (:mod:`.replies`): a request whose
prompt contains a reply's ``match`` generates that reply's text, then the model's EOS
(docs/engines/scheduler-protocol.md §10).

The sampling fields are handled by :class:`TokenSampler`'s ``next_token_*`` methods, the scheduler
picking one per request at admission (a request that asks for none of them takes
``next_token_plain``, the fast path):

* ``structured`` (1.1): constrained decoding under llguidance over the served vocabulary
  (:mod:`tokenmill.engines.guided`): each step draws one of the tokens the matcher allows with the request's
  generator (so deterministic for (seed, prompt)); once the grammar is complete the first stop
  token ends it with ``"stop"``; ``max_new_tokens`` still cuts it (``"length"``).
* ``min_tokens`` (1.1): no stop token ends a request before it has that many tokens: random mode
  skips ``--eos-probability`` and palette stop tokens, echo mode skips the prompt's stop
  tokens, and a scripted reply that ends early holds its stop token back, random-mode text
  filling up to ``min_tokens``. A structured request does not stop where its grammar could go
  on before ``min_tokens``; where the grammar allows nothing more, it stops anyway.
* ``logit_bias`` (1.1, random mode only): a token with bias <= -100 is never drawn (nor emitted
  by ``--eos-probability``); the token with the highest bias >= 100 (the lowest ID among
  equals) is drawn at every step instead (unless it is a stop token held back by
  ``min_tokens``). Other biases have no effect.
* ``min_p`` and ``repetition_penalty`` (1.1) are accepted and have no visible effect: the
  simulator has no distribution to reshape.
* ``allowed_token_ids`` / ``bad_words`` (1.2, random mode): draws keep to the allowed IDs and never
  complete a banned sequence (its last token after the others as the latest generated tokens).
"""

from __future__ import annotations

import hashlib
import random

from tokenmill.engines.simulated.request import SimulatedRequest
from tokenmill.scheduler_client.protocol import FINISH_LENGTH, FINISH_STOP, Generate

# Demo text: generated tokens are whole sentences of this paragraph, picked at random.
PALETTE_TEXT = (
    "The river wound slowly through the valley, carrying the last light of the afternoon. "
    "On the far bank, a small boat rested against the reeds, its paint faded by many summers. "
    "An old man sat on the steps of the mill and watched the water turn the great wheel. "
    "He had worked there since he was a boy, and he knew every sound the machinery made. "
    "Today the grinding stones were quiet, because the harvest had not yet come in. "
    "Children ran along the path with a kite that refused to rise in the still air. "
    "Somewhere in the village a bell rang, and the swallows lifted from the rooftops. "
    "The baker closed his shutters and walked home with a loaf under each arm. "
    "Clouds gathered over the hills, promising rain before the night was over. "
    "In the morning, the fields would be bright and the wheel would turn again. "
    "Nobody was in a hurry, and the evening settled gently over the houses. "
    "A dog barked twice at a passing cart and then lay down in the warm dust."
)


class TokenSource:
    """Where random-mode tokens come from: a tokenized palette, or a uniform ID range."""

    def __init__(self, vocab_size: int, sentences: list[list[int]] | None = None) -> None:
        self.vocab_size = vocab_size
        self.sentences = [s for s in (sentences or []) if s]

    @property
    def uses_palette(self) -> bool:
        return bool(self.sentences)


def build_palette(tokenizer, vocab_size: int | None) -> tuple[int, list[list[int]]]:
    """(vocab size, the palette paragraph tokenized one sentence at a time)."""
    size = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(with_added_tokens=True)
    added = set(tokenizer.get_added_tokens_decoder())
    sentences = []
    for sentence in PALETTE_TEXT.split(". "):
        text = " " + sentence.rstrip(".") + "."
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        ids = [i for i in ids if i < size and i not in added]
        if ids:
            sentences.append(ids)
    return size, sentences


# the generator of unseeded requests (and of their logprobs' keys): one, shared
UNSEEDED = random.Random()


def make_rng(generate: Generate, prompt_bytes: bytes) -> random.Random:
    """Deterministic for (seed, prompt); for the prompt alone with seed None and temperature 0."""
    seed = generate.sampling.seed
    if seed is not None:
        digest = hashlib.blake2b(seed.to_bytes(16, "little", signed=True) + prompt_bytes, digest_size=16)
    elif generate.sampling.temperature == 0:
        digest = hashlib.blake2b(b"greedy" + prompt_bytes, digest_size=16)
    else:
        return UNSEEDED  # seeding a new generator from os.urandom per request costs more than the request
    return random.Random(int.from_bytes(digest.digest(), "little"))


class TokenSampler:
    """The next token of a request, by the served vocabulary (or palette), ``--mode`` and ``--eos-probability``.

    The scheduler sets each request's ``next_token`` to one of the ``next_token_*`` methods at admission;
    each returns (the token or None, the finish reason or None).
    """

    def __init__(self, tokens: TokenSource, mode: str, eos_probability: float) -> None:
        self.tokens = tokens
        self.mode = mode
        self.eos_probability = eos_probability

    def next_token_plain(self, req: SimulatedRequest) -> tuple[int | None, str | None]:
        """A request that asked for none of the fields the module docstring lists: the fast path."""
        if req.script is not None:
            if req.generated < len(req.script):
                token = req.script[req.generated]
            elif req.first_stop_id is not None and not req.ignore_eos:
                return req.first_stop_id, FINISH_STOP
            else:
                return None, FINISH_STOP
        elif self.mode == "echo":
            token = req.prompt[req.generated % len(req.prompt)]
        elif (
            self.eos_probability > 0
            and not req.ignore_eos
            and req.first_stop_id is not None
            and req.rng.random() < self.eos_probability
        ):
            return req.first_stop_id, FINISH_STOP
        elif self.tokens.uses_palette:
            token = self._palette_token(req)
        else:
            token = req.rng.randrange(self.tokens.vocab_size)
            while token in req.stop_ids:  # stop tokens come from eos_probability only
                token = req.rng.randrange(self.tokens.vocab_size)
        if token in req.stop_ids:
            return token, FINISH_STOP
        if req.generated + 1 >= req.max_new_tokens:
            return token, FINISH_LENGTH
        return token, None

    def next_token_guided(self, req: SimulatedRequest) -> tuple[int | None, str | None]:
        """A structured request's next token: the matcher's draw, then the first stop token once the output
        is complete (the module docstring says how)."""
        token = req.decoder.next()
        if token is None:
            if req.first_stop_id is not None and not req.ignore_eos:
                return req.first_stop_id, FINISH_STOP
            return None, FINISH_STOP
        if req.generated + 1 >= req.max_new_tokens:
            return token, FINISH_LENGTH
        return token, None

    def next_token_biased(self, req: SimulatedRequest) -> tuple[int | None, str | None]:
        """next_token_plain for a request with min_tokens or logit_bias (the module docstring says how)."""
        early = req.generated < req.min_tokens  # no stop token may end the request yet
        stop_ids = req.stop_ids
        if req.script is not None:
            if req.generated < len(req.script):
                token = req.script[req.generated]
            elif early:
                token = self._draw(req, True)  # the stop token is held back: filler up to min_tokens
            elif req.first_stop_id is not None and not req.ignore_eos:
                return req.first_stop_id, FINISH_STOP
            else:
                return None, FINISH_STOP
        elif self.mode == "echo":
            prompt = req.prompt
            token = prompt[req.position % len(prompt)]
            req.position += 1
            if early and token in stop_ids:
                for _ in range(len(prompt)):
                    token = prompt[req.position % len(prompt)]
                    req.position += 1
                    if token not in stop_ids:
                        break
                else:
                    token = self._draw(req, True)
        elif req.forced is not None and not (early and req.forced in stop_ids) and self._permitted(req, req.forced):
            token = req.forced
        elif (
            self.eos_probability > 0
            and not early
            and not req.ignore_eos
            and req.first_stop_id is not None
            and req.first_stop_id not in req.banned
            and self._permitted(req, req.first_stop_id)
            and req.rng.random() < self.eos_probability
        ):
            return req.first_stop_id, FINISH_STOP
        else:
            token = self._draw(req, early)
        if token in stop_ids and not early:
            return token, FINISH_STOP
        if req.generated + 1 >= req.max_new_tokens:
            return token, FINISH_LENGTH
        return token, None

    def next_token_masked(self, req: SimulatedRequest) -> tuple[int | None, str | None]:
        """next_token_biased for a request with allowed_token_ids or bad_words (1.2): random-mode draws
        (and --eos-probability, and a logit_bias-forced token) keep to the allowed IDs and never
        complete a banned sequence; the generated tokens are kept for the latter."""
        token, reason = self.next_token_biased(req)
        if req.history is not None and token is not None:
            req.history.append(token)
        return token, reason

    def _permitted(self, req: SimulatedRequest, token: int) -> bool:
        """Whether allowed_token_ids and bad_words let ``token`` come next."""
        if req.allowed_set is not None and token not in req.allowed_set:
            return False
        if req.bad_words is not None:
            prefixes = req.bad_words.get(token)
            if prefixes:
                history = req.history
                for prefix in prefixes:
                    n = len(prefix)
                    if n == 0 or (len(history) >= n and tuple(history[-n:]) == prefix):
                        return False
        return True

    def _draw(self, req: SimulatedRequest, early: bool) -> int:
        """A random-mode token that is not banned (nor, while early, a stop token)."""
        banned, stop_ids = req.banned, req.stop_ids
        if req.allowed is not None or req.bad_words is not None:
            return self._draw_masked(req, early)
        if self.tokens.uses_palette:
            for _ in range(64):
                token = self._palette_token(req)
                if token not in banned and not (early and token in stop_ids):
                    return token
        vocab = self.tokens.vocab_size
        for _ in range(64):
            token = req.rng.randrange(vocab)
            if token not in banned and token not in stop_ids:
                return token
        for token in range(vocab):  # nearly the whole vocabulary is banned
            if token not in banned and token not in stop_ids:
                return token
        return req.rng.randrange(vocab)

    def _draw_masked(self, req: SimulatedRequest, early: bool) -> int:
        """_draw under allowed_token_ids / bad_words: from the palette (or the vocabulary) when that
        gives a permitted token, else from the allowed IDs; stop tokens only if nothing else is left."""
        banned, stop_ids = req.banned, req.stop_ids

        def fits(token: int, stops: bool) -> bool:
            return token not in banned and (stops or token not in stop_ids) and self._permitted(req, token)

        if req.allowed is None or self.tokens.uses_palette:
            for _ in range(64):
                token = (
                    self._palette_token(req) if self.tokens.uses_palette else req.rng.randrange(self.tokens.vocab_size)
                )
                if fits(token, not early and self.tokens.uses_palette):
                    return token
        pool = req.allowed if req.allowed is not None else range(self.tokens.vocab_size)
        if req.allowed is not None:
            for _ in range(16):
                token = pool[req.rng.randrange(len(pool))]
                if fits(token, False):
                    return token
        for stops in (False, not early):
            fitting = [t for t in pool if fits(t, stops)] if req.allowed is not None else None
            if fitting:
                return fitting[req.rng.randrange(len(fitting))]
            if fitting is None:  # the whole vocabulary: the first that fits
                token = next((t for t in pool if fits(t, stops)), None)
                if token is not None:
                    return token
        # nothing is permitted (every allowed token completes a banned word): an engine would emit the
        # least unlikely token anyway; so does the simulator
        return pool[req.rng.randrange(len(pool))]

    def _palette_token(self, req: SimulatedRequest) -> int:
        sentences = self.tokens.sentences
        if req.sentence < 0 or req.position >= len(sentences[req.sentence]):
            req.sentence = req.rng.randrange(len(sentences))
            req.position = 0
        token = sentences[req.sentence][req.position]
        req.position += 1
        return token
