"""Images on the way in: stored once by content address, described from their own bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from contextsvc.config import TokenSettings
from contextsvc.core.images import inspect_image
from contextsvc.core.messages import ImageRef
from contextsvc.engine.validation import IncomingImage
from contextsvc.errors import InvalidArgument
from contextsvc.ports import SessionStore


async def store_images(
    store: SessionStore, images: Sequence[IncomingImage], settings: TokenSettings, field: str
) -> tuple[ImageRef, ...]:
    """Put new bytes in the blob store and describe every image (type, size, token price).

    The type comes from the bytes, never from anything the client says.
    """
    refs: list[ImageRef] = []
    for j, image in enumerate(images):
        data = image.data
        if image.blob_id:
            found = await store.get_blob(image.blob_id)
            if found is None:
                raise InvalidArgument.field(f"{field}[{j}].blob_id", "no stored image has this id")
            data = found
        blob_id = hashlib.sha256(data).hexdigest()
        info = inspect_image(data, fallback_tokens=settings.image_tokens_fallback)
        if not image.blob_id:
            await store.put_blob(data, blob_id=blob_id)
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
    return tuple(refs)
