"""The workers' resizing against torch's own antialiased uint8 resize, value for value.

transformers' default image processors (the torchvision backend, which vLLM's own server runs) resize
uint8 images with ``torch.nn.functional.interpolate(..., antialias=True)``; tokenizer_workers/images/
resample.py reproduces its arithmetic without torch. Upscales, downscales (float32 and, past the scale
where float32 sums could lose a unit, float64), one axis only, thin strips, 1x1, noise, smooth
gradients and hard black/white edges (the filter's overshoot clipped at both ends), bicubic and
bilinear: every value equal. torch is in ./scripts/test.sh's environment (for the transformers
engine); ``--fast`` does not install it, and then this module skips.
"""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.tokenizer_workers.images import resample

torch = pytest.importorskip("torch", reason="torch is not installed (./scripts/test.sh installs it; --fast does not)")

CASES = [  # (height, width) -> (height, width), as smart_resize picks them
    ((1, 1), (56, 56)),
    ((20, 20), (56, 56)),
    ((1, 300), (28, 8400)),
    ((1024, 1024), (980, 980)),  # 1024² under max_pixels 1003520
    ((1024, 1024), (1036, 1036)),  # 1024² under Qwen2-VL-7B's max_pixels
    ((768, 1024), (756, 1008)),
    ((5000, 28), (1008, 28)),  # height only, scale 5: float64 sums
    ((200, 100), (196, 112)),  # down one way, up the other
    ((1080, 1920), (504, 924)),  # a screenshot, scale ~2.1
    ((1440, 2560), (504, 896)),  # scale ~2.9: float32 only because values are centred on 128
    ((2400, 2400), (336, 336)),  # scale ~7: float64
    ((224, 168), (224, 168)),  # nothing to do
]


def _image(kind: str, height: int, width: int, rng) -> np.ndarray:
    if kind == "noise":
        return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    if kind == "edges":  # black and white only: the cubic's overshoot goes past 0 and 255
        return (rng.integers(0, 2, (height, width, 3)) * 255).astype(np.uint8)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack(
        [128 + 100 * np.sin(x / 7.0 + y / 13.0), x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1)], -1
    )
    return np.clip(smooth + rng.integers(-20, 21, smooth.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("source, target", CASES, ids=[f"{a[0]}x{a[1]}-{b[0]}x{b[1]}" for a, b in CASES])
def test_resize_equals_torch_value_for_value(source, target):
    rng = np.random.default_rng(sum(source) + sum(target))
    for kind in ("noise", "smooth", "edges"):
        image = _image(kind, *source, rng)
        for mode, number in (("bicubic", resample.BICUBIC), ("bilinear", resample.BILINEAR)):
            theirs = torch.nn.functional.interpolate(
                torch.from_numpy(image).permute(2, 0, 1)[None],
                size=target,
                mode=mode,
                antialias=True,
                align_corners=False,
            )[0].numpy()
            mine = resample.resize(image, *target, number)
            assert mine.dtype == np.uint8 and mine.shape == theirs.shape and mine.flags.c_contiguous
            diff = mine.astype(np.int16) - theirs.astype(np.int16)
            assert not diff.any(), (kind, mode, int(np.abs(diff).max()), int(np.count_nonzero(diff)))


def test_float32_sums_only_where_they_stay_exact():
    """The exactness argument the module rests on, checked on its own numbers: float32 where every
    partial sum stays below 2**24 units (values as they are where 255 times the weights' magnitude fits,
    centred on 128 where only 128 times it does), float64 past it."""
    for n_in, n_out in ((1024, 980), (1024, 1036), (2560, 896), (5000, 1008), (2400, 336)):
        _, weights, precision = resample.int16_weights(n_in, n_out, resample.BICUBIC)
        magnitude = int(np.abs(weights).sum(axis=1).max())
        axis = resample._axis(n_in, n_out, resample.BICUBIC)
        assert (axis.dtype is np.float32) == (128 * magnitude < (1 << 24) and precision <= 16), (n_in, n_out)
        assert (axis.centre == 0) == (255 * magnitude < (1 << 24) and precision <= 16), (n_in, n_out)
    assert resample._axis(1024, 980, resample.BICUBIC).centre == 0  # the usual case: no centring pass
    assert resample._axis(2560, 896, resample.BICUBIC).dtype is np.float32
    assert resample._axis(2560, 896, resample.BICUBIC).centre == 128
    assert resample._axis(5000, 1008, resample.BICUBIC).dtype is np.float64
