/* GPU and NPU streams: the event layouts both share, calls in flight
 * between a uprobe and its uretprobe, the per-process submission sequence
 * and the per-thread device. Compiled after common.h and before sched.c (its
 * sched_process_free forgets a freed thread's calls here); decoded by
 * bpf/device.py. API ids (API_*) and call slots (SLOT_*) are generated from
 * the tables in bpf/cuda.py and bpf/ascend.py. Compiled either with sched.c
 * (MMTRACE_DEVICE_IN_UNIT) or on its own after it, on the maps it exports. */

/* Three rings (sizes: agent/kernel/probes.py ProbeOptions): dev_launches
 * carries the CUDA kernel launches whose return is not probed, each in one
 * cache line (struct dev_launch, 64 bytes); dev_events the other per-call
 * records (struct dev_event, 144 bytes); dev_names the rare ones that
 * carry strings (struct dev_named_event: a kernel handle's name, an aclop
 * opType, and a thread's comm, once per thread). */
#ifndef MMTRACE_DEV_RINGBUF_PAGES
#define MMTRACE_DEV_RINGBUF_PAGES 2048
#endif
#ifndef MMTRACE_DEV_LAUNCH_RINGBUF_PAGES
#define MMTRACE_DEV_LAUNCH_RINGBUF_PAGES 1024
#endif
#ifndef MMTRACE_DEV_NAMES_RINGBUF_PAGES
#define MMTRACE_DEV_NAMES_RINGBUF_PAGES 256
#endif
#ifndef MMTRACE_MAX_CALLS
#define MMTRACE_MAX_CALLS 16384
#endif
#ifndef MMTRACE_MAX_PROCESSES
#define MMTRACE_MAX_PROCESSES 32768
#endif
#ifndef MMTRACE_CALL_SLOTS
#define MMTRACE_CALL_SLOTS 1
#endif
#define MMTRACE_NAME_LEN 64

enum dev_kind {
    DEV_LAUNCH = 1,
    DEV_GRAPH_LAUNCH,
    DEV_MEMCPY,
    DEV_SYNC,
    DEV_MODEL_EXEC,
    DEV_EVENT_RECORD,   /* cudaEventRecord: where a later event sync points */
    DEV_FUNCTION_NAME,  /* a kernel handle's name, or the handle it stands for */
    DEV_THREAD,         /* a thread's comm (dev_names only): sent before the
                         * thread's first call, again after exec or a rename;
                         * userspace fills each event's comm from it */
};

enum dev_flag {
    DEV_RETURNED = 1,       /* duration_ns and ret are measured */
    DEV_NAME_TRUNCATED = 2, /* name is a prefix of a longer string */
    DEV_READ_FAILED = 4,    /* an argument in user memory could not be read */
};

#define DEV_NO_DIRECTION 0xff
#define DEV_NO_DEVICE (-1)

/* What every device record carries. Per-call facts only: the strings that
 * belong to a thread (comm) or to a handle (its name) go once on dev_names.
 * The fields are those of the recorded layout (bpf/device.py DEV_EVENT) in
 * its order, name_addr and alias aside, so that userspace widens a batch
 * with two block copies. */
#define DEV_EVENT_FIELDS \
    u64 ts_ns;              /* call entry, CLOCK_MONOTONIC */ \
    u64 duration_ns;        /* entry to return, when DEV_RETURNED */ \
    u64 sched_delay_ns;     /* the thread's latest run-queue delay before the call */ \
    u64 op_id;              /* per-process submission sequence from 1; 0 = none */ \
    u64 handle;             /* function / CUfunction / graph exec / event / op handle */ \
    u64 stream_handle; \
    u64 bytes; \
    u64 shared_mem_bytes; \
    u64 probe_ip;           /* address probed (aclnn: the op, when no cookie) */ \
    u64 return_ip;          /* launches: the caller's return address, [rsp] */ \
    u64 outer_return_ip;    /* and its caller's, [rbp + 8] where rbp is a frame */ \
    u32 grid_x, grid_y, grid_z;     /* flat, not arrays: recordings keep */ \
    u32 block_x, block_y, block_z;  /* scalar fields only */ \
    u32 pid; \
    u32 tid; \
    s32 device;             /* DEV_NO_DEVICE when the thread never set one */ \
    s32 ret;                /* return code, when DEV_RETURNED */ \
    u32 symbol_id;          /* the attach cookie: which aclnn op; 0 = none */ \
    u16 api;                /* API_* id */ \
    u8 kind;                /* enum dev_kind */ \
    u8 direction;           /* raw memcpy kind of the API; DEV_NO_DIRECTION */ \
    u8 flags;               /* enum dev_flag */ \
    u8 reserved[7];

/* A kernel launch, copy, sync, ...: the hot path's record (dev_events). */
struct dev_event {
    DEV_EVENT_FIELDS
};

/* The same, with what only names carry (dev_names; calls in flight). A
 * struct dev_event * may point at one: the fields above come first. */
struct dev_named_event {
    DEV_EVENT_FIELDS
    u64 name_addr;          /* user address of `name`: read in userspace when the
                             * kernel could not (a page not yet faulted in) */
    u64 alias;              /* DEV_FUNCTION_NAME: what `handle` stands for (the
                             * host function of a cudaKernel_t, the CUkernel of a
                             * CUfunction) */
    char comm[16];
    char name[MMTRACE_NAME_LEN];    /* opType, kernel name: NUL-terminated */
};

#define DEV(ev) ((struct dev_event *)(ev))
#define NAMED(ev) ((struct dev_named_event *)(ev))

/* A kernel launch in one cache line: the hot path's record. What a launch
 * shares with its thread (pid, comm) or its call site (the outer caller)
 * userspace knows from earlier records (agent/kernel/launch_records.py widens
 * it into DEV_EVENT); what is always narrow here is narrowed. A launch
 * whose facts do not fit goes on dev_events whole (launch_compact). No
 * padding: every byte is written. */
struct dev_launch {
    u64 ts_ns;
    u64 handle;
    u64 stream_handle;
    u64 return_ip;
    u32 tid;
    u32 op_id;              /* the low half: userspace carries the high one per process */
    u32 sched_delay_ns;
    u32 shared_mem_bytes;
    u32 grid_x;
    u16 grid_y, grid_z;     /* CUDA caps these at 65535 */
    u16 block_x, block_y;   /* and a block at 1024 threads */
    u8 block_z;
    u8 device;              /* an s8 (bcc's tables know no signed char): -1 none */
    u16 api;
};

/* Checked against the numpy dtypes at load time; never written. */
BPF_ARRAY(layout_dev_event, struct dev_event, 1);
BPF_ARRAY(layout_dev_named_event, struct dev_named_event, 1);
BPF_ARRAY(layout_dev_launch, struct dev_launch, 1);

BPF_RINGBUF_OUTPUT(dev_events, MMTRACE_DEV_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(dev_launches, MMTRACE_DEV_LAUNCH_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(dev_names, MMTRACE_DEV_NAMES_RINGBUF_PAGES);

/* A call between its uprobe and its uretprobe: the event built at entry.
 * Keyed by thread and call slot, so that a runtime call and the driver call
 * it makes (cudaStreamSynchronize -> cuStreamSynchronize) do not collide. */
BPF_HASH(calls_in_flight, u64, struct dev_named_event, MMTRACE_MAX_CALLS);
BPF_PERCPU_ARRAY(call_scratch, struct dev_named_event, 1);

/* process -> last op_id handed out */
BPF_HASH(op_seq, u32, u64, MMTRACE_MAX_PROCESSES);

/* Where a process's files are loaded, taken at its first submission: the
 * user stack twice, as addresses and as (build id, file offset) pairs. A
 * frame that has both gives the load bias of its file, so that addresses
 * of the process (kernel host functions, callers) are named from the file
 * on disk after the process has exited. The kernel unwinds frame pointers;
 * at a uprobe on a function's entry it adds the caller's return address. */
#define MMTRACE_LOAD_FRAMES 8
#ifndef MMTRACE_MAX_PROCESS_FILES
#define MMTRACE_MAX_PROCESS_FILES 4096
#endif
#define MMTRACE_EXE_PATH_LEN 256

struct load_frames {
    u64 ips[MMTRACE_LOAD_FRAMES];
    struct bpf_stack_build_id ids[MMTRACE_LOAD_FRAMES];
    s64 ips_bytes;          /* bpf_get_stack's results: bytes, or -errno */
    s64 ids_bytes;
};

BPF_TABLE("lru_hash", u32, struct load_frames, load_frames, MMTRACE_MAX_PROCESS_FILES);
BPF_PERCPU_ARRAY(load_frames_scratch, struct load_frames, 1);

/* The executable each process ran, as execve named it: the file the build
 * ids of its frames are looked up in once the process is gone. */
struct exe_path {
    char path[MMTRACE_EXE_PATH_LEN];
};
BPF_TABLE("lru_hash", u32, struct exe_path, exe_paths, MMTRACE_MAX_PROCESS_FILES);
BPF_PERCPU_ARRAY(exe_path_scratch, struct exe_path, 1);

static __always_inline void capture_load_frames(struct pt_regs *ctx, u32 tgid)
{
    u32 zero = 0;
    struct load_frames *f = load_frames_scratch.lookup(&zero);
    if (!f)
        return;
    __builtin_memset(f, 0, sizeof(*f));
    f->ips_bytes = bpf_get_stack(ctx, f->ips, sizeof(f->ips), BPF_F_USER_STACK);
    f->ids_bytes = bpf_get_stack(ctx, f->ids, sizeof(f->ids),
                                 BPF_F_USER_STACK | BPF_F_USER_BUILD_ID);
    load_frames.update(&tgid, f);
}

/* The processes discovery has read (their /proc/PID/maps), marked by the
 * agent as it reads them. One that exits unmarked lived less than a scan:
 * a library only it loaded was not probed, and the kernel is the one place
 * that sees it go. A new task or a new program is unread again (fork and
 * exec drop the mark). Counted only while discovery runs (unread_exits_on). */
#ifndef MMTRACE_MAX_PROCESSES_READ
#define MMTRACE_MAX_PROCESSES_READ 16384
#endif
BPF_TABLE("lru_hash", u32, u8, processes_read, MMTRACE_MAX_PROCESSES_READ);
BPF_ARRAY(unread_exits_on, u32, 1);

/* The processes whose mapped files may have changed since discovery last
 * looked: an exec, a new process, a file mapped executable (a dlopen), an
 * exit. One entry per process and reason (CHANGE_*) until the agent takes
 * them all; discovery then reads /proc for those processes alone,
 * whatever the number running. Kept only while discovery follows them
 * (process_changes_on). Full: counted, and the agent goes back to reading
 * /proc in rounds. */
#ifndef MMTRACE_MAX_PROCESS_CHANGES
#define MMTRACE_MAX_PROCESS_CHANGES 16384
#endif
enum process_change {
    CHANGE_EXEC = 1,
    CHANGE_FORK = 2,
    CHANGE_MAPPED = 4,
    CHANGE_EXIT = 8,            /* the process's last thread */
    CHANGE_LEADER_EXIT = 16,    /* its first thread (kernels without group_dead) */
};
/* Keyed by (process << 8 | reason): a note is inserted whole, never
 * or-ed into an entry the agent may be taking at that moment. */
BPF_HASH(process_changes, u64, u8, MMTRACE_MAX_PROCESS_CHANGES);
BPF_ARRAY(process_changes_on, u32, 1);

static __always_inline void note_change(u32 tgid, u32 change)
{
    u32 zero = 0;
    u32 *on = process_changes_on.lookup(&zero);
    if (!on || !*on || !tgid_in_scope(tgid))
        return;
    u64 key = ((u64)tgid << 8) | change;
    u8 one = 1;
    int err = process_changes.insert(&key, &one);
    if (err != 0 && err != -17 /* EEXIST: noted already */)
        count(CNT_PROCESS_CHANGES_FULL);
}

/* A thread's comm is sent again after it changes: exec names it after the
 * new program, prctl(PR_SET_NAME) and /proc/.../comm rename it. */
static __always_inline void comm_changed(u32 tid)
{
    struct thread_state *t = threads.lookup(&tid);
    if (t)
        t->dev_flags &= ~THREAD_COMM_SENT;
}

#ifdef MMTRACE_TASK_RENAME
TRACEPOINT_PROBE(task, task_rename)
{
#ifdef MMTRACE_TASK_RENAME_PID
    comm_changed(args->pid);
#else
    comm_changed((u32)bpf_get_current_pid_tgid());   /* kernels whose format has no pid */
#endif
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    comm_changed((u32)id);
    if (!tgid_in_scope(tgid))
        return 0;
    note_change(tgid, CHANGE_EXEC);
    u32 zero = 0;
    struct exe_path *p = exe_path_scratch.lookup(&zero);
    if (!p)
        return 0;
    __builtin_memset(p, 0, sizeof(*p));
    TP_DATA_LOC_READ_STR(p->path, filename, sizeof(p->path));
    exe_paths.update(&tgid, p);
    processes_read.delete(&tgid);   /* a new program: not read yet */
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 child = args->child_pid;
    processes_read.delete(&child);
    /* A thread joins its creator (task_newtask filled threads before this
     * tracepoint); a process holds its parent's files. */
    struct thread_state *t = threads.lookup(&child);
    if (!t || t->tgid == child)
        note_change(child, CHANGE_FORK);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, zero = 0;
#ifdef MMTRACE_EXIT_GROUP_DEAD
    if (args->group_dead)           /* the last thread: the process is gone */
        note_change(tgid, CHANGE_EXIT);
#else
    if ((u32)id == tgid)            /* no group_dead here: its threads may live on */
        note_change(tgid, CHANGE_LEADER_EXIT);
#endif
    u32 *on = unread_exits_on.lookup(&zero);
    if (!on || !*on || (u32)id != tgid || !tgid_in_scope(tgid))
        return 0;               /* off, or a thread other than the leader */
    if (processes_read.delete(&tgid) != 0)
        count(CNT_EXITED_UNREAD);
    return 0;
}

/* mmap(2), as the syscall tracepoints lay out every call: the common
 * header, the syscall number, then each argument (or the return value) in
 * 8 bytes. Read by offset, not through a generated struct: a kernel
 * without syscall tracepoints fails these attaches alone (the agent then
 * rescans /proc). A file mapped executable is noted at the call's return,
 * once the mapping is there to be read: noted at entry, a scan between
 * the two would take the note and miss the mapping. */
struct mmap_enter_args {
    u64 common;
    s32 syscall_nr;
    u32 pad;
    u64 addr, len, prot, flags, fd, off;
};

struct syscall_exit_args {
    u64 common;
    s32 syscall_nr;
    u32 pad;
    s64 ret;
};

BPF_HASH(mapping_executable, u32, u8, MMTRACE_MAX_THREADS);    /* tid, between the two */

int process_mapping(struct mmap_enter_args *args)
{
    if (!(args->prot & 0x4 /* PROT_EXEC */) || (s64)args->fd < 0)
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    u8 yes = 1;
    mapping_executable.update(&tid, &yes);
    return 0;
}

int process_mapped(struct syscall_exit_args *args)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id;
    if (mapping_executable.delete(&tid) != 0)
        return 0;               /* not a file mapped executable */
    if (args->ret < 0 && args->ret > -4096)
        return 0;               /* the call failed: nothing mapped */
    note_change(id >> 32, CHANGE_MAPPED);
    return 0;
}

static __always_inline u64 call_key(u32 tid, u32 slot)
{
    return ((u64)tid << 8) | slot;
}

static __always_inline u64 next_op_id(struct pt_regs *ctx, u32 tgid)
{
    u64 *seq = op_seq.lookup(&tgid);
    if (!seq) {
        u64 zero = 0;
        op_seq.insert(&tgid, &zero);
        seq = op_seq.lookup(&tgid);
        if (!seq) {
            count(CNT_OP_SEQ_MAP_FULL);
            return 0;
        }
        capture_load_frames(ctx, tgid);
    }
    return __sync_fetch_and_add(seq, 1) + 1;
}

/* What every event starts with: zeros, and who made it when. */
static __always_inline void dev_fill(struct dev_event *ev, u32 tgid, u32 tid, u64 now,
                                     u16 api, u8 kind)
{
    __builtin_memset(ev, 0, sizeof(*ev));
    ev->ts_ns = now;
    ev->pid = tgid;
    ev->tid = tid;
    ev->api = api;
    ev->kind = kind;
    ev->direction = DEV_NO_DIRECTION;
    ev->device = DEV_NO_DEVICE;
}

/* What a named event carries beyond dev_fill's: zeroed, and the comm
 * (its record is rare: it carries its own). */
static __always_inline void named_begin(struct dev_named_event *ev)
{
    ev->name_addr = 0;
    ev->alias = 0;
    __builtin_memset(ev->name, 0, sizeof(ev->name));
    bpf_get_current_comm(&ev->comm, sizeof(ev->comm));
}

/* A thread's comm on dev_names (a DEV_THREAD record); 1 when sent. */
static __always_inline int send_thread(u32 tgid, u32 tid, u64 now)
{
    struct dev_named_event *ev = dev_names.ringbuf_reserve(sizeof(struct dev_named_event));
    if (!ev)
        return 0;
    dev_fill(DEV(ev), tgid, tid, now, 0, DEV_THREAD);
    named_begin(ev);
    dev_names.ringbuf_submit(ev, ringbuf_wakeup_flag(2, MMTRACE_DEV_NAMES_WAKEUP_EVERY));
    return 1;
}

/* Who makes a call, when, and what their thread says about it. */
struct call_facts {
    u64 ts_ns;
    u64 sched_delay_ns;
    u64 op_id;
    u32 tgid;
    u32 tid;
    s32 device;
    u32 comm_sent;          /* userspace has the thread's comm and process */
};

/* Callers have checked the scope already, so that out-of-scope calls cost
 * one lookup. The thread's comm goes on dev_names before its first event
 * (and after each change), not in every event; a thread the scheduler
 * program has no entry for yet gets one (not waiting, its process known)
 * that says it was sent. Where the comm could not be sent (dev_names full)
 * it is sent with the next event; userspace reads /proc/TID/comm for the
 * events in between. */
static __always_inline void call_facts(struct pt_regs *ctx, struct call_facts *f, u8 kind)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    f->ts_ns = bpf_ktime_get_ns();
    f->sched_delay_ns = 0;
    f->op_id = 0;
    f->tgid = tgid;
    f->tid = tid;
    f->device = DEV_NO_DEVICE;
    f->comm_sent = 1;
    struct thread_state *t = threads.lookup(&tid);
    if (t) {
        f->sched_delay_ns = t->last_delay_ns;
        if (t->dev_flags & THREAD_DEVICE_SET)
            f->device = t->device;
        if (!(t->dev_flags & THREAD_COMM_SENT)) {
            if (send_thread(tgid, tid, f->ts_ns))
                t->dev_flags |= THREAD_COMM_SENT;
            else
                f->comm_sent = 0;
        }
    } else if (send_thread(tgid, tid, f->ts_ns)) {
        struct thread_state fresh = { .tgid = tgid, .dev_flags = THREAD_COMM_SENT };
        threads.insert(&tid, &fresh);
    } else {
        f->comm_sent = 0;
    }
    if (kind == DEV_LAUNCH || kind == DEV_GRAPH_LAUNCH || kind == DEV_MEMCPY ||
        kind == DEV_MODEL_EXEC)
        f->op_id = next_op_id(ctx, tgid);
}

/* Zero the event and fill what every event carries. */
static __always_inline void facts_fill(struct dev_event *ev, const struct call_facts *f,
                                       u16 api, u8 kind)
{
    dev_fill(ev, f->tgid, f->tid, f->ts_ns, api, kind);
    ev->sched_delay_ns = f->sched_delay_ns;
    ev->device = f->device;
    ev->op_id = f->op_id;
}

static __always_inline void dev_begin(struct pt_regs *ctx, struct dev_event *ev, u16 api,
                                      u8 kind)
{
    struct call_facts f;
    call_facts(ctx, &f, kind);
    facts_fill(ev, &f, api, kind);
}

static __always_inline int in_scope(void)
{
    return tgid_in_scope(bpf_get_current_pid_tgid() >> 32);
}

/* Read `size` bytes of user memory; on failure zero them and flag it. */
static __always_inline void read_user_flagged(u8 *flags, void *dst, u32 size, const void *src)
{
    if (bpf_probe_read_user(dst, size, src) != 0) {
        __builtin_memset(dst, 0, size);
        *flags |= DEV_READ_FAILED;
        count(CNT_USER_READ_FAILED);
    }
}

static __always_inline void read_user(struct dev_event *ev, void *dst, u32 size,
                                      const void *src)
{
    read_user_flagged(&ev->flags, dst, size, src);
}

/* The string at `src` into ev->name, truncation flagged and counted. */
static __always_inline void read_name(struct dev_named_event *ev, const char *src)
{
    if (!src)
        return;
    ev->name_addr = (u64)src;
    long n = bpf_probe_read_user_str(ev->name, sizeof(ev->name), src);
    if (n < 0) {
        ev->name[0] = 0;
        ev->flags |= DEV_READ_FAILED;
        count(CNT_USER_READ_FAILED);
        return;
    }
    if (n == sizeof(ev->name)) {
        /* Filled to the brim: longer than the field unless its last
         * character was the string's last. */
        char next = 0;
        bpf_probe_read_user(&next, 1, src + sizeof(ev->name) - 1);
        if (next) {
            ev->flags |= DEV_NAME_TRUNCATED;
            count(CNT_NAME_TRUNCATED);
        }
    }
}

/* A per-launch call whose return is not probed builds its event in the
 * ring buffer itself: dev_events, or dev_names for one that carries a name. */
static __always_inline struct dev_event *dev_reserve(void)
{
    struct dev_event *ev = dev_events.ringbuf_reserve(sizeof(struct dev_event));
    if (!ev)
        count(CNT_RINGBUF_FULL_DEV);
    return ev;
}

static __always_inline struct dev_named_event *dev_reserve_named(void)
{
    struct dev_named_event *ev = dev_names.ringbuf_reserve(sizeof(struct dev_named_event));
    if (!ev)
        count(CNT_RINGBUF_FULL_DEV);
    return ev;
}

static __always_inline void dev_submit(struct dev_event *ev)
{
    /* No wake-up per event: one per batch (common.h). */
    dev_events.ringbuf_submit(ev, ringbuf_wakeup_flag(1, MMTRACE_DEV_WAKEUP_EVERY));
    count(CNT_DEV_EVENTS);
}

static __always_inline void dev_submit_named(struct dev_named_event *ev)
{
    dev_names.ringbuf_submit(ev, ringbuf_wakeup_flag(2, MMTRACE_DEV_NAMES_WAKEUP_EVERY));
    count(CNT_DEV_EVENTS);
}

/* The per-CPU scratch event for calls timed by a uretprobe. */
static __always_inline struct dev_named_event *call_begin(void)
{
    u32 zero = 0;
    return call_scratch.lookup(&zero);
}

/* `ev`: a call_begin() event. */
static __always_inline void call_store(struct dev_event *ev, u32 slot)
{
    u64 key = call_key(ev->tid, slot);
    if (calls_in_flight.update(&key, NAMED(ev)) != 0)
        count(CNT_CALL_MAP_FULL);
}

/* At a return: the entry of this thread's call in `slot`. NULL when the
 * caller is out of scope, or (counted) when the entry was not seen:
 * attached mid-call, or dropped. */
static __always_inline struct dev_named_event *call_lookup(u64 *key, u32 slot)
{
    if (!in_scope())
        return NULL;
    *key = call_key((u32)bpf_get_current_pid_tgid(), slot);
    struct dev_named_event *ev = calls_in_flight.lookup(key);
    if (!ev)
        count(CNT_RETURN_WITHOUT_ENTRY);
    return ev;
}

/* A call timed by a uretprobe starts its event in per-CPU scratch (a named
 * event: whether it carries a name is known at its return), kept with
 * call_store() until its return; NULL when the caller is out of scope.
 * Per-launch calls start theirs with launch_event() below. */
static __always_inline struct dev_event *call_event(struct pt_regs *ctx, u16 api, u8 kind)
{
    if (!in_scope())
        return NULL;
    struct dev_named_event *ev = call_begin();
    if (ev) {
        dev_begin(ctx, DEV(ev), api, kind);
        named_begin(ev);
    }
    return DEV(ev);
}

/* process -> until when (ns) every per-launch call of theirs has its return
 * probed: a return code other than 0 moves it a second on; 0 once the
 * process has made its first such call (which is probed too). */
#define MMTRACE_FAILING_NS 1000000000ULL
BPF_TABLE("lru_hash", u32, u64, failing_until, MMTRACE_MAX_PROCESSES);

static __always_inline void note_return_code(struct dev_event *ev)
{
    if (ev->ret == 0)
        return;
    u32 tgid = ev->pid;
    u64 until = ev->ts_ns + ev->duration_ns + MMTRACE_FAILING_NS;
    failing_until.update(&tgid, &until);
    count(CNT_FAILED_CALLS);
}

/* A stored call carries a name (a kernel handle's, an opType): its record
 * goes on dev_names whole, else on dev_events without the named part. */
static __always_inline int carries_name(struct dev_named_event *entry)
{
    return entry->kind == DEV_FUNCTION_NAME || entry->name_addr != 0;
}

static __always_inline void returned_fill(struct pt_regs *ctx, struct dev_event *ev)
{
    ev->duration_ns = bpf_ktime_get_ns() - ev->ts_ns;
    ev->ret = (s32)PT_REGS_RC(ctx);
    ev->flags |= DEV_RETURNED;
    note_return_code(ev);
}

/* The ring-buffer copy of a stored call, with its duration and return code
 * filled in; NULL when the ring is full. The caller submits it. */
static __always_inline struct dev_event *returned_event(struct pt_regs *ctx,
                                                        struct dev_named_event *entry)
{
    struct dev_event *ev = dev_reserve();
    if (ev) {
        __builtin_memcpy(ev, entry, sizeof(*ev));
        returned_fill(ctx, ev);
    }
    return ev;
}

static __always_inline struct dev_named_event *returned_named(struct pt_regs *ctx,
                                                              struct dev_named_event *entry)
{
    struct dev_named_event *ev = dev_reserve_named();
    if (ev) {
        __builtin_memcpy(ev, entry, sizeof(*ev));
        returned_fill(ctx, DEV(ev));
    }
    return ev;
}

/* Per-launch calls (kernel launches, operator submissions) are the hot
 * path: a return probe costs a second trap (about 0.4 us here). With
 * uprobe sessions (Linux 6.13+, MMTRACE_LAUNCH_SESSIONS) the entry program
 * chooses call by call whether the return runs: one call in
 * MMTRACE_RETURN_EVERY on each CPU, a process's first, and every call of a
 * process whose calls failed in the last second, so that a storm of
 * failures is counted whole and pays for the return only while it lasts. A
 * call not chosen is sent at entry, its return unknown (no DEV_RETURNED). */
#ifndef MMTRACE_RETURN_EVERY
#define MMTRACE_RETURN_EVERY 64
#endif
BPF_PERCPU_ARRAY(return_sampler, u64, 1);

static __always_inline int launch_return_wanted(void)
{
#ifdef MMTRACE_LAUNCH_SESSIONS
    u32 zero = 0;
    u64 *n = return_sampler.lookup(&zero);
    if (n && (*n)++ % MMTRACE_RETURN_EVERY == 0)
        return 1;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 *until = failing_until.lookup(&tgid);
    if (!until) {
        u64 none = 0;
        failing_until.update(&tgid, &none);
        return 1;
    }
    return *until > bpf_ktime_get_ns();
#else
    return 0;
#endif
}

/* A per-launch call's event, NULL when out of scope or no room: in per-CPU
 * scratch when its return is probed (*timed), else in the ring (dev_names
 * for a call that carries a name: `named`, a constant per decoder). */
static __always_inline struct dev_event *launch_event(struct pt_regs *ctx, u16 api, u8 kind,
                                                      int *timed, int named)
{
    if (!in_scope())
        return NULL;
    *timed = launch_return_wanted();
    struct dev_event *ev;
    if (*timed)
        ev = DEV(call_begin());
    else if (named)
        ev = DEV(dev_reserve_named());
    else
        ev = dev_reserve();
    if (ev) {
        dev_begin(ctx, ev, api, kind);
        if (named)
            named_begin(NAMED(ev));
        else if (*timed)
            NAMED(ev)->name_addr = 0;   /* scratch: carries no name (carries_name) */
    }
    return ev;
}

/* Send a per-launch call's event, or keep it for its return; the result
 * is the session program's: 0 runs it again at the return, 1 does not.
 * The return address ([rsp]) tells the return from a later entry
 * (session_return). */
static __always_inline int launch_done(struct pt_regs *ctx, struct dev_event *ev, u32 slot,
                                       int timed, int named)
{
    if (!timed) {
        if (named)
            dev_submit_named(NAMED(ev));
        else
            dev_submit(ev);
        return 1;
    }
    if (!ev->return_ip)
        read_user(ev, &ev->return_ip, sizeof(ev->return_ip), (void *)PT_REGS_SP(ctx));
    call_store(ev, slot);
    return 0;
}

/* In a session program: whether this run is the return of the call its
 * entry kept in `slot`, which returns to the address the entry read at
 * [rsp]; else it is an entry (a kept call whose return was lost, by a
 * longjmp or an exception, is replaced by the next one kept). */
static __always_inline int session_return(struct pt_regs *ctx, u32 slot)
{
    u64 key = call_key((u32)bpf_get_current_pid_tgid(), slot);
    struct dev_named_event *ev = calls_in_flight.lookup(&key);
    return ev && ev->return_ip == PT_REGS_IP(ctx);
}


/* What a kernel launch decoder reads from its registers and stack, before
 * launch_send() chooses its record. */
struct launch_args {
    u64 handle;
    u64 stream_handle;
    u64 shared_mem_bytes;
    u64 return_ip;
    u32 grid[3];
    u32 block[3];
    u8 flags;               /* DEV_READ_FAILED */
    u8 outer;               /* a runtime launch: its outer caller names opaque handles */
};

/* The call sites whose outer caller userspace has (it came in a whole
 * record): (process, handle, return address), direct-mapped per CPU. A hit
 * spares the launch the read of [rbp + 8] and lets it go in one line; a
 * miss reads it and sends the launch whole. Userspace fills the outer
 * caller of a compact launch from the whole record of its call site. */
#define MMTRACE_CALL_SITES 256
struct call_site {
    u64 handle;
    u64 return_ip;
    u64 tgid;
};
BPF_PERCPU_ARRAY(call_sites, struct call_site, MMTRACE_CALL_SITES);

static __always_inline struct call_site *call_site_of(u32 tgid, const struct launch_args *a)
{
    u32 i = (u32)(a->handle ^ (a->handle >> 12) ^ a->return_ip ^ tgid) & (MMTRACE_CALL_SITES - 1);
    return call_sites.lookup(&i);
}

static __always_inline int call_site_known(struct call_site *site, u32 tgid,
                                           const struct launch_args *a)
{
    return site && site->handle == a->handle && site->return_ip == a->return_ip &&
           site->tgid == tgid;
}

/* Grid and block into either record (struct dev_event, struct dev_launch). */
#define SET_SHAPE(rec, a) do { \
    (rec)->grid_x = (a)->grid[0]; (rec)->grid_y = (a)->grid[1]; (rec)->grid_z = (a)->grid[2]; \
    (rec)->block_x = (a)->block[0]; (rec)->block_y = (a)->block[1]; \
    (rec)->block_z = (a)->block[2]; \
} while (0)

/* Whether every fact of the launch fits struct dev_launch. */
static __always_inline int launch_fits(const struct launch_args *a, const struct call_facts *f)
{
    return !a->flags && f->comm_sent && f->op_id != 0 && (f->sched_delay_ns >> 32) == 0 &&
           (a->shared_mem_bytes >> 32) == 0 && a->grid[1] <= 0xffff && a->grid[2] <= 0xffff &&
           a->block[0] <= 0xffff && a->block[1] <= 0xffff && a->block[2] <= 0xff &&
           f->device >= -1 && f->device <= 127;
}

/* The launch on dev_launches in one line; 0 when it does not fit, its call
 * site is new to this CPU, or the ring is full (it then goes whole on
 * dev_events). */
static __always_inline int launch_compact(const struct launch_args *a,
                                          const struct call_facts *f, u16 api)
{
#ifdef MMTRACE_LAUNCH_WHOLE
    return 0;           /* every launch whole: what the benchmark compares against */
#endif
    if (!launch_fits(a, f))
        return 0;
    if (a->outer && !call_site_known(call_site_of(f->tgid, a), f->tgid, a))
        return 0;
    struct dev_launch *r = dev_launches.ringbuf_reserve(sizeof(struct dev_launch));
    if (!r)
        return 0;
    r->ts_ns = f->ts_ns;
    r->handle = a->handle;
    r->stream_handle = a->stream_handle;
    r->return_ip = a->return_ip;
    r->tid = f->tid;
    r->op_id = (u32)f->op_id;
    r->sched_delay_ns = (u32)f->sched_delay_ns;
    r->shared_mem_bytes = (u32)a->shared_mem_bytes;
    SET_SHAPE(r, a);
    r->device = (u8)f->device;
    r->api = api;
    dev_launches.ringbuf_submit(r, ringbuf_wakeup_flag(3, MMTRACE_DEV_LAUNCH_WAKEUP_EVERY));
    count(CNT_DEV_EVENTS);
    return 1;
}

/* Who called a runtime launch: <<<>>> compiles into a host stub per kernel
 * (__device_stub__<kernel>) that calls the launch, directly or through a
 * static helper, so the caller names the kernel when the handle cannot
 * (an opaque cudaKernel_t whose __cudaGetKernel ran before tracing). At
 * entry [rsp] is the return address (read by the decoders with the stack
 * arguments where they have some); [rbp + 8] is the caller's own when the
 * caller keeps a frame pointer (nvcc's default -O0 host code does), else
 * rbp leads nowhere and it reads as 0. */
static __always_inline void set_outer_caller(struct pt_regs *ctx, struct dev_event *ev)
{
    if (bpf_probe_read_user(&ev->outer_return_ip, sizeof(ev->outer_return_ip),
                            (void *)(PT_REGS_FP(ctx) + 8)) != 0)
        ev->outer_return_ip = 0;
}

/* A kernel launch's record: in one line on dev_launches where it can, else
 * whole (on dev_events, or kept for its return); the result is the session
 * program's (launch_done). */
static __always_inline int launch_send(struct pt_regs *ctx, const struct launch_args *a,
                                       u16 api, u32 slot)
{
    int timed = launch_return_wanted();
    struct call_facts f;
    call_facts(ctx, &f, DEV_LAUNCH);
    if (!timed && launch_compact(a, &f, api))
        return 1;
    struct dev_event *ev = timed ? DEV(call_begin()) : dev_reserve();
    if (!ev)
        return 1;
    facts_fill(ev, &f, api, DEV_LAUNCH);
    if (timed)
        NAMED(ev)->name_addr = 0;       /* scratch: carries no name (carries_name) */
    ev->handle = a->handle;
    ev->stream_handle = a->stream_handle;
    ev->shared_mem_bytes = a->shared_mem_bytes;
    ev->return_ip = a->return_ip;
    SET_SHAPE(ev, a);
    ev->flags |= a->flags;
    if (a->outer)
        set_outer_caller(ctx, ev);
    /* Known once sent: a kept call is sent at its return, if ever, so it
     * teaches nothing. */
    struct call_site *site = a->outer && !timed ? call_site_of(f.tgid, a) : NULL;
    int session = launch_done(ctx, ev, slot, timed, 0);
    if (site) {
        site->handle = a->handle;
        site->return_ip = a->return_ip;
        site->tgid = f.tgid;
    }
    return session;
}


/* Decoders shared by the CUDA and Ascend programs; (ctx, api, slot) as
 * every decoder. */

/* Timed syncs: (stream), (event) or (void). */
static __always_inline int sync_call(struct pt_regs *ctx, u16 api, u32 slot, int arg)
{
    struct dev_event *ev = call_event(ctx, api, DEV_SYNC);
    if (!ev)
        return 0;
    if (arg == 1)
        ev->stream_handle = PT_REGS_PARM1(ctx);
    else if (arg == 2)
        ev->handle = PT_REGS_PARM1(ctx);
    call_store(ev, slot);
    return 0;
}

static __always_inline int sync_stream(struct pt_regs *ctx, u16 api, u32 slot)
{
    return sync_call(ctx, api, slot, 1);
}

static __always_inline int sync_event(struct pt_regs *ctx, u16 api, u32 slot)
{
    return sync_call(ctx, api, slot, 2);
}

static __always_inline int sync_device(struct pt_regs *ctx, u16 api, u32 slot)
{
    return sync_call(ctx, api, slot, 0);
}

/* The return of every timed call that has nothing else to read: emit the
 * stored call with its duration and return code, and forget it. */
static __always_inline int timed_return(struct pt_regs *ctx, u16 api, u32 slot)
{
    u64 key;
    struct dev_named_event *entry = call_lookup(&key, slot);
    if (!entry)
        return 0;
    if (carries_name(entry)) {
        struct dev_named_event *named = returned_named(ctx, entry);
        if (named)
            dev_submit_named(named);
    } else {
        struct dev_event *ev = returned_event(ctx, entry);
        if (ev)
            dev_submit(ev);
    }
    calls_in_flight.delete(&key);
    return 0;
}

/* cudaSetDevice(int device) / aclrtSetDevice(int32_t deviceId): the thread's
 * device once the call has succeeded; no event. */
static __always_inline int set_device(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_event *ev = call_event(ctx, api, 0);
    if (!ev)
        return 0;
    ev->device = (s32)PT_REGS_PARM1(ctx);
    call_store(ev, slot);
    return 0;
}

static __always_inline int set_device_return(struct pt_regs *ctx, u16 api, u32 slot)
{
    u64 key;
    struct dev_named_event *entry = call_lookup(&key, slot);
    if (!entry)
        return 0;
    if (PT_REGS_RC(ctx) == 0) {
        u32 tid = entry->tid;
        struct thread_state *t = threads.lookup(&tid);
        if (t) {
            t->device = entry->device;
            t->dev_flags |= THREAD_DEVICE_SET;
        } else {
            /* Its comm is not sent yet: its first call sends it. */
            struct thread_state fresh = { .tgid = entry->pid, .dev_flags = THREAD_DEVICE_SET,
                                          .device = entry->device };
            if (threads.insert(&tid, &fresh) != 0)
                count(CNT_THREAD_MAP_FULL);
        }
    }
    calls_in_flight.delete(&key);
    return 0;
}

/* sched_process_free: a freed thread never returns from its calls. */
static __always_inline void device_forget_thread(u32 tid)
{
    mapping_executable.delete(&tid);    /* freed inside an mmap */
    op_seq.delete(&tid);    /* the process, when tid is its leader */
#pragma unroll
    for (u32 slot = 0; slot < MMTRACE_CALL_SLOTS; slot++) {
        u64 key = call_key(tid, slot);
        if (calls_in_flight.delete(&key) == 0)
            count(CNT_CALL_ABANDONED);
    }
}

#ifndef MMTRACE_DEVICE_IN_UNIT
/* Compiled apart from sched.c (whose hook calls the above otherwise). */
TRACEPOINT_PROBE(sched, sched_process_free)
{
    device_forget_thread(args->pid);
    return 0;
}
#endif
