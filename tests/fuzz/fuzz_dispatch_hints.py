"""Fuzz target: the dispatcher's hint book against arbitrary hint lines.

A line either is refused with ValueError and changes nothing, or is held
and leaves effects within their bounds: batch caps >= 1, known priorities,
routes and weights naming only the dispatcher's devices, finite weights
(not all 0 right after an accepted hint), an expiry after the moment it was
applied. Time moves 0.3 s per line, so expiries interleave with hints."""

import json
import math
import sys

import atheris

with atheris.instrument_imports():
    from mmtrace.dispatch.hints import HintBook
    from mmtrace.dispatch.queue_config import PRIORITIES

DEVICES = ["gpu0", "gpu1"]
MODALITIES = ["vision", "text"]


def check(book: HintBook, now: int):
    fx = book.effects
    assert all(isinstance(v, int) and v >= 1 for v in fx.batch_cap.values())
    assert all(v in PRIORITIES for v in fx.priority.values())
    assert all(r and set(r) <= set(DEVICES) for r in fx.routes.values())
    if fx.weights:
        assert set(fx.weights) == set(DEVICES)
        assert all(math.isfinite(w) and w >= 0 for w in fx.weights.values())
    assert set(fx.batch_cap) | set(fx.priority) | set(fx.routes) <= set(MODALITIES)
    assert all(h.expires_ns > now for h in book.active.values())


def test_one_input(data: bytes):
    book = HintBook(DEVICES, MODALITIES)
    now = 1_000
    for line in data.split(b"\n")[:8]:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            continue
        before = (book.effects, list(book.active))
        try:
            book.apply(message, now)
        except ValueError:
            assert (book.effects, list(book.active)) == before
        else:
            assert not book.effects.weights or any(book.effects.weights.values())
        check(book, now)
        now += 300_000_000          # hints of short TTL expire among the others
        book.expire(now)
        check(book, now)
    book.expire(now + int(3601e9))
    assert not book.active


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
