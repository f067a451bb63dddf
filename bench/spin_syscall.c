/* Synthetic event producer: calls getppid() as fast as it can, or at a
 * fixed rate, for a while. Each call fires the tracepoint that the ingest
 * benchmark's program turns into one ring-buffer record.
 * Usage: spin_syscall SECONDS [CALLS_PER_SECOND (0 = flat out)]
 * Starts when a line arrives on stdin (so the tracer can target its pid
 * first); prints the number of calls made. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    double rate = argc > 2 ? atof(argv[2]) : 0.0;
    char go[8];
    if (!fgets(go, sizeof(go), stdin))
        return 1;
    double start = now(), end = start + seconds;
    long calls = 0;
    while (1) {
        double t = now();
        if (t >= end)
            break;
        /* Paced: catch up to where the schedule says we should be, in
         * bursts of at most 1000 calls, then yield the CPU for 100 µs. */
        long target = rate > 0 ? (long)((t - start) * rate) : calls + 1000;
        long burst = target - calls;
        if (burst > 1000)
            burst = 1000;
        for (long i = 0; i < burst; i++)
            getppid();
        calls += burst > 0 ? burst : 0;
        if (rate > 0 && burst < 1000)
            usleep(100);
    }
    printf("%ld\n", calls);
    return 0;
}
