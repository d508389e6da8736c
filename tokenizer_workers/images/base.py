"""The interface every model family's image processor implements, and what it hands back.

A family module (``qwen2_vl.py``; Gemma 3 or LLaVA would be one more) turns a decoded RGB image
into the pixel array the model's vision tower takes, and says how many placeholder tokens that
image occupies in the prompt. The converter knows nothing family-specific beyond this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class ImageError(ValueError):
    """An image part the server refuses; ``param`` names the content part (e.g. messages[0].content[1])."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the engine: its pixels, its grid and its share of the prompt."""

    family: str  # the processor family, e.g. "qwen2_vl" (how an engine reads pixels and grid)
    pixels: np.ndarray  # C-contiguous; for qwen2_vl uint8 (patches, 3 * 2 * 14 * 14), not normalised
    grid_thw: tuple[int, int, int]
    tokens: int  # placeholder tokens this image expands to
    content_hash: str
    shm: str | None = None  # the shared-memory file holding ``pixels`` (protocol 1.2 images.shm), if any

    @property
    def nbytes(self) -> int:
        return self.pixels.nbytes


class ImageProcessor:
    """One model family's preprocessing, configured from preprocessor_config.json."""

    family: str = ""
    placeholder_token: str = ""  # the template's one-token stand-in, expanded to ``tokens`` copies
    placeholder_text: str = ""  # what a string-content template gets for an image part

    def fingerprint(self) -> str:
        """Everything that changes the output for the same image (part of the cache key)."""
        raise NotImplementedError

    def process(self, image, content_hash: str) -> ProcessedImage:
        """An RGB PIL image to its processed form; raise ValueError for an image this model cannot take."""
        raise NotImplementedError

    def resized_image(self, pixels: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
        """The resized RGB image (height, width, 3) uint8 that ``process`` cut ``pixels`` from: for an engine
        whose API takes image files, not pixels, and that processes them again (giving the same pixels, as
        nothing is left to resize). NotImplementedError where the family's pixels cannot be turned back."""
        raise NotImplementedError
