/* STAND-IN for NVIDIA's libcuda.so.1 (no GPU driver on the test hosts).
 * Every function has the exact CUDA 12 prototype from cuda.h, so the probes
 * see arguments where the real driver receives them; bodies only do what
 * the tests need: cuModuleGetFunction and cuLibraryGetKernel hand out a
 * handle, cuKernelGetFunction another for the same kernel, syncs take a
 * measurable moment, and a sync on stream 0xdead never returns (a process
 * killed inside a call). Built by the tests into a temporary folder. */
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "cuda_driver_api.h"

static volatile unsigned long calls;
static unsigned long next_function = 0xf000;

#define BODY { calls++; return 0; }

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra) BODY
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX,
                             unsigned int blockDimY, unsigned int blockDimZ,
                             unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra) BODY
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) BODY
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                               void **kernelParams, void **extra) BODY
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams) BODY
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) BODY
CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) BODY
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream) BODY
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream) BODY
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) BODY

CUresult cuStreamSynchronize(CUstream hStream)
{
    calls++;
    if (hStream == (CUstream)0xdead)
        for (;;)
            pause();
    usleep(2000);
    return 0;
}

CUresult cuCtxSynchronize(void)
{
    calls++;
    usleep(3000);
    return 0;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    calls++;
    if (!name || !*name)
        return 500;     /* CUDA_ERROR_NOT_FOUND */
    *hfunc = (CUfunction)next_function;
    next_function += 0x10;
    return 0;
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    calls++;
    if (!pKernel || !name || !*name)
        return 500;     /* CUDA_ERROR_NOT_FOUND */
    *pKernel = (CUkernel)next_function;
    next_function += 0x10;
    return 0;
}

/* A CUkernel's CUfunction: a handle of its own, as the driver's is. */
CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    calls++;
    if (!pFunc || !kernel)
        return 400;     /* CUDA_ERROR_INVALID_HANDLE */
    *pFunc = (CUfunction)((unsigned long)kernel | 0x100000);
    return 0;
}

/* Device memory: addresses from a simulated range; nothing is taken. */
static CUdeviceptr next_device_ptr = 0x200000000000ULL;

static CUdeviceptr device_range(size_t bytesize)
{
    CUdeviceptr ptr = next_device_ptr;
    next_device_ptr += (bytesize + 0xfff) & ~0xfffULL;
    return ptr;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    *dptr = device_range(bytesize);
    return 0;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    *dptr = device_range(bytesize);
    return 0;
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    calls++;
    return 0;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    calls += 2;
    return 0;
}
