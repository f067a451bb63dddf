"""explain's --window, as a person types it (standard library only: the
live command imports no numpy)."""

import re

from mmtrace.agent.errors import MmtraceError

MAX_WINDOW_NS = 10 * 86400 * 10**9


def parse_window(text: str | None) -> tuple[int, int] | None:
    """`START:END` in CLOCK_MONOTONIC seconds (decimals, as the report prints
    them), or in nanoseconds when both are whole numbers and one has 13
    digits or more (one unit for both ends)."""
    if text is None:
        return None
    # up to 64 digits: a long number is a range error, not a format one
    m = re.fullmatch(r"\s*(\d{1,64}(?:\.\d*)?)\s*:\s*(\d{1,64}(?:\.\d*)?)\s*", text)
    if not m:
        raise MmtraceError(f"--window: expected START:END in seconds (12.5:20) or "
                           f"nanoseconds, got {text[:60]!r}")
    parts = m.groups()
    in_ns = all("." not in p for p in parts) and max(len(p) for p in parts) >= 13
    start, end = (int(p) if in_ns else int(float(p) * 1e9) for p in parts)
    unit = "ns" if in_ns else "s"
    if end <= start:
        raise MmtraceError(f"--window: expected END after START (both read in {unit}), "
                           f"got {text[:60]!r}")
    if end >= 1 << 63:
        raise MmtraceError(f"--window: expected CLOCK_MONOTONIC times (below 2**63 ns), got "
                           f"{text[:60]!r} (read in {unit})")
    if end - start > MAX_WINDOW_NS:
        raise MmtraceError(f"--window: expected at most {MAX_WINDOW_NS // 10**9} s, got "
                           f"{(end - start) / 1e9:g} s (read in {unit})")
    return start, end
