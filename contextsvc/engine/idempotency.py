"""What makes two AppendMessages requests "the same" for ``request_id`` idempotency."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from contextsvc.core.codec import message_to_dict
from contextsvc.engine.validation import IncomingMessage

#: bump when the hashed form changes, so old and new fingerprints are never compared as equal.
SCHEME = "v1"


def append_fingerprint(incoming: Sequence[IncomingMessage]) -> str:
    """A hash of the messages exactly as the client sent them (content, role, tool calls, flags,
    metadata, image bytes or blob ids), before the server stamps times and counts tokens. A retry
    of the same request has the same fingerprint; any change to what would be appended does not."""
    digest = hashlib.sha256()
    for item in incoming:
        d = message_to_dict(item.message)
        d["images_sent"] = [
            [hashlib.sha256(image.data).hexdigest() if image.data else "", image.blob_id] for image in item.images
        ]
        digest.update(json.dumps(d, sort_keys=True, separators=(",", ":")).encode())
        digest.update(b"\n")
    return f"{SCHEME}:{digest.hexdigest()}"
