# SPDX-License-Identifier: Apache-2.0
"""Image decoding under limits, with the pixel semantics of transformers.

``decode_image`` equals ``transformers.image_utils.load_image`` (EXIF transpose,
then ``convert("RGB")``); ``to_rgb`` equals the image processor's own RGB step,
which every preprocessor applies first. See docs/preprocessing.md.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from PIL import Image, ImageOps, PngImagePlugin

from epd_encoder.errors import (
    BadAspectRatio,
    EncoderError,
    ImageTooLarge,
    UndecodableImage,
    UnsupportedMedia,
)
from epd_encoder.preprocess.base import DecodeLimits

__all__ = ["ImageHeader", "decode_image", "probe_image", "sniff_format", "to_rgb"]

_SWAPS_AXES = frozenset({5, 6, 7, 8})  # EXIF orientations that transpose width and height
_ORIENTATION = 0x0112
_PNG_METADATA = frozenset({b"eXIf", b"tEXt", b"zTXt", b"iTXt"})  # where EXIF or XMP can live
_CHUNK_HEAD = struct.Struct(">I4s")


@dataclass(frozen=True)
class ImageHeader:
    """What the header says: the upright size (EXIF orientation applied) and format."""

    width: int
    height: int
    format: str
    orientation: int = 1


def sniff_format(data: bytes) -> str | None:
    """The supported format named by the magic bytes, or ``None``."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:2] == b"BM":
        return "BMP"
    return None


def _identify_other(data: bytes) -> str | None:
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.format
    except Exception:
        return None


def _open(data: bytes, limits: DecodeLimits) -> Image.Image:
    if not data:
        raise UndecodableImage("empty image payload")
    if len(data) > limits.max_bytes:
        raise ImageTooLarge(f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    fmt = sniff_format(data)
    if fmt is None:
        other = _identify_other(data)
        if other is None:
            raise UnsupportedMedia("unrecognised image format")
        raise UnsupportedMedia(f"image format {other} is not supported")
    try:
        # Only the plugin the magic bytes name may parse the payload.
        img = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(str(e)) from e
    except Exception as e:
        raise UndecodableImage(f"invalid {fmt} header: {e}") from e
    w, h = img.size
    if w <= 0 or h <= 0:
        raise UndecodableImage(f"image has an empty size {w}x{h}")
    if w * h > limits.max_pixels:
        raise ImageTooLarge(f"image is {w}x{h} pixels; the limit is {limits.max_pixels}")
    ratio = max(w, h) / min(w, h)
    if ratio > limits.max_aspect_ratio:
        raise BadAspectRatio(
            f"aspect ratio {ratio:.1f} of a {w}x{h} image exceeds {limits.max_aspect_ratio}"
        )
    return img


def _png_trailing_info(data: bytes, animated: bool) -> dict:
    """What ``load()`` adds to a PNG's ``info`` from metadata chunks after the image
    data, parsed by Pillow's own chunk handlers; IDAT payloads are skipped, never inflated."""
    stream = PngImagePlugin.PngStream(io.BytesIO(data))
    pos, after_pixels = 8, False
    while pos + 8 <= len(data):
        length, kind = _CHUNK_HEAD.unpack_from(data, pos)
        if kind == b"IEND" or (animated and after_pixels and kind == b"fcTL"):  # the next frame
            break
        if kind == b"IDAT":
            after_pixels = True
        elif after_pixels and kind in _PNG_METADATA:
            stream.fp.seek(pos + 8)  # type: ignore[union-attr]
            stream.call(kind, pos + 8, length)
        pos += 12 + length
    return stream.im_info


def _orientation(img: Image.Image, data: bytes) -> int:
    if img.format == "PNG":
        # PngImageFile.getexif() decodes every pixel to reach chunks after IDAT; the
        # base getexif() reads ``info`` only, completed here as load() would.
        img.info.update(_png_trailing_info(data, bool(getattr(img, "is_animated", False))))
        exif = Image.Image.getexif(img)
    else:  # JPEG, WebP, GIF and BMP keep their metadata in what open() has parsed
        exif = img.getexif()
    value = exif.get(_ORIENTATION, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def probe_image(data: bytes, limits: DecodeLimits) -> ImageHeader:
    """Parse the header only and enforce ``limits``; the size is the upright one.

    Never decodes pixels. The orientation is the one ``decode_image`` applies,
    wherever its EXIF or XMP sits (a PNG may keep it after the pixel data).
    Raises ``ImageTooLarge``, ``BadAspectRatio``, ``UnsupportedMedia`` or
    ``UndecodableImage`` exactly as ``decode_image`` would for the header.
    """
    img = _open(data, limits)
    try:
        orientation = _orientation(img, data)
    except EncoderError:
        raise
    except Exception as e:
        raise UndecodableImage(f"invalid image metadata: {e}") from e
    w, h = img.size
    if orientation in _SWAPS_AXES:
        w, h = h, w
    return ImageHeader(width=w, height=h, format=str(img.format), orientation=orientation)


def decode_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """Decode ``data`` (PNG, JPEG, WebP, GIF first frame, BMP) to an upright RGB image.

    Limits are checked on the header before any pixel is decoded. The pixels
    equal ``transformers.image_utils.load_image``: alpha is dropped, 16-bit
    values saturate at 255, CMYK uses PIL's conversion. A tRNS colour stays in
    ``info["transparency"]`` for ``to_rgb`` to composite, as the HF processor
    does. Raises ``ImageTooLarge``, ``BadAspectRatio``, ``UnsupportedMedia``,
    or ``UndecodableImage``; never a PIL exception.
    """
    img = _open(data, limits)
    try:
        ImageOps.exif_transpose(img, in_place=True)
        return img if img.mode == "RGB" else img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(str(e)) from e
    except EncoderError:
        raise
    except Exception as e:
        raise UndecodableImage(f"cannot decode {img.format} image: {e}") from e


def to_rgb(image: Image.Image) -> Image.Image:
    """The HF image processor's RGB step: transparency is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
