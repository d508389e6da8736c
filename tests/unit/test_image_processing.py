"""Images in the workers: decoding, Qwen2-VL preprocessing against transformers' own processor
(Qwen2VLImageProcessorPil here, which runs without torch: the same grid, the same patch layout, the
same values where nothing is resampled, within two levels where Pillow's filter and torch's rounding
part; tests/unit/test_resample_against_torch.py holds the pixels to torch's, value for value),
hostile input, and the cache."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from tokenmill.tokenizer_workers.images.pipeline import ImageError, ImagePipeline
from tokenmill.tokenizer_workers.images.qwen2_vl import Qwen2VLProcessor

HUB_CONFIG = {  # Qwen2-VL-7B-Instruct's preprocessor_config.json
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
SMALL_CONFIG = {**HUB_CONFIG, "max_pixels": 1003520}  # transformers' default


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise: resampling sees both edges and flat regions."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(-30, 30, size=(height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _oracle(image: Image.Image, config: dict, normalise: bool = False):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(
        min_pixels=config["min_pixels"],
        max_pixels=config["max_pixels"],
        image_mean=config["image_mean"],
        image_std=config["image_std"],
    )
    out = proc(images=[image], do_rescale=normalise, do_normalize=normalise, return_tensors="np")
    return np.asarray(out["pixel_values"]), [int(v) for v in out["image_grid_thw"][0]]


def _normalised(pixels: np.ndarray, config: dict) -> np.ndarray:
    """The workers' uint8 patches rescaled and normalised as transformers' Pillow backend does it (x / 255
    in float64, then float32; then (x - mean) / std in float32), per channel of the patch layout."""
    assert pixels.dtype == np.uint8
    x = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32).reshape(len(pixels), 3, -1)
    mean = np.array(config["image_mean"], dtype=np.float32)[None, :, None]
    std = np.array(config["image_std"], dtype=np.float32)[None, :, None]
    return ((x - mean) / std).reshape(pixels.shape)


def _levels_apart(mine: np.ndarray, pillow: np.ndarray) -> tuple[int, float]:
    """Largest difference in intensity levels, and the share of values off by two."""
    diff = np.abs(mine.astype(np.int16) - pillow.astype(np.int16))
    return int(diff.max()), float((diff >= 2).mean())


def _pipeline(config=SMALL_CONFIG, **kw) -> ImagePipeline:
    return ImagePipeline(Qwen2VLProcessor(config), **kw)


@pytest.mark.parametrize(
    "size, config, tokens",
    [
        ((1, 1), SMALL_CONFIG, 4),
        ((20, 20), SMALL_CONFIG, 4),
        ((1024, 1024), SMALL_CONFIG, 1225),
        ((1024, 1024), HUB_CONFIG, 1369),
        ((768, 1024), HUB_CONFIG, 999),
        ((28, 5000), SMALL_CONFIG, 179),
        ((224, 168), SMALL_CONFIG, 48),  # multiples of 28: nothing resampled
    ],
)
def test_pixels_match_transformers(size, config, tokens):
    image = _photo(*size)
    mine = _pipeline(config).load_image_part(_data_url(_encode(image, "PNG")), "messages[0].content[0]")
    pixels, grid = _oracle(image, config)
    assert list(mine.grid_thw) == grid and mine.tokens == grid[1] * grid[2] // 4 == tokens
    assert mine.pixels.dtype == np.uint8 and mine.pixels.shape == pixels.shape
    assert mine.nbytes == pixels.size  # one byte a value: a quarter of float32's
    largest, twos = _levels_apart(mine.pixels, pixels)
    if size in ((1, 1), (224, 168)):  # one colour, or no resampling: the same values, in the same places
        assert largest == 0
        assert np.array_equal(_normalised(mine.pixels, config), _oracle(image, config, normalise=True)[0])
    else:  # torch's int16 weights against Pillow's 22-bit ones; a layout slip would be far off
        assert largest <= 2 and twos < 0.001, (largest, twos)


def test_exif_rotation_rgba_palette_and_animation_match_transformers_after_the_same_decoding():
    photo = _photo(64, 40)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    jpeg = _encode(photo, "JPEG", exif=exif, quality=90)
    rgba = photo.convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(64, dtype=np.uint8) * 4, (40, 1))))
    frames = [_photo(50, 30, seed=s) for s in range(3)]
    gif = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    palette = photo.convert("P", palette=Image.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    cases = {
        "jpeg_exif": (jpeg, lambda im: ImageOps.exif_transpose(im)),  # transformers leaves EXIF alone: apply it
        "rgba": (_encode(rgba, "PNG"), lambda im: im),
        "gif": (gif, lambda im: im),  # frame 0 (transformers converts the first frame too)
        "palette": (_encode(palette, "PNG", transparency=0), lambda im: im),
    }
    pipeline = _pipeline()
    for name, (data, prepare) in cases.items():
        mine = pipeline.load_image_part(_data_url(data), "p")
        opened = prepare(Image.open(io.BytesIO(data)))
        pixels, grid = _oracle(opened, SMALL_CONFIG)
        assert list(mine.grid_thw) == grid, name
        largest, twos = _levels_apart(mine.pixels, pixels)
        assert largest <= 2 and twos < 0.001, (name, largest, twos)
    upright = pipeline.load_image_part(_data_url(jpeg), "p")
    assert upright.grid_thw == (1, 6, 4)  # 64 x 40 turned upright is 40 wide, 64 high: 84 x 56 (min_pixels)


def test_hostile_and_broken_input_is_refused_naming_the_part():
    pipeline = _pipeline()
    png = _encode(_photo(30, 30), "PNG")
    bomb = _encode(Image.new("1", (10000, 10000)), "PNG")  # ~100 Mpx, a few KB
    assert len(bomb) < 200_000
    cases = {
        "aspect": (_data_url(_encode(_photo(1, 300), "PNG")), "aspect ratio"),
        "bad base64": ("data:image/png;base64,@@@notbase64", "base64"),
        "not base64": ("data:image/png,rawbytes", "base64"),
        "not an image type": ("data:text/plain;base64,aGVsbG8=", "media type"),
        "truncated": (_data_url(png[: len(png) // 2]), "truncated"),
        "corrupt": (_data_url(png[: png.index(b"IDAT") + 8] + b"\xff" * 300), "truncated or corrupt"),
        "corrupt header": (_data_url(png[:12] + b"\0" * 200), "corrupt header"),
        "unsupported format": (_data_url(_encode(_photo(30, 30), "TIFF"), "image/tiff"), "another format"),
        "bomb": (_data_url(bomb), "at most"),
        "empty": ("data:image/png;base64,", "empty"),
        "scheme": ("file:///etc/passwd", "data: URLs or http(s)"),
        "fetch off": ("http://example.com/a.png", "not fetched"),
    }
    for name, (url, words) in cases.items():
        with pytest.raises(ImageError) as err:
            pipeline.load_image_part(url, "messages[2].content[1]")
        assert err.value.param == "messages[2].content[1]", name
        assert words in str(err.value) and str(err.value).startswith("messages[2].content[1]: "), (name, err.value)


def test_a_lower_pixel_cap_refuses_before_decoding():
    pipeline = _pipeline(max_pixels=100 * 100)
    pipeline.load_image_part(_data_url(_encode(_photo(100, 100), "PNG")), "p")
    with pytest.raises(ImageError, match="101x100 = 10100 pixels"):
        pipeline.load_image_part(_data_url(_encode(_photo(101, 100), "PNG")), "p")


def test_processed_images_are_kept_by_content_hash_under_a_byte_budget():
    first, second = _encode(_photo(56, 56, 1), "PNG"), _encode(_photo(56, 56, 2), "PNG")
    one = _pipeline().load_image_part(_data_url(first), "p")
    pipeline = _pipeline(cache_bytes=one.nbytes)  # room for one image
    a = pipeline.load_image_part(_data_url(first), "p")
    again = pipeline.load_image_part(_data_url(first), "p")
    assert again is a and pipeline.cache.hits == 1 and pipeline.cache.misses == 1
    assert a.content_hash == one.content_hash and len(a.content_hash) == 64
    b = pipeline.load_image_part(_data_url(second), "p")
    assert b.content_hash != a.content_hash and pipeline.cache.evictions == 1
    assert pipeline.cache.bytes_used == b.nbytes <= pipeline.cache.budget
    assert pipeline.load_image_part(_data_url(first), "p") is not a  # evicted: processed again, same pixels
    assert np.array_equal(pipeline.load_image_part(_data_url(first), "p").pixels, a.pixels)
    other = ImagePipeline(Qwen2VLProcessor(HUB_CONFIG)).load_image_part(_data_url(first), "p")
    assert other.content_hash != a.content_hash  # other processor settings: another hash


@pytest.mark.parametrize("size", [(1, 1), (300, 500), (28, 5000), (1024, 768)])
def test_the_resized_image_comes_back_from_its_pixels_and_processes_to_them_again(size):
    """What an engine API that takes image files gets (engines/http_backend.py): the pixels turned back into
    the resized image, which processes again to the same pixels and grid (nothing left to resize)."""
    processor = Qwen2VLProcessor(HUB_CONFIG)
    rng = np.random.default_rng(size[0] * 7 + size[1])
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    processed = processor.process(image, "h")
    back = processor.resized_image(processed.pixels, processed.grid_thw)
    height, width = processor.target_size(image.width, image.height)
    assert back.shape == (height, width, 3) and back.dtype == np.uint8
    again = processor.process(Image.fromarray(back), "h")
    assert again.grid_thw == processed.grid_thw and np.array_equal(again.pixels, processed.pixels)
    with pytest.raises(ValueError):
        processor.resized_image(processed.pixels[1:], processed.grid_thw)
