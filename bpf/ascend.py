"""NPU stream: the Ascend CANN symbols bpf/ascend.c decodes.

Which library defines the aclrt* symbols varies across CANN releases
(libascendcl.so, libacl_rt.so, ...): the `library` here is a family label,
attachment follows whichever file defines the symbol.
"""

from mmtrace.bpf.api import (ALLOC_FIELDS, BYTES, DIRECTION, GRID, HANDLE, MEMCPY_FIELDS, STREAM, Api)

SOURCE = "ascend.c"

# aclrtMemcpyKind onto the interface's directions: 5 is host -> buffer ->
# device, 6 and 7 are copies inside one device and between devices.
DIRECTIONS = {0: "h2h", 1: "h2d", 2: "d2h", 3: "d2d", 4: "default", 5: "h2d", 6: "d2d",
              7: "d2d"}

# Every aclnn[A-Z]... symbol is a phase-2 (execute) function except the
# phase-1 ...GetWorkspaceSize ones.
ACLNN_PATTERN = r"aclnn[A-Z]\w*"
ACLNN_EXCLUDE = r"\w*GetWorkspaceSize"
ACLNN_SYMBOL = "aclnn"


def _npu(id, symbol, kind, library, impl, **kw):
    return Api(id, symbol, "npu", kind, library, impl, **kw)


_OP = dict(fields=frozenset({STREAM}), per_launch=True)
_KERNEL = dict(fields=frozenset({HANDLE, STREAM, GRID}), per_launch=True)
_STREAM_SYNC = dict(return_impl="timed_return", fields=frozenset({STREAM}), sync_scope="stream")
_DEVICE_SYNC = dict(return_impl="timed_return", sync_scope="device")

APIS = (
    _npu(100, ACLNN_SYMBOL, "launch", "opapi", "aclnn_launch", pattern=ACLNN_PATTERN,
         exclude=ACLNN_EXCLUDE, fields=frozenset({HANDLE, STREAM}), per_launch=True),
    _npu(101, "aclopExecuteV2", "launch", "ascendcl", "aclop_execute", **_OP),
    _npu(102, "aclopCompileAndExecute", "launch", "ascendcl", "aclop_compile_execute", **_OP),
    _npu(103, "aclopCompileAndExecuteV2", "launch", "ascendcl", "aclop_compile_execute",
         **_OP),
    _npu(104, "aclmdlExecute", "model_exec", "ascendcl", "model_execute",
         return_impl="timed_return", fields=frozenset({HANDLE}), blocking=True),
    _npu(105, "aclmdlExecuteAsync", "model_exec", "ascendcl", "model_execute_async",
         return_impl="timed_return", fields=frozenset({HANDLE, STREAM})),
    _npu(106, "aclrtLaunchKernel", "launch", "ascendcl", "acl_launch_kernel", **_KERNEL),
    _npu(107, "aclrtLaunchKernelWithConfig", "launch", "ascendcl", "acl_launch_kernel_cfg",
         **_KERNEL),
    _npu(108, "aclrtLaunchKernelWithHostArgs", "launch", "ascendcl", "acl_launch_kernel_cfg",
         **_KERNEL),
    _npu(109, "aclrtMemcpy", "memcpy", "ascendcl", "acl_memcpy", return_impl="timed_return",
         fields=frozenset({BYTES, DIRECTION}), blocking=True),
    _npu(110, "aclrtMemcpyAsync", "memcpy", "ascendcl", "acl_memcpy_async",
         return_impl="timed_return", fields=MEMCPY_FIELDS),
    _npu(111, "aclrtSynchronizeStream", "sync", "ascendcl", "sync_stream", **_STREAM_SYNC),
    _npu(112, "aclrtSynchronizeStreamWithTimeout", "sync", "ascendcl", "sync_stream",
         **_STREAM_SYNC),
    _npu(113, "aclrtSynchronizeDevice", "sync", "ascendcl", "sync_device", **_DEVICE_SYNC),
    _npu(114, "aclrtSynchronizeDeviceWithTimeout", "sync", "ascendcl", "sync_device",
         **_DEVICE_SYNC),
    _npu(115, "aclrtSetDevice", "set_device", "ascendcl", "set_device",
         return_impl="set_device_return"),
    # device memory (decoders: bpf/device_memory.c)
    _npu(116, "aclrtMalloc", "alloc", "ascendcl", "alloc_call", return_impl="memory_return",
         fields=ALLOC_FIELDS),
    _npu(117, "aclrtFree", "free", "ascendcl", "free_call", return_impl="memory_return",
         fields=ALLOC_FIELDS),
)
