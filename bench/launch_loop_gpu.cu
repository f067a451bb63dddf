/* tests/native/launch_loop.c for a real GPU (bench/gpu_check's per-launch
 * cost): the same protocol on stdin and stdout, so that bench_gpu_probes'
 * Loop drives it, but each launch starts a real (empty) kernel through the
 * shared libcudart, on a real stream, and the copy is a real device-to-host
 * copy. For each line "run N [L [SPIN_NS]]": N iterations of L launches
 * (each followed by SPIN_NS of host work), then, unless "launch-only", one
 * cudaMemcpyAsync and one cudaStreamSynchronize. Prints "done SECONDS".
 *
 * Build: nvcc -cudart shared -o launch_loop_gpu launch_loop_gpu.cu
 * Usage: launch_loop_gpu [launch-only] */
#include <cstdio>
#include <cstring>
#include <ctime>
#include <unistd.h>
#include <cuda_runtime.h>

__global__ void loop_step(float *p) { }

static double now_s()
{
    timespec ts;
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
    bool launch_only = argc > 1 && strcmp(argv[1], "launch-only") == 0;
    cudaStream_t stream;
    float *dev = nullptr;
    static char host[64];
    if (cudaStreamCreate(&stream) != cudaSuccess || cudaMalloc(&dev, sizeof host) != cudaSuccess) {
        fprintf(stderr, "launch_loop_gpu: no CUDA device: %s\n",
                cudaGetErrorString(cudaGetLastError()));
        return 2;
    }
    void *args[1] = { &dev };
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %d\n", getpid());
    while (fgets(line, sizeof line, stdin)) {
        long n = 0, per_sync = 1, spin_ns = 0;
        if (sscanf(line, "run %ld %ld %ld", &n, &per_sync, &spin_ns) < 1)
            break;
        double start = now_s();
        for (long i = 0; i < n; i++) {
            for (long k = 0; k < per_sync; k++) {
                cudaLaunchKernel((const void *)loop_step, dim3(64), dim3(256), args, 0, stream);
                spin(spin_ns);
            }
            if (!launch_only) {
                cudaMemcpyAsync(host, dev, sizeof host, cudaMemcpyDeviceToHost, stream);
                cudaStreamSynchronize(stream);
            }
        }
        cudaStreamSynchronize(stream);
        printf("done %.9f\n", now_s() - start);
    }
    return 0;
}
