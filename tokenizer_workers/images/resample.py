"""Antialiased bicubic and bilinear resizing of uint8 RGB, value for value as torch computes it.

transformers' default image processors (the torchvision backend) and so vLLM's own server resize
uint8 images with torch's ``interpolate(..., antialias=True)``, whose CPU uint8 path rounds each
filter weight to int16 at a precision chosen per axis, sums integer products and shifts, width
first, then height, with a uint8 image in between. Pillow runs the same filter with 22-bit weights,
which lands one or two levels away on a few values in a thousand. Here the weights are made as
torch makes them (aten/src/ATen/native/cpu/UpSampleKernel.cpp: ``_compute_indices_min_size_weights_aa``
and ``_compute_index_ranges_int16_weights``), and each axis is one banded matrix product in floating
point that stays exact: the weights carry the shift as a power of two, every partial sum stays an
exact multiple of it below 2**24 units (float32; values centred on 128 where that needs it; float64
for steep downscales), and a clamp and a truncation make the floor. The products go through BLAS
one band of outputs at a time: 0.8x Pillow's CPU at Qwen2-VL's usual scales, 1.1-1.2x for ~2-3x
downscales (docs/design/images.md); memory stays bounded by going through the rows in stripes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# PIL's resample numbers (preprocessor_config.json's "resample") -> torch's antialias filter and its
# support at scale 1 (HelperInterpLinear / HelperInterpCubic: interp_size / 2)
BILINEAR, BICUBIC = 2, 3
SUPPORTED = (BILINEAR, BICUBIC)
_SPAN = 40  # input samples one matrix product reads per band: long enough for BLAS, short enough to waste little
_STRIPE_VALUES = 1 << 22  # float values converted at a time in the width pass (16 MB of float32)


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic with a = -0.5 (torch's antialiased bicubic, like PIL's), in torch's order of operations."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _triangle(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


_FILTERS = {BILINEAR: (_triangle, 1.0), BICUBIC: (_cubic, 2.0)}


@dataclass(frozen=True)
class _Axis:
    """One axis's resampling: bands of outputs, each a dense (outputs x inputs) block of the int16
    weights times 2**-precision (exact in binary floating point: the shift is folded in)."""

    bands: tuple[tuple[int, int, int, int, np.ndarray], ...]  # (first out, end out, first in, end in, weights)
    offsets: np.ndarray  # per output: (centre * its weights' sum + half a unit) * 2**-precision
    centre: int  # subtracted from every value before the products (0 or 128), added back by the offsets
    dtype: type


def int16_weights(n_in: int, n_out: int, resample: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's uint8 weights for one axis: first input per output, int16 taps (n_out x taps), precision."""
    kernel, base_support = _FILTERS[resample]
    scale = n_in / n_out
    support = base_support * scale if scale >= 1.0 else base_support
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(n_out, dtype=np.float64) + 0.5)
    first = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C's truncation, as torch casts
    size = np.clip(np.minimum((center + support + 0.5).astype(np.int64), n_in) - first, 0, taps)
    k = np.arange(taps)
    weights = kernel((k + first[:, None] - center[:, None] + 0.5) * invscale)
    weights[k >= size[:, None]] = 0.0
    total = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0.0)
    largest = float(weights.max())
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return first, np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64), precision


@lru_cache(maxsize=64)
def _axis(n_in: int, n_out: int, resample: int) -> _Axis:
    first, weights, precision = int16_weights(n_in, n_out, resample)
    magnitude = int(np.abs(weights).sum(axis=1).max())
    # Exactness: a product of a value (8 bits) and a weight (16) is exact in float32, and so is every
    # partial sum while its integer (in units of 2**-precision) stays below 2**24. Values of 0..255 keep
    # it there up to Qwen2-VL's usual scales; centred on 128 (-128..127) they do up to ~3x downscales;
    # past that, float64. A sum past 256 << precision clips to 255 whatever its rounding (precision <= 16).
    if precision <= 16 and 255 * magnitude < (1 << 24):
        centre, dtype = 0, np.float32
    elif precision <= 16 and 128 * magnitude < (1 << 24):
        centre, dtype = 128, np.float32
    else:
        centre, dtype = 128, np.float64
    unit = 2.0**-precision
    per_band = max(4, round((_SPAN - weights.shape[1]) / max(n_in / n_out, 1.0)))
    bands = []
    columns = first[:, None] + np.arange(weights.shape[1])
    for start in range(0, n_out, per_band):
        end = min(start + per_band, n_out)
        used = weights[start:end] != 0
        if not used.any():
            bands.append((start, end, 0, 0, np.zeros((end - start, 0), dtype)))
            continue
        lo, hi = int(columns[start:end][used].min()), int(columns[start:end][used].max()) + 1
        dense = np.zeros((end - start, hi - lo), dtype)
        rows = np.broadcast_to(np.arange(end - start)[:, None], used.shape)
        dense[rows[used], columns[start:end][used] - lo] = weights[start:end][used] * unit
        bands.append((start, end, lo, hi, dense))
    offsets = ((centre * weights.sum(axis=1) + (1 << precision >> 1)) * unit).astype(dtype)
    return _Axis(tuple(bands), offsets, centre, dtype)


def _load(values: np.ndarray, axis: _Axis, out: np.ndarray) -> np.ndarray:
    """uint8 values into ``out`` (the axis's float type), less its centre: one pass either way."""
    if axis.centre:
        return np.subtract(values, axis.centre, out=out, dtype=axis.dtype)
    np.copyto(out, values, casting="unsafe")
    return out


def _to_uint8(sums: np.ndarray, out: np.ndarray) -> None:
    """Shifted sums (offsets added) to uint8 in ``out`` (same shape): clamped to 0..255, then truncated,
    which for values of 0 and up is the floor torch's arithmetic shift takes."""
    np.clip(sums, 0, 255, out=sums)
    np.copyto(out, sums, casting="unsafe")


def _width_pass(image: np.ndarray, axis: _Axis, width: int) -> np.ndarray:
    """(H, W, 3) uint8 -> (3, H, width) uint8."""
    height, in_width, channels = image.shape
    out = np.empty((channels, height, width), np.uint8)
    rows = max(1, _STRIPE_VALUES // (channels * in_width))
    for top in range(0, height, rows):
        bottom = min(top + rows, height)
        stripe = _load(
            image[top:bottom].transpose(2, 0, 1), axis, np.empty((channels, bottom - top, in_width), axis.dtype)
        )
        flat = stripe.reshape(-1, in_width)
        sums = np.empty((flat.shape[0], width), axis.dtype)
        for start, end, lo, hi, dense in axis.bands:
            np.matmul(flat[:, lo:hi], dense.T, out=sums[:, start:end])
        sums += axis.offsets
        _to_uint8(sums.reshape(channels, bottom - top, width), out[:, top:bottom])
    return out


def _height_pass(planes: np.ndarray, axis: _Axis, height: int) -> np.ndarray:
    """(3, H, W) uint8 -> (3, height, W) uint8."""
    channels, _, width = planes.shape
    out = np.empty((channels, height, width), np.uint8)
    for start, end, lo, hi, dense in axis.bands:
        values = _load(planes[:, lo:hi], axis, np.empty((channels, hi - lo, width), axis.dtype))
        sums = np.matmul(dense, values)  # (end - start, span) @ (3, span, W)
        sums += axis.offsets[start:end, None]
        _to_uint8(sums, out[:, start:end])
    return out


def resize(image: np.ndarray, height: int, width: int, resample: int = BICUBIC) -> np.ndarray:
    """(H, W, 3) uint8 RGB -> (3, height, width) uint8, channels first, equal to torch's antialiased resize."""
    in_height, in_width, _ = image.shape
    if width != in_width:
        planes = _width_pass(image, _axis(in_width, width, resample), width)
    else:
        planes = np.ascontiguousarray(image.transpose(2, 0, 1))
    if height != in_height:
        planes = _height_pass(planes, _axis(in_height, height, resample), height)
    return planes
