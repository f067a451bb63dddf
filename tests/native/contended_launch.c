/* A launching thread under forced CPU contention, calling the real
 * libcudart. A SCHED_FIFO "hog" and the launching thread share one CPU: in
 * each round the launcher wakes the hog, which preempts it at once and
 * spins for HOG_MS while the launcher waits on the run queue; when the
 * launcher runs again it calls cudaLaunchKernel (grid.x = the round number),
 * and every SYNC_EVERY rounds cudaStreamSynchronize. One more launch comes
 * after the last sync, so it is retired by none.
 *
 * Usage: contended_launch ROUNDS HOG_MS CPU SYNC_EVERY
 * Prints one JSON line: {"pid":..,"launcher_tid":..,"hog_tid":..} */
#define _GNU_SOURCE
#include "../workloads/threads.h"
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_runtime_api.h"

void step_stub(void) __asm__("_Z4stepPf");
void step_stub(void) { }

static int to_hog[2];
static int rounds, cpu;
static long hog_ns;
static volatile pid_t hog_tid;

static void *hog(void *arg)
{
    (void)arg;
    hog_tid = syscall(SYS_gettid);
    pin(cpu);
    become_fifo("contended_launch");
    char c;
    for (int i = 0; i < rounds; i++) {
        if (read(to_hog[0], &c, 1) != 1)
            break;
        spin_for_ns(hog_ns);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: contended_launch ROUNDS HOG_MS CPU SYNC_EVERY\n");
        return 2;
    }
    rounds = atoi(argv[1]);
    hog_ns = atol(argv[2]) * 1000000L;
    cpu = atoi(argv[3]);
    int sync_every = atoi(argv[4]);
    if (pipe(to_hog))
        return 1;
    pin(cpu);
    pthread_t th;
    pthread_create(&th, NULL, hog, NULL);
    while (!hog_tid)
        usleep(1000);
    usleep(20000);      /* the hog is pinned and FIFO, blocked in read */
    cudaStream_t stream = (cudaStream_t)(unsigned long)0x5eed;
    void *args[1] = { NULL };
    dim3 block = { 128, 1, 1 };
    for (int i = 1; i <= rounds; i++) {
        char c = 'x';
        if (write(to_hog[1], &c, 1) != 1)   /* the hog preempts us here */
            return 1;
        dim3 grid = { (unsigned)i, 1, 1 };
        cudaLaunchKernel((const void *)step_stub, grid, block, args, 0, stream);
        if (i % sync_every == 0)
            cudaStreamSynchronize(stream);
    }
    dim3 last = { (unsigned)rounds + 1, 1, 1 };
    cudaLaunchKernel((const void *)step_stub, last, block, args, 0, stream);
    pthread_join(th, NULL);
    printf("{\"pid\":%d,\"launcher_tid\":%ld,\"hog_tid\":%d}\n", getpid(),
           (long)syscall(SYS_gettid), hog_tid);
    return 0;
}
