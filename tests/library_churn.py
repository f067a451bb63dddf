"""Library churn, as an unprivileged user can cause it: many distinct copies
of a library defining cudaLaunchKernel, each loaded by a short-lived process
and deleted once that process has exited.

`build(out_dir)` compiles a small stand-in runtime (cudaLaunchKernel,
cudaMemcpy, cudaStreamSynchronize: four uprobe_multi links with every probe
on) and the churn driver. The driver, run as the user, keeps PARALLEL
children alive at once; for each, the parent copies the library to a file
of its own; the child dlopen()s it, calls every function every 20 ms when
CALLS is 1 (else only maps it), lives LIVE_MS and exits; the parent then
deletes that copy. It prints one line per hundred copies, and
"done N failed F" at the end."""

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The daemon's settings for a churn: every probe on (the most links per
# copy), and rings that keep 5 s of events (the churn's scheduler events
# too), so that what is measured once it settles is what the probes hold.
DAEMON_CONFIG = """
tick_s = 0.025
metrics_address = "127.0.0.1:0"
state_dir = "{work}/state"
socket = "{work}/s.sock"
discover_interval_s = {interval}
adaptive_launches = false
ring_seconds = 5
"""

LIBRARY = r"""
#include <stddef.h>
typedef struct { unsigned x, y, z; } dim3;
static volatile unsigned long calls;
int cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **a, size_t s, void *st)
{ calls += g.x; return 0; }
int cudaMemcpy(void *d, const void *s, size_t n, int kind)
{ calls += n; return 0; }
int cudaStreamSynchronize(void *stream)
{ calls += 3; return 0; }
"""

DRIVER = r"""
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;
typedef int (*launch_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*memcpy_fn)(void *, const void *, size_t, int);
typedef int (*sync_fn)(void *);

static void copy_file(const char *from, const char *to)
{
    int in = open(from, O_RDONLY), out = open(to, O_WRONLY | O_CREAT | O_EXCL, 0755);
    struct stat st;
    if (in < 0 || out < 0 || fstat(in, &st) || sendfile(out, in, NULL, st.st_size) != st.st_size) {
        fprintf(stderr, "copy %s -> %s: %s\n", from, to, strerror(errno));
        exit(3);
    }
    close(in);
    close(out);
}

static void child(const char *copy, long live_ms, int calls)
{
    void *lib = dlopen(copy, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen %s: %s\n", copy, dlerror());
        _exit(4);
    }
    launch_fn launch = (launch_fn)dlsym(lib, "cudaLaunchKernel");
    memcpy_fn copy_bytes = (memcpy_fn)dlsym(lib, "cudaMemcpy");
    sync_fn sync = (sync_fn)dlsym(lib, "cudaStreamSynchronize");
    struct timespec end, now;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += live_ms / 1000;
    end.tv_nsec += (live_ms % 1000) * 1000000L;
    if (end.tv_nsec >= 1000000000L) { end.tv_sec++; end.tv_nsec -= 1000000000L; }
    dim3 grid = {1, 1, 1}, block = {32, 1, 1};
    char buf[64];
    do {    /* a call every 20 ms: some land after the probes attach */
        if (calls) {
            launch((const void *)child, grid, block, NULL, 0, NULL);
            copy_bytes(buf, buf + 32, 32, 1);
            sync(NULL);
        }
        usleep(20000);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while (now.tv_sec < end.tv_sec || (now.tv_sec == end.tv_sec && now.tv_nsec < end.tv_nsec));
    _exit(0);
}

int main(int argc, char **argv)
{
    if (argc != 7) {
        fprintf(stderr, "usage: %s LIBRARY DIR COPIES PARALLEL LIVE_MS CALLS\n", argv[0]);
        return 2;
    }
    const char *library = argv[1], *dir = argv[2];
    long copies = atol(argv[3]), parallel = atol(argv[4]), live_ms = atol(argv[5]);
    int calls = atoi(argv[6]);
    pid_t *slots = calloc(parallel, sizeof(pid_t));
    char (*names)[4096] = calloc(parallel, sizeof(*names));
    long started = 0, finished = 0, failed = 0;
    while (finished < copies) {
        for (long s = 0; s < parallel && started < copies; s++) {
            if (slots[s])
                continue;
            snprintf(names[s], sizeof(names[s]), "%s/libchurn-%ld.so", dir, started++);
            copy_file(library, names[s]);
            pid_t pid = fork();
            if (pid == 0)
                child(names[s], live_ms, calls);
            slots[s] = pid;
        }
        int status;
        pid_t done = wait(&status);
        for (long s = 0; s < parallel; s++) {
            if (slots[s] != done)
                continue;
            slots[s] = 0;
            unlink(names[s]);
            failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
            if (++finished % 100 == 0)
                printf("%ld\n", finished), fflush(stdout);
        }
    }
    printf("done %ld failed %ld\n", finished, failed);
    return failed != 0;
}
"""


@dataclass
class Churn:
    library: Path       # the stand-in runtime every copy is made from
    driver: Path        # LIBRARY DIR COPIES PARALLEL LIVE_MS CALLS


def build(out_dir: Path) -> Churn:
    """Compile the stand-in and the driver into `out_dir`, readable by
    every user (the driver runs as an unprivileged one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    library, driver = out_dir / "libchurn.so", out_dir / "churn"
    for source, out, flags in ((LIBRARY, library, ["-shared", "-fPIC", "-O1"]),
                               (DRIVER, driver, ["-O1", "-ldl"])):
        text = out.with_name(out.name + ".c")
        text.write_text(source)
        result = subprocess.run(["gcc", *flags, "-o", str(out), str(text)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"gcc {out.name} failed:\n{result.stderr}")
    for path in (out_dir, library, driver):
        path.chmod(path.stat().st_mode | stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP
                   | stat.S_IXOTH)
    return Churn(library, driver)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status: expected an RssAnon line, found none")
