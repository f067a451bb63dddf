/* The CUDA 12 runtime API the test programs call, exactly as
 * cuda_runtime_api.h declares it: types reduced to what the calls need. */
#ifndef MMTRACE_TEST_CUDA_RUNTIME_API_H
#define MMTRACE_TEST_CUDA_RUNTIME_API_H
#include <stddef.h>

typedef int cudaError_t;                        /* enum cudaError */
typedef struct CUstream_st *cudaStream_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct cudaLaunchAttribute_st cudaLaunchAttribute;
typedef struct dim3 { unsigned int x, y, z; } dim3;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4
};
typedef struct cudaLaunchConfig_st {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;

extern cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim,
                                    void **args, size_t sharedMem, cudaStream_t stream);
extern cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim,
                                         void **args, size_t sharedMem, cudaStream_t stream);
extern cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func,
                                       void **args);
extern cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
extern cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                   enum cudaMemcpyKind kind, cudaStream_t stream);
extern cudaError_t cudaMemcpy(void *dst, const void *src, size_t count,
                              enum cudaMemcpyKind kind);
extern cudaError_t cudaStreamSynchronize(cudaStream_t stream);

extern cudaError_t cudaSetDevice(int device);

/* Device memory (cuda_runtime_api.h). */
extern cudaError_t cudaMalloc(void **devPtr, size_t size);
extern cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream);
extern cudaError_t cudaFree(void *devPtr);
extern cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream);

#endif
