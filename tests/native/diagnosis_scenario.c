/* The diagnosis' ground truth: a launching thread that runs healthy for
 * BASE_S seconds, then meets one incident for INCIDENT_S seconds. Each
 * iteration does 1 ms of host work, submits 4 operations, syncs its stream
 * and sleeps 1 ms; the incident changes that as its mode says:
 *   healthy       nothing changes
 *   cpu_starved   a process named cpu_hog spins 3 ms of every 4 on the
 *                 launcher's CPU, at a higher SCHED_FIFO priority
 *   cfs_starved   the launcher is an ordinary thread at nice -10, and 3
 *                 processes named cpu_hog spin on its CPU at its niceness
 *                 (the scheduler's fair share: each wait is capped near a
 *                 time slice); the host's load at nice 0 and above weighs
 *                 a tenth of it or less
 *   host_bound    4 ms of host work and no sleep
 *   bus_bound     a synchronous 8 MB copy (the stand-in runtime blocks it
 *                 for its bytes over the simulated link)
 *   device_bound  the sync blocks for 8 ms (the stand-in's compute budget)
 *   blocked       the launcher waits for each work item on a pipe that a
 *                 slow feeder writes every 20 ms
 *   npu_queue     (built with -DASCEND) the stream sync waits 8 ms on the
 *                 NPU's queue (the stand-in AscendCL's MMTRACE_STANDIN_SYNC_US)
 * The launcher is a SCHED_FIFO thread (priority 5), so that no ordinary
 * thread of a busy host delays it and only the incident does; the hog is
 * SCHED_FIFO above it, the feeder an ordinary process.
 * Built against the real libcudart (healthy, cpu_starved, host_bound,
 * blocked), the stand-in runtime (bus_bound, device_bound) or the stand-in
 * AscendCL (npu_queue).
 * Usage: diagnosis_scenario MODE BASE_S INCIDENT_S CPU
 * Prints one JSON line at the end: {"pid":..,"tid":..,"incident_ns":..,
 * "end_ns":..,"hogs":[..]} (CLOCK_MONOTONIC). */
#define _GNU_SOURCE
#include "../workloads/threads.h"
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef ASCEND
#include "ascend_api.h"
#define SUBMIT() aclopExecuteV2("MatMul", 0, NULL, NULL, 0, NULL, NULL, NULL, stream)
#define SYNC() aclrtSynchronizeStream(stream)
#define COPY(dst, src, n) ((void)0)
typedef aclrtStream stream_t;
#else
#include "cuda_runtime_api.h"
void step_stub(void) __asm__("_Z4stepPf");
void step_stub(void) { }
#define SUBMIT() cudaLaunchKernel((const void *)step_stub, grid, block, NULL, 0, stream)
#define SYNC() cudaStreamSynchronize(stream)
#define COPY(dst, src, n) cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice)
typedef cudaStream_t stream_t;
#endif

#define COPY_BYTES (8L << 20)

static pid_t spawn(const char *name, int cpu, void (*body)(void *), void *arg)
{
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_NAME, name);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (cpu >= 0)
            pin(cpu);
        body(arg);
        _exit(0);
    }
    return pid;
}

static void fair_hog(void *arg)
{
    (void)arg;
    for (;;)
        ;
}

static void hog(void *arg)
{
    (void)arg;
    become_fifo("cpu_hog");
    for (;;) {
        spin_for_ns(3000000);
        usleep(1000);
    }
}

static void feeder(void *arg)
{
    int fd = *(int *)arg;
    struct sched_param ordinary = { .sched_priority = 0 };
    pthread_setschedparam(pthread_self(), SCHED_OTHER, &ordinary);   /* not the launcher's FIFO */
    for (;;) {
        usleep(20000);
        if (write(fd, "x", 1) != 1)
            return;
    }
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: diagnosis_scenario MODE BASE_S INCIDENT_S CPU\n");
        return 2;
    }
    const char *mode = argv[1];
    double base = atof(argv[2]), incident = atof(argv[3]);
    int cpu = atoi(argv[4]);
    pin(cpu);
    int fair = !strcmp(mode, "cfs_starved");
    if (!fair)
        become_fifo_at("diagnosis_scenario", 5);
    else if (setpriority(PRIO_PROCESS, 0, -10) != 0) {
        perror("diagnosis_scenario: nice -10 (needs CAP_SYS_NICE)");
        return 3;
    }
    stream_t stream = 0;
    /* The stand-ins' sync: quick while healthy (read at every call). */
    setenv("MMTRACE_STANDIN_SYNC_US", "100", 1);
#ifdef ASCEND
    aclrtSetDevice(0);
#else
    dim3 grid = { 1, 1, 1 }, block = { 32, 1, 1 };
#endif
    static char buffer[COPY_BYTES];
    long start = now_ns(), incident_at = start + (long)(base * 1e9);
    long end = incident_at + (long)(incident * 1e9);
    int started = 0, pipe_fds[2] = { -1, -1 };
    pid_t hogs[3] = { 0, 0, 0 }, feeding = 0;
    while (now_ns() < end) {
        int in_incident = now_ns() >= incident_at;
        if (in_incident && !started) {
            started = 1;
            if (!strcmp(mode, "cpu_starved"))
                hogs[0] = spawn("cpu_hog", cpu, hog, NULL);
            if (fair)
                for (int i = 0; i < 3; i++)
                    hogs[i] = spawn("cpu_hog", cpu, fair_hog, NULL);
            if (!strcmp(mode, "device_bound") || !strcmp(mode, "npu_queue"))
                setenv("MMTRACE_STANDIN_SYNC_US", "8000", 1);
            if (!strcmp(mode, "blocked")) {
                if (pipe(pipe_fds) != 0)
                    return 1;
                feeding = spawn("slow_feeder", -1, feeder, &pipe_fds[1]);
            }
        }
        int host_bound = in_incident && !strcmp(mode, "host_bound");
        spin_for_ns(host_bound ? 4000000 : 1000000);
        for (int i = 0; i < 4; i++)
            SUBMIT();
        if (in_incident && !strcmp(mode, "bus_bound"))
            COPY(buffer, buffer, COPY_BYTES);
        SYNC();
        if (in_incident && !strcmp(mode, "blocked")) {
            char c;
            if (read(pipe_fds[0], &c, 1) != 1)
                return 1;
        } else if (!host_bound) {
            usleep(1000);
        }
    }
    for (int i = 0; i < 3; i++)
        if (hogs[i])
            kill(hogs[i], SIGKILL);
    if (feeding)
        kill(feeding, SIGKILL);
    while (wait(NULL) > 0)
        ;
    printf("{\"pid\":%d,\"tid\":%ld,\"incident_ns\":%ld,\"end_ns\":%ld,\"hogs\":[%d,%d,%d]}\n",
           getpid(), syscall(SYS_gettid), incident_at, end, hogs[0], hogs[1], hogs[2]);
    return 0;
}
