/* STAND-IN for Ascend CANN's libopapi.so: a few aclnn operators with the
 * exact two-phase prototypes of the aclnn op headers (aclnn_add.h, ...).
 * Phase 1 (...GetWorkspaceSize) is not probed; phase 2 is. Built by the tests. */
#include <stdint.h>

typedef int32_t aclnnStatus;
typedef void *aclrtStream;
typedef struct aclTensor aclTensor;
typedef struct aclScalar aclScalar;
typedef struct aclOpExecutor aclOpExecutor;

static volatile unsigned long calls;
static unsigned long next_executor = 0x9000;

static aclnnStatus phase1(uint64_t *workspaceSize, aclOpExecutor **executor)
{
    calls++;
    *workspaceSize = 0;
    *executor = (aclOpExecutor *)next_executor;
    next_executor += 0x100;
    return 0;
}

aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other,
                                     const aclScalar *alpha, aclTensor *out,
                                     uint64_t *workspaceSize, aclOpExecutor **executor)
{
    return phase1(workspaceSize, executor);
}

aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor *self, const aclTensor *other,
                                     aclTensor *out, uint64_t *workspaceSize,
                                     aclOpExecutor **executor)
{
    return phase1(workspaceSize, executor);
}

aclnnStatus aclnnSoftmaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out,
                                         uint64_t *workspaceSize, aclOpExecutor **executor)
{
    return phase1(workspaceSize, executor);
}

aclnnStatus aclnnAdd(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                     aclrtStream stream) { calls += 1; return 0; }
aclnnStatus aclnnMul(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                     aclrtStream stream) { calls += 2; return 0; }
aclnnStatus aclnnSoftmax(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                         aclrtStream stream) { calls += 3; return 0; }
