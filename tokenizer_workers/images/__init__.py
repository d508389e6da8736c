"""Images in the tokenizer workers: fetch, decode, preprocess, cache (never on the gateway loop).

``ImagePipeline.load_image_part(source, field_path[, media_type])`` is the one entry point every API's image
form calls (OpenAI ``image_url``; Anthropic ``image`` blocks and Responses ``input_image`` pass
their base64 data as a ``data:`` URL, or their URL): it returns a ``ProcessedImage`` or raises
``ImageError`` naming ``field_path``.

The content hash is BLAKE2b (32 bytes, hex) of the image's raw file bytes (after base64 decoding
or fetching), keyed with the processor's settings: the same file processed the same way has the
same hash, whatever URL it came from. The cache keys on it, and the engine gets it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

from tokenizer_workers.images import decode as _decode
from tokenizer_workers.images.base import ImageError, ImageProcessor, ProcessedImage
from tokenizer_workers.images.cache import ImageCache
from tokenizer_workers.images.fetch import ImageFetcher, ImageFetchSettings

__all__ = ["ImageError", "ImagePipeline", "ImageProcessor", "ProcessedImage", "base64_data_url", "processor_for"]


def base64_data_url(media_type: str, data: str) -> str:
    """An API's base64 image block (Anthropic's ``source``: media_type and data) as the data: URL
    that ``load_image_part`` and OpenAI's ``image_url`` parts take."""
    return f"data:{media_type};base64,{data}"


def processor_for(model_dir: Path | None) -> ImageProcessor | None:
    """The model's image processor from its preprocessor_config.json; None for a text-only model."""
    import json

    if model_dir is None or not (model_dir / "preprocessor_config.json").is_file():
        return None
    config = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    kind = config.get("image_processor_type", "")
    from tokenizer_workers.images import qwen2_vl

    if kind in qwen2_vl.PROCESSOR_TYPES:
        return qwen2_vl.Qwen2VLProcessor(config)
    return None


class ImagePipeline:
    def __init__(
        self,
        processor: ImageProcessor,
        cache_bytes: int = 256 << 20,
        max_pixels: int = _decode.DEFAULT_MAX_PIXELS,
        fetch: ImageFetchSettings | None = None,
    ):
        self.processor = processor
        self.cache = ImageCache(cache_bytes)
        self.max_pixels = max_pixels
        self.fetcher = ImageFetcher(fetch or ImageFetchSettings())
        self._key = hashlib.blake2b(processor.fingerprint().encode(), digest_size=16).digest()
        # images this worker has sent the engine with their pixels, most recent last (protocol 1.2
        # images.by_hash): sent again by hash alone. Only a belief: the engine may have evicted one since,
        # then it answers image_missing and the pixels go after all (PixelsWanted)
        self._sent: OrderedDict[str, None] = OrderedDict()
        self._sent_lock = threading.Lock()

    SENT_REMEMBERED = 4096  # hashes: past this many, the oldest go with their pixels again

    def engine_frame(self, image: ProcessedImage, by_hash: bool) -> memoryview:
        """The pixel frame for the engine: empty (the engine holds it) when ``by_hash`` and this worker has
        sent the image's pixels before, else the pixels (not copied), remembered as sent."""
        with self._sent_lock:
            sent = self._sent
            # by hash only while the cache still has the pixels, to send them if the engine has lost them
            if by_hash and image.content_hash in sent and self.cache.holds(image.content_hash):
                sent.move_to_end(image.content_hash)
                return memoryview(b"")
            sent[image.content_hash] = None
            if len(sent) > self.SENT_REMEMBERED:
                sent.popitem(last=False)
        return memoryview(image.pixels).cast("B")

    def forget_sent(self) -> None:
        """A new engine session (its Welcome again): it may hold none of them."""
        with self._sent_lock:
            self._sent.clear()

    def pixel_frames(self, content_hashes: list[str]) -> list[memoryview] | None:
        """The cached pixels of these images, for an engine that lost them; None if one is gone."""
        frames = []
        for content_hash in content_hashes:
            image = self.cache.get(content_hash)
            if image is None:
                return None
            frames.append(self.engine_frame(image, False))
        return frames

    def load_image_part(self, source: str, field_path: str, media_type: str | None = None) -> ProcessedImage:
        """``media_type``: what the request declared for the bytes (Anthropic's base64 source), checked."""
        if not isinstance(source, str) or not source:
            raise ImageError(f"{field_path}: the image URL must be a non-empty string.", field_path)
        try:
            if source[:5].lower() == "data:":
                raw = _decode.data_url_bytes(source)
            elif source[:7].lower() == "http://" or source[:8].lower() == "https://":
                raw = self.fetcher.fetch(source)
            else:
                raise ValueError("image URLs must be base64 data: URLs or http(s) URLs")
            if media_type is not None and (actual := _decode.media_type_of(raw)) != media_type:
                raise ValueError(
                    f"the image data is {actual or 'not a known image type'}, not the declared {media_type}"
                )
            content_hash = hashlib.blake2b(raw, digest_size=32, key=self._key).hexdigest()
            cached = self.cache.get(content_hash)
            if cached is not None:
                return cached
            image = _decode.decode_image(raw, self.max_pixels)
            processed = self.processor.process(image, content_hash)
        except ValueError as exc:
            raise ImageError(f"{field_path}: {exc}.", field_path) from None
        self.cache.put(content_hash, processed)
        return processed
