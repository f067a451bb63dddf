"""One modality's queue on one device, and when it holds a batch to run.

A queue is ready when it holds a full batch (`batch_max` requests) or when
its oldest request has waited `wait_ms`: a batch forms until one of the two
happens, never longer. Time is CLOCK_MONOTONIC nanoseconds passed in by the
caller, so the rule is testable without sleeping.
"""

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass(slots=True)
class Request:
    item: object
    modality: str
    session: object
    device: str
    submitted_ns: int
    future: Future = field(default_factory=Future)


class ModalityQueue:
    __slots__ = ("modality", "requests")

    def __init__(self, modality: str):
        self.modality = modality
        self.requests: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.requests)

    def push(self, request: Request):
        self.requests.append(request)

    def oldest_ns(self) -> int | None:
        return self.requests[0].submitted_ns if self.requests else None

    def ready(self, now_ns: int, batch_max: int, wait_ns: int) -> bool:
        if not self.requests:
            return False
        return len(self.requests) >= batch_max or now_ns - self.requests[0].submitted_ns >= wait_ns

    def deadline_ns(self, wait_ns: int) -> int | None:
        """When the oldest request will have waited its limit."""
        return self.requests[0].submitted_ns + wait_ns if self.requests else None

    def take(self, batch_max: int) -> list[Request]:
        n = min(batch_max, len(self.requests))
        return [self.requests.popleft() for _ in range(n)]

    def drain(self) -> list[Request]:
        out = list(self.requests)
        self.requests.clear()
        return out
