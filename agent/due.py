"""When a periodic step is due: once its interval has passed, a tenth of
it early counting. The daemon's loop wakes at most an interval apart, some
wakes a few ms sooner than others; with a strict deadline, a step meant
for every wake (a discovery poll, a device sample, the tick) ran every
other one."""

EARLY = 0.1


def due(elapsed: float, interval: float) -> bool:
    """Whether a step last run `elapsed` ago (any unit, as `interval`) is due."""
    return elapsed >= interval * (1 - EARLY)
