/* The GPU check's rehearsal workload (bench/gpu_check --rehearse): a
 * decode-like loop whose every submission is known, standing in for the
 * PyTorch loop and torch.profiler of the real run. It calls both layers in
 * one process, as PyTorch does: NVIDIA's real libcudart.so.12 (its own
 * kernels, graph replays, copies, syncs; without a driver each call fails,
 * the probes see it all the same) and the libcuda.so.1 stand-in
 * (cuda_driver_standin.c): kernels named as Triton names them
 * (cuModuleGetFunction) and as cuBLAS 13 does (cuLibraryGetKernel, then a
 * CUkernel launched as it is, or its CUfunction from cuKernelGetFunction).
 *
 * Prints {"pid": P} and waits for a line "go STEPS" (the tracer attaches in
 * between). Then it takes its kernels' handles, runs STEPS steps between
 * two CLOCK_MONOTONIC stamps, and prints one JSON line: the window and the
 * reference list of what it submitted, in the shape bench/gpu_compare.py
 * makes of a torch.profiler trace (kernel names as a profiler gives them:
 * demangled). It waits for stdin to close before it exits. */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_runtime_api.h"
#include "cuda_driver_api.h"

/* Host stubs of the runtime's kernels, named as nvcc names them. */
void embedding_stub(void) __asm__("_ZN6decode9embeddingEPKiPfi");
void embedding_stub(void) { }
void rms_norm_stub(void) __asm__("_ZN6decode8rms_normEPfPKfi");
void rms_norm_stub(void) { }
void softmax_stub(void) __asm__("_ZN6decode7softmaxEPfi");
void softmax_stub(void) { }

#define LAYERS 2
#define MAX_KINDS 16

struct kind {
    const char *api, *name;
    long count;
};
static struct kind kinds[MAX_KINDS];
static int nkinds;
static long graph_launches, h2d, d2h, syncs;

static void count(const char *api, const char *name)
{
    for (int i = 0; i < nkinds; i++)
        if (kinds[i].api == api && kinds[i].name == name) {
            kinds[i].count++;
            return;
        }
    if (nkinds < MAX_KINDS)
        kinds[nkinds++] = (struct kind){ api, name, 1 };
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static const char EMBEDDING[] = "decode::embedding(int const*, float*, int)";
static const char RMS_NORM[] = "decode::rms_norm(float*, float const*, int)";
static const char SOFTMAX[] = "decode::softmax(float*, int)";
static const char TRITON[] = "triton_poi_fused_silu_mul_0";
static const char GEMM[] = "void cublas::gemm<float>(float const*, float const*, float*, int)";
static const char GEMV[] = "gemv_splitk_kernel";

int main(void)
{
    char line[64];
    long steps = 0;
    static char host[4096];
    void *args[1] = { host };
    cudaStream_t stream = (cudaStream_t)(unsigned long)0xdec0;
    CUstream cu_stream = (CUstream)(unsigned long)0xdec0;
    dim3 grid = { 32, 1, 1 }, block = { 256, 1, 1 };

    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("{\"pid\": %d}\n", (int)getpid());
    if (!fgets(line, sizeof line, stdin) || sscanf(line, "go %ld", &steps) != 1 || steps < 1)
        return 2;

    /* Handles taken once, as a framework does at its first use of a kernel. */
    CUmodule module = (CUmodule)(unsigned long)0x7700;
    CUlibrary library = (CUlibrary)(unsigned long)0x11b;
    CUfunction triton = 0, gemv = 0;
    CUkernel gemm_kernel = 0, gemv_kernel = 0;
    if (cuModuleGetFunction(&triton, module, TRITON) ||
        cuLibraryGetKernel(&gemm_kernel, library, "_ZN6cublas4gemmIfEEvPKT_S3_PS1_i") ||
        cuLibraryGetKernel(&gemv_kernel, library, GEMV) ||
        cuKernelGetFunction(&gemv, gemv_kernel))
        return 3;
    cudaGraphExec_t graph = (cudaGraphExec_t)(unsigned long)0x6a00;
    CUgraphExec cu_graph = (CUgraphExec)(unsigned long)0x6b00;
    CUlaunchConfig cfg = { 64, 1, 1, 128, 1, 1, 1024, cu_stream, NULL, 0 };

    long long start = now_ns();
    for (long s = 0; s < steps; s++) {
        cudaMemcpyAsync(host, host, 64, cudaMemcpyHostToDevice, stream);     /* token ids */
        h2d++;
        cudaLaunchKernel((const void *)embedding_stub, grid, block, args, 0, stream);
        count("cudaLaunchKernel", EMBEDDING);
        for (int layer = 0; layer < LAYERS; layer++) {
            cudaLaunchKernel((const void *)rms_norm_stub, grid, block, args, 0, stream);
            count("cudaLaunchKernel", RMS_NORM);
            cuLaunchKernel((CUfunction)gemm_kernel, 8, 4, 1, 128, 1, 1, 4096, cu_stream, NULL,
                           NULL);
            count("cuLaunchKernel", GEMM);
            cudaLaunchKernel((const void *)softmax_stub, grid, block, args, 0, stream);
            count("cudaLaunchKernel", SOFTMAX);
            cuLaunchKernelEx(&cfg, gemv, NULL, NULL);
            count("cuLaunchKernelEx", GEMV);
            cuLaunchKernel(triton, 16, 1, 1, 256, 1, 1, 0, cu_stream, NULL, NULL);
            count("cuLaunchKernel", TRITON);
        }
        cudaGraphLaunch(graph, stream);          /* the MLP, captured once, replayed */
        cuGraphLaunch(cu_graph, cu_stream);
        graph_launches += 2;
        cuMemcpyDtoHAsync_v2(host, 0xd000, 256, cu_stream);               /* logits */
        cudaMemcpyAsync(host, host, 8, cudaMemcpyDeviceToHost, stream);  /* next token */
        d2h += 2;
        cudaStreamSynchronize(stream);
        syncs++;
    }
    long long end = now_ns();

    printf("{\"pid\": %d, \"window_ns\": [%lld, %lld], \"steps\": %ld, \"launches\": [",
           (int)getpid(), start, end, steps);
    for (int i = 0; i < nkinds; i++)
        printf("%s{\"api\": \"%s\", \"name\": \"%s\", \"count\": %ld}", i ? ", " : "",
               kinds[i].api, kinds[i].name, kinds[i].count);
    printf("], \"graph_launches\": %ld, \"graph_kernels\": null, "
           "\"memcpy\": {\"h2d\": %ld, \"d2h\": %ld}, \"syncs\": %ld}\n",
           graph_launches, h2d, d2h, syncs);
    while (fgets(line, sizeof line, stdin))
        ;
    return 0;
}
