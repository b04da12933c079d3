"""Image pricing from headers (DESIGN §5.3)."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageFile

from contextsvc.config import TokenSettings
from contextsvc.core.images import ImageInfo, image_tokens, inspect_image, ref_tokens
from contextsvc.core.messages import ImageRef


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (1024, 1024, 1026),
        (2048, 2048, 4098),
        (4096, 4096, 4098),  # downscaled to 2048² first
        (3000, 1000, 1410),  # -> 2048x682: 64 x 22 patches + 2
        (100, 100, 258),  # 16 patches, clamped up to 256
        (1, 1, 258),
        (2048, 1, 258),
        (512, 512, 258),  # exactly 256 patches
        (1920, 1080, 2042),  # 60 x 34 = 2040 patches
    ],
)
def test_image_tokens_pins(width: int, height: int, tokens: int) -> None:
    assert image_tokens(width, height) == tokens


def test_a_larger_image_costs_more_than_a_thumbnail() -> None:
    assert image_tokens(1024, 1024) == 4 * image_tokens(512, 512) - 6  # 4 x 256 patches, one frame


@given(st.integers(1, 100_000), st.integers(1, 100_000))
def test_image_tokens_stay_in_the_clamp_and_are_symmetric(width: int, height: int) -> None:
    tokens = image_tokens(width, height)
    assert 258 <= tokens <= 4098
    assert tokens == image_tokens(height, width)


@pytest.mark.parametrize(("width", "height"), [(0, 10), (10, 0), (-1, 5)])
def test_image_tokens_reject_non_positive_sizes(width: int, height: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        image_tokens(width, height)


def _encoded(fmt: str, size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("fmt", "mime"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")],
)
def test_inspect_detects_the_type_from_the_bytes(fmt: str, mime: str) -> None:
    info = inspect_image(_encoded(fmt, (1024, 1024)))
    assert info == ImageInfo(mime, 1024, 1024, 1026)


@pytest.mark.parametrize("data", [b"", b"garbage bytes, not an image", b"\x89PNG\r\n\x1a\n" + b"\x00" * 10])
def test_unreadable_bytes_price_at_the_fallback(data: bytes) -> None:
    assert inspect_image(data) == ImageInfo("application/octet-stream", 0, 0, 1024)
    assert TokenSettings().image_tokens_fallback == 1024


def test_fallback_price_comes_from_the_caller() -> None:
    assert inspect_image(b"nope", fallback_tokens=777).tokens == 777


# --- crafted PNGs: a header that claims a huge image, with little or no pixel data -----------


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)


def _zero_rows(width: int, height: int) -> Iterator[bytes]:
    """A valid, highly compressed IDAT stream of black rows, produced without holding the image."""
    comp = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # filter byte + pixels
    for _ in range(height):
        out = comp.compress(row)
        if out:
            yield out
    yield comp.flush()


def _valid_png(width: int, height: int) -> bytes:
    idat = b"".join(_zero_rows(width, height))
    return _png_header(width, height) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _undecodable_png(width: int, height: int) -> bytes:
    """A real header and a broken pixel stream: opening works, decoding cannot.

    (Pillow pads a merely *short* stream with black, so the stream is corrupt, not short.)
    """
    return _png_header(width, height) + _chunk(b"IDAT", b"\x78\x9c" + b"\xff" * 64)


def _pillow_images_allocated() -> int:
    """Pixel buffers Pillow's C core has allocated so far (invisible to tracemalloc)."""
    return int(Image.core.get_stats()["new_count"])  # type: ignore[attr-defined]


def test_a_40_megapixel_png_is_priced_without_decoding_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    width, height = 8000, 5000  # 40 MP; 40 MB once decoded as 8-bit grayscale
    data = _valid_png(width, height)
    assert len(data) < 200_000

    def no_decode(self: ImageFile.ImageFile) -> None:
        raise AssertionError("pricing decoded the pixels")

    before = _pillow_images_allocated()
    with monkeypatch.context() as patch:
        patch.setattr(ImageFile.ImageFile, "load", no_decode)
        info = inspect_image(data)
    assert _pillow_images_allocated() == before, "pricing allocated a pixel buffer"
    assert info == ImageInfo("image/png", width, height, image_tokens(width, height))
    assert info.tokens == 64 * 40 + 2  # 8000x5000 -> 2048x1280

    # Control: a decode of the same bytes does allocate, so the check above can fail.
    with Image.open(io.BytesIO(data)) as im:
        im.load()
    assert _pillow_images_allocated() > before


def test_a_corrupt_png_prices_although_its_pixels_cannot_be_decoded() -> None:
    data = _undecodable_png(8000, 5000)
    assert inspect_image(data) == ImageInfo("image/png", 8000, 5000, 2562)
    with Image.open(io.BytesIO(data)) as im, pytest.raises(OSError):
        im.load()  # proves that a decode would have failed


def test_a_decompression_bomb_header_is_priced_not_rejected() -> None:
    # 100,000² px is past Pillow's hard limit (2 x MAX_IMAGE_PIXELS): Image.open raises on it.
    data = _undecodable_png(100_000, 100_000)
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no DecompressionBombWarning leaks either
        info = inspect_image(data)
        mid = inspect_image(_undecodable_png(10_000, 10_000))  # between the warning and the error
    assert info == ImageInfo("image/png", 100_000, 100_000, 4098)
    assert mid == ImageInfo("image/png", 10_000, 10_000, 4098)
    assert Image.MAX_IMAGE_PIXELS is not None  # the global guard was left alone


def test_an_extreme_aspect_bomb_is_priced_by_its_shape() -> None:
    # 200 MP but a thin strip: after the downscale it is 2048 x 1 -> the minimum price.
    assert inspect_image(_undecodable_png(1_000_000, 200)).tokens == 258


@pytest.mark.parametrize(
    ("ref", "tokens"),
    [
        (ImageRef("a", token_count=500, width=1024, height=1024), 500),  # the recorded price wins
        (ImageRef("b", width=1024, height=1024), 1026),
        (ImageRef("c"), 1024),
    ],
)
def test_ref_tokens(ref: ImageRef, tokens: int) -> None:
    assert ref_tokens(ref) == tokens


_SEEDS = [_encoded("PNG", (64, 48)), _encoded("JPEG", (64, 48)), _encoded("GIF", (64, 48)), _png_header(9, 9)]


@given(st.sampled_from(_SEEDS), st.integers(0, 200), st.binary(max_size=8), st.integers(0, 300))
def test_mangled_headers_never_raise(seed: bytes, at: int, junk: bytes, cut: int) -> None:
    data = (seed[:at] + junk + seed[at + len(junk) :])[: max(cut, 1)]
    info = inspect_image(data)
    assert info.tokens == 1024 or 258 <= info.tokens <= 4098
    assert (info.width == 0) == (info.height == 0)


@given(st.binary(max_size=64))
def test_random_bytes_never_raise(data: bytes) -> None:
    assert inspect_image(data).tokens > 0
