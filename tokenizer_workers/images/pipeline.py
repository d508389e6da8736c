"""ImagePipeline: every API's image part to a processed, cached, hashed image (see the package's docstring)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict

import blake3

from tokenmill.tokenizer_workers.images import decode as _decode
from tokenmill.tokenizer_workers.images import processor_for
from tokenmill.tokenizer_workers.images.base import ImageError, ImageProcessor, ProcessedImage
from tokenmill.tokenizer_workers.images.cache import ImageCache
from tokenmill.tokenizer_workers.images.fetch import ImageFetcher
from tokenmill.tokenizer_workers.images.shared_memory import SharedPixels
from tokenmill.tokenizer_workers.settings import ImageFetchSettings

log = logging.getLogger("tokenmill.worker")

__all__ = ["ImageError", "ImagePipeline", "ImageProcessor", "ProcessedImage", "base64_data_url", "processor_for"]


def base64_data_url(media_type: str, data: str) -> str:
    """An API's base64 image block (Anthropic's ``source``: media_type and data) as the data: URL
    that ``load_image_part`` and OpenAI's ``image_url`` parts take."""
    return f"data:{media_type};base64,{data}"


class ImagePipeline:
    def __init__(
        self,
        processor: ImageProcessor,
        cache_bytes: int = 256 << 20,
        max_pixels: int = _decode.DEFAULT_MAX_PIXELS,
        fetch: ImageFetchSettings | None = None,
    ):
        self.processor = processor
        self.cache = ImageCache(cache_bytes, on_drop=self._dropped)
        self.max_pixels = max_pixels
        self.fetcher = ImageFetcher(fetch or ImageFetchSettings())
        # BLAKE3, not hashlib's BLAKE2b: every turn of an agent hashes every screenshot it resends, and
        # BLAKE3 does 2.4 MB in 0.4 ms where BLAKE2b takes 2.5 (vLLM hashes its multimodal items with it too)
        self._key = blake3.blake3(processor.fingerprint().encode()).digest()
        # images this worker has sent the engine with their pixels, most recent last (protocol 1.2
        # images.by_hash): sent again by hash alone. Only a belief: the engine may have evicted one since,
        # then it answers image_missing and the pixels go after all (PixelsWanted)
        self._sent: OrderedDict[str, None] = OrderedDict()
        self._sent_lock = threading.Lock()
        # protocol 1.2 images.shm: pixels written once to shared memory that the engine maps; on while the
        # engine lists the feature and is on this host (use_shared_memory), off after SHM_MISSES refusals
        self.shared: SharedPixels | None = None
        self._shm_on = False
        self._shm_misses = 0

    SENT_REMEMBERED = 4096  # hashes: past this many, the oldest go with their pixels again
    SHM_MISSES = 3  # the engine could not read this many of the files: it cannot see them (another host, user)

    def use_shared_memory(self, on: bool) -> None:
        """A new engine session: whether to hand it pixels in shared-memory files (images.shm)."""
        if on and self.shared is None:
            self.shared = SharedPixels()
        self._shm_on = self.shared is not None and on and not self.shared.failed
        self._shm_misses = 0

    def engine_frame(self, image: ProcessedImage, by_hash: bool) -> tuple[memoryview, str | None, str]:
        """How the engine gets the image: (its pixel frame, the shared-memory file to name in its item,
        and which of "hash", "shm", "pixels"). By hash (an empty frame) when ``by_hash`` and this worker
        has sent it before; else by its file while shared memory is on; else its pixels (not copied).
        A hash-only item names its file too, which the engine maps if it has let the image go."""
        shm = image.shm if self._shm_on else None
        with self._sent_lock:
            sent = self._sent
            # by hash only while the cache still has the pixels, to send them if the engine has lost them
            if by_hash and image.content_hash in sent and self.cache.holds(image.content_hash):
                sent.move_to_end(image.content_hash)
                return memoryview(b""), shm, "hash"
            sent[image.content_hash] = None
            if len(sent) > self.SENT_REMEMBERED:
                sent.popitem(last=False)
        if shm is not None:
            return memoryview(b""), shm, "shm"
        return memoryview(image.pixels).cast("B"), None, "pixels"

    def forget_sent(self) -> None:
        """A new engine session (its Welcome again): it may hold none of them."""
        with self._sent_lock:
            self._sent.clear()

    def pixel_frames(self, content_hashes: list[str]) -> list[memoryview] | None:
        """The cached pixels of these images, for an engine that lost them or could not read their
        files; None if one is gone."""
        frames, had_files = [], False
        for content_hash in content_hashes:
            image = self.cache.get(content_hash)
            if image is None:
                return None
            frames.append(memoryview(image.pixels).cast("B"))
            had_files = had_files or image.shm is not None
        if self._shm_on and had_files:
            self._shm_misses += 1
            if self._shm_misses >= self.SHM_MISSES:
                log.warning(
                    "the engine could not read %d of this worker's shared-memory image files (is it on another "
                    "host, or another user?): sending pixels in frames until it says welcome again",
                    self._shm_misses,
                )
                self._shm_on = False
        return frames

    def _dropped(self, image: ProcessedImage) -> None:
        if image.shm is not None and self.shared is not None:
            self.shared.retire(image.shm, image.nbytes)

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
            content_hash = blake3.blake3(raw, key=self._key).hexdigest()
            cached = self.cache.get(content_hash)
            if cached is not None:
                return cached
            image = _decode.decode_image(raw, self.max_pixels)
            processed = self.processor.process(image, content_hash)
        except ValueError as exc:
            raise ImageError(f"{field_path}: {exc}.", field_path) from None
        shared = self.shared
        if self._shm_on and shared is not None:
            shared.sweep(self.cache.budget)
            written = shared.write(content_hash, processed.pixels)
            if written is not None:
                processed = dataclasses.replace(processed, pixels=written[1], shm=written[0])
            else:
                self._shm_on = False
        self.cache.put(content_hash, processed)
        return processed
