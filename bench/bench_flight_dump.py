"""A flight recording's write, this tree beside a baseline revision: the
daemon's rings (the run-queue PackedRing, the GPU/NPU Aligner, held
compressed) filled with --seconds of a real recording, then
FlightRecorder.dump_now timed as the daemon calls it (SIGUSR2, `mmtrace
dump`, an alarm), in thread CPU.

Each tree runs in a process of its own (the baseline from a `git archive`
on PYTHONPATH, as bench_recording's baseline_env makes), --rounds times,
alternating. Printed: each tree's median and best, the ratio, and the
sha1 of the events each wrote (read back): the two must write the same.
Written to bench/out/flight_dump.json.

Usage:
    .venv/bin/python bench/bench_flight_dump.py --recording FILE
        [--baseline-rev REV] [--seconds 40] [--dumps 7] [--rounds 2]
The soak's mix makes a fitting recording (bench_recording.py --mix-s 90
--keep).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from side_by_side import RECORDED_STREAMS, alternating_runs, run_child  # noqa: E402

OUT = ROOT / "bench" / "out" / "flight_dump.json"
REACH_S = 30.0          # the daemon's ring_seconds: what a dump writes
STEP_NS = 250_000_000   # the rings are pushed a tick's worth at a time

# Run in each tree's own process: fill the rings, dump, print the figures.
DUMPS = r"""
import hashlib, json, sys, tempfile, time
from pathlib import Path
import numpy as np
from mmtrace.agent.daemon.streams import SCHEMAS, _plain_device
from mmtrace.agent.ingest.align import Aligner, ApiRoles
from mmtrace.agent.ingest.packed_ring import PackedRing
from mmtrace.agent.recording.file_format import RecordingReader
from mmtrace.agent.recording.flight import FlightRecorder
from mmtrace.bpf.device import default_infos
from mmtrace.bpf.sched import RUNQ_EVENT

path, seconds, dumps, reach_s, step = (sys.argv[1], float(sys.argv[2]), int(sys.argv[3]),
                                       float(sys.argv[4]), int(sys.argv[5]))
""" + RECORDED_STREAMS + r"""end = first + int(seconds * 1e9)
age = int(reach_s * 1e9)
ring = PackedRing(RUNQ_EVENT, 1 << 22, age)
aligner = Aligner(ApiRoles.from_infos(default_infos()), capacity=1 << 21, max_age_ns=age,
                  compress=True)
for lo in range(first, end, step):
    for part, push in ((runq, ring.push), (device, aligner.push)):
        ts = part["ts_ns"].astype(np.int64)
        batch = part[(ts >= lo) & (ts < lo + step)]
        if len(batch):
            push(batch)
times, written = [], None
with tempfile.TemporaryDirectory() as state:
    recorder = FlightRecorder(Path(state), reach_s, keep=2)
    for _ in range(dumps):
        windows = {"cpu.runq": ring.pieces(), "dev.event": map(_plain_device, aligner.pieces())}
        began = time.thread_time()
        written = recorder.dump_now(windows, SCHEMAS, [], reason="bench", now_ns=end)
        times.append(time.thread_time() - began)
    digest = hashlib.sha1()
    with RecordingReader(written) as rec:
        for schema in ("cpu.runq", "dev.event"):
            for piece in rec.pieces(schema):
                digest.update(piece.tobytes())
        counts = {s: n for s, n in rec.counts.items() if n}
if not counts.get("cpu.runq") or not counts.get("dev.event"):
    sys.exit(f"a dump wrote no run-queue or no GPU/NPU events: {counts}")
print(json.dumps({"ms": [t * 1e3 for t in times], "sha1": digest.hexdigest(),
                  "events": counts}))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recording", type=Path, required=True, help="a recording to fill the rings")
    p.add_argument("--baseline-rev", help="git revision timed beside this tree")
    p.add_argument("--seconds", type=float, default=40.0,
                   help="of the recording pushed (a dump writes the last 30)")
    p.add_argument("--dumps", type=int, default=7, help="dumps timed per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if not args.recording.is_file():
        p.error(f"--recording: expected a recording file, got {args.recording}")
    if args.dumps < 1 or args.rounds < 1 or args.seconds <= REACH_S:
        p.error(f"expected --dumps and --rounds of 1 or more and --seconds over {REACH_S:g}, "
                f"got {args.dumps}, {args.rounds} and {args.seconds:g}")
    runs = alternating_runs(
        "bench_flight_dump", args.baseline_rev, args.rounds,
        lambda env: run_child("bench_flight_dump", DUMPS, [args.recording, args.seconds,
                                                            args.dumps, REACH_S, STEP_NS], env),
        lambda run: f"median {statistics.median(run['ms']):.1f} ms")
    result = {"recording": str(args.recording), "seconds": args.seconds, "trees": {}}
    for name, got in runs.items():
        ms = [m for run in got for m in run["ms"]]
        result["trees"][name] = {"median_ms": round(statistics.median(ms), 1),
                                 "best_ms": round(min(ms), 1), "sha1": got[0]["sha1"],
                                 "events": got[0]["events"]}
        print(f"{name:<12} median {statistics.median(ms):.1f} ms, best {min(ms):.1f} ms, "
              f"events {got[0]['events']}, sha1 {got[0]['sha1'][:12]}")
    if args.baseline_rev:
        this, base = result["trees"]["this"], result["trees"][args.baseline_rev]
        result["ratio"] = round(this["median_ms"] / base["median_ms"], 3)
        result["same_events"] = this["sha1"] == base["sha1"]
        print(f"this / {args.baseline_rev}: {result['ratio']:.2f}x; the same events written: "
              f"{result['same_events']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
