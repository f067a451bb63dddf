/* NPU stream: decoders for Ascend CANN calls (AscendCL runtime, aclop,
 * aclmdl, and the aclnn operator API). Called by the generated on_<symbol>
 * functions like the CUDA decoders; the table is bpf/ascend.py. Shared
 * decoders (syncs, set-device, timed returns) live in device.h. */

/* aclnnXxx(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
 * aclrtStream stream): one program for every op; the op is the symbol,
 * named by the cookie it was attached with (agent/kernel/uprobe_link.py), or by
 * the probed address in userspace where cookies are not available. */
static __always_inline int aclnn_launch(struct pt_regs *ctx, u16 api, u32 slot)
{
    int timed;
    struct dev_event *ev = launch_event(ctx, api, DEV_LAUNCH, &timed, 0);
    if (!ev)
        return 1;
    ev->probe_ip = PT_REGS_IP(ctx);
    ev->symbol_id = bpf_get_attach_cookie(ctx) >> 32;    /* 0: attached without */
    ev->handle = PT_REGS_PARM3(ctx);
    ev->stream_handle = PT_REGS_PARM4(ctx);
    return launch_done(ctx, ev, slot, timed, 0);
}

/* An aclop call: opType (const char *) first, the stream on the stack. */
static __always_inline int aclop_launch(struct pt_regs *ctx, u16 api, u32 slot,
                                        u32 stack_slot)
{
    int timed;
    struct dev_event *ev = launch_event(ctx, api, DEV_LAUNCH, &timed, 1);
    if (!ev)
        return 1;
    read_name(NAMED(ev), (const char *)PT_REGS_PARM1(ctx));
    read_user(ev, &ev->stream_handle, sizeof(ev->stream_handle),
              (void *)(PT_REGS_SP(ctx) + 8 * stack_slot));
    return launch_done(ctx, ev, slot, timed, 1);
}

/* aclopExecuteV2(opType, numInputs, inputDesc, inputs, numOutputs,
 * outputDesc, [stack] outputs, attr, stream) */
static __always_inline int aclop_execute(struct pt_regs *ctx, u16 api, u32 slot)
{
    return aclop_launch(ctx, api, slot, 3);
}

/* aclopCompileAndExecute[V2](opType, numInputs, inputDesc, inputs,
 * numOutputs, outputDesc, [stack] outputs, attr, engineType, compileFlag,
 * opPath, stream) */
static __always_inline int aclop_compile_execute(struct pt_regs *ctx, u16 api, u32 slot)
{
    return aclop_launch(ctx, api, slot, 6);
}

/* aclmdlExecuteAsync(uint32_t modelId, const aclmdlDataset *input,
 * aclmdlDataset *output, aclrtStream stream) */
static __always_inline int model_execute_async(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_event *ev = call_event(ctx, api, DEV_MODEL_EXEC);
    if (!ev)
        return 0;
    ev->handle = (u32)PT_REGS_PARM1(ctx);
    ev->stream_handle = PT_REGS_PARM4(ctx);
    call_store(ev, slot);
    return 0;
}

/* aclmdlExecute(uint32_t modelId, input, output): blocks until done; timed. */
static __always_inline int model_execute(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_event *ev = call_event(ctx, api, DEV_MODEL_EXEC);
    if (!ev)
        return 0;
    ev->handle = (u32)PT_REGS_PARM1(ctx);
    call_store(ev, slot);
    return 0;
}

/* The aclrtLaunchKernel family: handle and block count first, the stream
 * where each signature puts it. */
static __always_inline int acl_kernel_launch(struct pt_regs *ctx, u16 api, u32 slot,
                                             u64 handle, u32 blocks, u64 stream)
{
    int timed;
    struct dev_event *ev = launch_event(ctx, api, DEV_LAUNCH, &timed, 0);
    if (!ev)
        return 1;
    ev->handle = handle;
    ev->grid_x = blocks;
    ev->grid_y = 1;
    ev->grid_z = 1;
    ev->stream_handle = stream;
    return launch_done(ctx, ev, slot, timed, 0);
}

/* aclrtLaunchKernel(aclrtFuncHandle funcHandle, uint32_t blockDim, const
 * void *argsData, size_t argsSize, aclrtStream stream) */
static __always_inline int acl_launch_kernel(struct pt_regs *ctx, u16 api, u32 slot)
{
    return acl_kernel_launch(ctx, api, slot, PT_REGS_PARM1(ctx), (u32)PT_REGS_PARM2(ctx),
                             PT_REGS_PARM5(ctx));
}

/* aclrtLaunchKernelWithConfig(funcHandle, blockDim, aclrtStream stream,
 * cfg, argsHandle, reserve) and aclrtLaunchKernelWithHostArgs(funcHandle,
 * numBlocks, stream, cfg, hostArgs, argsSize, ...): the stream third. */
static __always_inline int acl_launch_kernel_cfg(struct pt_regs *ctx, u16 api, u32 slot)
{
    return acl_kernel_launch(ctx, api, slot, PT_REGS_PARM1(ctx), (u32)PT_REGS_PARM2(ctx),
                             PT_REGS_PARM3(ctx));
}

/* aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t
 * count, aclrtMemcpyKind kind, aclrtStream stream) */
static __always_inline int acl_memcpy_async(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_event *ev = call_event(ctx, api, DEV_MEMCPY);
    if (!ev)
        return 0;
    ev->bytes = PT_REGS_PARM4(ctx);
    ev->direction = (u8)PT_REGS_PARM5(ctx);
    ev->stream_handle = PT_REGS_PARM6(ctx);
    call_store(ev, slot);
    return 0;
}

/* aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
 * aclrtMemcpyKind kind): blocks; timed. */
static __always_inline int acl_memcpy(struct pt_regs *ctx, u16 api, u32 slot)
{
    struct dev_event *ev = call_event(ctx, api, DEV_MEMCPY);
    if (!ev)
        return 0;
    ev->bytes = PT_REGS_PARM4(ctx);
    ev->direction = (u8)PT_REGS_PARM5(ctx);
    call_store(ev, slot);
    return 0;
}
