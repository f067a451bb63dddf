/* Shared by every mmtrace eBPF program: event layouts, loss counters and
 * the scope filter. The Python decoders beside each program describe the same
 * layouts as numpy dtypes and check them against the compiled program at
 * load time, so a change here that is not mirrored there fails loudly. */
#include <uapi/linux/ptrace.h>

/* The maps every stream shares. The scheduler program is compiled on its
 * own first (its stream goes live at once) and exports them; the GPU/NPU
 * programs, compiled after it, use those very maps. Compiled as one unit,
 * they are plain maps. */
#if defined(MMTRACE_SHARED_EXTERN)
#define MMTRACE_SHARED_TABLE(_type, _key, _leaf, _name, _size) \
    BPF_TABLE("extern", _key, _leaf, _name, _size)
#elif defined(MMTRACE_SHARED_PUBLIC)
#define MMTRACE_SHARED_TABLE(_type, _key, _leaf, _name, _size) \
    BPF_TABLE_PUBLIC(_type, _key, _leaf, _name, _size)
#else
#define MMTRACE_SHARED_TABLE(_type, _key, _leaf, _name, _size) \
    BPF_TABLE(_type, _key, _leaf, _name, _size)
#endif

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
    CNT_EXITED_UNREAD,          /* a process (or program exec'd) exited before
                                 * discovery read its maps: what only it loaded
                                 * was not probed */
    CNT_FAILED_CALLS,           /* GPU/NPU calls that returned an error code */
    CNT_PROCESS_CHANGES_FULL,   /* a process change not kept: discovery reads all */
    MMTRACE_N_COUNTERS
};

MMTRACE_SHARED_TABLE("percpu_array", int, u64, counters, MMTRACE_N_COUNTERS);

static __always_inline void count(u32 which)
{
    u64 *v = counters.lookup(&which);
    if (v)
        (*v)++;
}

/* The consumer sleeps until a ring holds a batch worth waking for: each
 * CPU forces a wake-up at every WAKEUP_EVERY-th record it submits, so a
 * ring is at most about a quarter full when its reader is woken (userspace
 * sizes the period from the ring and the CPU count); at low rates the
 * reader drains on its own timer. Slot 0: run-queue ring, 1: device ring,
 * 2: the device names ring, 3: the launch ring. */
#ifndef MMTRACE_RUNQ_WAKEUP_EVERY
#define MMTRACE_RUNQ_WAKEUP_EVERY 1024
#endif
#ifndef MMTRACE_DEV_WAKEUP_EVERY
#define MMTRACE_DEV_WAKEUP_EVERY 256
#endif
#ifndef MMTRACE_DEV_NAMES_WAKEUP_EVERY
#define MMTRACE_DEV_NAMES_WAKEUP_EVERY 64
#endif
#ifndef MMTRACE_DEV_LAUNCH_WAKEUP_EVERY
#define MMTRACE_DEV_LAUNCH_WAKEUP_EVERY 512
#endif
BPF_PERCPU_ARRAY(ringbuf_submitted, u64, 4);

static __always_inline u64 ringbuf_wakeup_flag(u32 ring, u64 every)
{
    u64 *n = ringbuf_submitted.lookup(&ring);
    if (!n)
        return BPF_RB_NO_WAKEUP;
    *n += 1;
    return *n % every ? BPF_RB_NO_WAKEUP : BPF_RB_FORCE_WAKEUP;
}

struct settings {
    u32 configured;     /* 0 until userspace has set the scope: nothing is traced
                         * in the moment between attaching and configuring */
    u32 filter_pids;    /* 0: every process is in scope */
};
MMTRACE_SHARED_TABLE("array", int, struct settings, settings, 1);

/* Processes in scope when filter_pids is set; threads are mapped to their
 * process through `threads` below. */
MMTRACE_SHARED_TABLE("hash", u32, u8, scope_tgids, MMTRACE_MAX_SCOPE);

/* Everything known about one thread, in one entry: a context switch costs
 * two lookups and in-place stores, not an insert and a delete per wake-up.
 * GPU/NPU probes stamp last_delay_ns onto each submission of the thread. */
struct thread_state {
    u64 enqueued_ns;    /* when it became runnable; 0: not waiting */
    u64 last_delay_ns;  /* its latest run-queue delay (in scope only) */
    u64 last_ts_ns;     /* when it got the CPU after that delay */
    u64 slept_ns;       /* when it went off the CPU to sleep; 0: it did not */
    u32 tgid;           /* its process; 0 until learnt */
    u32 dev_flags;      /* THREAD_COMM_SENT: its comm is on the device names ring;
                         * THREAD_DEVICE_SET: `device` holds what it set */
    s32 device;         /* set by cudaSetDevice / aclrtSetDevice: here, not in a
                         * map of its own, so that a launch looks its thread up once */
    u32 reserved;
};
#define THREAD_COMM_SENT 1
#define THREAD_DEVICE_SET 2
MMTRACE_SHARED_TABLE("hash", u32, struct thread_state, threads, MMTRACE_MAX_THREADS);

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
