"""The launch decoder's cost one piece at a time (bench_gpu_probes.py
--only pieces).

A ladder of bcc uprobes on cudaLaunchKernel, each the one before plus one
piece of what bpf/device.h's launch path does, in its order: the 144-byte
ring record zeroed and stamped with the registers' arguments; the scope
check; the return sampler (a per-CPU count, the process's failing time);
the thread's entry (run-queue delay, comm sent, device); the process's op
id (an atomic add); the stack read (caller, shared memory, stream); the
outer caller ([rbp + 8]). The maps are the decoder's kinds and sizes. The
step between two rungs is what that piece costs a launch; together they
show where the decoder's time goes, against the empty program and the
bpftrace-like floor in the same rounds. The last rung is the launch as it
goes now: the same pieces in a 64-byte record written field by field (not
zeroed), a per-CPU call-site lookup instead of the outer caller's read.
Beside the wall time per call, each program's own run time as the kernel
times it (bench/program_time.py): the trap is not in it, nor its noise.
"""

LADDER = ["ring record (144 B, zeroed, arguments)", "+ scope (settings; no pid filter)",
          "+ return sampler (per-CPU count, failing time)",
          "+ thread entry (delay, comm sent, device)", "+ op id (per-process atomic add)",
          "+ stack read (caller, shared mem, stream)", "+ outer caller ([rbp + 8])",
          "one line: 64 B written, call-site lookup for the outer caller"]

PROGRAM = r"""
#include <uapi/linux/ptrace.h>
BPF_RINGBUF_OUTPUT(ring, 8192);             /* 32 MiB: a whole run of records */
struct settings { u64 configured; u64 filter_pids; };
BPF_ARRAY(settings, struct settings, 1);
BPF_HASH(scope, u32, u8, 32768);
BPF_PERCPU_ARRAY(sampler, u64, 1);
BPF_TABLE("lru_hash", u32, u64, failing, 32768);
struct thread_state { u64 enqueued_ns, last_delay_ns, last_ts_ns; u32 tgid, flags;
                      s32 device; u32 reserved; };
BPF_HASH(threads, u32, struct thread_state, 65536);
BPF_HASH(seq, u32, u64, 32768);
struct site { u64 handle, ret, tgid; };
BPF_PERCPU_ARRAY(sites, struct site, 256);

/* The last rung's record: rung 6's pieces, the record in one line. */
static __always_inline int line(struct pt_regs *ctx, u64 id, int timed)
{
    u32 tgid = id >> 32, tid = id;
    u64 stack[3], delay = 0, op = 0;
    bpf_probe_read_user(stack, sizeof(stack), (void *)PT_REGS_SP(ctx));
    struct thread_state *t = threads.lookup(&tid);
    if (t)
        delay = t->last_delay_ns;
    u64 *q = seq.lookup(&tgid);
    if (q)
        op = __sync_fetch_and_add(q, 1) + 1;
    u64 h = PT_REGS_PARM1(ctx);
    u32 i = (u32)(h ^ stack[0] ^ tgid) & 255;
    struct site *s = sites.lookup(&i);
    if (!s)
        return 0;
    if (s->handle != h || s->ret != stack[0] || s->tgid != tgid) {
        s->handle = h;
        s->ret = stack[0];
        s->tgid = tgid;
    }
    u64 *p = ring.ringbuf_reserve(64);
    if (!p)
        return 0;
    p[0] = bpf_ktime_get_ns();
    p[1] = h;
    p[2] = stack[2];
    p[3] = stack[0];
    p[4] = tid | op << 32;
    p[5] = delay | stack[1] << 32;
    p[6] = PT_REGS_PARM2(ctx) ^ (u64)timed;
    p[7] = PT_REGS_PARM4(ctx) ^ PT_REGS_PARM5(ctx);
    ring.ringbuf_submit(p, BPF_RB_NO_WAKEUP);
    return 0;
}

static __always_inline int rung(struct pt_regs *ctx, int level)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = id, zero = 0;
    if (level >= 1) {
        struct settings *s = settings.lookup(&zero);
        if (!s)
            return 0;
        /* as tgid_in_scope: the scope map only when filtering by pid
         * (not here, nor in the bench's mmtrace) */
        if (!s->configured)
            return 0;
        if (s->filter_pids && !scope.lookup(&tgid))
            return 0;
    }
    int timed = 0;
    if (level >= 2) {
        u64 *n = sampler.lookup(&zero);
        if (n && (*n)++ % 64 == 12345)
            timed = 1;
        u64 *until = failing.lookup(&tgid);
        if (!until) {
            u64 none = 0;
            failing.update(&tgid, &none);
        } else if (*until > 12345)
            timed = 1;
    }
    if (level == 7)
        return line(ctx, id, timed);
    u64 *p = ring.ringbuf_reserve(144);
    if (!p)
        return 0;
    __builtin_memset(p, 0, 144);
    p[0] = bpf_ktime_get_ns();
    p[1] = id;
    p[2] = PT_REGS_PARM1(ctx);
    p[3] = PT_REGS_PARM2(ctx);
    p[4] = PT_REGS_PARM3(ctx) | (u64)timed << 63;
    p[5] = PT_REGS_PARM4(ctx);
    p[6] = PT_REGS_PARM5(ctx);
    if (level >= 3) {
        struct thread_state *t = threads.lookup(&tid);
        if (t) {
            p[7] = t->last_delay_ns;
            if (t->flags & 2)
                p[8] = t->device;
        } else {
            struct thread_state fresh = { .tgid = tgid, .flags = 1 };
            threads.insert(&tid, &fresh);
        }
    }
    if (level >= 4) {
        u64 *q = seq.lookup(&tgid);
        if (q)
            p[9] = __sync_fetch_and_add(q, 1) + 1;
        else {
            u64 none = 0;
            seq.insert(&tgid, &none);
        }
    }
    if (level >= 5)
        bpf_probe_read_user(&p[10], 24, (void *)PT_REGS_SP(ctx));
    if (level >= 6)
        bpf_probe_read_user(&p[13], 8, (void *)(PT_REGS_FP(ctx) + 8));
    ring.ringbuf_submit(p, BPF_RB_NO_WAKEUP);
    return 0;
}
int empty(struct pt_regs *ctx) { return 0; }
int rung0(struct pt_regs *ctx) { return rung(ctx, 0); }
int rung1(struct pt_regs *ctx) { return rung(ctx, 1); }
int rung2(struct pt_regs *ctx) { return rung(ctx, 2); }
int rung3(struct pt_regs *ctx) { return rung(ctx, 3); }
int rung4(struct pt_regs *ctx) { return rung(ctx, 4); }
int rung5(struct pt_regs *ctx) { return rung(ctx, 5); }
int rung6(struct pt_regs *ctx) { return rung(ctx, 6); }
int rung7(struct pt_regs *ctx) { return rung(ctx, 7); }
"""


def uprobe_run(program, fn_name: str, runtime, loop, calls: int, drain: bool = True,
               run_args=()) -> float:
    """Seconds of loop.run(calls, *run_args) with bcc `program`'s `fn_name`
    on the runtime's cudaLaunchKernel; its rings drained after (`drain`),
    so that the next run has room."""
    program.attach_uprobe(name=str(runtime), sym="cudaLaunchKernel", fn_name=fn_name)
    try:
        return loop.run(calls, *run_args)
    finally:
        program.detach_uprobe(name=str(runtime), sym="cudaLaunchKernel")
        if drain:
            program.ring_buffer_consume()


def interleaved_rounds(loop, calls: int, repeat: int, runs: dict) -> dict:
    """Seconds of each of `repeat` rounds of each run, the runs interleaved
    so that all see the same host load, after a warm-up."""
    rounds = {name: [] for name in runs}
    loop.run(calls // 10)
    for _ in range(repeat):
        for name, run in runs.items():
            rounds[name].append(run())
    return rounds


def interleaved_best(loop, calls: int, repeat: int, runs: dict) -> dict:
    """Seconds of the fastest of `repeat` interleaved rounds of each run."""
    return {name: min(ts) for name, ts in interleaved_rounds(loop, calls, repeat, runs).items()}


def pieces(loop, runtime, calls: int, repeat: int, traced=None, traced_fds=None) -> dict:
    """ns per call of each rung, the empty program and (`traced`: a
    function that attaches mmtrace, runs `calls` and detaches; `traced_fds`:
    a function giving its launch program's descriptors) mmtrace's decoder,
    all in the same rounds; the fastest round of each counts. And each
    program's own ns per run, the median of the rounds."""
    import statistics

    import bcc
    import program_time
    program = bcc.BPF(text=PROGRAM)
    program["settings"][0] = program["settings"].Leaf(1, 0)
    program["ring"].open_ring_buffer(lambda *_: None)
    fns = ["empty"] + [f"rung{i}" for i in range(len(LADDER))]
    program_ns: dict = {}

    def kernel_timed(name, fds, run):
        def timed():
            took, per_run = program_time.timed_runs(fds(), run)
            program_ns.setdefault(name, []).append(per_run)
            return took
        return timed

    runs = {fn: kernel_timed(fn, lambda fn=fn: [program.load_func(fn.encode(),
                                                                  bcc.BPF.KPROBE).fd],
                             lambda fn=fn: uprobe_run(program, fn, runtime, loop, calls))
            for fn in fns}
    if traced is not None:
        runs["mmtrace"] = kernel_timed("mmtrace", traced_fds, traced) if traced_fds else traced
    try:
        with program_time.RunTimeStats():
            best = interleaved_best(loop, calls, repeat, runs)
    finally:
        program.cleanup()
    ns = {name: t / calls * 1e9 for name, t in best.items()}
    kernel_ns = {name: statistics.median(v) for name, v in program_ns.items()}
    empty = ns["empty"]
    rows, before, kernel_before = [], empty, kernel_ns["empty"]
    for i, what in enumerate(LADDER):
        here, kernel_here = ns[f"rung{i}"], kernel_ns[f"rung{i}"]
        rows.append({"piece": what, "ns": here, "step_ns": here - before,
                     "vs_empty": here / empty, "program_ns": kernel_here,
                     "program_step_ns": kernel_here - kernel_before})
        before, kernel_before = here, kernel_here
    out = {"empty_ns": empty, "empty_program_ns": kernel_ns["empty"], "rungs": rows}
    if "mmtrace" in ns:
        out["mmtrace_ns"] = ns["mmtrace"]
        out["mmtrace_vs_empty"] = ns["mmtrace"] / empty
        out["mmtrace_program_ns"] = kernel_ns.get("mmtrace")
    return out


def rows_of(p: dict) -> list[tuple]:
    rows = [("launch decoder piece by piece: empty bcc uprobe", f"{p['empty_ns']:.0f} ns/call",
             f"program {p['empty_program_ns']:.0f} ns/run")]
    for r in p["rungs"]:
        rows.append((f"  {r['piece']}", f"{r['ns']:.0f} ns/call",
                     f"{r['step_ns']:+.0f} ns; {r['vs_empty']:.3f}x empty; program "
                     f"{r['program_ns']:.0f} ns/run ({r['program_step_ns']:+.0f})"))
    if "mmtrace_ns" in p:
        kernel = p.get("mmtrace_program_ns")
        rows.append(("  mmtrace's decoder (bcc uprobe, no return probed)",
                     f"{p['mmtrace_ns']:.0f} ns/call", f"{p['mmtrace_vs_empty']:.3f}x empty" + (
                         f"; program {kernel:.0f} ns/run" if kernel else "")))
    return rows
