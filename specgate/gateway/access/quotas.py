"""Per-key quotas: requests per minute, tokens per minute, streams at once.

Plain arithmetic on a clock the caller passes in (time.monotonic in the
server), so tests step time by hand. A request is admitted when its key has
room now; its tokens (prompt at start, completion as they are produced) are
counted afterwards, so a long stream may carry a key past its tpm and the
key's next request waits until the window has room again.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0
# Nothing better to say for a key at its stream limit: a stream ends when it ends.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True)
class KeyLimits:
    rpm: int | None = None  # requests started per minute
    tpm: int | None = None  # prompt + completion tokens per minute
    max_concurrent: int | None = None  # requests in flight (queued or decoding)


class Rejected(Exception):
    """A key over one of its limits; `reason` is a metrics label."""

    def __init__(self, reason: str, message: str, retry_after: float):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, rounded up, at least 1: a client retrying then finds room."""
        return str(max(1, math.ceil(self.retry_after)))


@dataclass
class RequestWindow:
    """Exact sliding window of request start times (at most `limit` kept)."""

    limit: int
    times: deque[float] = field(default_factory=deque)

    def _prune(self, now: float) -> None:
        while self.times and self.times[0] <= now - WINDOW_S:
            self.times.popleft()

    def wait(self, now: float) -> float:
        """Seconds until one more request fits (0: it fits now)."""
        self._prune(now)
        if len(self.times) < self.limit:
            return 0.0
        # The request that must leave the window to make room.
        return self.times[len(self.times) - self.limit] + WINDOW_S - now

    def count(self, now: float) -> int:
        self._prune(now)
        return len(self.times)

    def add(self, now: float) -> None:
        self.times.append(now)
        while len(self.times) > self.limit:
            self.times.popleft()


@dataclass
class TokenWindow:
    """Tokens counted in the last minute, in one-second buckets so that a
    long stream costs at most 60 entries however many events it sends."""

    limit: int
    buckets: deque[list[int]] = field(default_factory=deque)  # [second, tokens]
    total: int = 0

    def _prune(self, now: float) -> None:
        # Bucket s holds tokens counted in [s, s + 1); it leaves at s + 1 + WINDOW_S.
        while self.buckets and self.buckets[0][0] + 1 + WINDOW_S <= now:
            self.total -= self.buckets.popleft()[1]

    def used(self, now: float) -> int:
        self._prune(now)
        return self.total

    def add(self, now: float, tokens: int) -> None:
        if tokens <= 0:
            return
        second = math.floor(now)
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += tokens
        else:
            self.buckets.append([second, tokens])
        self.total += tokens

    def wait(self, now: float) -> float:
        """Seconds until the window holds fewer than `limit` tokens (0: now)."""
        self._prune(now)
        if self.total < self.limit:
            return 0.0
        left = self.total
        for second, tokens in self.buckets:
            left -= tokens
            if left < self.limit:
                return second + 1 + WINDOW_S - now
        return math.inf  # a limit of 0 never has room


class KeyUsage:
    """One key's live usage against its limits; kept across keys-file
    reloads (by key name), so re-reading the file does not reset a quota."""

    def __init__(self, limits: KeyLimits = KeyLimits()):
        self.in_flight = 0
        self.limits = limits
        self._requests: RequestWindow | None = None
        self._tokens: TokenWindow | None = None
        self.set_limits(limits)

    def set_limits(self, limits: KeyLimits) -> None:
        self.limits = limits
        old_requests, old_tokens = self._requests, self._tokens
        self._requests = RequestWindow(limits.rpm) if limits.rpm is not None else None
        self._tokens = TokenWindow(limits.tpm) if limits.tpm is not None else None
        if self._requests is not None and old_requests is not None:
            for t in old_requests.times:
                self._requests.add(t)
        if self._tokens is not None and old_tokens is not None:
            self._tokens.buckets, self._tokens.total = old_tokens.buckets, old_tokens.total

    def check(self, now: float) -> None:
        """Raise Rejected if one more request does not fit now; changes nothing."""
        lim = self.limits
        if lim.max_concurrent is not None and self.in_flight >= lim.max_concurrent:
            raise Rejected(
                "concurrency",
                f"this key has {self.in_flight} requests in flight (limit {lim.max_concurrent})",
                CONCURRENCY_RETRY_S,
            )
        if self._requests is not None and (wait := self._requests.wait(now)) > 0:
            raise Rejected(
                "rpm", f"this key's limit of {lim.rpm} requests per minute is reached", wait
            )
        if self._tokens is not None and (wait := self._tokens.wait(now)) > 0:
            raise Rejected(
                "tpm",
                f"this key used {self._tokens.used(now)} of its {lim.tpm} tokens per minute",
                wait,
            )

    def start(self, now: float) -> None:
        """A request passed check() and was accepted (queued or decoding)."""
        self.in_flight += 1
        if self._requests is not None:
            self._requests.add(now)

    def count_tokens(self, now: float, tokens: int) -> None:
        if self._tokens is not None:
            self._tokens.add(now, tokens)

    def finish(self) -> None:
        self.in_flight -= 1

    def in_window(self, now: float) -> dict:
        """Requests and tokens in the last minute where a limit counts them
        (None where none does), and the requests in flight."""
        return {"in_flight": self.in_flight,
                "requests": None if self._requests is None else self._requests.count(now),
                "tokens": None if self._tokens is None else self._tokens.used(now)}  # fmt: skip
