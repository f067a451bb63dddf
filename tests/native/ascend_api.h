/* The Ascend CANN API the test and benchmark programs call, as the public
 * headers declare it (acl/acl_rt.h, acl/acl_op.h, acl/acl_op_compiler.h,
 * acl/acl_mdl.h, the aclnn op headers): types reduced to what the calls need. */
#ifndef MMTRACE_TEST_ASCEND_API_H
#define MMTRACE_TEST_ASCEND_API_H
#include <stddef.h>
#include <stdint.h>

typedef int aclError;
typedef int32_t aclnnStatus;
typedef void *aclrtStream;
typedef struct aclOpExecutor aclOpExecutor;
typedef struct aclTensor aclTensor;
typedef struct aclScalar aclScalar;

aclError aclrtSetDevice(int32_t);
aclError aclopExecuteV2(const char *, int, void *[], void *[], int, void *[], void *[], void *,
                        aclrtStream);
aclError aclopCompileAndExecute(const char *, int, const void *const[], const void *const[],
                                int, const void *const[], void *const[], const void *, int,
                                int, const char *, aclrtStream);
aclError aclopCompileAndExecuteV2(const char *, int, void *[], void *[], int, void *[],
                                  void *[], void *, int, int, const char *, aclrtStream);
aclError aclmdlExecute(uint32_t, const void *, void *);
aclError aclmdlExecuteAsync(uint32_t, const void *, void *, aclrtStream);
aclError aclrtLaunchKernel(void *, uint32_t, const void *, size_t, aclrtStream);
aclError aclrtLaunchKernelWithConfig(void *, uint32_t, aclrtStream, void *, void *, void *);
aclError aclrtLaunchKernelWithHostArgs(void *, uint32_t, aclrtStream, void *, void *, size_t,
                                       void *, size_t);
aclError aclrtMemcpy(void *, size_t, const void *, size_t, int);
aclError aclrtMemcpyAsync(void *, size_t, const void *, size_t, int, aclrtStream);
aclError aclrtSynchronizeStream(aclrtStream);
aclError aclrtSynchronizeStreamWithTimeout(aclrtStream, int32_t);
aclError aclrtSynchronizeDevice(void);
aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *, const aclTensor *, const aclScalar *,
                                     aclTensor *, uint64_t *, aclOpExecutor **);
aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor *, const aclTensor *, aclTensor *,
                                     uint64_t *, aclOpExecutor **);
aclnnStatus aclnnSoftmaxGetWorkspaceSize(const aclTensor *, int64_t, aclTensor *, uint64_t *,
                                         aclOpExecutor **);
aclnnStatus aclnnAdd(void *, uint64_t, aclOpExecutor *, aclrtStream);
aclnnStatus aclnnMul(void *, uint64_t, aclOpExecutor *, aclrtStream);
aclnnStatus aclnnSoftmax(void *, uint64_t, aclOpExecutor *, aclrtStream);

/* Device memory (acl/acl_rt.h). */
typedef enum { ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY,
               ACL_MEM_MALLOC_NORMAL_ONLY } aclrtMemMallocPolicy;
aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);

#endif
