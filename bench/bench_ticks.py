"""What the daemon's tick costs, without eBPF and without the host's noise:
a real recording replayed through the daemon's sinks (Streams, the
detectors, the launchers' time split, the alarms) and its tick, a tick's
span of events at a time, timed in process CPU. This tree beside a
baseline revision.

The live daemon drains its rings once a tick (4 a second while busy); its
CPU on a loaded host (bench/soak.py, bench_daemon_mix.py) moves by a
fifth with the host's hour. Here the same events go in the same batches
every run: each --spans value (seconds of recorded events a tick) is
timed on its own daemon, its first ticks (WARMUP: 40 %) left out,
and the ticks' cost is fitted as a fixed part a tick and a part an event
(least squares over the spans; work that follows recorded time, such as
windows closing, goes with the events: in one recording the two grow
together). A tick takes the events the rings would have handed it: a
GPU/NPU call comes out when it returns. What the ring drain costs (the
read, threads' processes, op names learnt from /proc), the probes and the
socket is not in it (profile_daemon.py sees those); nor are flight
recordings (bench_flight_dump.py times them) and heap trims.

With --breakdown, the sinks' main steps (STEPS: Aligner.push, PackedRing.push,
P99Drift.observe...) are timed too, each inclusive of what it calls, in ms a
tick: where a tick's fixed part and its part an event go.

Each tree runs in a process of its own (the baseline from a `git archive`
on PYTHONPATH, as bench_recording's baseline_env makes), --rounds times,
alternating. Written to bench/out/ticks.json.

Usage:
    .venv/bin/python bench/bench_ticks.py --recording FILE [--baseline-rev REV]
        [--seconds 60] [--spans 0.02 0.25 1] [--rounds 2] [--breakdown]
The soak's mix makes a fitting recording (bench_recording.py --mix-s 90
--keep).
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from side_by_side import RECORDED_STREAMS, alternating_runs, run_child  # noqa: E402

OUT = ROOT / "bench" / "out" / "ticks.json"
WARMUP = 0.4            # of each span's ticks, left out: baselines learnt, tables grown
MIN_SPAN_S = 0.001      # shorter ticks: more of them than a run is worth

# Run in each tree's own process: replay, tick, print the figures.
TICKS = r"""
import dataclasses, json, logging, sys, tempfile, time
from pathlib import Path
import numpy as np
from mmtrace.agent import heap
from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.recording.file_format import RecordingReader

path, seconds, warmup = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
breakdown = sys.argv[4] == "1"
spans = [float(s) for s in sys.argv[5:]]
logging.disable(logging.CRITICAL)

# --breakdown: the process CPU of each of these steps, summed over the
# measured ticks (inclusive: a step called inside another counts in both).
STEPS = [("agent.daemon.streams", "Streams.batch"), ("agent.ingest.align", "Aligner.push"),
         ("agent.ingest.packed_ring", "PackedRing.push"),
         ("agent.ingest.packed_ring", "PackedRing._seal"),
         ("agent.daemon.launcher_time", "LauncherTime.on_device"),
         ("agent.daemon.launcher_time", "LauncherTime.on_runq"),
         ("agent.daemon.launcher_time", "LauncherTime.tick"),
         ("detectors.p99_drift", "P99Drift.observe"), ("detectors.p99_drift", "P99Drift.advance"),
         ("exporters.live.event_counts", "EventCounts.on_device"),
         ("exporters.live.event_counts", "EventCounts.on_runq"),
         ("detectors.call_failures", "CallFailures.feed"),
         ("agent.ingest.latency_series", "Submitters.learn"),
         ("agent.daemon.memory_watch", "MemoryWatch.on_device")]
spent = {}


def timed(cls, name, label):
    inner = getattr(cls, name)

    def step(*args, **kwargs):
        began = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.process_time() - began
    setattr(cls, name, step)


if breakdown:
    import importlib
    for module, step in STEPS:     # a tree without the step: left out
        cls_name, _, method = step.partition(".")
        cls = getattr(importlib.import_module("mmtrace." + module), cls_name, None)
        if cls is not None and hasattr(cls, method):
            timed(cls, method, step)
""" + RECORDED_STREAMS + r"""# When each record leaves the rings: a switch-in at its stamp, a GPU/NPU
# call at its return (stamped at its entry).
times = {"cpu": runq["ts_ns"].astype(np.int64),
         "dev": (device["ts_ns"] + device["duration_ns"]).astype(np.int64)}
streams = {"cpu": runq, "dev": device}


class Feed:
    # The rings' batches of one tick, handed to the sinks as Ingest.drain does.
    def __init__(self, daemon):
        self.daemon, self.batches = daemon, []

    def drain(self):
        for stream, batch in self.batches:
            self.daemon.streams.batch(stream, batch, [])
        n, self.batches = sum(len(b) for _, b in self.batches), []
        return n


class Probes:
    compiling, loaded = False, None

    def attach_new(self):
        pass


out = []
heap.keep_large_blocks_mapped()
SET = ("_drained_at", "_next_sweep", "_next_exited_sweep", "_next_trim")
with tempfile.TemporaryDirectory() as tmp:
    for span in spans:
        cfg = dataclasses.replace(DaemonConfig(), state_dir=Path(tmp) / str(span),
                                  socket=Path(tmp) / "s.sock", metrics_address="off")
        daemon = Daemon(cfg)
        missing = [f"Daemon.{name}" for name in SET if not hasattr(daemon, name)] + (
            [] if hasattr(daemon.alarms, "flight_record") else ["Alarms.flight_record"])
        if missing:
            sys.exit(f"expected the daemon's {', '.join(SET)} and Alarms.flight_record "
                     f"(what this bench holds still), got a tree without {', '.join(missing)}")
        daemon.probes = Probes()
        daemon.probes.ingest = Feed(daemon)
        daemon.alarms.flight_record = lambda anomaly: None
        step = int(span * 1e9)
        count = int(seconds * 1e9) // step
        # Each tick's events in their recorded (ring) order: a stable sort by tick.
        cuts = {}
        for s, t in times.items():
            tick = (t - first) // step
            order = np.argsort(tick, kind="stable")
            cuts[s] = (order, np.searchsorted(tick[order], np.arange(count + 1)))
        timed, events = 0.0, 0
        for i in range(count):
            now = first + (i + 1) * step
            batches = [(s, streams[s][order[bounds[i]:bounds[i + 1]]])
                       for s, (order, bounds) in cuts.items()]
            daemon.probes.ingest.batches = batches
            daemon._drained_at = 0.0                   # every tick drains
            # No /proc sweeps, no heap trims (due by the wall clock, not the recording's).
            daemon._next_sweep = daemon._next_exited_sweep = daemon._next_trim = float("inf")
            if i == int(np.ceil(warmup * count)):
                spent.clear()
            began = time.process_time()
            daemon.tick(now_ns=now)
            if i >= warmup * count:
                timed += time.process_time() - began
                events += sum(len(b) for _, b in batches)
        n = count - int(np.ceil(warmup * count))
        out.append({"span_s": span, "ticks": n, "ms_a_tick": timed / n * 1e3,
                    "events_a_tick": events / n,
                    "steps_ms_a_tick": {k: v / n * 1e3 for k, v in spent.items()}})
        spent.clear()
print(json.dumps(out))
"""


def fitted(rows: list[dict]) -> tuple[float, float]:
    """(ms a tick whatever its batch, µs an event): least squares over the spans."""
    x = np.array([r["events_a_tick"] for r in rows])
    y = np.array([r["ms_a_tick"] for r in rows])
    slope, fixed = np.polyfit(x, y, 1)
    return float(fixed), float(slope * 1e3)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recording", type=Path, required=True, help="a recording to replay")
    p.add_argument("--baseline-rev", help="git revision timed beside this tree")
    p.add_argument("--seconds", type=float, default=60.0, help="of the recording replayed")
    p.add_argument("--spans", type=float, nargs="+", default=[0.02, 0.25, 1.0],
                   help="seconds of events a tick (the live daemon's: 0.25)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--breakdown", action="store_true",
                   help="also time the sinks' main steps (Aligner.push, PackedRing.push, ...): "
                        "ms a tick each, inclusive, printed for each span")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if not args.recording.is_file():
        p.error(f"--recording: expected a recording file, got {args.recording}")
    steps = {int(span * 1e9) for span in args.spans if math.isfinite(span)}
    if args.rounds < 1 or not math.isfinite(args.seconds) or len(args.spans) < 2 \
            or len(steps) < len(args.spans) or min(args.spans) < MIN_SPAN_S \
            or max(args.spans) * 5 > args.seconds:
        p.error(f"expected --rounds of 1 or more, two or more distinct --spans of "
                f"{MIN_SPAN_S:g} s or more and --seconds of five longest spans or more, "
                f"got {args.rounds}, {args.spans} and {args.seconds:g}")
    runs = alternating_runs(
        "bench_ticks", args.baseline_rev, args.rounds,
        lambda env: run_child("bench_ticks", TICKS, [args.recording, args.seconds, WARMUP,
                                                      int(args.breakdown), *args.spans], env),
        lambda run: ", ".join(f"{row['ms_a_tick']:.2f} ms a {row['span_s']:g} s tick"
                              for row in run))
    result = {"recording": str(args.recording), "seconds": args.seconds, "trees": {}}
    for name, got in runs.items():
        rows = [{**got[0][k], "ms_a_tick": statistics.median(run[k]["ms_a_tick"] for run in got),
                 "steps_ms_a_tick": {step: statistics.median(run[k]["steps_ms_a_tick"][step]
                                                             for run in got)
                                     for step in got[0][k].get("steps_ms_a_tick", {})}}
                for k in range(len(args.spans))]
        fixed, per_event = fitted(rows)
        result["trees"][name] = {"spans": rows, "fixed_ms_a_tick": round(fixed, 3),
                                 "us_an_event": round(per_event, 4)}
        print(f"{name:<12} " + ", ".join(f"{r['ms_a_tick']:.2f} ms a {r['span_s']:g} s tick "
                                         f"({r['events_a_tick']:.0f} events)" for r in rows)
              + f"; fitted {fixed:.2f} ms a tick + {per_event:.3f} µs an event")
        for r in rows if args.breakdown else ():
            steps = sorted(r["steps_ms_a_tick"].items(), key=lambda kv: -kv[1])
            print(f"  {r['span_s']:g} s ticks, ms a tick (inclusive): " + ", ".join(
                f"{step} {ms:.3f} ({100 * ms / r['ms_a_tick']:.0f} %)" for step, ms in steps))
    if args.baseline_rev:
        this, base = result["trees"]["this"], result["trees"][args.baseline_rev]
        result["ratios"] = {str(a["span_s"]): round(a["ms_a_tick"] / b["ms_a_tick"], 3)
                            for a, b in zip(this["spans"], base["spans"])}
        print(f"this / {args.baseline_rev}: " + ", ".join(
            f"{ratio:.2f}x at {span} s" for span, ratio in result["ratios"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
