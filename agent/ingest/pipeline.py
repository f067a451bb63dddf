"""The one ingest path: drain the kernel's rings, fill in what is known
(each event's process from its thread, the names of GPU/NPU ops), and hand
every enriched batch to the sinks, in order. `record` and `run` differ
only in their sinks: the recording file for one; the rings, detectors,
metrics and hints of the daemon for the other (as the OpenTelemetry SDK's
span processors feed its exporters)."""

from typing import Protocol

import numpy as np


class Sink(Protocol):
    def batch(self, stream: str, events: np.ndarray, op_names: list[list]) -> None:
        """One batch of `stream` ("cpu" or "dev"), its threads' processes
        filled in; `op_names`: the [pid, address, name] rows this batch
        named first (device batches only)."""


class Ingest:
    def __init__(self, loaded, threads, names=None, sinks=(), max_rounds: int = 8):
        self.loaded = loaded        # probes.LoadedProbes: the rings to read
        self.threads = threads      # threads.ThreadProcesses
        self.names = names          # ingest.device_names.DeviceNames, once the device stream is wired
        self.sinks: list[Sink] = list(sinks)
        # A few rounds at most, so that a producer faster than the sinks
        # cannot keep the caller from seeing a stop.
        self.max_rounds = max_rounds

    def drain(self) -> int:
        """What the rings hold now, through every sink; the events handed on."""
        total = 0
        for _ in range(self.max_rounds):
            batches = self.loaded.read()
            if not batches:
                break
            for stream, batch in batches.items():
                learnt = self.threads.fill(batch)
                if learnt:
                    self.loaded.learn_threads(learnt)
                rows = self.names.process(batch) if stream == "dev" and \
                    self.names is not None else []
                for sink in self.sinks:
                    sink.batch(stream, batch, rows)
                total += len(batch)
        return total
