/* What the C workloads share: a monotonic clock, pinning the calling thread
 * to a CPU, and making it a SCHED_FIFO thread (the "hog" that forces a known
 * run-queue delay on the threads sharing its CPU). */
#ifndef MMTRACE_WORKLOAD_THREADS_H
#define MMTRACE_WORKLOAD_THREADS_H
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* SCHED_FIFO at `priority`; exits with status 3, naming `who`, where the
 * kernel refuses. */
static void become_fifo_at(const char *who, int priority)
{
    struct sched_param sp = { .sched_priority = priority };
    if (pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp) != 0) {
        fprintf(stderr, "%s: SCHED_FIFO refused (needs CAP_SYS_NICE)\n", who);
        exit(3);
    }
}

static void become_fifo(const char *who)
{
    become_fifo_at(who, 10);
}

static void spin_for_ns(long ns)
{
    long end = now_ns() + ns;
    while (now_ns() < end)
        ;
}
#endif
