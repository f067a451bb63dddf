/* A stand-in libcudart.so.12 for the diagnosis scenarios, from the public
 * prototypes (cuda_runtime_api.h): there is no GPU here, and the real
 * runtime without a driver fails every call at once, so nothing in it ever
 * blocks. Here a synchronous copy blocks for its bytes over a simulated link
 * (MMTRACE_STANDIN_LINK_BPS bytes a second, default 1e9), and a stream sync
 * for a simulated compute budget (MMTRACE_STANDIN_SYNC_US, default 0), as a
 * bus-bound or device-bound host sees them. Launches succeed at once. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_runtime_api.h"

static void sleep_ns(long ns)
{
    struct timespec ts = { ns / 1000000000L, ns % 1000000000L };
    while (nanosleep(&ts, &ts) != 0)
        ;
}

static double env_number(const char *name, double fallback)
{
    const char *text = getenv(name);
    return text && *text ? atof(text) : fallback;
}

cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                             size_t sharedMem, cudaStream_t stream)
{
    return 0;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                            enum cudaMemcpyKind kind, cudaStream_t stream)
{
    return 0;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    double rate = env_number("MMTRACE_STANDIN_LINK_BPS", 1e9);
    sleep_ns((long)(count / rate * 1e9));
    return 0;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    long budget_us = (long)env_number("MMTRACE_STANDIN_SYNC_US", 0);
    if (budget_us > 0)
        sleep_ns(budget_us * 1000L);
    return 0;
}

cudaError_t cudaSetDevice(int device)
{
    return device < 0;
}

/* Device memory: pointers handed out from a simulated address space (no
 * memory is taken); a free always succeeds. */
static uintptr_t next_device_ptr = 0x100000000000UL;

static void *device_range(size_t size)
{
    void *ptr = (void *)next_device_ptr;
    next_device_ptr += (size + 0xfff) & ~(uintptr_t)0xfff;
    return ptr;
}

#ifdef MMTRACE_STANDIN_NESTED
/* As NVIDIA's runtime does: its allocations go through the driver's. */
extern int cuMemAlloc_v2(unsigned long long *dptr, size_t bytesize);
extern int cuMemFree_v2(unsigned long long dptr);

cudaError_t cudaMalloc(void **devPtr, size_t size)
{
    unsigned long long ptr = 0;
    int rc = cuMemAlloc_v2(&ptr, size);
    *devPtr = (void *)(uintptr_t)ptr;
    return rc;
}
#else
cudaError_t cudaMalloc(void **devPtr, size_t size)
{
    *devPtr = device_range(size);
    return 0;
}
#endif

cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream)
{
    *devPtr = device_range(size);
    return 0;
}

cudaError_t cudaFree(void *devPtr)
{
#ifdef MMTRACE_STANDIN_NESTED
    if (devPtr != (void *)1)
        return cuMemFree_v2((unsigned long long)(uintptr_t)devPtr);
#endif
    return devPtr == (void *)1 ? 1 /* cudaErrorInvalidValue */ : 0;
}

cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream)
{
    return hStream == (cudaStream_t)1 ? 1 : 0;
}
