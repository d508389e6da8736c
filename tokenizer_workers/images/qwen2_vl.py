"""Qwen2-VL / Qwen2.5-VL image preprocessing, as transformers' Qwen2-VL image processor does it.

``smart_resize`` rounds height and width to multiples of patch_size * merge_size (28), keeps the
pixel count within [min_pixels, max_pixels] and refuses aspect ratios over 200. The image is
resized value for value as torch resizes it (``resample.py``: transformers' default torchvision
backend, which is what vLLM's own server runs) and cut into (grid_h * grid_w) patches of 3 x
temporal_patch_size x 14 x 14 values (a still image repeated temporal_patch_size times), ordered
merge window by merge window: the layout transformers' Qwen2-VL processors return as ``pixel_values``.

The values stay uint8 (0..255), not rescaled or normalised: a quarter of float32's bytes through the
cache, the gateway and the engine's IPC. The engine rescales and normalises with the model's own
``image_mean`` / ``image_std`` (vLLM's default ``mm_device_do_normalize`` path, which takes exactly
this array: what its processor hands over with ``do_rescale`` and ``do_normalize`` off).
"""

from __future__ import annotations

import math

import numpy as np

from tokenmill.tokenizer_workers.images import resample
from tokenmill.tokenizer_workers.images.base import ImageProcessor, ProcessedImage

MAX_ASPECT_RATIO = 200
PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) transformers' smart_resize picks; ValueError past the aspect-ratio limit."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLProcessor(ImageProcessor):
    family = "qwen2_vl"
    placeholder_token = "<|image_pad|>"
    placeholder_text = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, config: dict):
        size = config.get("size") or {}
        self.min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.patch_size = int(config.get("patch_size", 14))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        self.resample = int(config.get("resample", resample.BICUBIC))  # PIL's numbering, as transformers reads it
        if self.min_pixels > self.max_pixels:
            raise ValueError("preprocessor_config.json: min_pixels is above max_pixels")
        if self.resample not in resample.SUPPORTED:
            raise ValueError(
                f"preprocessor_config.json: resample {self.resample} is not supported (2, bilinear, and 3, bicubic, are)"
            )

    def fingerprint(self) -> str:
        return repr(
            (
                self.family,
                self.min_pixels,
                self.max_pixels,
                self.patch_size,
                self.temporal_patch_size,
                self.merge_size,
                self.resample,
                "uint8",
                "torch-int16",  # the resampling arithmetic (resample.py): other pixels, other hashes
            )
        )

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) after smart_resize."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def process(self, image, content_hash: str) -> ProcessedImage:
        height, width = self.target_size(image.width, image.height)
        planes = resample.resize(np.asarray(image), height, width, self.resample)  # (3, h, w) uint8
        patches, grid_h, grid_w = self._patchify(planes)
        tokens = grid_h * grid_w // (self.merge_size**2)
        return ProcessedImage(self.family, patches, (1, grid_h, grid_w), tokens, content_hash)

    def resized_image(self, pixels: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
        """The (height, width, 3) uint8 image ``_patchify`` cut these patches from (the first of the
        temporal_patch_size copies of each patch: a still image's are all the same)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_t, grid_h, grid_w = (int(x) for x in grid_thw)
        if pixels.dtype != np.uint8 or grid_t != 1 or pixels.shape != (grid_h * grid_w, 3 * t * p * p):
            raise ValueError(f"not the pixels of one {self.family} image of grid {list(grid_thw)}: {pixels.shape}")
        patches = pixels.reshape(grid_h // m, grid_w // m, m, m, 3, t, p, p)[:, :, :, :, :, 0]
        planes = patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, grid_h * p, grid_w * p)
        return np.ascontiguousarray(planes.transpose(1, 2, 0))

    def _patchify(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, height, width = image.shape
        grid_h, grid_w = height // p, width // p
        patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None, :, :], (*patches.shape[:5], t, *patches.shape[5:]))
        return np.ascontiguousarray(patches.reshape(grid_h * grid_w, channels * t * p * p)), grid_h, grid_w
