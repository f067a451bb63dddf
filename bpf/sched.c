/* CPU stream: run-queue delay per thread from the classic scheduler
 * tracepoints. Arguments are read through each tracepoint's format, never
 * through struct task_struct, so headers that do not match the running
 * kernel cannot corrupt it. Decoded by bpf/sched.py. */

#ifndef MMTRACE_RUNQ_RINGBUF_PAGES
#define MMTRACE_RUNQ_RINGBUF_PAGES 2048
#endif
#ifndef MMTRACE_MAX_CPUS
#define MMTRACE_MAX_CPUS 4096
#endif

struct runq_event {
    u64 ts_ns;          /* switch-in, CLOCK_MONOTONIC */
    u64 delay_ns;       /* wake-up (or preemption) to switch-in */
    u64 blocked_ns;     /* switch-out asleep to the wake-up that ended it (0:
                         * preempted, or asleep since before tracing began) */
    u32 pid;            /* process; 0 when the kernel has not learnt it */
    u32 tid;
    u32 cpu;
    u32 prev_tid;       /* the thread that gave up the CPU */
    char comm[16];
};

/* Checked against the numpy dtype at load time; never written. */
BPF_ARRAY(layout_runq_event, struct runq_event, 1);

/* The thread each CPU runs now (0: idle or not yet seen): a wake-up of a
 * running thread (woken before it got to sleep) starts no wait. */
BPF_ARRAY(cpu_current, u32, MMTRACE_MAX_CPUS);

/* log2 histogram of delays in microseconds, runqlat's buckets. */
BPF_PERCPU_ARRAY(runq_hist_log2_us, u64, 64);
/* The sum of those delays in ns: a Prometheus histogram carries its sum. */
BPF_PERCPU_ARRAY(runq_delay_sum_ns, u64, 1);
BPF_RINGBUF_OUTPUT(runq_events, MMTRACE_RUNQ_RINGBUF_PAGES);

/* Mark a thread runnable: in place when it has an entry, else a new one.
 * A thread already waiting keeps the stamp of when its wait began: the
 * kernel also reports a wake-up of a task still on the run queue (woken
 * while preempted on its way to sleep, or while its dequeue was delayed),
 * and that does not start a new wait. */
static __always_inline void runq_enqueue(u32 tid, u64 now, u32 tgid, u32 full_counter)
{
    if (tid == 0)
        return;
    struct thread_state *t = threads.lookup(&tid);
    if (t) {
        if (!t->enqueued_ns)
            t->enqueued_ns = now;
        if (!t->tgid)
            t->tgid = tgid;
        return;
    }
    struct thread_state fresh = { .enqueued_ns = now, .tgid = tgid };
    if (threads.update(&tid, &fresh) != 0)
        count(full_counter);
}

/* Defined first, so attached first (bcc attaches in definition order): a
 * wake-up seen before the switch program was attached would leave a wait
 * whose end no program saw, counted as a switch-in unseen. */
TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid;

    if (prev != 0) {
        /* prev is still current: the one moment its process id is known.
         * Preempted or yielding, it is still runnable and waits again; the
         * TASK_REPORT_MAX bit (0x100, "R+") marks preemption. */
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        struct thread_state *p = threads.lookup(&prev);
        int runnable = (args->prev_state & 0xff) == 0;
        if (p) {
            if (!p->tgid)
                p->tgid = tgid;
            /* Marked waiting, yet it was running: the kernel now and then
             * drops a sched_switch (for every program, not only ours). */
            if (p->enqueued_ns)
                count(CNT_SWITCH_IN_UNSEEN);
            p->enqueued_ns = runnable ? now : 0;
            /* Asleep from now until a wake-up: the blocked part of its
             * time, carried by the record of its next switch-in. */
            p->slept_ns = runnable ? 0 : now;
        } else {
            runq_enqueue(prev, runnable ? now : 0, tgid, CNT_THREAD_MAP_FULL);
            if (!runnable) {
                struct thread_state *fresh = threads.lookup(&prev);
                if (fresh)
                    fresh->slept_ns = now;
            }
        }
    }

    u32 next = args->next_pid;
    u32 cpu = bpf_get_smp_processor_id();
    u32 *current = cpu_current.lookup(&cpu);
    if (current)
        *current = next;
    if (next == 0)
        return 0;
    struct thread_state *n = threads.lookup(&next);
    if (!n || !n->enqueued_ns)
        return 0;       /* woken before tracing began */
    u64 start = n->enqueued_ns;
    u64 slept = n->slept_ns;
    n->enqueued_ns = 0;
    n->slept_ns = 0;
    /* The waker stamps the wake-up after the task is already runnable, so
     * another CPU can switch it in a moment before that stamp: it waited
     * no time at all. */
    u64 delay = 0;
    if (now >= start)
        delay = now - start;
    else
        count(CNT_NEGATIVE_DELTA);

    u32 tgid = n->tgid;
    if (!tgid_in_scope(tgid))
        return 0;
    n->last_delay_ns = delay;
    n->last_ts_ns = now;

    u32 slot = bpf_log2l(delay / 1000);
    if (slot > 0)
        slot--;         /* bpf_log2l(0) == bpf_log2l(1) == 1 */
    if (slot > 63)
        slot = 63;
    u64 *bucket = runq_hist_log2_us.lookup(&slot);
    if (bucket)
        (*bucket)++;
    u32 zero = 0;
    u64 *sum = runq_delay_sum_ns.lookup(&zero);
    if (sum)
        *sum += delay;

    struct runq_event *ev = runq_events.ringbuf_reserve(sizeof(*ev));
    if (!ev) {
        count(CNT_RINGBUF_FULL_CPU);
        return 0;
    }
    ev->ts_ns = now;
    ev->delay_ns = delay;
    ev->blocked_ns = slept && start > slept ? start - slept : 0;
    ev->pid = tgid;
    ev->tid = next;
    ev->cpu = cpu;
    ev->prev_tid = prev;
    __builtin_memcpy(ev->comm, args->next_comm, sizeof(ev->comm));   /* ctx memory */
    /* No wake-up per event: one per batch (common.h). */
    runq_events.ringbuf_submit(ev, ringbuf_wakeup_flag(0, MMTRACE_RUNQ_WAKEUP_EVERY));
    count(CNT_RUNQ_EVENTS);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    u32 cpu = args->target_cpu;
    u32 *running = cpu_current.lookup(&cpu);
    if (running && *running == args->pid)
        return 0;
    runq_enqueue(args->pid, bpf_ktime_get_ns(), 0, CNT_ENQUEUE_MAP_FULL);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    runq_enqueue(args->pid, bpf_ktime_get_ns(), 0, CNT_ENQUEUE_MAP_FULL);
    return 0;
}

/* New threads join their creator's process; new processes are their own. */
TRACEPOINT_PROBE(task, task_newtask)
{
    u32 tid = args->pid;
    u32 tgid = tid;
    if (args->clone_flags & 0x00010000 /* CLONE_THREAD */)
        tgid = bpf_get_current_pid_tgid() >> 32;
    struct thread_state *t = threads.lookup(&tid);
    if (t) {
        t->tgid = tgid;
        return 0;
    }
    struct thread_state fresh = { .tgid = tgid };
    if (threads.update(&tid, &fresh) != 0)
        count(CNT_THREAD_MAP_FULL);
    return 0;
}

/* Freed tasks never run again: drop their entries so maps stay bounded. */
TRACEPOINT_PROBE(sched, sched_process_free)
{
    u32 tid = args->pid;
    threads.delete(&tid);
#ifdef MMTRACE_DEVICE_IN_UNIT
    device_forget_thread(tid);      /* bpf/device.h; compiled apart, it has its own hook */
#endif
    return 0;
}
