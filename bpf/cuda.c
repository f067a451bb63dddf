/* GPU stream: decoders for the CUDA runtime and driver calls. Each takes
 * (ctx, api, slot) and is called by a generated on_<symbol> / ret_<symbol>
 * function (bpf/device.py); which symbol uses which decoder is the table in
 * bpf/cuda.py. Argument locations: probe-abi.md, x86-64 System V. */

#define STACK_ARG(ctx, k) ((void *)(PT_REGS_SP(ctx) + 8 * (k)))

/* cudaLaunchConfig_t, CUDA 12 cuda_runtime_api.h: dim3 gridDim, dim3
 * blockDim, size_t dynamicSmemBytes, cudaStream_t stream, ... */
struct cuda_launch_config {
    u32 grid[3];
    u32 block[3];
    u64 shared_mem;
    u64 stream;
};

/* CUlaunchConfig, CUDA 12 cuda.h: gridDimX..blockDimZ, sharedMemBytes
 * (unsigned int), CUstream hStream at 32, ... */
struct cu_launch_config {
    u32 grid[3];
    u32 block[3];
    u32 shared_mem;
    u32 pad;
    u64 stream;
};

/* Grid and block sizes of the Ex launches' config structs. */
static __always_inline void set_shape(struct launch_args *a, const u32 grid[3],
                                      const u32 block[3])
{
    a->grid[0] = grid[0];
    a->grid[1] = grid[1];
    a->grid[2] = grid[2];
    a->block[0] = block[0];
    a->block[1] = block[1];
    a->block[2] = block[2];
}

/* cudaLaunchKernel / cudaLaunchCooperativeKernel (const void *func, dim3
 * gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t
 * stream): a 12-byte dim3 by value takes two registers (x | y << 32, z).
 * func may be a cudaKernel_t: nvcc 13's <<<>>> passes the one
 * __cudaGetKernel made, through __cudaLaunchKernel (so its callers, the
 * return address and the outer caller, name it: launch_send). */
static __always_inline int launch_runtime(struct pt_regs *ctx, u16 api, u32 slot)
{
    if (!in_scope())
        return 1;
    struct launch_args a = { .outer = 1 };
    u64 grid_xy = PT_REGS_PARM2(ctx), block_xy = PT_REGS_PARM4(ctx);
    a.handle = PT_REGS_PARM1(ctx);
    a.grid[0] = (u32)grid_xy;
    a.grid[1] = grid_xy >> 32;
    a.grid[2] = (u32)PT_REGS_PARM3(ctx);
    a.block[0] = (u32)block_xy;
    a.block[1] = block_xy >> 32;
    a.block[2] = (u32)PT_REGS_PARM5(ctx);
    u64 stack[3];   /* the return address, then the stack arguments */
    read_user_flagged(&a.flags, stack, sizeof(stack), STACK_ARG(ctx, 0));
    a.return_ip = stack[0];
    a.shared_mem_bytes = stack[1];
    a.stream_handle = stack[2];
    return launch_send(ctx, &a, api, slot);
}

/* cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args) */
static __always_inline int launch_runtime_ex(struct pt_regs *ctx, u16 api, u32 slot)
{
    if (!in_scope())
        return 1;
    struct launch_args a = { .outer = 1 };
    a.handle = PT_REGS_PARM2(ctx);
    struct cuda_launch_config cfg;
    read_user_flagged(&a.flags, &cfg, sizeof(cfg), (void *)PT_REGS_PARM1(ctx));
    set_shape(&a, cfg.grid, cfg.block);
    a.shared_mem_bytes = cfg.shared_mem;
    a.stream_handle = cfg.stream;
    read_user_flagged(&a.flags, &a.return_ip, sizeof(a.return_ip), STACK_ARG(ctx, 0));
    return launch_send(ctx, &a, api, slot);
}

/* cuLaunchKernel / cuLaunchCooperativeKernel (CUfunction f, unsigned gridX,
 * gridY, gridZ, blockX, blockY, [stack] blockZ, sharedMemBytes, CUstream
 * hStream, ...): 32-bit stack slots hold garbage in their upper halves. */
static __always_inline int launch_driver(struct pt_regs *ctx, u16 api, u32 slot)
{
    if (!in_scope())
        return 1;
    struct launch_args a = {};
    a.handle = PT_REGS_PARM1(ctx);
    a.grid[0] = (u32)PT_REGS_PARM2(ctx);
    a.grid[1] = (u32)PT_REGS_PARM3(ctx);
    a.grid[2] = (u32)PT_REGS_PARM4(ctx);
    a.block[0] = (u32)PT_REGS_PARM5(ctx);
    a.block[1] = (u32)PT_REGS_PARM6(ctx);
    u64 stack[3];
    read_user_flagged(&a.flags, stack, sizeof(stack), STACK_ARG(ctx, 1));
    a.block[2] = (u32)stack[0];
    a.shared_mem_bytes = (u32)stack[1];
    a.stream_handle = stack[2];
    return launch_send(ctx, &a, api, slot);
}

/* cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) */
static __always_inline int launch_driver_ex(struct pt_regs *ctx, u16 api, u32 slot)
{
    if (!in_scope())
        return 1;
    struct launch_args a = {};
    a.handle = PT_REGS_PARM2(ctx);
    struct cu_launch_config cfg;
    read_user_flagged(&a.flags, &cfg, sizeof(cfg), (void *)PT_REGS_PARM1(ctx));
    set_shape(&a, cfg.grid, cfg.block);
    a.shared_mem_bytes = cfg.shared_mem;
    a.stream_handle = cfg.stream;
    return launch_send(ctx, &a, api, slot);
}

/* cudaGraphLaunch / cuGraphLaunch (graphExec, stream); also the shape of
 * cudaEventRecord(event, stream). */
static __always_inline int handle_and_stream(struct pt_regs *ctx, u16 api, u32 slot, u8 kind)
{
    struct dev_event *ev = call_event(ctx, api, kind);
    if (!ev)
        return 0;
    ev->handle = PT_REGS_PARM1(ctx);
    ev->stream_handle = PT_REGS_PARM2(ctx);
    call_store(ev, slot);
    return 0;
}

static __always_inline int graph_launch(struct pt_regs *ctx, u16 api, u32 slot)
{
    return handle_and_stream(ctx, api, slot, DEV_GRAPH_LAUNCH);
}

static __always_inline int event_record(struct pt_regs *ctx, u16 api, u32 slot)
{
    return handle_and_stream(ctx, api, slot, DEV_EVENT_RECORD);
}

/* The copies, graph launches and event records below are timed by a
 * uretprobe: their return codes count (a failed copy moved no bytes), and
 * they are rare beside kernel launches. */

/* cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) */
static __always_inline int memcpy_runtime_async(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_event *ev = call_event(ctx, api, DEV_MEMCPY);
    if (!ev)
        return 0;
    ev->bytes = PT_REGS_PARM3(ctx);
    ev->direction = (u8)PT_REGS_PARM4(ctx);
    ev->stream_handle = PT_REGS_PARM5(ctx);
    call_store(ev, slot);
    return 0;
}

/* cuMemcpyHtoDAsync_v2 / cuMemcpyDtoHAsync_v2 / cuMemcpyAsync (dst, src,
 * size_t ByteCount, CUstream hStream): the direction is the function's. */
static __always_inline int memcpy_driver(struct pt_regs *ctx, u16 api, u32 slot, u8 direction)
{
    struct dev_event *ev = call_event(ctx, api, DEV_MEMCPY);
    if (!ev)
        return 0;
    ev->bytes = PT_REGS_PARM3(ctx);
    ev->direction = direction;
    ev->stream_handle = PT_REGS_PARM4(ctx);
    call_store(ev, slot);
    return 0;
}

static __always_inline int memcpy_htod_async(struct pt_regs *ctx, u16 api, u32 slot)
{
    return memcpy_driver(ctx, api, slot, 1 /* cudaMemcpyHostToDevice */);
}

static __always_inline int memcpy_dtoh_async(struct pt_regs *ctx, u16 api, u32 slot)
{
    return memcpy_driver(ctx, api, slot, 2 /* cudaMemcpyDeviceToHost */);
}

static __always_inline int memcpy_driver_async(struct pt_regs *ctx, u16 api, u32 slot)
{
    return memcpy_driver(ctx, api, slot, 4 /* cudaMemcpyDefault: unified addressing */);
}

/* cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind): timed. */
static __always_inline int memcpy_runtime(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_event *ev = call_event(ctx, api, DEV_MEMCPY);
    if (!ev)
        return 0;
    ev->bytes = PT_REGS_PARM3(ctx);
    ev->direction = (u8)PT_REGS_PARM4(ctx);
    call_store(ev, slot);
    return 0;
}

/* Calls that write a kernel handle through their first argument: read at
 * return. cuModuleGetFunction / cuLibraryGetKernel (out, module or
 * library, const char *name) name it: the name is read at return too, when
 * the driver has read it (so its page is in memory). __cudaGetKernel /
 * cudaGetKernel (cudaKernel_t *out, const void *hostFunction) and
 * cuKernelGetFunction (CUfunction *out, CUkernel kernel) make a handle
 * that stands for another (alias). */
static __always_inline int handle_out_call(struct pt_regs *ctx, u16 api, u32 slot,
                                           u64 alias, u64 name_addr)
{
    struct dev_named_event *ev = NAMED(call_event(ctx, api, DEV_FUNCTION_NAME));
    if (!ev)
        return 0;
    ev->handle = PT_REGS_PARM1(ctx);    /* the out-parameter until return */
    ev->alias = alias;
    ev->name_addr = name_addr;
    call_store(DEV(ev), slot);
    return 0;
}

static __always_inline int get_function(struct pt_regs *ctx, u16 api, u32 slot)
{
    return handle_out_call(ctx, api, slot, 0, PT_REGS_PARM3(ctx));
}

static __always_inline int get_alias(struct pt_regs *ctx, u16 api, u32 slot)
{
    return handle_out_call(ctx, api, slot, PT_REGS_PARM2(ctx), 0);
}

/* cuFuncGetName(const char **name, CUfunction hfunc): the name pointer is
 * written by the call, its string read at return. */
static __always_inline int func_get_name(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_named_event *ev = NAMED(call_event(ctx, api, DEV_FUNCTION_NAME));
    if (!ev)
        return 0;
    ev->name_addr = PT_REGS_PARM1(ctx);     /* the out-parameter until return */
    ev->handle = PT_REGS_PARM2(ctx);
    call_store(DEV(ev), slot);
    return 0;
}

/* At the return of either: the handle, read through the out-parameter
 * (`name_indirect` 0), or the name, through the pointer cuFuncGetName
 * wrote (1); then the name's string. */
static __always_inline int returned_handle(struct pt_regs *ctx, u32 slot, int name_indirect)
{
    u64 key;
    struct dev_named_event *entry = call_lookup(&key, slot);
    if (!entry)
        return 0;
    struct dev_named_event *ev = returned_named(ctx, entry);
    if (ev) {
        u64 name = entry->name_addr;
        ev->name_addr = 0;
        if (!name_indirect)
            ev->handle = 0;
        if (ev->ret == 0) {
            if (name_indirect)
                read_user(DEV(ev), &name, sizeof(name), (void *)entry->name_addr);
            else
                read_user(DEV(ev), &ev->handle, sizeof(ev->handle), (void *)entry->handle);
            read_name(ev, (const char *)name);
        }
        dev_submit_named(ev);
    }
    calls_in_flight.delete(&key);
    return 0;
}

static __always_inline int handle_out_return(struct pt_regs *ctx, u16 api, u32 slot)
{
    return returned_handle(ctx, slot, 0);
}

static __always_inline int func_get_name_return(struct pt_regs *ctx, u16 api, u32 slot)
{
    return returned_handle(ctx, slot, 1);
}
