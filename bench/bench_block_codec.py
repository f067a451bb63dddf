"""The flight recorder's rings, packed with LZ4 against zlib, on a real recording.

The daemon holds its recent past packed (agent/ingest/packed_ring.py): the
run-queue records in blocks of a second, the aligned GPU/NPU records in
blocks of a quarter second, each block's near-constant byte planes given
to LZ4 (the lz4 package), or to zlib at level 1 where lz4 is missing
(agent/ingest/block_codec.py). This pushes a recording's records into
rings built as the daemon builds them (its default capacities and reach),
in the order the recording holds them (the rings' own, with the disorder
of CPUs sharing a ring), the GPU/NPU ones aligned first by an Aligner as
the daemon's (not timed; the retired_ns it sets on records pushed before
are set on the ring, as the daemon's Aligner does), and reads each ring
back whole at the end. Per codec, each at its threshold (LZ4: 4 bits;
zlib: 2.5 for the run-queue ring, as without lz4), in interleaved rounds:
CPU per record of the pushes (the hot block's copies and the seals: what
the daemon pays), of the read (a flight recording, `top`), and the bytes
held per record in the sealed blocks (the hot block is raw whatever the
codec); the median of --rounds, and the ratios. Every read is checked
against a plain ring.

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


def batches_of(path: str) -> dict:
    """Per ring: (its batches in the recording's order, each with the
    retired_ns updates the Aligner made to earlier records before it, the
    ring's kwargs besides raw_bits and lz4, its LZ4 raw_bits, its zlib ones)."""
    config = DaemonConfig()
    age = int(config.ring_seconds * 1e9)
    out = {}
    with RecordingReader(path) as reader:
        if "cpu.runq" in reader.schemas:
            runq = [(p.copy(), []) for p in reader.pieces("cpu.runq") if len(p)]
            if runq:
                out["run-queue"] = (runq, dict(dtype=RUNQ_EVENT, capacity=config.ring_capacity,
                                               max_age_ns=age, block_ns=RUNQ_BLOCK_NS),
                                    block_codec.runq_raw_bits(True),
                                    block_codec.runq_raw_bits(False))
        if "dev.event" in reader.schemas:
            updates: list = []
            aligner = Aligner(ApiRoles.from_infos(device_stream.default_infos()),
                              capacity=config.device_ring_capacity, max_age_ns=age,
                              on_retired=lambda seq, ns: updates.append((seq.copy(), ns.copy())))
            aligned = []
            for piece in reader.pieces("dev.event"):
                if len(piece):
                    batch = aligner.push(piece.copy()).copy()
                    aligned.append((batch, updates[:]))
                    updates.clear()
            if aligned:
                out["GPU/NPU"] = (aligned, dict(dtype=ALIGNED_EVENT,
                                                capacity=config.device_ring_capacity,
                                                max_age_ns=age),
                                  block_codec.RAW_BITS, block_codec.RAW_BITS)
    return out


def fill(ring, batches: list):
    """What the daemon does to its ring, batch after batch: the retired_ns
    of earlier records set (Aligner.push), then the batch pushed."""
    for batch, updates in batches:
        for seq, retired in updates:
            ring.update(seq, "retired_ns", retired)
        ring.push(batch)


def one_round(batches: list, ring_args: dict, raw_bits: float, lz4: bool,
              want: bytes) -> dict:
    """Fill a ring packed with one codec; CPU per record of the fill and
    of the read, bytes a record held in its sealed blocks (the hot block is
    held raw whatever the codec); the read checked against `want`."""
    ring = PackedRing(**ring_args, raw_bits=raw_bits, lz4=lz4)
    t0 = time.process_time()
    fill(ring, batches)
    t1 = time.process_time()
    got = ring.window()
    t2 = time.process_time()
    if got.tobytes() != want:
        raise SystemExit("the packed ring read back other records than were pushed")
    sealed = [b for b in ring._blocks if b.count]
    pushed = sum(len(b) for b, _ in batches)
    held = sum(b.packed.nbytes for b in sealed) / max(sum(b.count for b in sealed), 1)
    return {"push_ns": (t1 - t0) / pushed * 1e9, "read_ns": (t2 - t1) / max(len(got), 1) * 1e9,
            "held_bytes": held, "held_records": len(got)}


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recording", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--raw-bits", type=float, nargs="*", default=[],
                    help="also these entropy thresholds (bits a byte), both codecs")
    opts = ap.parse_args()
    if block_codec.codec_missing:
        raise SystemExit(f"{block_codec.codec_missing}: nothing to compare")
    rings = batches_of(opts.recording)
    if not rings:
        raise SystemExit(f"{opts.recording}: no run-queue or GPU/NPU records")
    results = []
    for name, (batches, ring_args, lz4_bits, zlib_bits) in rings.items():
        plain = EventRing(ring_args["dtype"], ring_args["capacity"], ring_args["max_age_ns"])
        fill(plain, batches)
        want = plain.window().tobytes()
        variants = {"zlib": (zlib_bits, False), "lz4": (lz4_bits, True)}
        for bits in opts.raw_bits:
            variants.update({f"zlib, {bits:g} bits": (bits, False),
                             f"lz4, {bits:g} bits": (bits, True)})
        runs = {v: [] for v in variants}
        for _ in range(opts.rounds):
            for v, (bits, lz4) in variants.items():
                runs[v].append(one_round(batches, ring_args, bits, lz4, want))
        med = {v: medians(r) for v, r in runs.items()}
        pushed = sum(len(b) for b, _ in batches)
        print(f"{name}: {pushed:,} records pushed, {med['lz4']['held_records']:,.0f} held at the "
              f"end (raw above {lz4_bits:g} bits with LZ4, {zlib_bits:g} with zlib); "
              f"medians of {opts.rounds} rounds; held: in the sealed blocks")
        for v, m in med.items():
            print(f"  {v:<15} push {m['push_ns']:7.1f} ns/record  read {m['read_ns']:6.1f} "
                  f"ns/record  held {m['held_bytes']:5.2f} B/record")
            results.append({"ring": name, "variant": v, "raw_bits": variants[v][0], **m,
                            "rounds": runs[v]})
        lz, zl = med["lz4"], med["zlib"]
        print(f"  lz4 / zlib: push {lz['push_ns'] / zl['push_ns']:.2f}x, read "
              f"{lz['read_ns'] / zl['read_ns']:.2f}x, "
              f"held {lz['held_bytes'] / zl['held_bytes']:.2f}x")
    write_out("block_codec.json", results)


if __name__ == "__main__":
    main()
