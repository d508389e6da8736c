"""What text the simulated model knows: the model directory whose tokenizer it serves (``--model``) and
the replies scripted for it (``--replies``), so demos and tests can make it say something in particular.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


class ScriptedReplies:
    """``--replies FILE``: JSON lines of {"match": "...", "text": "..."}.

    A request whose decoded prompt contains a reply's ``match`` generates that reply's
    ``text``, tokenized with the served tokenizer (markers and other special tokens as
    single tokens), and then stops with the request's first stop token (the model's EOS).
    Where several replies match, the one whose match stands latest in the prompt wins: in
    a chat that is the one in the newest message, so an agent's turns can be scripted by
    their last user or tool message.
    """

    def __init__(self, path: str | Path, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.replies: list[tuple[str, list[int]]] = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
                if not (
                    isinstance(entry, dict)
                    and isinstance(entry.get("match"), str)
                    and entry["match"]
                    and isinstance(entry.get("text"), str)
                ):
                    raise ValueError(f'{path}:{number}: expected {{"match": "non-empty string", "text": "string"}}')
                ids = tokenizer.encode(entry["text"], add_special_tokens=False).ids
                self.replies.append((entry["match"], ids))
        if not self.replies:
            raise ValueError(f"{path} holds no replies")

    def for_prompt(self, prompt: Sequence[int]) -> list[int] | None:
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        best, where = None, -1
        for match, ids in self.replies:
            at = text.rfind(match)
            if at > where:
                best, where = ids, at
        return best


def resolve_model_dir(model: str) -> Path:
    """``default`` -> the embedded default model's directory, else the path itself."""
    if model == "default":
        from tokenmill.tokenizer_workers.model import default_model_dir

        return default_model_dir()
    return Path(model)
