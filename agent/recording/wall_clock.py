"""Wall-clock time for a recording's CLOCK_MONOTONIC stamps, for people:
"p99 went up at 14:02" is matched against the rest of a host's logs by
the clock on the wall, in the local zone and in UTC. The offset is the one
the writer took when it opened the file (the header's
realtime_minus_monotonic_ns): a clock stepped since moves the mapping by
as much, which NTP's slewing keeps to milliseconds."""

import time
from datetime import datetime, timezone


class WallClock:
    def __init__(self, realtime_minus_monotonic_ns: int | None):
        self.offset_ns = realtime_minus_monotonic_ns

    @classmethod
    def now(cls) -> "WallClock":
        """The host's clocks as they stand now (a live daemon's anomalies)."""
        return cls(time.time_ns() - time.monotonic_ns())

    @classmethod
    def of(cls, rec) -> "WallClock":
        return cls((getattr(rec, "header", None) or {}).get("realtime_minus_monotonic_ns"))

    @property
    def known(self) -> bool:
        return isinstance(self.offset_ns, int)

    def unix_ns(self, ts_ns: int) -> int | None:
        return ts_ns + self.offset_ns if self.known else None

    def _local(self, ts_ns: int) -> datetime | None:
        unix_ns = self.unix_ns(ts_ns)
        if unix_ns is None:
            return None
        try:
            return datetime.fromtimestamp(unix_ns / 1e9, tz=timezone.utc).astimezone()
        except (OverflowError, OSError, ValueError):     # a stamp no calendar holds
            return None

    def iso(self, ts_ns: int) -> str | None:
        """ISO 8601 in the local zone with its offset, to the microsecond."""
        moment = self._local(ts_ns)
        return moment.isoformat(timespec="microseconds") if moment else None

    def iso_utc(self, ts_ns: int) -> str | None:
        moment = self._local(ts_ns)
        return moment.astimezone(timezone.utc).isoformat(timespec="microseconds") \
            if moment else None

    def text(self, ts_ns: int) -> str:
        """`2026-12-02 14:02:03.123 +0100 (13:02:03.123 UTC)`, or `?` unknown."""
        moment = self._local(ts_ns)
        if moment is None:
            return "?"
        utc = moment.astimezone(timezone.utc)
        return (f"{moment:%Y-%m-%d %H:%M:%S}.{moment.microsecond // 1000:03d} {moment:%z} "
                f"({utc:%H:%M:%S}.{utc.microsecond // 1000:03d} UTC)")

    def stamp(self, ts_ns: int) -> dict:
        """What JSON carries of a moment: its nanoseconds and ISO 8601 forms."""
        return {"monotonic_ns": int(ts_ns), "unix_ns": self.unix_ns(int(ts_ns)),
                "local": self.iso(ts_ns), "utc": self.iso_utc(ts_ns)}
