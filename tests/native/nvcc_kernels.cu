/* A CUDA program as users write it, built by the tests with the real nvcc
 * four ways (static and shared runtime, libcudart.so.12 and .so.13):
 * kernels in a namespace, a template and an extern "C" one, launched with
 * <<<>>> and with cudaLaunchKernel, a copy and a stream sync. Without a
 * driver every call fails; the probes fire all the same.
 *
 * It waits for one line on stdin before calling (the tracer attaches in
 * between), prints one JSON line of what it called, then with "linger"
 * waits for stdin to close, with "exit" returns at once. */
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <cuda_runtime.h>

namespace vision {
__global__ void patch_embed(float *x, int n)
{
    if (threadIdx.x < n)
        x[threadIdx.x] *= 2.0f;
}
}

template <typename T> __global__ void softmax_rows(T *x, int n)
{
    if (threadIdx.x < n)
        x[threadIdx.x] += T(1);
}

extern "C" __global__ void plain_c_kernel(int *p)
{
    *p = 1;
}

int main(int argc, char **argv)
{
    bool linger = argc > 1 && strcmp(argv[1], "linger") == 0;
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 2;
    cudaStream_t stream = (cudaStream_t)0x5eed;
    float *dev = nullptr;
    int *flag = nullptr;
    float host[16];
    for (int i = 0; i < 3; i++)
        vision::patch_embed<<<dim3(7, 2, 1), dim3(64, 1, 1), 128, stream>>>(dev, 5);
    for (int i = 0; i < 2; i++)
        softmax_rows<float><<<dim3(3, 1, 1), dim3(32, 1, 1), 0, stream>>>(dev, 4);
    plain_c_kernel<<<dim3(1, 1, 1), dim3(1, 1, 1), 0, stream>>>(flag);
    void *c_args[] = {&flag};
    cudaLaunchKernel((const void *)plain_c_kernel, dim3(2, 1, 1), dim3(8, 1, 1), c_args, 16,
                     stream);
    int n = 5;
    void *v_args[] = {&dev, &n};
    cudaLaunchKernel((const void *)vision::patch_embed, dim3(4, 4, 1), dim3(16, 16, 1),
                     v_args, 0, stream);
    cudaError_t copied = cudaMemcpyAsync(host, dev, sizeof host, cudaMemcpyDeviceToHost,
                                         stream);
    cudaError_t synced = cudaStreamSynchronize(stream);
    /* Stdout is a pipe: one write, then out (within microseconds). */
    printf("{\"pid\": %d, \"stream\": %lu, \"copy_bytes\": %zu, \"copy_ret\": %d, "
           "\"sync_ret\": %d}\n", (int)getpid(), (unsigned long)stream, sizeof host,
           (int)copied, (int)synced);
    fflush(stdout);
    if (linger)
        while (fgets(line, sizeof line, stdin))
            ;
    return 0;
}
