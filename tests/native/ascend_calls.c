/* Calls the libascendcl.so and libopapi.so stand-ins with known arguments,
 * each API once, in the order the test expects. Prints one JSON line with
 * the executors phase 1 handed out.
 *
 * Op types come both as string literals (whose page the kernel may find
 * not yet in memory: the agent then reads them through /proc/PID/mem) and
 * built at run time, as a framework builds them from its op registry.
 *
 * Usage: ascend_calls [LINGER_MS]: stay alive that long after the calls. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ascend_api.h"

#define S(v) ((aclrtStream)(unsigned long)(v))
#define P(v) ((void *)(unsigned long)(v))
/* 90 characters: longer than the event's 64-byte name field. */
#define LONG_OP "FusedInferAttentionScoreWithQuantizedKeyValueCacheAndRotaryEmbeddingPagedV3_0123456789ab"

int main(int argc, char **argv)
{
    char layer_norm[32];
    snprintf(layer_norm, sizeof(layer_norm), "%s%s", "Layer", "Norm");
    uint64_t ws;
    aclOpExecutor *add, *mul, *softmax;
    char host[256];
    aclrtSetDevice(5);
    aclnnAddGetWorkspaceSize(0, 0, 0, 0, &ws, &add);
    aclnnAdd(P(0xa100), 0, add, S(0xb001));
    aclnnMulGetWorkspaceSize(0, 0, 0, &ws, &mul);
    aclnnMul(P(0xa200), 64, mul, S(0xb002));
    aclnnSoftmaxGetWorkspaceSize(0, -1, 0, &ws, &softmax);
    aclnnSoftmax(P(0xa300), 128, softmax, S(0xb001));
    aclopExecuteV2("MatMulV2", 2, 0, 0, 1, 0, 0, 0, S(0xb003));
    aclopCompileAndExecute(layer_norm, 3, 0, 0, 1, 0, 0, 0, 1, 0, "/opp", S(0xb004));
    aclopCompileAndExecuteV2(LONG_OP, 4, 0, 0, 1, 0, 0, 0, 2, 1, NULL, S(0xb005));
    aclmdlExecute(7, 0, 0);
    aclmdlExecuteAsync(8, 0, 0, S(0xb001));
    aclrtLaunchKernel(P(0xc001), 24, host, sizeof(host), S(0xb001));
    aclrtLaunchKernelWithConfig(P(0xc002), 48, S(0xb002), 0, 0, 0);
    aclrtLaunchKernelWithHostArgs(P(0xc003), 96, S(0xb003), 0, host, sizeof(host), 0, 0);
    for (int kind = 0; kind <= 7; kind++)
        aclrtMemcpyAsync(host, sizeof(host), host, 200 + kind, kind, S(0xb001));
    aclrtMemcpy(host, sizeof(host), host, 300, 2);
    aclrtSynchronizeStream(S(0xb001));
    aclrtSynchronizeStreamWithTimeout(S(0xb002), 1000);
    aclrtSynchronizeDevice();
    printf("{\"pid\":%d,\"add\":%lu,\"mul\":%lu,\"softmax\":%lu}\n", getpid(),
           (unsigned long)add, (unsigned long)mul, (unsigned long)softmax);
    fflush(stdout);
    if (argc > 1)
        usleep(atoi(argv[1]) * 1000);
    return 0;
}
