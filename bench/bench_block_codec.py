"""The flight recorder's block packing, LZ4 against zlib, on a real recording.

The daemon holds its recent past packed (agent/ingest/packed_ring.py): the
run-queue records in blocks of a second, the aligned GPU/NPU records in
blocks of a quarter second. block_codec gives the near-constant byte planes
to LZ4 (the lz4 package), or to zlib at level 1 where lz4 is missing. This
packs the recording's records in blocks of those sizes both ways, in
interleaved rounds: CPU per record of the whole pack (what the daemon
pays) and of the unpack (a flight recording, `top`), and bytes held per
record; the median of --rounds, and the ratios.

Usage: .venv/bin/python bench/bench_block_codec.py --recording FILE [--rounds 5]
(a recording of the soak's mix: bench_recording.py --mix-s 90 --keep)
"""

import argparse
import statistics
import time

import numpy as np

from mmtrace.agent.ingest import block_codec
from mmtrace.agent.ingest.align import ApiRoles, align
from mmtrace.agent.recording.file_format import RecordingReader
from mmtrace.bpf import device as device_stream

CODECS = {"lz4": block_codec.lz4_block, "zlib": None}


def blocks_of(path: str, runq_block_s: float = 1.0, device_block_s: float = 0.25,
              limit: int = 2_000_000) -> dict:
    """(records in blocks, raw_bits) per stream, blocks cut by time as the rings cut them."""
    out = {}
    with RecordingReader(path) as reader:
        for schema, raw_bits, span in (("cpu.runq", block_codec.RUNQ_RAW_BITS, runq_block_s),
                                       ("dev.event", block_codec.RAW_BITS, device_block_s)):
            if schema not in reader.schemas:
                continue
            parts, n = [], 0
            for piece in reader.pieces(schema):
                parts.append(piece)
                n += len(piece)
                if n >= limit:
                    break
            records = np.concatenate(parts)
            records = records[np.argsort(records["ts_ns"], kind="stable")]
            if schema == "dev.event":
                records = align(records, ApiRoles.from_infos(device_stream.default_infos()))
            ts = records["ts_ns"]
            cuts = np.searchsorted(ts, np.arange(int(ts[0]), int(ts[-1]), int(span * 1e9)))
            out[schema] = ([records[a:b] for a, b in zip(cuts, list(cuts[1:]) + [len(ts)])
                            if b > a], raw_bits)
    return out


def one_round(blocks: list, raw_bits: float) -> tuple[float, float, float]:
    """(pack ns, unpack ns, bytes) per record, with the codec set now."""
    n = sum(len(b) for b in blocks)
    work = [b.copy() for b in blocks]
    judged = np.full(blocks[0].dtype.itemsize, -1, np.int8)
    t0 = time.process_time()
    packed = [block_codec.pack(b, "ts_ns", in_place=True, raw_bits=raw_bits, judged=judged)
              for b in work]
    t1 = time.process_time()
    for p, b in zip(packed, blocks):
        block_codec.unpack(p, b.dtype, "ts_ns")
    t2 = time.process_time()
    return (t1 - t0) / n * 1e9, (t2 - t1) / n * 1e9, sum(p.nbytes for p in packed) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recording", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    opts = ap.parse_args()
    if CODECS["lz4"] is None:
        raise SystemExit("the lz4 package is not installed: nothing to compare")
    for schema, (blocks, raw_bits) in blocks_of(opts.recording).items():
        runs = {name: [] for name in CODECS}
        for _ in range(opts.rounds):
            for name, module in CODECS.items():
                block_codec.lz4_block = module
                runs[name].append(one_round(blocks, raw_bits))
        block_codec.lz4_block = CODECS["lz4"]
        n = sum(len(b) for b in blocks)
        print(f"{schema}: {n:,} records in {len(blocks)} blocks, medians of {opts.rounds} rounds")
        med = {name: [statistics.median(r[k] for r in rs) for k in range(3)]
               for name, rs in runs.items()}
        for name, (pack_ns, unpack_ns, held) in med.items():
            print(f"  {name:<5} pack {pack_ns:7.1f} ns/record  unpack {unpack_ns:6.1f} ns/record"
                  f"  held {held:5.2f} B/record")
        lz, zl = med["lz4"], med["zlib"]
        print(f"  lz4 / zlib: pack {lz[0] / zl[0]:.2f}x, unpack {lz[1] / zl[1]:.2f}x, "
              f"held {lz[2] / zl[2]:.2f}x")


if __name__ == "__main__":
    main()
