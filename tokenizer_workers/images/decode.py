"""Image bytes to one RGB Pillow image, refusing what a worker must not try to decode.

* Formats: JPEG, PNG, GIF, WebP and BMP only (``Image.open`` is given exactly these).
* Size: ``Image.open`` reads only the header; an image above ``max_pixels`` (width x height) is
  refused before any pixel is decoded, so a 97 KB PNG of 10000 x 10000 costs a header read, not
  1.4 s and 500 MB. Pillow's own limit (an error above 2 x 89.5 Mpx) still holds behind it.
* Orientation: the EXIF orientation tag is applied (a phone's rotated JPEG arrives upright).
* Mode: alpha (RGBA, LA, P with transparency) is composited onto white, as transformers and
  vLLM do; everything else is converted to RGB. An animated GIF or WebP gives its first frame.
* Truncated or corrupt data is a ValueError (the caller names the content part).
"""

from __future__ import annotations

import binascii
import io
import warnings

import pybase64
from PIL import Image, ImageOps

FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP")
DEFAULT_MAX_PIXELS = 50_000_000  # ~7071 x 7071: over any real screenshot or photo, below Pillow's bomb warning


def data_url_bytes(url: str) -> bytes:
    """The bytes of a ``data:[<media type>];base64,<data>`` URL; ValueError for anything else."""
    head, sep, data = url.partition(",")
    if not sep:
        raise ValueError("the data: URL has no ',' before its data")
    params = head[len("data:") :].split(";")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ValueError("only base64 data: URLs are accepted ('data:image/png;base64,...')")
    media = params[0].strip().lower()
    if media and not media.startswith("image/"):
        raise ValueError(f"the data: URL's media type {media!r} is not an image type")
    try:
        # pybase64 (SIMD): 0.2 ms for a 5 MB body's four images where the standard library takes 13 ms,
        # every turn an agent resends its screenshots; the same strict validation
        return pybase64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the base64 data does not decode") from None


_SIGNATURES = ((b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG\r\n\x1a\n", "image/png"), (b"GIF8", "image/gif"))


def media_type_of(data: bytes) -> str | None:
    """The media type the file's first bytes say (JPEG, PNG, GIF, WebP), to check a declared one."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((media for magic, media in _SIGNATURES if data.startswith(magic)), None)


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decoded, upright, RGB; ValueError with a message for the client."""
    if not data:
        raise ValueError("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the cap below decides
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width < 1 or height < 1:
                raise ValueError("the image has no pixels")
            if width * height > max_pixels:
                raise ValueError(
                    f"the image is {width}x{height} = {width * height} pixels; this server decodes at most "
                    f"{max_pixels} pixels per image"
                )
            image.seek(0)  # an animation: its first frame
            image.load()
            return _to_rgb(ImageOps.exif_transpose(image))
    except ValueError:
        raise
    except Image.UnidentifiedImageError:
        raise ValueError(
            f"the data is not a readable image in an accepted format ({', '.join(FORMATS)}): another format, "
            "or a corrupt header"
        ) from None
    except Image.DecompressionBombError as exc:
        raise ValueError(f"the image is refused as a decompression bomb: {exc}") from None
    except (OSError, SyntaxError, EOFError, IndexError) as exc:
        raise ValueError(f"the image is truncated or corrupt: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
