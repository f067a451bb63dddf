/* Ground truth for the device memory and hang tests: a caller of the
 * allocation APIs, built against libraries made from the public prototypes
 * (cuda_runtime_api.h, cuda.h, acl/acl_rt.h): the stand-ins here, or the
 * real libcudart (which fails every call without a driver).
 * Usage: device_memory_calls MODE [ARG] where MODE is
 *   calls        each allocation and free once with known sizes, then two
 *                frees that fail; prints the pointers as one JSON line and
 *                lingers ARG ms
 *   runtime      cudaMalloc and cudaFree of 4096 bytes only (real libcudart)
 *   leak         every 10 ms allocates 1 MiB on the GPU and frees nothing,
 *                for ARG ms
 *   balanced     every 10 ms allocates 1 MiB and frees the one before, for ARG ms
 *   npu_hang     two copies on an NPU stream, then its sync, which never
 *                returns (the stand-in's MMTRACE_STANDIN_SYNC_FOREVER=1), on
 *                a thread of its own
 *   chain        the seed's failure: the NPU sync hangs while GPU memory
 *                grows without frees, for ARG ms
 *   loop         ARG cudaMalloc/cudaFree pairs as fast as they go; prints
 *                the ns per pair
 * Modes that run for a while print their JSON line first:
 * {"pid":..,"tid":..,"start_ns":..} (CLOCK_MONOTONIC). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ascend_api.h"
#include "cuda_driver_api.h"
#include "cuda_runtime_api.h"

#define MIB (1UL << 20)

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void started(void)
{
    printf("{\"pid\":%d,\"tid\":%ld,\"start_ns\":%ld}\n", getpid(), syscall(SYS_gettid),
           now_ns());
    fflush(stdout);
}

static void *hang_npu(void *stream)
{
    static char buf[64];
    aclrtSetDevice(1);
    aclrtMemcpyAsync(buf, sizeof(buf), buf, sizeof(buf), 1 /* host to device */, stream);
    aclrtMemcpyAsync(buf, sizeof(buf), buf, sizeof(buf), 2 /* device to host */, stream);
    aclrtSynchronizeStream(stream);
    return NULL;
}

/* Allocates 1 MiB every 10 ms for `ms`, on a fixed schedule from the
 * start (a late wake-up catches up), so that what it holds at any moment
 * is known from the clock; frees the previous one when `balanced`. */
static void grow(long ms, int balanced)
{
    void *previous = NULL;
    long start = now_ns(), end = start + ms * 1000000L;
    for (long k = 0; start + k * 10000000L < end; k++) {
        long wait = start + k * 10000000L - now_ns();
        if (wait > 0)
            usleep(wait / 1000);
        void *ptr = NULL;
        cudaMalloc(&ptr, MIB);
        if (balanced && previous)
            cudaFree(previous);
        previous = ptr;
    }
    if (balanced && previous)
        cudaFree(previous);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "calls";
    long arg = argc > 2 ? atol(argv[2]) : 0;
    if (!strcmp(mode, "calls")) {
        void *rt = NULL, *rt_async = NULL, *acl = NULL;
        CUdeviceptr drv = 0, drv_async = 0;
        int rc[10];
        rc[0] = cudaMalloc(&rt, 1000);
        rc[1] = cudaMallocAsync(&rt_async, 2 * MIB, (cudaStream_t)0x5100);
        rc[2] = cuMemAlloc_v2(&drv, 3 * MIB);
        rc[3] = cuMemAllocAsync(&drv_async, 4 * MIB, (CUstream)0x5200);
        rc[4] = aclrtMalloc(&acl, 5 * MIB, ACL_MEM_MALLOC_HUGE_FIRST);
        rc[5] = cudaFree(rt);
        rc[6] = cudaFreeAsync(rt_async, (cudaStream_t)0x5300);
        rc[7] = cuMemFree_v2(drv);
        rc[8] = cuMemFreeAsync(drv_async, (CUstream)0x5400);
        rc[9] = aclrtFree(acl);
        int failed_free = cudaFree((void *)1);         /* the stand-in refuses it */
        int unknown_free = cudaFree((void *)0x4242000);    /* never allocated */
        printf("{\"pid\":%d,\"rt\":%lu,\"rt_async\":%lu,\"drv\":%llu,\"drv_async\":%llu,"
               "\"acl\":%lu,\"failed_free\":%d,\"unknown_free\":%d,\"rc\":[",
               getpid(), (unsigned long)rt, (unsigned long)rt_async, drv, drv_async,
               (unsigned long)acl, failed_free, unknown_free);
        for (int i = 0; i < 10; i++)
            printf("%s%d", i ? "," : "", rc[i]);
        printf("]}\n");
        fflush(stdout);
        usleep(arg * 1000);
    } else if (!strcmp(mode, "runtime")) {
        void *ptr = NULL;
        int alloc_rc = cudaMalloc(&ptr, 4096);
        int free_rc = cudaFree(ptr);
        printf("{\"pid\":%d,\"alloc_rc\":%d,\"free_rc\":%d}\n", getpid(), alloc_rc, free_rc);
        fflush(stdout);
        usleep(arg * 1000);
    } else if (!strcmp(mode, "leak") || !strcmp(mode, "balanced")) {
        cudaSetDevice(0);
        started();
        grow(arg, !strcmp(mode, "balanced"));
    } else if (!strcmp(mode, "npu_hang") || !strcmp(mode, "chain")) {
        pthread_t npu;
        started();
        pthread_create(&npu, NULL, hang_npu, (void *)0x7700);
        if (!strcmp(mode, "chain")) {
            cudaSetDevice(0);
            grow(arg, 0);
        }
        else
            usleep(arg * 1000);
    } else if (!strcmp(mode, "loop")) {
        long start = now_ns();
        for (long i = 0; i < arg; i++) {
            void *ptr = NULL;
            cudaMalloc(&ptr, 4096);
            cudaFree(ptr);
        }
        printf("{\"pid\":%d,\"ns_per_pair\":%.1f}\n", getpid(),
               (double)(now_ns() - start) / (arg ? arg : 1));
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    return 0;
}
