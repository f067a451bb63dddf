/* Launches the way cuBLAS 13 makes them, through the toolkit's cuda.h:
 * kernels taken from a library with cuLibraryGetKernel, launched as a
 * CUkernel (cast to CUfunction, as cuLaunchKernel accepts) and as the
 * CUfunction of cuKernelGetFunction, with cuLaunchKernel and
 * cuLaunchKernelEx. One kernel's handles are taken before the tracer
 * attaches: only cuFuncGetName can name it then.
 *
 * Prints {"pid"} and waits for a line on stdin (the tracer attaches), then
 * calls, prints one JSON line, and waits for stdin to close. */
#include <stdio.h>
#include <unistd.h>
#include <cuda.h>

static const char image[] = "stand-in library image";

int main(void)
{
    CUlibrary lib;
    CUkernel early_kernel, gemm, gemv;
    CUfunction early, gemm_fn, gemv_fn;
    char line[64];
    if (cuLibraryLoadData(&lib, image, NULL, NULL, 0, NULL, NULL, 0) != CUDA_SUCCESS)
        return 2;
    if (cuLibraryGetKernel(&early_kernel, lib, "_ZN6cublas6epilogEPfi") != CUDA_SUCCESS ||
        cuKernelGetFunction(&early, early_kernel) != CUDA_SUCCESS)
        return 2;
    printf("{\"pid\": %d}\n", (int)getpid());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 2;
    cuLibraryGetKernel(&gemm, lib, "_ZN6cublas4gemmIfEEvPKT_S3_PS1_i");
    cuLibraryGetKernel(&gemv, lib, "gemv_splitk_kernel");
    cuKernelGetFunction(&gemv_fn, gemv);
    cuKernelGetFunction(&gemm_fn, gemm);
    CUstream stream = (CUstream)0xc0b1a5;
    /* a CUkernel launched as it is */
    cuLaunchKernel((CUfunction)gemm, 8, 4, 1, 128, 1, 1, 4096, stream, NULL, NULL);
    /* CUfunctions of cuKernelGetFunction, with cuLaunchKernelEx */
    CUlaunchConfig cfg = {.gridDimX = 16, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 256,
                          .blockDimY = 1, .blockDimZ = 1, .sharedMemBytes = 512,
                          .hStream = stream};
    cuLaunchKernelEx(&cfg, gemv_fn, NULL, NULL);
    cuLaunchKernel(gemm_fn, 2, 2, 2, 32, 4, 1, 0, stream, NULL, NULL);
    /* a CUfunction made before tracing began: named by asking the driver */
    const char *name = NULL;
    cuFuncGetName(&name, early);
    cuLaunchKernel(early, 1, 1, 1, 64, 1, 1, 0, stream, NULL, NULL);
    printf("{\"pid\": %d, \"stream\": %lu, \"asked\": \"%s\"}\n", (int)getpid(),
           (unsigned long)stream, name ? name : "");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin))
        ;
    return 0;
}
