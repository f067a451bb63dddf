/* STAND-IN for the CUDA 12+ library-loading part of NVIDIA's libcuda.so.1
 * (no driver on the test hosts), compiled against the toolkit's own
 * cuda.h, so every prototype is the real one: cuLibraryLoadData,
 * cuLibraryGetKernel, cuKernelGetFunction, cuFuncGetName and the launches
 * cuBLAS 13 makes. Handles are counters; a CUfunction remembers the name
 * of its CUkernel so that cuFuncGetName can answer. */
#include <stdint.h>
#include <string.h>
#include <cuda.h>

#define MAX_KERNELS 64
static const char *kernel_names[MAX_KERNELS];
static unsigned kernels;
static volatile unsigned long calls;

/* Kernel i is handle 0x1000 + 16 i; its CUfunction 0x9000 + 16 i. */
static uintptr_t kernel_handle(unsigned i) { return 0x1000 + 16 * (uintptr_t)i; }
static uintptr_t function_handle(unsigned i) { return 0x9000 + 16 * (uintptr_t)i; }

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions)
{
    calls++;
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    *library = (CUlibrary)0x11b;
    return CUDA_SUCCESS;
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    calls++;
    if (!pKernel || !name || !*name || kernels == MAX_KERNELS)
        return CUDA_ERROR_NOT_FOUND;
    kernel_names[kernels] = name;
    *pKernel = (CUkernel)kernel_handle(kernels++);
    return CUDA_SUCCESS;
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    calls++;
    uintptr_t k = (uintptr_t)kernel;
    if (!pFunc || k < kernel_handle(0) || k >= kernel_handle(kernels))
        return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = (CUfunction)function_handle((unsigned)((k - kernel_handle(0)) / 16));
    return CUDA_SUCCESS;
}

CUresult cuFuncGetName(const char **name, CUfunction hfunc)
{
    calls++;
    uintptr_t f = (uintptr_t)hfunc;
    if (!name || f < function_handle(0) || f >= function_handle(kernels))
        return CUDA_ERROR_INVALID_HANDLE;
    *name = kernel_names[(f - function_handle(0)) / 16];
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra)
{
    calls++;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra)
{
    calls++;
    return CUDA_SUCCESS;
}
