"""GPU stream: the CUDA runtime and driver symbols bpf/cuda.c decodes.

Argument locations: ../shared/reference/probe-abi.md (x86-64 System V).
Per-launch probes (`per_launch`) are the ones the adaptive mode detaches:
every kernel launch traps into the kernel, graph launches, copies and syncs
are orders of magnitude rarer.
"""

from mmtrace.bpf.api import (ALLOC_FIELDS, BYTES, DIRECTION, HANDLE, LAUNCH_FIELDS, MEMCPY_FIELDS,
                             STREAM, Api)

SOURCE = "cuda.c"

# cudaMemcpyKind (the driver's copies are mapped onto the same values).
DIRECTIONS = {0: "h2h", 1: "h2d", 2: "d2h", 3: "d2d", 4: "default"}


def _runtime(id, symbol, kind, impl, **kw):
    return Api(id, symbol, "gpu", kind, "cudart", impl, **kw)


def _driver(id, symbol, kind, impl, **kw):
    return Api(id, symbol, "gpu", kind, "cuda", impl, **kw)


_LAUNCH = dict(fields=LAUNCH_FIELDS, per_launch=True)
_STREAM_SYNC = dict(return_impl="timed_return", fields=frozenset({STREAM}), sync_scope="stream")
_DEVICE_SYNC = dict(return_impl="timed_return", sync_scope="device")
_GRAPH = dict(return_impl="timed_return", fields=frozenset({HANDLE, STREAM}))
_RECORD = dict(return_impl="timed_return", fields=frozenset({HANDLE, STREAM}))
_ASYNC_COPY = dict(return_impl="timed_return", fields=MEMCPY_FIELDS)
_ALIAS = dict(return_impl="handle_out_return")
_MEMORY = dict(return_impl="memory_return", fields=ALLOC_FIELDS)

APIS = (
    # runtime (libcudart, or linked statically into an executable)
    _runtime(1, "cudaLaunchKernel", "launch", "launch_runtime", **_LAUNCH),
    _runtime(2, "cudaLaunchKernel_ptsz", "launch", "launch_runtime", **_LAUNCH),
    _runtime(3, "cudaLaunchKernelExC", "launch", "launch_runtime_ex", **_LAUNCH),
    _runtime(4, "cudaLaunchKernelExC_ptsz", "launch", "launch_runtime_ex", **_LAUNCH),
    _runtime(5, "cudaLaunchCooperativeKernel", "launch", "launch_runtime", **_LAUNCH),
    _runtime(6, "cudaLaunchCooperativeKernel_ptsz", "launch", "launch_runtime", **_LAUNCH),
    _runtime(7, "cudaGraphLaunch", "graph_launch", "graph_launch", **_GRAPH),
    _runtime(8, "cudaGraphLaunch_ptsz", "graph_launch", "graph_launch", **_GRAPH),
    _runtime(9, "cudaMemcpyAsync", "memcpy", "memcpy_runtime_async", **_ASYNC_COPY),
    _runtime(10, "cudaMemcpyAsync_ptsz", "memcpy", "memcpy_runtime_async",
             **_ASYNC_COPY),
    _runtime(11, "cudaMemcpy", "memcpy", "memcpy_runtime", return_impl="timed_return",
             fields=frozenset({BYTES, DIRECTION}), blocking=True),
    _runtime(12, "cudaMemcpy_ptds", "memcpy", "memcpy_runtime", return_impl="timed_return",
             fields=frozenset({BYTES, DIRECTION}), blocking=True),
    _runtime(13, "cudaStreamSynchronize", "sync", "sync_stream", **_STREAM_SYNC),
    _runtime(14, "cudaStreamSynchronize_ptsz", "sync", "sync_stream", **_STREAM_SYNC),
    _runtime(15, "cudaDeviceSynchronize", "sync", "sync_device", **_DEVICE_SYNC),
    _runtime(16, "cudaEventSynchronize", "sync", "sync_event", return_impl="timed_return",
             fields=frozenset({HANDLE, STREAM}), sync_scope="event"),
    _runtime(17, "cudaEventRecord", "event_record", "event_record", **_RECORD),
    _runtime(18, "cudaEventRecord_ptsz", "event_record", "event_record", **_RECORD),
    _runtime(19, "cudaEventRecordWithFlags", "event_record", "event_record", **_RECORD),
    _runtime(20, "cudaEventRecordWithFlags_ptsz", "event_record", "event_record", **_RECORD),
    _runtime(21, "cudaSetDevice", "set_device", "set_device", return_impl="set_device_return"),
    # nvcc 13's <<<>>> takes a cudaKernel_t for each kernel once, then calls
    # __cudaLaunchKernel with it, which jumps to cudaLaunchKernel (in 12.9
    # and 13.0, shared and static): probed there, so counted once.
    _runtime(24, "__cudaGetKernel", "function_name", "get_alias", **_ALIAS),
    _runtime(25, "cudaGetKernel", "function_name", "get_alias", **_ALIAS),
    # device memory (decoders: bpf/device_memory.c)
    _runtime(26, "cudaMalloc", "alloc", "alloc_call", **_MEMORY),
    _runtime(27, "cudaMallocAsync", "alloc", "alloc_async_call", **_MEMORY),
    _runtime(28, "cudaMallocAsync_ptsz", "alloc", "alloc_async_call", **_MEMORY),
    _runtime(29, "cudaFree", "free", "free_call", **_MEMORY),
    _runtime(30, "cudaFreeAsync", "free", "free_async_call", **_MEMORY),
    _runtime(31, "cudaFreeAsync_ptsz", "free", "free_async_call", **_MEMORY),
    # driver (libcuda.so.1: Triton, cuBLAS, and maybe the runtime itself)
    _driver(40, "cuLaunchKernel", "launch", "launch_driver", **_LAUNCH),
    _driver(41, "cuLaunchKernel_ptsz", "launch", "launch_driver", **_LAUNCH),
    _driver(42, "cuLaunchKernelEx", "launch", "launch_driver_ex", **_LAUNCH),
    _driver(43, "cuLaunchKernelEx_ptsz", "launch", "launch_driver_ex", **_LAUNCH),
    _driver(44, "cuLaunchCooperativeKernel", "launch", "launch_driver", **_LAUNCH),
    _driver(45, "cuLaunchCooperativeKernel_ptsz", "launch", "launch_driver", **_LAUNCH),
    _driver(46, "cuGraphLaunch", "graph_launch", "graph_launch", **_GRAPH),
    _driver(47, "cuGraphLaunch_ptsz", "graph_launch", "graph_launch", **_GRAPH),
    _driver(48, "cuMemcpyHtoDAsync_v2", "memcpy", "memcpy_htod_async", **_ASYNC_COPY),
    _driver(49, "cuMemcpyHtoDAsync_v2_ptsz", "memcpy", "memcpy_htod_async",
            **_ASYNC_COPY),
    _driver(50, "cuMemcpyDtoHAsync_v2", "memcpy", "memcpy_dtoh_async", **_ASYNC_COPY),
    _driver(51, "cuMemcpyDtoHAsync_v2_ptsz", "memcpy", "memcpy_dtoh_async",
            **_ASYNC_COPY),
    _driver(52, "cuMemcpyAsync", "memcpy", "memcpy_driver_async", **_ASYNC_COPY),
    _driver(53, "cuMemcpyAsync_ptsz", "memcpy", "memcpy_driver_async", **_ASYNC_COPY),
    _driver(54, "cuStreamSynchronize", "sync", "sync_stream", **_STREAM_SYNC),
    _driver(55, "cuStreamSynchronize_ptsz", "sync", "sync_stream", **_STREAM_SYNC),
    _driver(56, "cuCtxSynchronize", "sync", "sync_device", **_DEVICE_SYNC),
    _driver(57, "cuModuleGetFunction", "function_name", "get_function",
            return_impl="handle_out_return"),
    # CUDA 12+ library loading (cuBLAS, cuBLASLt): the CUkernel by name, the
    # CUfunction of a CUkernel; and a CUfunction's name asked of the driver.
    _driver(58, "cuLibraryGetKernel", "function_name", "get_function",
            return_impl="handle_out_return"),
    _driver(59, "cuKernelGetFunction", "function_name", "get_alias", **_ALIAS),
    _driver(60, "cuFuncGetName", "function_name", "func_get_name",
            return_impl="func_get_name_return"),
    _driver(61, "cuMemAlloc_v2", "alloc", "alloc_call", **_MEMORY),
    _driver(62, "cuMemAllocAsync", "alloc", "alloc_async_call", **_MEMORY),
    _driver(63, "cuMemAllocAsync_ptsz", "alloc", "alloc_async_call", **_MEMORY),
    _driver(64, "cuMemFree_v2", "free", "free_call", **_MEMORY),
    _driver(65, "cuMemFreeAsync", "free", "free_async_call", **_MEMORY),
    _driver(66, "cuMemFreeAsync_ptsz", "free", "free_async_call", **_MEMORY),
)
