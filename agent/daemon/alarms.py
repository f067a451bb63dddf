"""What the daemon does when a detector speaks: the anomaly kept, logged
and counted, the policy told, the recent past written as a flight
recording, the per-launch probes turned on for a burst (adaptive mode),
OTLP told. Dumps on request (`mmtrace dump`, SIGUSR2) write the same
recording."""

import logging
import os
import platform
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from mmtrace.bpf import device as device_stream

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.client_messages import ClientMessages
from mmtrace.agent.daemon.live_probes import LiveProbes
from mmtrace.agent.daemon.steering import Steering
from mmtrace.agent.daemon.streams import SCHEMAS, Streams
from mmtrace.agent.recording.flight import FlightRecorder
from mmtrace.agent.recording.meta_budget import fit_meta
from mmtrace.agent.recording.wall_clock import WallClock

log = logging.getLogger("mmtrace.daemon")

MAX_ANOMALIES = 1000        # kept for status replies


class Alarms:
    def __init__(self, config: DaemonConfig, streams: Streams, probes: LiveProbes,
                 steering: Steering, flight: FlightRecorder, messages: ClientMessages,
                 otlp, trim_heap):
        self.config = config
        self.streams = streams
        self.probes = probes
        self.steering = steering
        self.flight = flight
        self.trim_heap = trim_heap      # after each recording: it leaves the heap big
        self.messages = messages        # the dispatchers' samples: their tables go in recordings
        self.otlp = otlp                # live.otlp.OtlpTraces, when configured
        self.anomalies: list[dict] = []
        self.counts: Counter = Counter()        # firing anomalies by detector

    def act(self, anomalies: list[dict]):
        for anomaly in anomalies:
            key = self.streams.series_keys.get(anomaly.get("series"))
            if key is not None:             # what the series is about, for the policy
                anomaly["key"] = key.as_dict()
            if anomaly.get("state") == "firing" and "verdict" not in \
                    (anomaly.get("evidence") or {}):
                self.streams.launchers.add_verdict(anomaly)
            self.steering.inputs.on_anomaly(anomaly)
            self.anomalies.append(anomaly)
            del self.anomalies[:-MAX_ANOMALIES]
            firing = anomaly.get("state") == "firing"
            if firing:
                self.counts[anomaly.get("detector", "unknown")] += 1
            # When it happened on the wall, in the local zone and UTC, for
            # matching against the host's other logs.
            clock = WallClock.now()
            at = anomaly.get("ts_ns")
            at = at if isinstance(at, int) else time.monotonic_ns()
            anomaly["wall_time"] = clock.stamp(at)
            ev = anomaly.get("evidence") or {}
            about = f" pid {anomaly['pid']} ({anomaly.get('comm')})" if "pid" in anomaly else ""
            log.warning("anomaly %s %s%s %s at %s%s", anomaly.get("detector"),
                        anomaly.get("series") or anomaly.get("kind"), about, anomaly.get("state"),
                        clock.text(at), f": verdict {ev['verdict']}" if ev.get("verdict") else "")
            if firing:
                self._on_firing(anomaly)
        if anomalies and self.otlp is not None:
            self.otlp.anomalies(anomalies)

    def _on_firing(self, anomaly: dict):
        path = self.flight_record(anomaly)
        if path is not None:
            anomaly["flight_recording"] = str(path)
            log.warning("flight recording: %s", path)
        device = self.probes.device
        if self.config.adaptive_launches and device is not None:
            # The next minutes complete: per-launch probes on for a while.
            device.attach_launches(self.config.launch_burst_s)

    def flight_record(self, anomaly: dict) -> Path | None:
        """The recent past, written for `anomaly` (None within the flight
        recorder's interval, or when it cannot be written)."""
        meta = self._meta()
        try:
            return self.flight.dump(self.streams.windows(), SCHEMAS, anomaly, meta,
                                    time.monotonic_ns())
        finally:
            self.trim_heap()

    def dump(self, reason: str) -> Path:
        """The flight recorder's ring written now (`mmtrace dump`, SIGUSR2),
        past its interval; OSError when it cannot be written."""
        try:
            path = self.flight.dump_now(self.streams.windows(), SCHEMAS, self._meta(),
                                        reason=reason, now_ns=time.monotonic_ns())
        finally:
            self.trim_heap()
        log.warning("flight recording (%s): %s", reason, path)
        return path

    def _meta(self) -> list[dict]:
        device = self.probes.device
        return [fit_meta({
            "apis": device_stream.default_table().to_json(),
            "probes": self.probes.states(),
            "symbol_names": {str(k): v for k, v in
                             (device.symbol_names().items() if device is not None else [])},
            "op_names": self.streams.op_names,
            **self.messages.samples.tables(),
            "hint_audit": self.steering.audit(),
            **self.streams.memory.meta(self.probes.loaded, time.monotonic_ns()),
            "host": platform.node(), "daemon_pid": os.getpid(),
            "config": _jsonable(asdict(self.config))})]


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
