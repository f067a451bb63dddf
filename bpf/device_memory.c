/* Device memory: decoders for the allocation and free calls of the CUDA
 * runtime and driver and of AscendCL, called by the generated on_<symbol> /
 * ret_<symbol> functions like the other decoders (tables: bpf/cuda.py,
 * bpf/ascend.py; decoded by bpf/device_memory.py). An allocation's pointer
 * comes back through an out-parameter, so both calls are read at their
 * return: a failed call holds nothing. Live allocations are kept here,
 * bounded, so that a free carries the size and device it gives back. */

/* Record kinds after enum dev_kind's (bpf/device.py KINDS). */
enum dev_memory_kind {
    DEV_ALLOC = 9,
    DEV_FREE = 10,
};

#ifndef MMTRACE_MAX_ALLOCATIONS
#define MMTRACE_MAX_ALLOCATIONS 65536
#endif

/* Flags of alloc/free records beyond enum dev_flag (bpf/device_memory.py). */
#define DEV_ALLOC_UNTRACKED 32      /* allocations map full: not counted as held */
#define DEV_FREE_UNMATCHED 64       /* freed a pointer not allocated while traced */

struct allocation_key {
    u32 pid;
    u32 pad;
    u64 ptr;
};

struct allocation {
    u64 bytes;
    u64 ts_ns;
    s32 device;
    u16 api;
    u16 pad;
};

BPF_HASH(allocations, struct allocation_key, struct allocation, MMTRACE_MAX_ALLOCATIONS);

/* thread -> call slot of its outermost allocation or free in flight: the
 * runtime's cudaMalloc calls the driver's cuMemAlloc_v2, and one
 * allocation must be counted once, at the layer the program called. */
BPF_HASH(memory_call_owner, u32, u32, MMTRACE_MAX_THREADS);

/* What the allocation probes could not do, apart from common.h's shared
 * counters (bpf/device_memory.py MEMORY_COUNTERS names them). */
enum memory_counter {
    MEM_ALLOCATION_MAP_FULL = 0,    /* an allocation not kept: not counted as held */
    MEM_FREE_UNMATCHED,             /* a free of a pointer not seen allocated */
    MEM_NESTED,                     /* a call made inside another one: not counted */
    MEM_N_COUNTERS
};
BPF_PERCPU_ARRAY(memory_counters, u64, MEM_N_COUNTERS);

static __always_inline void memory_count(u32 which)
{
    u64 *v = memory_counters.lookup(&which);
    if (v)
        (*v)++;
}

/* Whether this call is the thread's outermost allocation or free: an
 * owner whose call is no longer in flight (its thread died in it, its
 * return was lost) gives way. */
static __always_inline int memory_call_enter(u32 slot)
{
    u32 tid = bpf_get_current_pid_tgid();
    u32 *owner = memory_call_owner.lookup(&tid);
    if (owner) {
        u64 key = call_key(tid, *owner);
        if (calls_in_flight.lookup(&key)) {
            memory_count(MEM_NESTED);
            return 0;
        }
    }
    memory_call_owner.update(&tid, &slot);
    return 1;
}

/* At a return: whether it is the outermost call's (the owner goes). */
static __always_inline int memory_call_leave(u32 slot)
{
    u32 tid = bpf_get_current_pid_tgid();
    u32 *owner = memory_call_owner.lookup(&tid);
    if (!owner || *owner != slot)
        return 0;
    memory_call_owner.delete(&tid);
    return 1;
}

/* An allocation (void **out, size_t size[, stream]) or a free (void *ptr[,
 * stream]): the pointer argument waits in `handle` until the return (for an
 * allocation, the address its pointer is written to). */
static __always_inline int memory_entry(struct pt_regs *ctx, u16 api, u32 slot, u8 kind,
                                        u64 bytes, u64 stream)
{
    if (!in_scope() || !memory_call_enter(slot))
        return 0;
    struct dev_event *ev = call_event(ctx, api, kind);
    if (!ev)
        return 0;
    ev->handle = PT_REGS_PARM1(ctx);
    ev->bytes = bytes;
    ev->stream_handle = stream;
    call_store(ev, slot);
    return 0;
}

/* cudaMalloc(void **devPtr, size_t size), cuMemAlloc_v2(CUdeviceptr *dptr,
 * size_t bytesize), aclrtMalloc(void **devPtr, size_t size,
 * aclrtMemMallocPolicy policy) */
static __always_inline int alloc_call(struct pt_regs *ctx, u16 api, u32 slot)
{
    return memory_entry(ctx, api, slot, DEV_ALLOC, PT_REGS_PARM2(ctx), 0);
}

/* cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream),
 * cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) */
static __always_inline int alloc_async_call(struct pt_regs *ctx, u16 api, u32 slot)
{
    return memory_entry(ctx, api, slot, DEV_ALLOC, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
}

/* cudaFree(void *devPtr), cuMemFree_v2(CUdeviceptr dptr), aclrtFree(void *devPtr) */
static __always_inline int free_call(struct pt_regs *ctx, u16 api, u32 slot)
{
    return memory_entry(ctx, api, slot, DEV_FREE, 0, 0);
}

/* cudaFreeAsync(void *devPtr, cudaStream_t hStream), cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) */
static __always_inline int free_async_call(struct pt_regs *ctx, u16 api, u32 slot)
{
    return memory_entry(ctx, api, slot, DEV_FREE, 0, PT_REGS_PARM2(ctx));
}

/* An allocation returned: its pointer read through the out-parameter and
 * kept, or, failed, a record of what was asked (handle 0). */
static __always_inline void allocated(struct dev_event *ev, u16 api)
{
    u64 out = ev->handle;
    ev->handle = 0;
    if (ev->ret == 0)
        read_user(ev, &ev->handle, sizeof(ev->handle), (void *)out);
    if (ev->ret != 0 || !ev->handle)
        return;
    struct allocation_key akey = { .pid = ev->pid, .ptr = ev->handle };
    struct allocation a = { .bytes = ev->bytes, .ts_ns = ev->ts_ns, .device = ev->device,
                            .api = api };
    if (allocations.update(&akey, &a) != 0) {
        ev->flags |= DEV_ALLOC_UNTRACKED;
        memory_count(MEM_ALLOCATION_MAP_FULL);
    }
}

/* A free returned: a successful one gives back what its allocation held,
 * on the allocation's device. */
static __always_inline void freed(struct dev_event *ev)
{
    if (ev->ret != 0 || !ev->handle)
        return;
    struct allocation_key akey = { .pid = ev->pid, .ptr = ev->handle };
    struct allocation *a = allocations.lookup(&akey);
    if (!a) {
        ev->flags |= DEV_FREE_UNMATCHED;
        memory_count(MEM_FREE_UNMATCHED);
        return;
    }
    ev->bytes = a->bytes;
    ev->device = a->device;
    allocations.delete(&akey);
}

/* The return of either (ret_ of every allocation and free). */
static __always_inline int memory_return(struct pt_regs *ctx, u16 api, u32 slot)
{
    if (!in_scope() || !memory_call_leave(slot))
        return 0;
    u64 key;
    struct dev_named_event *entry = call_lookup(&key, slot);
    if (!entry)
        return 0;
    struct dev_event *ev = returned_event(ctx, entry);
    if (ev) {
        if (ev->kind == DEV_ALLOC)
            allocated(ev, api);
        else
            freed(ev);
        dev_submit(ev);
    }
    calls_in_flight.delete(&key);
    return 0;
}
