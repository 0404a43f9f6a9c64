# SPDX-License-Identifier: Apache-2.0
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from epd_encoder.errors import (
    BadAspectRatio,
    EncoderError,
    ImageTooLarge,
    UndecodableImage,
    UnsupportedMedia,
)
from epd_encoder.preprocess.base import DecodeLimits
from epd_encoder.preprocess.decode import decode_image, probe_image, sniff_format, to_rgb

from .conftest import CORPUS, encode, exif_with_orientation, reference_image, rgb_array

LIMITS = DecodeLimits()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width x height`` followed by a tiny IDAT."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_decode_matches_load_image(name):
    data = CORPUS[name]
    got = decode_image(data, LIMITS)
    ref = reference_image(data)
    assert got.mode == "RGB"
    assert got.size == ref.size
    assert np.array_equal(np.asarray(got), np.asarray(ref))
    # The processor's RGB step must see the same transparency metadata.
    assert np.array_equal(np.asarray(to_rgb(got)), convert_to_rgb(ref, return_numpy=True))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_and_probed(orientation):
    data = CORPUS[f"jpeg_exif_{orientation}"]
    img = decode_image(data, LIMITS)
    expected = (37, 61) if orientation >= 5 else (61, 37)
    assert img.size == expected
    header = probe_image(data, LIMITS)
    assert (header.width, header.height) == expected
    assert header.orientation == orientation and header.format == "JPEG"


def test_png_exif_chunk_orientation_is_probed():
    header = probe_image(CORPUS["png_exif_6"], LIMITS)
    assert (header.width, header.height) == (29, 45)
    assert decode_image(CORPUS["png_exif_6"], LIMITS).size == (29, 45)


def test_gif_decodes_first_frame_only():
    data = CORPUS["gif_animated"]
    with Image.open(io.BytesIO(data)) as im:
        assert im.n_frames == 2
        first = np.asarray(im.convert("RGB"))
        im.seek(1)
        second = np.asarray(im.convert("RGB"))
    got = np.asarray(decode_image(data, LIMITS))
    assert np.array_equal(got, first) and not np.array_equal(got, second)


def test_sixteen_bit_saturates_like_pil():
    arr = np.array([[0, 100, 255, 256, 40000]], dtype=np.uint16)
    got = np.asarray(decode_image(encode(Image.fromarray(arr), "PNG"), LIMITS))
    assert got[0, :, 0].tolist() == [0, 100, 255, 255, 255]


def test_sniff_format():
    assert sniff_format(CORPUS["png_p"]) == "PNG"
    assert sniff_format(CORPUS["jpeg_gray"]) == "JPEG"
    assert sniff_format(CORPUS["gif"]) == "GIF"
    assert sniff_format(CORPUS["webp_lossy"]) == "WEBP"
    assert sniff_format(CORPUS["bmp_rgb"]) == "BMP"
    assert sniff_format(b"RIFF\0\0\0\0WAVE") is None


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM"])
def test_other_formats_are_unsupported(fmt):
    data = encode(Image.fromarray(rgb_array(16, 16)), fmt)
    with pytest.raises(UnsupportedMedia, match=fmt if fmt != "PPM" else "PPM"):
        decode_image(data, LIMITS)


def test_garbage_is_unsupported_and_empty_is_undecodable():
    with pytest.raises(UnsupportedMedia):
        decode_image(b"hello, this is not an image", LIMITS)
    with pytest.raises(UndecodableImage):
        decode_image(b"", LIMITS)


@pytest.mark.parametrize("name", ["png_rgb_517x333", "jpeg_rgb_640x480", "webp_lossy", "gif", "bmp_rgb"])
def test_truncated_data_is_undecodable(name):
    data = CORPUS[name]
    for cut in (len(data) // 2, 20):
        with pytest.raises(UndecodableImage) as err:
            decode_image(data[:cut], LIMITS)
        assert isinstance(err.value, EncoderError)


def test_corrupt_pixels_pass_probe_but_fail_decode():
    data = bytearray(CORPUS["png_rgb_517x333"])
    idat = data.index(b"IDAT")
    data[idat + 8 : idat + 64] = b"\x00" * 56
    header = probe_image(bytes(data), LIMITS)
    assert (header.width, header.height) == (517, 333)
    with pytest.raises(UndecodableImage):
        decode_image(bytes(data), LIMITS)


def test_byte_limit():
    data = CORPUS["png_rgb_517x333"]
    with pytest.raises(ImageTooLarge, match="bytes"):
        decode_image(data, DecodeLimits(max_bytes=len(data) - 1))
    assert decode_image(data, DecodeLimits(max_bytes=len(data))).size == (517, 333)


def test_declared_pixels_are_checked_before_decoding():
    # 60000 x 60000 declared but only a few bytes of pixels: decoding would fail,
    # so ImageTooLarge proves the check ran on the header.
    bomb = _png_header_only(60000, 60000)
    with pytest.raises(ImageTooLarge, match="pixels"):
        decode_image(bomb, LIMITS)
    with pytest.raises(ImageTooLarge):
        probe_image(bomb, LIMITS)


def test_pil_bomb_error_becomes_image_too_large():
    bomb = _png_header_only(200000, 100000)  # beyond 2x PIL's MAX_IMAGE_PIXELS
    with pytest.raises(ImageTooLarge) as err:
        decode_image(bomb, DecodeLimits(max_pixels=10**12, max_aspect_ratio=1e6))
    assert isinstance(err.value.__cause__, Image.DecompressionBombError)


def test_aspect_ratio_limit():
    ok = encode(Image.fromarray(rgb_array(200, 1)), "PNG")
    assert decode_image(ok, LIMITS).size == (200, 1)
    bad = encode(Image.fromarray(rgb_array(1, 201)), "PNG")
    with pytest.raises(BadAspectRatio):
        decode_image(bad, LIMITS)
    with pytest.raises(BadAspectRatio):
        probe_image(bad, LIMITS)
    assert decode_image(bad, DecodeLimits(max_aspect_ratio=300)).size == (1, 201)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P", "L", "I", "I;16", "F", "CMYK", "1"])
def test_to_rgb_matches_processor_rgb_step(mode):
    base = Image.fromarray(np.dstack([rgb_array(23, 17, 3), rgb_array(23, 17, 4)[..., :1]]))
    img = base.convert(mode) if mode not in ("I", "I;16", "F") else Image.fromarray(rgb_array(23, 17)[..., 0]).convert(mode)
    assert np.array_equal(np.asarray(to_rgb(img)), convert_to_rgb(img, return_numpy=True))


# -- the probe never decodes pixels -----------------------------------------------

def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _xmp(orientation: int | None) -> bytes:
    attr = f' tiff:Orientation="{orientation}"' if orientation else ""
    return _chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + (
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/"{attr}/></rdf:RDF></x:xmpmeta>'
    ).encode())


def _exif(orientation: int) -> bytes:
    return _chunk(b"eXIf", exif_with_orientation(orientation).removeprefix(b"Exif\0\0"))


def _png_with(before_idat: bytes = b"", after_idat: bytes = b"", size=(45, 29)) -> bytes:
    """A PNG with extra chunks spliced in before its first IDAT and before IEND."""
    data = encode(Image.fromarray(rgb_array(*size, 11)), "PNG")
    first_idat = data.index(b"IDAT") - 4
    assert data[-12:] == _chunk(b"IEND", b"")
    return data[:first_idat] + before_idat + data[first_idat:-12] + after_idat + data[-12:]


@pytest.fixture
def loads(monkeypatch):
    """Counts pixel loads (every plugin's decode goes through one of these)."""
    from PIL import ImageFile, WebPImagePlugin

    calls = []
    for cls in (ImageFile.ImageFile, WebPImagePlugin.WebPImageFile):
        real = cls.load

        def counted(self, real=real):
            calls.append(self.format)
            return real(self)

        monkeypatch.setattr(cls, "load", counted)
    return calls


def test_probe_of_a_png_with_xmp_decodes_nothing(loads):
    data = _png_with(before_idat=_xmp(None), size=(2000, 1500))
    header = probe_image(data, LIMITS)
    assert (header.width, header.height, header.orientation) == (2000, 1500, 1)
    assert loads == []


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_probe_decodes_nothing_and_predicts_the_decoded_size(name, loads):
    header = probe_image(CORPUS[name], LIMITS)
    assert loads == []
    assert (header.width, header.height) == decode_image(CORPUS[name], LIMITS).size


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("meta", ["xmp", "exif"])
def test_png_orientation_anywhere_is_probed_without_decoding_and_agrees(where, meta, loads):
    chunk = _xmp(8) if meta == "xmp" else _exif(6)
    data = _png_with(**{f"{where}_idat": chunk})
    header = probe_image(data, LIMITS)
    assert loads == []
    assert (header.width, header.height) == (29, 45) and header.orientation == (8 if meta == "xmp" else 6)
    decoded = decode_image(data, LIMITS)
    assert decoded.size == (29, 45)
    assert np.array_equal(np.asarray(decoded), np.asarray(reference_image(data)))


def test_png_exif_after_the_pixels_wins_over_xmp_before_them(loads):
    # As for Pillow after a full load: EXIF orientation first, XMP only without it.
    data = _png_with(before_idat=_xmp(1), after_idat=_exif(6))
    header = probe_image(data, LIMITS)
    assert loads == [] and (header.width, header.height) == (29, 45)
    assert decode_image(data, LIMITS).size == (29, 45)
