"""The GPU check's PyTorch workload (bench/gpu_check, on a host with an
NVIDIA GPU): a decode-like loop of a small transformer (layer norms,
matmuls through cuBLAS, softmax, a convolution through cuDNN, a CUDA graph
replayed with torch.cuda.CUDAGraph, and with --compile a function compiled
with torch.compile(mode="reduce-overhead"), whose Triton kernels replay as
a graph too), with copies both ways and syncs.

It imports nothing of mmtrace's and runs under the host's own Python.
Prints {"pid": P} once CUDA is up (the tracer attaches then), waits for a
line "go STEPS", warms up (kernels are loaded and named at their first
use; the graphs are captured), waits --settle-s for the tracer to find
the libraries loaded meanwhile, then runs STEPS steps under torch.profiler
between two CLOCK_MONOTONIC stamps. Prints one JSON line: the window, and
the reference list of submissions made of the profiler's trace
(gpu_compare.reference_from_trace). Waits for stdin to close, then exits.

    python3 bench/gpu_workload.py --trace /tmp/trace.json [--compile]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_compare  # noqa: E402


def build(torch, hidden: int, layers: int, vocab: int, dtype):
    """The model's weights, on the GPU."""
    dev = "cuda"
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)
            self.norm2 = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x, cache):
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            keys = torch.cat([cache, k], dim=0)
            attention = torch.softmax(q @ keys.T / hidden ** 0.5, dim=-1)
            x = x + self.out(attention @ torch.cat([cache, v], dim=0))
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))

    model = nn.ModuleDict({
        "embed": nn.Embedding(vocab, hidden),
        "blocks": nn.ModuleList(Block() for _ in range(layers)),
        "conv": nn.Conv1d(hidden, hidden, kernel_size=3, padding=1),   # cuDNN
        "head": nn.Linear(hidden, vocab, bias=False),
    }).to(dev, dtype).eval()
    caches = [torch.randn(16, hidden, device=dev, dtype=dtype) for _ in range(layers)]
    return model, caches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="where the profiler's trace goes")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--compile", action="store_true",
                        help='also a function compiled with torch.compile(mode="reduce-overhead")')
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    if not torch.cuda.is_available():
        sys.exit("gpu_workload: expected a CUDA device, torch.cuda.is_available() is False")
    dtype = torch.bfloat16
    torch.cuda.init()
    model, caches = build(torch, args.hidden, args.layers, args.vocab, dtype)
    mlp = model["blocks"][0]
    static_in = torch.zeros(1, args.hidden, device="cuda", dtype=dtype)
    print(json.dumps({"pid": os.getpid(), "torch": torch.__version__,
                      "cuda": torch.version.cuda, "device": torch.cuda.get_device_name()}),
          flush=True)
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "go":
        sys.exit(f"gpu_workload: expected 'go STEPS' on stdin, got {line!r}")
    steps = int(line[1])

    compiled, compile_error = None, None
    if args.compile:
        try:
            compiled = torch.compile(lambda x: torch.nn.functional.silu(x) * x + 1,
                                     mode="reduce-overhead")
        except Exception as exc:        # reported, and the check goes on without it
            compile_error = f"{type(exc).__name__}: {exc}"
    graph = torch.cuda.CUDAGraph()

    @torch.inference_mode()
    def step(token: int) -> int:
        ids = torch.tensor([token], dtype=torch.long).to("cuda")        # host to device
        x = model["embed"](ids)
        for block, cache in zip(model["blocks"], caches):
            x = block(x, cache)
        x = x + model["conv"](x.T.unsqueeze(0)).squeeze(0).T
        static_in.copy_(x)
        graph.replay()                                                   # CUDA graph
        x = static_out.clone()
        if compiled is not None:
            x = compiled(x)
        nxt = int(model["head"](x).argmax(-1).item())                  # device to host
        torch.cuda.synchronize()
        return nxt % args.vocab

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                mlp(static_in, caches[0])
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static_out = mlp(static_in, caches[0])
    token = 1
    for _ in range(5):                  # warm-up: first uses, compilation, graph trees
        try:
            token = step(token)
        except Exception as exc:
            if compiled is None:
                raise
            compile_error = f"{type(exc).__name__}: {exc}"
            compiled = None
    time.sleep(args.settle_s)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(gpu_compare.WINDOW_ANNOTATION):
            start = time.monotonic_ns()
            for _ in range(steps):
                token = step(token)
            end = time.monotonic_ns()
    prof.export_chrome_trace(args.trace)
    reference = gpu_compare.reference_from_trace(json.loads(Path(args.trace).read_text()))
    print(json.dumps({"pid": os.getpid(), "window_ns": [start, end], "steps": steps,
                      "compile": "off" if not args.compile else (compile_error or "on"),
                      **reference}), flush=True)
    for _ in sys.stdin:
        pass


if __name__ == "__main__":
    main()
