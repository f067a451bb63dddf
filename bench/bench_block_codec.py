"""The flight recorder's rings, packed with LZ4 against zlib, on a real recording.

The daemon holds its recent past packed (agent/ingest/packed_ring.py): the
run-queue records in blocks of a second, the aligned GPU/NPU records in
blocks of a quarter second, each block's near-constant byte planes given
to LZ4 (the lz4 package), or to zlib at level 1 where lz4 is missing
(agent/ingest/block_codec.py). This pushes a recording's records into
rings built as the daemon builds them (its default capacities and reach),
in the order the recording holds them (the rings' own, with the disorder
of CPUs sharing a ring), the GPU/NPU ones aligned first by an Aligner as
the daemon's (not timed), and reads each ring back whole at the end. Per
codec, in interleaved rounds: CPU per record of the pushes (the hot block's
copies and the seals: what the daemon pays), of the read (a flight
recording, `top`), and the bytes held per record at the end; the median of
--rounds, and the ratios. Every read is checked against a plain ring.

--raw-bits B ... also packs with both codecs at each entropy threshold B
(block_codec's RAW_BITS: positions noisier than B bits a byte are kept
raw), for both rings.

Usage: .venv/bin/python bench/bench_block_codec.py --recording FILE [--rounds 5]
           [--raw-bits 2 2.5 3 4 5]
FILE: a recording of the soak's mix, made as root with
    .venv/bin/python bench/bench_recording.py --mix-s 90 --keep --sizes-mib --commands report
(it lands in /var/tmp/mmtrace-bench/mix-90s.mmtr). Figures go to bench/out/block_codec.json.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.streams import RUNQ_BLOCK_NS
from mmtrace.agent.ingest import block_codec
from mmtrace.agent.ingest.align import ALIGNED_EVENT, Aligner, ApiRoles
from mmtrace.agent.ingest.event_ring import EventRing
from mmtrace.agent.ingest.packed_ring import PackedRing
from mmtrace.agent.recording.file_format import RecordingReader
from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recording import write_out  # noqa: E402

LZ4 = block_codec.lz4_block


def batches_of(path: str) -> dict:
    """Per ring: (its records' batches in the recording's order, the ring's
    kwargs besides raw_bits, its default raw_bits)."""
    config = DaemonConfig()
    age = int(config.ring_seconds * 1e9)
    out = {}
    with RecordingReader(path) as reader:
        if "cpu.runq" in reader.schemas:
            runq = [p.copy() for p in reader.pieces("cpu.runq") if len(p)]
            if runq:
                out["run-queue"] = (runq, dict(dtype=RUNQ_EVENT, capacity=config.ring_capacity,
                                               max_age_ns=age, block_ns=RUNQ_BLOCK_NS),
                                    block_codec.RAW_BITS)
        if "dev.event" in reader.schemas:
            aligner = Aligner(ApiRoles.from_infos(device_stream.default_infos()),
                              capacity=config.device_ring_capacity, max_age_ns=age)
            aligned = [aligner.push(p.copy()) for p in reader.pieces("dev.event") if len(p)]
            aligned = [a for a in aligned if len(a)]
            if aligned:
                out["GPU/NPU"] = (aligned, dict(dtype=ALIGNED_EVENT,
                                                capacity=config.device_ring_capacity,
                                                max_age_ns=age), block_codec.RAW_BITS)
    return out


def one_round(batches: list, ring_args: dict, raw_bits: float, use_lz4: bool) -> dict:
    """Push every batch into a ring packed with one codec; CPU per record
    of the pushes and of the read, bytes held per record; the read checked
    against a plain ring of the same limits."""
    block_codec.lz4_block = LZ4 if use_lz4 else None
    try:
        ring = PackedRing(**ring_args, raw_bits=raw_bits)
        t0 = time.process_time()
        for batch in batches:
            ring.push(batch)
        t1 = time.process_time()
        got = ring.window()
        t2 = time.process_time()
    finally:
        block_codec.lz4_block = LZ4
    plain = EventRing(ring_args["dtype"], ring_args["capacity"], ring_args["max_age_ns"])
    for batch in batches:
        plain.push(batch)
    if got.tobytes() != plain.window().tobytes():
        raise SystemExit("the packed ring read back other records than were pushed")
    pushed, held = sum(len(b) for b in batches), max(len(ring), 1)
    return {"push_ns": (t1 - t0) / pushed * 1e9, "read_ns": (t2 - t1) / held * 1e9,
            "held_bytes": ring.nbytes / held, "held_records": len(ring)}


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recording", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--raw-bits", type=float, nargs="*", default=[],
                    help="also these entropy thresholds (bits a byte), both codecs")
    opts = ap.parse_args()
    if LZ4 is None:
        raise SystemExit("the lz4 package is not installed: nothing to compare")
    block_codec._warned_no_lz4 = True      # zlib here is chosen, not missing lz4
    rings = batches_of(opts.recording)
    if not rings:
        raise SystemExit(f"{opts.recording}: no run-queue or GPU/NPU records")
    results = []
    for name, (batches, ring_args, raw_bits) in rings.items():
        variants = {}
        for bits in [raw_bits] + [b for b in opts.raw_bits if b != raw_bits]:
            suffix = "" if bits == raw_bits else f", {bits:g} bits"
            variants.update({f"zlib{suffix}": (bits, False), f"lz4{suffix}": (bits, True)})
        runs = {v: [] for v in variants}
        for _ in range(opts.rounds):
            for v, (bits, use_lz4) in variants.items():
                runs[v].append(one_round(batches, ring_args, bits, use_lz4))
        med = {v: medians(r) for v, r in runs.items()}
        pushed = sum(len(b) for b in batches)
        print(f"{name}: {pushed:,} records pushed, {med['lz4']['held_records']:,.0f} held at the "
              f"end (raw_bits {raw_bits:g}); medians of {opts.rounds} rounds")
        for v, m in med.items():
            print(f"  {v:<15} push {m['push_ns']:7.1f} ns/record  read {m['read_ns']:6.1f} "
                  f"ns/record  held {m['held_bytes']:5.2f} B/record")
            results.append({"ring": name, "variant": v, "raw_bits": variants[v][0], **m,
                            "rounds": runs[v]})
        lz, zl = med["lz4"], med["zlib"]
        print(f"  lz4 / zlib: push {lz['push_ns'] / zl['push_ns']:.2f}x, read "
              f"{lz['read_ns'] / zl['read_ns']:.2f}x, held {lz['held_bytes'] / zl['held_bytes']:.2f}x")
    write_out("block_codec.json", results)


if __name__ == "__main__":
    main()
