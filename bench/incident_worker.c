/* A launcher for bench/bench_detection.py whose incidents are switched on
 * and off from stdin while it runs, and which reports what its users see.
 *
 * Each step does 1 ms of host work, submits 4 operations (a kernel launch
 * through the runtime, or an operator on the NPU), syncs, and sleeps 1 ms.
 * After each step it sends the step's latency to the agent's hint socket as
 * a dispatcher would ("sample", series = its name), and every 10th step
 * the attention entropy of 16 heads ("entropy", modality = its name).
 * A line on stdin sets what the next steps meet:
 *   healthy
 *   host_bound US      US of host work a step, no sleep
 *   bus_bound BYTES    a synchronous copy of BYTES a step (the stand-in
 *                      runtime blocks it for BYTES over its simulated link)
 *   device_bound US    the sync blocks for US (the stand-in's compute budget)
 *   npu_queue US       the step goes to the NPU and its stream sync waits US
 *                      on the stand-in AscendCL's queue
 *   blocked US         each step waits for its input on a pipe that a
 *                      feeder thread writes every US
 *   input_shift        4 of the 16 heads' entropy rise far above their level
 * CPU starvation is made from outside (hogs on its CPU).
 *
 * Linked against stand-ins built from the public prototypes: no GPU or NPU
 * is here, and a real runtime without a driver never blocks.
 * Usage: incident_worker NAME SOCKET CPU */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "../tests/native/ascend_api.h"
#include "../tests/native/cuda_runtime_api.h"

void step_stub(void) __asm__("_Z4stepPf");
void step_stub(void) { }

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void spin_ns(long ns)
{
    long end = now_ns() + ns;
    while (now_ns() < end)
        ;
}

static volatile long feed_period_us;
static int pipe_fds[2];

static void *feeder(void *arg)
{
    (void)arg;
    for (;;) {
        long period = feed_period_us;
        usleep(period > 0 ? period : 10000);
        if (period > 0 && write(pipe_fds[1], "x", 1) != 1)
            return NULL;
    }
}

static int connect_to(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    strncpy(addr.sun_path, path, sizeof(addr.sun_path) - 1);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
        return -1;
    fcntl(fd, F_SETFL, O_NONBLOCK);     /* a slow agent costs samples, never steps */
    return fd;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: incident_worker NAME SOCKET CPU\n");
        return 2;
    }
    const char *name = argv[1];
    int cpu = atoi(argv[3]);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof(set), &set);
    int agent = -1;
    long next_connect = 0;
    if (pipe(pipe_fds) != 0)
        return 1;
    pthread_t th;
    pthread_create(&th, NULL, feeder, NULL);
    aclrtSetDevice(0);
    fcntl(0, F_SETFL, O_NONBLOCK);
    static char buffer[64 << 20];
    char mode[32] = "healthy", line[128];
    long size = 0;
    dim3 grid = { 1, 1, 1 }, block = { 32, 1, 1 };
    unsigned seed = 1;
    char msg[2048];
    printf("{\"pid\":%d}\n", getpid());
    fflush(stdout);
    for (unsigned step = 0;; step++) {
        ssize_t got = read(0, line, sizeof(line) - 1);
        if (got == 0)
            break;                      /* stdin closed: done */
        if (got > 0) {
            line[got] = 0;
            char *last = line, *nl;
            while ((nl = strchr(last, '\n')) && nl[1])
                last = nl + 1;          /* the latest command wins */
            size = 0;
            sscanf(last, "%31s %ld", mode, &size);
            char budget[32];
            snprintf(budget, sizeof(budget), "%ld", !strcmp(mode, "device_bound") ||
                     !strcmp(mode, "npu_queue") ? size : 100);
            setenv("MMTRACE_STANDIN_SYNC_US", budget, 1);
            feed_period_us = !strcmp(mode, "blocked") ? size : 0;
        }
        long start = now_ns();
        int host = !strcmp(mode, "host_bound");
        spin_ns(host ? size * 1000 : 1000000);
        if (!strcmp(mode, "npu_queue")) {
            for (int i = 0; i < 4; i++)
                aclopExecuteV2("MatMul", 0, NULL, NULL, 0, NULL, NULL, NULL, NULL);
            aclrtSynchronizeStream(NULL);
        } else {
            for (int i = 0; i < 4; i++)
                cudaLaunchKernel((const void *)step_stub, grid, block, NULL, 0, 0);
            if (!strcmp(mode, "bus_bound"))
                cudaMemcpy(buffer, buffer, size < (long)sizeof(buffer) ? size : sizeof(buffer),
                           cudaMemcpyHostToDevice);
            cudaStreamSynchronize(0);
        }
        if (!strcmp(mode, "blocked")) {
            char c;
            if (read(pipe_fds[0], &c, 1) != 1)
                return 1;
        } else if (!host) {
            usleep(1000);
        }
        double ms = (now_ns() - start) / 1e6;
        if (agent < 0 && now_ns() >= next_connect) {
            agent = connect_to(argv[2]);
            next_connect = now_ns() + 1000000000L;
        }
        if (agent >= 0) {
            int n = snprintf(msg, sizeof(msg), "{\"v\":1,\"type\":\"sample\",\"series\":\"%s\","
                             "\"modality\":\"%s\",\"value_ms\":%.4f}\n", name, name, ms);
            if (step % 10 == 0) {
                n += snprintf(msg + n, sizeof(msg) - n, "{\"v\":1,\"type\":\"entropy\","
                              "\"modality\":\"%s\",\"values\":[", name);
                for (int h = 0; h < 16; h++) {
                    double level = 0.3 + 0.02 * h;
                    if (h < 4 && !strcmp(mode, "input_shift"))
                        level = 0.97;
                    level += ((rand_r(&seed) % 2001) - 1000) / 1e5;
                    n += snprintf(msg + n, sizeof(msg) - n, "%s{\"layer\":\"l0\",\"head\":%d,"
                                  "\"value\":%.4f}", h ? "," : "", h, fmin(1.0, level));
                }
                n += snprintf(msg + n, sizeof(msg) - n, "]}\n");
            }
            if (send(agent, msg, n, MSG_NOSIGNAL) < 0 && errno != EAGAIN) {
                close(agent);
                agent = -1;
            }
        }
    }
    return 0;
}
