/* STAND-IN for Ascend CANN's libascendcl.so (no NPU on the test hosts).
 * Exact prototypes from CANN's acl/acl_rt.h, acl/acl_op.h,
 * acl/acl_op_compiler.h and acl/acl_mdl.h; bodies only return success,
 * with a measurable moment in the blocking calls. Built by the tests. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtFuncHandle;
typedef void *aclrtArgsHandle;
typedef struct aclrtLaunchKernelCfg aclrtLaunchKernelCfg;
typedef struct aclrtPlaceHolderInfo aclrtPlaceHolderInfo;
typedef struct aclTensorDesc aclTensorDesc;
typedef struct aclDataBuffer aclDataBuffer;
typedef struct aclopAttr aclopAttr;
typedef struct aclmdlDataset aclmdlDataset;
typedef enum { ACL_ENGINE_SYS, ACL_ENGINE_AICORE, ACL_ENGINE_VECTOR } aclopEngineType;
typedef enum { ACL_COMPILE_SYS, ACL_COMPILE_UNREGISTERED } aclopCompileType;
typedef enum {
    ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_DEVICE_TO_DEVICE, ACL_MEMCPY_DEFAULT, ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE,
    ACL_MEMCPY_INNER_DEVICE_TO_DEVICE, ACL_MEMCPY_INTER_DEVICE_TO_DEVICE
} aclrtMemcpyKind;

static volatile unsigned long calls;
#define BODY { calls++; return 0; }

aclError aclrtSetDevice(int32_t deviceId) BODY
aclError aclopExecuteV2(const char *opType, int numInputs, aclTensorDesc *inputDesc[],
                        aclDataBuffer *inputs[], int numOutputs, aclTensorDesc *outputDesc[],
                        aclDataBuffer *outputs[], aclopAttr *attr, aclrtStream stream) BODY
aclError aclopCompileAndExecute(const char *opType, int numInputs,
                                const aclTensorDesc *const inputDesc[],
                                const aclDataBuffer *const inputs[], int numOutputs,
                                const aclTensorDesc *const outputDesc[],
                                aclDataBuffer *const outputs[], const aclopAttr *attr,
                                aclopEngineType engineType, aclopCompileType compileFlag,
                                const char *opPath, aclrtStream stream) BODY
aclError aclopCompileAndExecuteV2(const char *opType, int numInputs, aclTensorDesc *inputDesc[],
                                  aclDataBuffer *inputs[], int numOutputs,
                                  aclTensorDesc *outputDesc[], aclDataBuffer *outputs[],
                                  aclopAttr *attr, aclopEngineType engineType,
                                  aclopCompileType compileFlag, const char *opPath,
                                  aclrtStream stream) BODY
aclError aclmdlExecuteAsync(uint32_t modelId, const aclmdlDataset *input,
                            aclmdlDataset *output, aclrtStream stream) BODY
aclError aclrtLaunchKernel(aclrtFuncHandle funcHandle, uint32_t blockDim, const void *argsData,
                           size_t argsSize, aclrtStream stream) BODY
aclError aclrtLaunchKernelWithConfig(aclrtFuncHandle funcHandle, uint32_t blockDim,
                                     aclrtStream stream, aclrtLaunchKernelCfg *cfg,
                                     aclrtArgsHandle argsHandle, void *reserve) BODY
aclError aclrtLaunchKernelWithHostArgs(aclrtFuncHandle funcHandle, uint32_t numBlocks,
                                       aclrtStream stream, aclrtLaunchKernelCfg *cfg,
                                       void *hostArgs, size_t argsSize,
                                       aclrtPlaceHolderInfo *placeHolderArray,
                                       size_t placeHolderNum) BODY
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream) BODY

aclError aclmdlExecute(uint32_t modelId, const aclmdlDataset *input, aclmdlDataset *output)
{
    calls++;
    usleep(1000);
    return 0;
}

aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                     aclrtMemcpyKind kind)
{
    calls++;
    usleep(1000);
    return 0;
}

/* 2 ms, or the simulated queue wait MMTRACE_STANDIN_SYNC_US (the diagnosis'
 * npu_queue scenario), read at every call. */
aclError aclrtSynchronizeStream(aclrtStream stream)
{
    const char *budget = getenv("MMTRACE_STANDIN_SYNC_US");
    const char *forever = getenv("MMTRACE_STANDIN_SYNC_FOREVER");
    calls++;
    while (forever && *forever == '1')      /* a hung device: the call never returns */
        pause();
    usleep(budget && *budget ? atoi(budget) : 2000);
    return 0;
}

aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout)
{
    calls++;
    usleep(2000);
    return 0;
}

aclError aclrtSynchronizeDevice(void)
{
    calls++;
    usleep(3000);
    return 0;
}

/* Device memory: addresses from a simulated range; nothing is taken. */
typedef enum { ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY,
               ACL_MEM_MALLOC_NORMAL_ONLY } aclrtMemMallocPolicy;
static uintptr_t next_device_ptr = 0x300000000000UL;

aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    *devPtr = (void *)next_device_ptr;
    next_device_ptr += (size + 0xfff) & ~(uintptr_t)0xfff;
    return 0;
}

aclError aclrtFree(void *devPtr)
{
    calls++;
    return 0;
}
