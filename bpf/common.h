/* Shared by every mmtrace eBPF program: event layouts, loss counters and
 * the scope filter. The Python decoders beside each program describe the same
 * layouts as numpy dtypes and check them against the compiled program at
 * load time, so a change here that is not mirrored there fails loudly. */
#include <uapi/linux/ptrace.h>

#ifndef MMTRACE_MAX_THREADS
#define MMTRACE_MAX_THREADS 65536
#endif
#ifndef MMTRACE_MAX_SCOPE
#define MMTRACE_MAX_SCOPE 4096
#endif

/* Counters of everything the kernel side could not do. Indices are part of
 * the layout: bpf/counters.py names them in the same order. */
enum mmtrace_counter {
    CNT_RINGBUF_FULL_CPU = 0,   /* runq event dropped: ring buffer full */
    CNT_ENQUEUE_MAP_FULL,       /* wake-up not stored: map full */
    CNT_THREAD_MAP_FULL,        /* thread -> process entry not stored */
    CNT_NEGATIVE_DELTA,         /* switch-in stamped before its wake-up: delay 0 */
    CNT_RUNQ_EVENTS,            /* runq events emitted (in scope) */
    CNT_RINGBUF_FULL_DEV,       /* device event dropped: ring buffer full */
    CNT_CALL_MAP_FULL,          /* call in flight not stored: map full */
    CNT_USER_READ_FAILED,       /* user memory could not be read */
    CNT_DEV_EVENTS,             /* device events emitted */
    CNT_RETURN_WITHOUT_ENTRY,   /* uretprobe whose entry was not seen */
    CNT_CALL_ABANDONED,         /* thread freed inside a timed call: no event */
    CNT_NAME_TRUNCATED,         /* op / kernel name longer than the event's field */
    CNT_OP_SEQ_MAP_FULL,        /* submission without op_id: process map full */
    CNT_SWITCH_IN_UNSEEN,       /* a waiting thread ran, but the kernel did not
                                 * report its switch-in: one runq event lost */
    MMTRACE_N_COUNTERS
};

BPF_PERCPU_ARRAY(counters, u64, MMTRACE_N_COUNTERS);

static __always_inline void count(u32 which)
{
    u64 *v = counters.lookup(&which);
    if (v)
        (*v)++;
}

struct settings {
    u32 configured;     /* 0 until userspace has set the scope: nothing is traced
                         * in the moment between attaching and configuring */
    u32 filter_pids;    /* 0: every process is in scope */
};
BPF_ARRAY(settings, struct settings, 1);

/* Processes in scope when filter_pids is set; threads are mapped to their
 * process through `threads` below. */
BPF_HASH(scope_tgids, u32, u8, MMTRACE_MAX_SCOPE);

/* Everything known about one thread, in one entry: a context switch costs
 * two lookups and in-place stores, not an insert and a delete per wake-up.
 * GPU/NPU probes stamp last_delay_ns onto each submission of the thread. */
struct thread_state {
    u64 enqueued_ns;    /* when it became runnable; 0: not waiting */
    u64 last_delay_ns;  /* its latest run-queue delay (in scope only) */
    u64 last_ts_ns;     /* when it got the CPU after that delay */
    u32 tgid;           /* its process; 0 until learnt */
    u32 reserved;
};
BPF_HASH(threads, u32, struct thread_state, MMTRACE_MAX_THREADS);

static __always_inline int tgid_in_scope(u32 tgid)
{
    u32 zero = 0;
    struct settings *s = settings.lookup(&zero);
    if (!s || !s->configured)
        return 0;
    if (!s->filter_pids)
        return 1;
    return tgid && scope_tgids.lookup(&tgid) != 0;
}
