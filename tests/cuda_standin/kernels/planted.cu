// Test kernels for the stand-in's own tests (tests/standin_catches.rs) and the recovery
// tests: each correct kernel has a twin with one planted bug of a kind the stand-in must
// catch. Never used by celer itself.
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 thread_index() {
    return (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x;
}

// dst[i] = src[i] * factor for i < n.
extern "C" __global__ void scale(const float* src, u32 n, float factor, float* dst) {
    u64 i = thread_index();
    if (i >= n) return;
    dst[i] = src[i] * factor;
}

// dst[i] = value for i < n ... with an off-by-one bound: thread n writes one past the end.
extern "C" __global__ void fill_off_by_one(float* dst, u32 n, float value) {
    u64 i = thread_index();
    if (i > n) return;
    dst[i] = value;
}

// The sum of src[0..n) per warp, in out[warp]: every lane takes part in the shuffles.
extern "C" __global__ void warp_sums(const u32* src, u32 n, u32* out) {
    u64 i = thread_index();
    u32 v = i < n ? src[i] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if ((threadIdx.x & 31u) == 0u) out[i / 32u] = v;
}

// The same with the planted bug: lanes past n return before the shuffles that name them.
extern "C" __global__ void warp_sums_early_return(const u32* src, u32 n, u32* out) {
    u64 i = thread_index();
    if (i >= n) return;
    u32 v = src[i];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if ((threadIdx.x & 31u) == 0u) out[i / 32u] = v;
}

// A block-wide reduction through shared memory and __syncthreads (blocks of 64).
extern "C" __global__ void block_sums(const u32* src, u32 n, u32* out) {
    __shared__ u32 partial[64];
    u64 i = thread_index();
    partial[threadIdx.x] = i < n ? src[i] : 0u;
    __syncthreads();
    for (u32 stride = 32; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}

// Writes to an address no allocation holds (not a null pointer, which a compiler may
// treat as unreachable): an illegal address on a GPU and on the stand-in alike, which
// makes the context's error sticky. The recovery tests lose a device with it on purpose.
extern "C" __global__ void write_to_address(u64 address, u32 value) {
    volatile u32* target = (volatile u32*)address;
    target[threadIdx.x] = value;
}

// out[i] = the value of thread i - 1 of the block (0 for thread 0), through shared memory
// with the __syncthreads between the write and the read.
extern "C" __global__ void shift_with_sync(const u32* src, u32 n, u32* out) {
    __shared__ u32 slot[64];
    u64 i = thread_index();
    slot[threadIdx.x] = i < n ? src[i] : 0u;
    __syncthreads();
    u32 left = threadIdx.x > 0 ? slot[threadIdx.x - 1] : 0u;
    if (i < n) out[i] = left;
}

// The same with the planted bug: no __syncthreads, so a lane may read its neighbour's
// slot before the neighbour wrote it (right in CUDA's thread order, wrong on a GPU).
extern "C" __global__ void shift_without_sync(const u32* src, u32 n, u32* out) {
    __shared__ u32 slot[64];
    u64 i = thread_index();
    slot[threadIdx.x] = i < n ? src[i] : 0u;
    u32 left = threadIdx.x > 0 ? slot[threadIdx.x - 1] : 0u;
    if (i < n) out[i] = left;
}

// Planted: block b reads what block b - 1 wrote, with nothing ordering the blocks (blocks
// of a grid run in any order on a GPU): data[b] = b + 1 only if they run in order.
extern "C" __global__ void chain_blocks(u32* data) {
    if (threadIdx.x != 0) return;
    u32 b = blockIdx.x;
    data[b] = b == 0 ? 1u : data[b - 1] + 1u;
}

// dst[i] = src[i] * factor, the factor passed through a __shared__ variable that thread 0
// of each block sets.
extern "C" __global__ void scale_through_shared(const float* src, u32 n, float factor, float* dst) {
    __shared__ float shared_factor;
    if (threadIdx.x == 0) shared_factor = factor;
    __syncthreads();
    u64 i = thread_index();
    if (i < n) dst[i] = src[i] * shared_factor;
}

// The same with the planted bug: only block 0 sets it; every other block reads a shared
// variable no lane of it wrote (what the previous block left, if the blocks shared it).
extern "C" __global__ void scale_through_shared_once(const float* src, u32 n, float factor, float* dst) {
    __shared__ float shared_factor;
    if (blockIdx.x == 0 && threadIdx.x == 0) shared_factor = factor;
    __syncthreads();
    u64 i = thread_index();
    if (i < n) dst[i] = src[i] * shared_factor;
}

// scale, with launch bounds of 64 threads per block: a larger block is refused at launch.
extern "C" __global__ void __launch_bounds__(64) scale_bounded(const float* src, u32 n, float factor, float* dst) {
    u64 i = thread_index();
    if (i >= n) return;
    dst[i] = src[i] * factor;
}

// Holds 96 values live at once (volatile loads in order, used in reverse), so that it
// needs about 100 registers per thread: a block of 1024 threads needs more than an SM's
// 65536 registers and is refused at launch; 128 threads fit.
extern "C" __global__ void many_registers(const volatile float* src, float* dst) {
    float v[96];
#pragma unroll
    for (int k = 0; k < 96; ++k) v[k] = src[k];
    float acc = 0.0f;
#pragma unroll
    for (int k = 95; k >= 0; --k) acc = acc * 0.5f + v[k];
    dst[thread_index()] = acc;
}
