/* A thread launching CUDA kernels through the real libcudart, first alone,
 * then under forced CPU contention. It launches every millisecond and syncs
 * every tenth launch; after BASE_S seconds a SCHED_FIFO hog on the same CPU
 * spins 3 ms of every 5 ms, so the launcher's wake-ups wait up to 3 ms on
 * the run queue. The launcher itself is SCHED_FIFO below the hog: no
 * ordinary thread of a busy host delays it, so its calm phase waits
 * microseconds whatever else runs, and only the hog makes it wait.
 * Usage: launch_phases BASE_S CONTENDED_S CPU
 * Prints one JSON line when contention starts and one at the end:
 * {"pid":..,"launcher_tid":..,"contention_ns":..} */
#define _GNU_SOURCE
#include "threads.h"
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../native/cuda_runtime_api.h"

void work_stub(void) __asm__("_Z4workPf");
void work_stub(void) { }

static volatile int stop;
static int cpu;

static void *hog(void *arg)
{
    (void)arg;
    pin(cpu);
    become_fifo("launch_phases");
    while (!stop) {
        spin_for_ns(3000000);
        usleep(2000);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: launch_phases BASE_S CONTENDED_S CPU\n");
        return 2;
    }
    double base = atof(argv[1]), contended = atof(argv[2]);
    cpu = atoi(argv[3]);
    pin(cpu);
    become_fifo_at("launch_phases launcher", 5);
    int tid = syscall(SYS_gettid);
    long start = now_ns(), switch_at = start + (long)(base * 1e9);
    long end = switch_at + (long)(contended * 1e9);
    pthread_t th;
    int hogging = 0;
    dim3 grid = { 1, 1, 1 }, block = { 32, 1, 1 };
    for (unsigned n = 0; now_ns() < end; n++) {
        if (!hogging && now_ns() >= switch_at) {
            pthread_create(&th, NULL, hog, NULL);
            hogging = 1;
            printf("{\"pid\":%d,\"launcher_tid\":%d,\"contention_ns\":%ld}\n", getpid(), tid,
                   now_ns());
            fflush(stdout);
        }
        cudaLaunchKernel((const void *)work_stub, grid, block, NULL, 0, NULL);
        if (n % 10 == 9)
            cudaStreamSynchronize(NULL);
        usleep(1000);
    }
    stop = 1;
    if (hogging)
        pthread_join(th, NULL);
    printf("{\"pid\":%d,\"launcher_tid\":%d,\"done\":true}\n", getpid(), tid);
    return 0;
}
