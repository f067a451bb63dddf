"""`mmtrace record`: drain the probes into a recording file."""

import os
import platform
import signal
import sys
import time
from dataclasses import dataclass

from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import sched as sched_stream

from . import probes as probe_loader
from .recording import RecordingWriter
from .threads import ThreadProcesses

SCHEMAS = {"cpu.runq": sched_stream.RUNQ_EVENT}
STREAM_SCHEMA = {"cpu": "cpu.runq"}


@dataclass
class RecordResult:
    events: int
    lost: int
    duration_s: float
    stopped_by: str


class StopFlag:
    """Set by SIGINT / SIGTERM; the loop finishes the file and exits 0."""

    def __init__(self):
        self.reason = None
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self.reason = signal.Signals(signum).name

    def __bool__(self):
        return self.reason is not None


class Progress:
    """One line on stderr: rewritten in place on a terminal, else every 10 s."""

    def __init__(self, stream=sys.stderr, interval_s: float | None = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval_s if interval_s is not None else (1.0 if self.tty else 10.0)
        self._last = 0.0

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval

    def update(self, elapsed: float, events: int, lost: int, force: bool = False):
        if not force and not self.due():
            return
        self._last = time.monotonic()
        line = f"recording {elapsed:7.1f} s  events {events:>12,}  lost {lost:>8,}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if force else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def record(output, duration_s: float | None, pids=(), drain_interval_s: float = 0.025,
           progress: Progress | None = None, stop: StopFlag | None = None,
           options: probe_loader.ProbeOptions | None = None) -> RecordResult:
    options = options or probe_loader.ProbeOptions(pids=tuple(pids))
    loaded = probe_loader.load(options)
    threads = ThreadProcesses()
    own_stop = stop is None
    stop = stop or StopFlag()
    if own_stop:
        stop.install()
    writer = None
    try:
        writer = RecordingWriter(output, SCHEMAS, info={
            "hostname": platform.node(),
            "kernel": platform.release(),
            "pids": list(options.pids),
            "recorder_pid": os.getpid(),
        })
        start_counters = loaded.counters()
        writer.write_meta({"counters_at_start": start_counters,
                           "probes": [{"stream": "cpu", "program": sched_stream.SOURCE,
                                       "state": "attached"}]})
        started = time.monotonic()
        deadline = started + duration_s if duration_s else None
        events = 0
        while True:
            finishing = bool(stop) or (deadline is not None and time.monotonic() >= deadline)
            events += _drain(loaded, writer, threads)
            if progress and (finishing or progress.due()):
                lost = bpf_counters.total_lost(_delta(loaded.counters(), start_counters))
                progress.update(time.monotonic() - started, events, lost, force=finishing)
            if finishing:
                break
            time.sleep(drain_interval_s)
        end_counters = loaded.counters()
        delta = _delta(end_counters, start_counters)
        lost = bpf_counters.total_lost(delta)
        elapsed = time.monotonic() - started
        writer.close({
            "end_monotonic_ns": time.monotonic_ns(),
            "duration_s": elapsed,
            "events": events,
            "counters": delta,
            "lost_events": lost,
            "runq_hist_log2_us": loaded.runq_hist(),
            "unresolved_pids": threads.unresolved,
            "stopped_by": stop.reason or "duration",
        })
        return RecordResult(events, lost, elapsed, stop.reason or "duration")
    finally:
        if writer is not None and not writer.closed:
            writer.close({"stopped_by": "error"})
        loaded.close()
        if own_stop:
            stop.restore()


def _drain(loaded, writer, threads, max_rounds: int = 8) -> int:
    """What the rings hold now; a few rounds at most, so that a producer
    faster than the disk cannot keep the loop from seeing a stop."""
    total = 0
    for _ in range(max_rounds):
        batches = loaded.read()
        if not batches:
            break
        for stream, batch in batches.items():
            learnt = threads.fill(batch)
            if learnt:
                loaded.learn_threads(learnt)
            writer.write_events(STREAM_SCHEMA[stream], batch)
            total += len(batch)
    return total


def _delta(now: dict, start: dict) -> dict:
    return {k: now[k] - start.get(k, 0) for k in now}
