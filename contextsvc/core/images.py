"""Image pricing from the header alone (DESIGN §5.3).

An image costs tokens by its own pixel area, never a flat constant: a flat price undercounted
screenshots 2x-8x, so a session full of them never reached the compression trigger. Pricing reads
only the header — Pillow's ``Image.open`` is lazy — so a 40-megapixel upload costs a few hundred
bytes of parsing, not a decode.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from contextsvc.config import TokenSettings
from contextsvc.core.messages import ImageRef

if TYPE_CHECKING:
    from PIL import ImageFile

#: Images are downscaled (keeping aspect) to fit this square before they are cut into patches.
MAX_SIDE = 2048
#: Side of one vision patch in pixels.
PATCH_PX = 32
#: The patch count is clamped to this range: tiny images still cost a minimum tile grid.
MIN_PATCHES = 256
MAX_PATCHES = 4096
#: Tokens that frame every image (begin/end markers).
FRAME_TOKENS = 2

UNKNOWN_MIME = "application/octet-stream"
#: The configured default for unreadable images (settings.tokens.image_tokens_fallback).
DEFAULT_FALLBACK_TOKENS = TokenSettings().image_tokens_fallback


@dataclass(slots=True, frozen=True)
class ImageInfo:
    """What the header says about an image, and what it costs in a prompt."""

    mime_type: str
    width: int
    height: int
    tokens: int


def image_tokens(width: int, height: int) -> int:
    """Tokens of a ``width`` x ``height`` image: fit within 2048², 32-px patches clamped to [256, 4096], +2."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image dimensions must be positive, got {width}x{height}")
    w, h = _fit(width, height)
    patches = math.ceil(w / PATCH_PX) * math.ceil(h / PATCH_PX)
    return min(max(patches, MIN_PATCHES), MAX_PATCHES) + FRAME_TOKENS


def _fit(width: int, height: int) -> tuple[int, int]:
    """Downscale to fit MAX_SIDE x MAX_SIDE keeping aspect; never upscale, never below 1 px."""
    longest = max(width, height)
    if longest <= MAX_SIDE:
        return width, height
    # Integer arithmetic keeps the result exact and the long side exactly MAX_SIDE.
    return max(1, width * MAX_SIDE // longest), max(1, height * MAX_SIDE // longest)


def inspect_image(data: bytes, *, fallback_tokens: int = DEFAULT_FALLBACK_TOKENS) -> ImageInfo:
    """Type, size and price of an image from its header; never decodes pixels.

    Bytes no image plugin recognizes (or whose header is broken) price at ``fallback_tokens``
    (``settings.tokens.image_tokens_fallback``) with mime ``application/octet-stream`` and 0x0.
    """
    try:
        with _open_header(io.BytesIO(data)) as im:
            width, height = im.size
            mime = im.get_format_mimetype() or UNKNOWN_MIME
    except Exception:  # any header a plugin chokes on is "unreadable": priced, never an error
        return ImageInfo(UNKNOWN_MIME, 0, 0, fallback_tokens)
    if width <= 0 or height <= 0:
        return ImageInfo(mime, 0, 0, fallback_tokens)
    return ImageInfo(mime, width, height, image_tokens(width, height))


def ref_tokens(ref: ImageRef, *, fallback_tokens: int = DEFAULT_FALLBACK_TOKENS) -> int:
    """Price of a stored image reference: its recorded price, else its size, else the fallback."""
    if ref.token_count > 0:
        return ref.token_count
    if ref.width > 0 and ref.height > 0:
        return image_tokens(ref.width, ref.height)
    return fallback_tokens


def _open_header(fp: IO[bytes]) -> ImageFile.ImageFile:
    """``Image.open`` without the decompression-bomb guard.

    The guard protects a *decode*; we never decode, and a huge header must be priced (it is
    the most expensive kind of image), not rejected. Pillow offers no per-call switch and
    ``MAX_IMAGE_PIXELS`` is process-global, so: open normally with the warning silenced, and
    only when the size is past the hard limit, re-identify through Pillow's plugin registry
    (the same factories ``Image.open`` uses) without the check.
    """
    # Imported on the first image, not at start-up (Pillow costs ~0.1 s of CPU to load).
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(fp)
    except Image.DecompressionBombError:
        pass
    Image.init()
    prefix = _prefix(fp)
    for fmt in Image.ID:
        factory, accept = Image.OPEN[fmt]
        verdict = accept(prefix) if accept is not None else True
        if isinstance(verdict, str) or not verdict:  # a str is Pillow's "almost, but no" warning
            continue
        fp.seek(0)
        try:
            return factory(fp, "")
        except Exception:  # the next plugin may still recognize it, as in Image.open
            continue
    raise UnidentifiedImageError("no image plugin recognized the header")


def _prefix(fp: IO[bytes]) -> bytes:
    fp.seek(0)
    return fp.read(16)
