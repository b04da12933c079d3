"""Failed authentications, limited per peer address (DESIGN §5.10).

Each call presenting an unknown token costs a token lookup (a read of the token store: a database
round trip with PostgreSQL), and the cache of unknown values does not help against a flood of
distinct ones. ``FailedAuthLimiter`` gives every peer address a bucket of
``auth.failures_per_peer_per_minute`` failures, refilled continuously; a peer that emptied it gets
``RESOURCE_EXHAUSTED`` (with ``RetryInfo``) for calls whose token this server has not accepted
lately, without a lookup, until the bucket refills. A token accepted before keeps working from that
peer (a client that shares its address with a broken one, behind a NAT or the WebSocket gateway,
is not locked out). The peer crossing the limit is one warning line, at most
``refusal_log_per_minute`` such lines a minute.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import unquote

from contextsvc.api.token_bucket import TokenBucket
from contextsvc.throttled_log import ThrottledLog

log = logging.getLogger(__name__)


def peer_address(peer: str) -> str:
    """The address of a gRPC peer string without its port: ``ipv4:10.0.0.7:5123`` -> ``10.0.0.7``,
    ``ipv6:%5B::1%5D:5123`` (gRPC escapes the brackets) -> ``::1``, an IPv4 client of a dual-stack
    listener (``ipv6:[::ffff:10.0.0.7]:5123``) -> ``10.0.0.7``, so one client is one key however
    the server listens; anything else (``unix:…``) as it is."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = unquote(rest).rpartition(":")[0] or unquote(rest)
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            mapped = ipaddress.IPv6Address(host).ipv4_mapped
        except ValueError:
            return host
        return str(mapped) if mapped is not None else host
    return peer


class FailedAuthLimiter:
    """Failed authentications per peer address: a token bucket each, ``per_minute`` deep."""

    def __init__(
        self,
        *,
        per_minute: int,
        max_peers: int,
        log_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_minute <= 0:
            raise ValueError(f"per_minute must be positive, got {per_minute}")
        self._capacity = float(per_minute)
        self._rate = per_minute / 60.0
        self._max_peers = max_peers
        self._clock = clock
        self._peers: OrderedDict[str, TokenBucket] = OrderedDict()
        self._log = ThrottledLog(log, per_minute=log_per_minute)

    def wait(self, peer: str) -> float:
        """0.0 when ``peer`` may try a token now; else the seconds until it may."""
        bucket = self._peers.get(peer)
        return 0.0 if bucket is None else bucket.wait(1.0, self._clock())

    def failed(self, peer: str) -> None:
        """Count one failed authentication of ``peer``."""
        now = self._clock()
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = self._peers[peer] = TokenBucket(self._capacity, self._rate, now)
            if len(self._peers) > self._max_peers:
                self._peers.popitem(last=False)  # the least recently failed peer
        else:
            self._peers.move_to_end(peer)
        if bucket.take(1.0, now) == 0.0 and bucket.tokens < 1.0:
            self._log.write(
                "authentication failures over the limit: refusing this peer's unknown tokens for a while",
                peer=peer,
                limit=f"auth.failures_per_peer_per_minute={self._capacity:g}",
            )
