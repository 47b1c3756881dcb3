// Device work of the data-parallel training harness (src/train/):
// gradient contents and the u32 axpy used for accumulation and the
// optimizer update. Compiled at run time with NVRTC.

// The pattern of `seed` (splitmix64 of seed and word index), bit for bit
// the simulator's `fill_pattern`, so the host can check the results.
extern "C" __global__ void gpupool_pattern(unsigned long long* p,
                                           unsigned long long words,
                                           unsigned long long seed) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < words; i += stride) {
        unsigned long long z = seed ^ (i * 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        p[i] = z ^ (z >> 31);
    }
}

// d[i] += alpha * s[i], modulo 2^32.
extern "C" __global__ void gpupool_axpy(unsigned int* d, const unsigned int* s,
                                        unsigned long long n, unsigned int alpha) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += stride) {
        d[i] += alpha * s[i];
    }
}
