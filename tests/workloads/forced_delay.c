/* A known run-queue delay. A SCHED_FIFO "hog" and a normal "victim" share
 * one CPU. In each round the victim wakes the hog (which preempts it at
 * once) or the hog wakes the victim; either way the hog then spins for
 * HOG_MS while the victim, runnable, waits on the run queue. The victim
 * measures each wait itself.
 *
 * Usage: forced_delay MODE ROUNDS HOG_MS CPU   (MODE: preempt | wakeup)
 * Prints one JSON line: {"pid":..,"victim_tid":..,"hog_tid":..,"waits_ns":[..]} */
#define _GNU_SOURCE
#include "threads.h"
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int to_hog[2], to_victim[2];
static int rounds, cpu;
static long hog_ns;
static int preempt_mode;
static volatile pid_t victim_tid, hog_tid;
static long *waits;

static void *hog(void *arg)
{
    (void)arg;
    hog_tid = syscall(SYS_gettid);
    pin(cpu);
    become_fifo("forced_delay");
    char c;
    for (int i = 0; i < rounds; i++) {
        if (read(to_hog[0], &c, 1) != 1)
            break;
        if (!preempt_mode && write(to_victim[1], &c, 1) != 1)
            break;
        spin_for_ns(hog_ns);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: forced_delay preempt|wakeup ROUNDS HOG_MS CPU\n");
        return 2;
    }
    preempt_mode = strcmp(argv[1], "preempt") == 0;
    rounds = atoi(argv[2]);
    hog_ns = atol(argv[3]) * 1000000L;
    cpu = atoi(argv[4]);
    waits = calloc(rounds, sizeof(long));
    if (pipe(to_hog) || pipe(to_victim))
        return 1;
    victim_tid = syscall(SYS_gettid);
    pin(cpu);
    pthread_t th;
    pthread_create(&th, NULL, hog, NULL);
    usleep(100000);
    char c = 'x';
    for (int i = 0; i < rounds; i++) {
        long t0 = now_ns();
        if (write(to_hog[1], &c, 1) != 1)
            return 1;
        /* preempt: the hog runs now, we resume after its spin.
         * wakeup: we block until the hog wakes us, then wait for its spin. */
        if (!preempt_mode && read(to_victim[0], &c, 1) != 1)
            return 1;
        waits[i] = now_ns() - t0;
        usleep(2000);
    }
    pthread_join(th, NULL);
    printf("{\"pid\":%d,\"victim_tid\":%d,\"hog_tid\":%d,\"waits_ns\":[", getpid(),
           victim_tid, hog_tid);
    for (int i = 0; i < rounds; i++)
        printf("%s%ld", i ? "," : "", waits[i]);
    printf("]}\n");
    return 0;
}
