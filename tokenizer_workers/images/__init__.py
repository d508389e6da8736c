"""Images in the tokenizer workers: fetch, decode, preprocess, cache (never on the gateway loop).

``ImagePipeline.load_image_part(source, field_path[, media_type])`` is the one entry point every API's image
form calls (OpenAI ``image_url``; Anthropic ``image`` blocks and Responses ``input_image`` pass
their base64 data as a ``data:`` URL, or their URL): it returns a ``ProcessedImage`` or raises
``ImageError`` naming ``field_path``.

The content hash is keyed BLAKE3 (32 bytes, hex) of the image's raw file bytes (after base64 decoding
or fetching), the key derived from the processor's settings: the same file processed the same way has the
same hash, whatever URL it came from. The cache keys on it, and the engine gets it.

How the engine gets an image (``engine_frame``): by hash alone once this worker has sent it to the
engine session (protocol 1.2 ``images.by_hash``); else, to an engine on this host, as the
shared-memory file its pixels were written to when processed (``images.shm``, shared_memory.py);
else as its pixels in a frame.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.tokenizer_workers.images.base import ImageProcessor


def processor_for(model_dir: Path | None) -> ImageProcessor | None:
    """The model's image processor from its preprocessor_config.json; None for a text-only model. Here, not in
    the pipeline: a text-only model's worker asks it and loads none of the image modules (numpy, Pillow)."""
    if model_dir is None or not (model_dir / "preprocessor_config.json").is_file():
        return None
    config = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    kind = config.get("image_processor_type", "")
    from tokenmill.tokenizer_workers.images import qwen2_vl

    if kind in qwen2_vl.PROCESSOR_TYPES:
        return qwen2_vl.Qwen2VLProcessor(config)
    return None
