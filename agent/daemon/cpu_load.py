"""Host CPU utilisation from /proc/stat: the busy share of all CPUs between
two reads (the first read only sets the starting point)."""

from pathlib import Path

# Fields of the aggregate "cpu" line (proc(5)); guest time is already
# counted in user and nice.
IDLE_FIELDS = (3, 4)            # idle, iowait
COUNTED_FIELDS = 8              # user nice system idle iowait irq softirq steal


class CpuLoad:
    def __init__(self, proc_root: Path = Path("/proc")):
        self.path = Path(proc_root) / "stat"
        self._last: tuple[int, int] | None = None

    def read(self) -> float | None:
        """Utilisation 0..1 since the previous read; None on the first read,
        when no time passed, or when /proc/stat cannot be read."""
        try:
            now = _busy_total(self.path.read_text())
        except (OSError, ValueError):
            return None
        last, self._last = self._last, now
        if last is None or now[1] <= last[1]:
            return None
        return min(1.0, max(0.0, (now[0] - last[0]) / (now[1] - last[1])))


def _busy_total(text: str) -> tuple[int, int]:
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            ticks = [int(v) for v in parts[1:1 + COUNTED_FIELDS]]
            if len(ticks) < 4:
                raise ValueError(f"/proc/stat cpu line: expected at least 4 counters, got {line!r}")
            total = sum(ticks)
            return total - sum(ticks[i] for i in IDLE_FIELDS if i < len(ticks)), total
    raise ValueError("/proc/stat: expected a 'cpu' line, found none")
