/* A launch-heavy loop on the real libcudart, driven from stdin, for the
 * adaptive-mode test and the benchmark. For each line "run N [L [SPIN_NS]]"
 * it makes N iterations of: L cudaLaunchKernel calls (default 1), each
 * followed by SPIN_NS of busy host work (default 0: without a driver a
 * launch returns at once, so a benchmark can stand in the few microseconds
 * a real launch takes), then, unless "launch-only", one cudaMemcpyAsync and
 * one cudaStreamSynchronize. Prints "done SECONDS" (the loop's wall time).
 * Anything else (or EOF) ends it.
 *
 * Usage: launch_loop [launch-only] */
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_runtime_api.h"

void loop_stub(void) __asm__("_Z9loop_stepPf");
void loop_stub(void) { }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void spin(long ns)
{
    if (ns <= 0)
        return;
    double end = now_s() + ns / 1e9;
    while (now_s() < end)
        ;
}

int main(int argc, char **argv)
{
    int launch_only = argc > 1 && strcmp(argv[1], "launch-only") == 0;
    cudaStream_t stream = (cudaStream_t)(unsigned long)0x100;
    static char buf[64];
    void *args[1] = { buf };
    dim3 grid = { 64, 1, 1 }, block = { 256, 1, 1 };
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %d\n", getpid());
    while (fgets(line, sizeof(line), stdin)) {
        long n = 0, per_sync = 1, spin_ns = 0;
        if (sscanf(line, "run %ld %ld %ld", &n, &per_sync, &spin_ns) < 1)
            break;
        double start = now_s();
        for (long i = 0; i < n; i++) {
            for (long k = 0; k < per_sync; k++) {
                cudaLaunchKernel((const void *)loop_stub, grid, block, args, 0, stream);
                spin(spin_ns);
            }
            if (!launch_only) {
                cudaMemcpyAsync(buf, buf, sizeof(buf), 1, stream);
                cudaStreamSynchronize(stream);
            }
        }
        printf("done %.9f\n", now_s() - start);
    }
    return 0;
}
