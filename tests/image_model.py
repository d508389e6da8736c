"""A Qwen2-VL-shaped model directory for the front end, made at test time: the embedded DeepSeek-V4
tokenizer with Qwen2-VL's special tokens added, a chat template of Qwen2-VL's shape (ChatML, an
image part rendered as <|vision_start|><|image_pad|><|vision_end|> through the ``content['type'] ==
'image'`` branch transformers uses) and a preprocessor_config.json. No weights: the simulated
scheduler serves it.

``python tests/image_model.py OUT_DIR`` (with torch and transformers: .venv-vllm) adds random weights:
a tiny Qwen2VLForConditionalGeneration (text 128 x 2 layers, vision tower depth 2, tied embeddings,
attention values and outputs scaled up so that the image decides the output, bfloat16, ~34 MB, nearly all of it the 129k-token embedding) that vLLM's CPU build loads, for
tests/engines/test_vllm_images.py. Same script, same bytes: the weights come from ``torch.manual_seed(0)``."""

from __future__ import annotations

import json
from pathlib import Path

VISION_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 3136,
    "max_pixels": 1003520,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def make_vl_model(root: Path, name: str = "Tiny-Qwen2-VL") -> Path:
    from tokenizers import AddedToken, Tokenizer

    from tokenmill.tokenizer_workers.model import default_model_dir

    d = root / name
    d.mkdir(parents=True)
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "model_max_length": 32768,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    return d


def make_vl_weights(root: Path, name: str = "Tiny-Qwen2-VL") -> Path:
    """make_vl_model's directory with a tiny random Qwen2-VL in it (needs torch and transformers)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    d = make_vl_model(root, name)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    torch.manual_seed(0)
    text = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        # Qwen2-VL's multimodal rotary sections (temporal, height, width) sum to head_dim / 2 = 16
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        "bos_token_id": 0,
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": True,
    }
    vision = {"depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 2}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():  # at the default init the last token's own embedding decides the next token whatever
        # the image; stronger attention values and outputs make the output depend on the image
        for name, weight in model.named_parameters():
            if "language_model" in name and name.endswith(("v_proj.weight", "o_proj.weight")):
                weight.mul_(10.0)
    model.to(torch.bfloat16).save_pretrained(d)
    return d


if __name__ == "__main__":
    import sys

    make_vl_weights(Path(sys.argv[1]).parent, Path(sys.argv[1]).name)
