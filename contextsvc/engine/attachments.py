"""Images on the way in: described from their own bytes, stored once by content address."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

from contextsvc.config import TokenSettings
from contextsvc.core.images import inspect_image
from contextsvc.core.messages import ImageRef
from contextsvc.engine.validation import IncomingImage
from contextsvc.errors import InvalidArgument
from contextsvc.ports import SessionStore

# Hashing a few megabytes takes milliseconds: larger images are hashed off the event loop.
_HASH_INLINE_BYTES = 256 * 1024


async def content_address(data: bytes) -> str:
    """The SHA-256 hex digest that names a blob."""
    if len(data) <= _HASH_INLINE_BYTES:
        return hashlib.sha256(data).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())


async def describe_images(
    store: SessionStore,
    images: Sequence[IncomingImage],
    settings: TokenSettings,
    field: str,
    *,
    persist: bool,
) -> tuple[tuple[ImageRef, ...], dict[str, bytes]]:
    """Describe every image (type from the bytes, never from the client; size; token price) and,
    with ``persist``, put new bytes in the blob store. Returns the refs and the bytes by blob id."""
    refs: list[ImageRef] = []
    data_by_id: dict[str, bytes] = {}
    for j, image in enumerate(images):
        data = image.data
        if image.blob_id:
            found = await store.get_blob(image.blob_id)
            if found is None:
                raise InvalidArgument.field(f"{field}[{j}].blob_id", "no stored image has this id")
            data = found
        blob_id = image.blob_id or await content_address(data)
        info = inspect_image(data, fallback_tokens=settings.image_tokens_fallback)
        if persist and not image.blob_id:
            await store.put_blob(data, blob_id=blob_id)
        data_by_id[blob_id] = data
        refs.append(
            ImageRef(
                blob_id=blob_id,
                mime_type=info.mime_type,
                width=info.width,
                height=info.height,
                size_bytes=len(data),
                token_count=info.tokens,
            )
        )
    return tuple(refs), data_by_id
