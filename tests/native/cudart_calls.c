/* Calls NVIDIA's real libcudart.so.12 with known arguments, each API once.
 * Without a GPU driver every call returns an error, but it is entered with
 * these arguments, which is what the probes decode. The declarations are
 * the CUDA 12 prototypes (cuda_runtime_api.h, driver_types.h, vector_types.h),
 * written out because the toolkit headers are not installed here.
 *
 * Prints one JSON line with what it passed that the test cannot know: the
 * kernel host-stub addresses and the return codes.
 *
 * Usage: cudart_calls [LINGER_MS]: stay alive that long after the calls,
 * as a server would: kernel names are resolved through /proc/PID/maps
 * while the process runs. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "cuda_runtime_api.h"

/* Host stubs named as nvcc names kernels: C++ mangled, so the agent's
 * demangling is exercised too. */
void vector_add_stub(void) __asm__("_Z10vector_addPKfS0_Pfi");
void vector_add_stub(void) { }
void softmax_stub(void) __asm__("_ZN6kernel7softmaxEPfi");
void softmax_stub(void) { }
void gelu_stub(void) __asm__("_Z4geluPf");
void gelu_stub(void) { }

#define S(v) ((cudaStream_t)(unsigned long)(v))

int main(int argc, char **argv)
{
    static char host_a[4096], host_b[4096];
    void *args[1] = { host_a };
    int rc[12];
    dim3 g1 = { 3, 4, 5 }, b1 = { 6, 7, 8 };
    rc[0] = cudaLaunchKernel((const void *)vector_add_stub, g1, b1, args, 1024, S(0x1234));
    dim3 g2 = { 9, 10, 11 }, b2 = { 12, 13, 14 };
    rc[1] = cudaLaunchKernel_ptsz((const void *)softmax_stub, g2, b2, args, 2048, S(0x2345));
    cudaLaunchConfig_t cfg = { { 15, 16, 17 }, { 18, 19, 20 }, 4096, S(0x3456), NULL, 0 };
    rc[2] = cudaLaunchKernelExC(&cfg, (const void *)gelu_stub, args);
    rc[3] = cudaGraphLaunch((cudaGraphExec_t)(unsigned long)0x4567, S(0x5678));
    for (int kind = 0; kind <= 4; kind++)
        rc[4 + kind] = cudaMemcpyAsync(host_b, host_a, 100 + kind, (enum cudaMemcpyKind)kind,
                                       S(0x6000 + kind));
    rc[9] = cudaMemcpy(host_b, host_a, 777, cudaMemcpyHostToDevice);
    rc[10] = cudaStreamSynchronize(S(0x3456));
    printf("{\"pid\":%d,\"vector_add\":%lu,\"softmax\":%lu,\"gelu\":%lu,\"rc\":[",
           getpid(), (unsigned long)vector_add_stub, (unsigned long)softmax_stub,
           (unsigned long)gelu_stub);
    for (int i = 0; i < 11; i++)
        printf("%s%d", i ? "," : "", rc[i]);
    printf("]}\n");
    fflush(stdout);
    if (argc > 1)
        usleep(atoi(argv[1]) * 1000);
    return 0;
}
