// smid_probe: a kernel that records the SM each block ran on, for checking SM partitions by their effect.
// Built on a GPU machine only (`make -C native probe`, needs nvcc); loaded by bullet_ray.gpu.probe.
#include <cuda_runtime.h>
#include <stdint.h>

__global__ void smid_kernel(int* out, long long spin_ns) {
    unsigned int smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {  // hold the SM a while so that later blocks spread over every SM the stream may use
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < spin_ns);
    if (threadIdx.x == 0) out[blockIdx.x] = (int)smid;
}

// Launch `num_blocks` blocks of 256 threads on `stream` (a CUstream/cudaStream_t as an integer); each
// writes its SM id into out[block]. Returns the cudaError_t of the launch (0 ok).
extern "C" int smid_probe_launch(uintptr_t stream, int* out, int num_blocks, long long spin_ns) {
    smid_kernel<<<num_blocks, 256, 0, (cudaStream_t)stream>>>(out, spin_ns);
    return (int)cudaGetLastError();
}
