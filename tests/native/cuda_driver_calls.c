/* Calls the libcuda.so.1 stand-in (cuda_driver_standin.c) with known
 * arguments, each API once, in the order the test expects.
 *
 * Usage: cuda_driver_calls [hang]   ("hang": end in a sync that never
 * returns, for a test that kills the process inside a call).
 * Kernel names come from cuModuleGetFunction, read by the probes
 * themselves: no need to outlive the agent's drain.
 * Prints one JSON line with the handles cuModuleGetFunction returned. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cuda_driver_api.h"

#define S(v) ((CUstream)(unsigned long)(v))
/* 80 characters: longer than the event's 64-byte name field. */
#define LONG_NAME "triton_red_fused_native_layer_norm_backward_per_row_reduction_kernel_0123456789"

int main(int argc, char **argv)
{
    int hang = argc > 1 && strcmp(argv[1], "hang") == 0;
    CUfunction add = 0, norm = 0;
    CUmodule module = (CUmodule)(unsigned long)0xabc0;
    cuModuleGetFunction(&add, module, "triton_poi_fused_add_0");
    cuModuleGetFunction(&norm, module, LONG_NAME);
    void *params[1] = { 0 };
    cuLaunchKernel(add, 21, 22, 23, 24, 25, 26, 512, S(0x7001), params, NULL);
    cuLaunchKernel_ptsz(norm, 31, 32, 33, 34, 35, 36, 768, S(0x7002), params, NULL);
    CUlaunchConfig cfg = { 41, 42, 43, 44, 45, 46, 1536, S(0x7003), NULL, 0 };
    cuLaunchKernelEx(&cfg, add, params, NULL);
    cuLaunchCooperativeKernel(norm, 51, 52, 53, 54, 55, 56, 256, S(0x7001), params);
    cuGraphLaunch((CUgraphExec)(unsigned long)0x8001, S(0x7001));
    cuMemcpyHtoDAsync_v2(0xd000, params, 4096, S(0x7001));
    cuMemcpyDtoHAsync_v2(params, 0xd000, 8192, S(0x7002));
    cuMemcpyAsync(0xd000, 0xe000, 16384, S(0x7003));
    cuStreamSynchronize(S(0x7001));
    cuCtxSynchronize();
    printf("{\"pid\":%d,\"add\":%lu,\"norm\":%lu}\n", getpid(), (unsigned long)add,
           (unsigned long)norm);
    fflush(stdout);
    if (hang)
        cuStreamSynchronize(S(0xdead));
    return 0;
}
