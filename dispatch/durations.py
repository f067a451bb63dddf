"""Durations from outside input, checked where they arrive.

Every duration a peer or a user hands in (a hint's `ttl_s`, a queue's
`wait_ms`, a setting, an MMTRACE_* variable, a flag) becomes nanoseconds
or a deadline. A value the clocks cannot hold is refused with a message
that names the field and the range: not a number (a bool is not one), NaN
or infinite, zero or below (unless the field gives 0 a meaning, such as
"off"), under the range's floor, or over its top. Every floor is at least
one tick of CLOCK_MONOTONIC (1 ns): a hint of ttl_s 5e-63 once expired at
the very nanosecond it was applied. The comparisons are done on the value
as given, so an integer of 400 digits is refused, not an OverflowError.
"""

NS_PER_UNIT = {"s": 1_000_000_000, "ms": 1_000_000}
MIN_DURATION_S = 1e-6        # the floor of a setting that names none: one microsecond


def expected_duration(low: float, high: float, *, unit: str = "s", zero: bool = False) -> str:
    """The range as an error message says it: 'a number of seconds in 0.000001..10'."""
    name = {"s": "seconds", "ms": "milliseconds"}[unit]
    text = f"a number of {name} in {range_end(low)}..{range_end(high)}"
    return f"0 or {text}" if zero else text


def is_duration(value, low: float, high: float, *, unit: str = "s", zero: bool = False) -> bool:
    """True where `value` is an int or float in low..high (or exactly 0, if `zero`)."""
    if low * NS_PER_UNIT[unit] < 1:
        raise ValueError(f"a duration's floor must be one clock tick (1 ns) at least, got "
                         f"{low!r} {unit}")
    if type(value) not in (int, float):
        return False
    if zero and value == 0:
        return True
    return low <= value <= high          # NaN fails every comparison; no float() of a huge int


def check_duration(value, where: str, low: float, high: float, *, unit: str = "s",
                   zero: bool = False) -> float:
    """`value` as a float, else ValueError: '<where>: expected ..., got <value>'."""
    if not is_duration(value, low, high, unit=unit, zero=zero):
        raise ValueError(f"{where}: expected {expected_duration(low, high, unit=unit, zero=zero)}"
                         f", got {_shown(value)}")
    return float(value)


def range_end(value: float) -> str:
    """A range's end as written: 16777216, 0.5, 0.000001 (never 1e-06)."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    text = f"{value:g}"
    return f"{value:.9f}".rstrip("0") if "e" in text and abs(value) < 1 else text


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
