"""A token bucket: per-user quotas (``quotas``) and failed authentications per address (``auth_limit``)."""

from __future__ import annotations


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second. A request for more than the capacity
    passes when the bucket is full and leaves it in debt, so an oversized request is slowed down
    rather than refused for ever."""

    __slots__ = ("capacity", "rate", "stamp", "tokens")

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity = capacity
        self.rate = rate
        self.tokens = capacity
        self.stamp = now

    def wait(self, amount: float, now: float) -> float:
        """The seconds until ``amount`` could be taken (0.0: now), taking nothing."""
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        needed = min(amount, self.capacity)
        return 0.0 if self.tokens >= needed else (needed - self.tokens) / self.rate

    def take(self, amount: float, now: float) -> float:
        """Take ``amount``; 0.0 when taken, else the seconds until it could be."""
        waited = self.wait(amount, now)
        if not waited:
            self.tokens -= amount
        return waited
