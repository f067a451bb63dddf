/* An NPU stand-in caller for the soak, driven from stdin like
 * tests/native/launch_loop.c: for each line "run N" it makes N iterations
 * of an aclnnAdd (both phases), an aclrtMemcpyAsync and an
 * aclrtSynchronizeStream on the gcc-built libascendcl.so / libopapi.so
 * stand-ins (tests/native: the public CANN prototypes, trivial bodies; no
 * NPU here), then prints "done SECONDS". Three probed calls per iteration.
 * Anything else (or EOF) ends it. */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "ascend_api.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(void)
{
    aclrtStream stream = (aclrtStream)(unsigned long)0xb001;
    static char buf[256];
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof(line), stdin)) {
        long n = 0;
        if (sscanf(line, "run %ld", &n) < 1)
            break;
        double start = now_s();
        for (long i = 0; i < n; i++) {
            uint64_t ws;
            aclOpExecutor *add;
            aclnnAddGetWorkspaceSize(0, 0, 0, 0, &ws, &add);
            aclnnAdd(buf, 0, add, stream);
            aclrtMemcpyAsync(buf, sizeof(buf), buf, 64, 1, stream);
            aclrtSynchronizeStream(stream);
        }
        printf("done %.6f\n", now_s() - start);
    }
    return 0;
}
