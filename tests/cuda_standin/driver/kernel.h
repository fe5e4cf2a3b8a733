// The CUDA C dialect of celer's kernels, as host C++: what a `.cu` file sees when the
// stand-in driver builds it for the CPU. Included first (-include) in every kernel
// translation unit; the `.cu` sources themselves are compiled unchanged.
//
// Each GPU thread runs as a lane on a fiber (see lanes.cpp): `threadIdx` and friends
// read the running lane's coordinates, and a warp shuffle or `__syncthreads` parks the
// lane until every lane it names has arrived, so the 32 lanes of a warp move in
// lockstep through each shuffle as they do on a GPU. A lane that has returned before a
// shuffle that names it is an error, not a silent zero.
//
// Arithmetic: compiled with -ffp-contract=off and SSE (no x87), so `a * b + c` rounds
// twice as with NVRTC's --fmad=false, and f32/f64 operations are IEEE, as on the GPU.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace standin {

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

// The running lane's coordinates. Set by the lane scheduler before it resumes a lane;
// kernel code only reads them.
struct LaneCoordinates {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
extern thread_local LaneCoordinates lane;

// Parks the running lane at a warp shuffle: returns lane (own + delta)'s value once every
// lane of `mask` has arrived at the same shuffle (the lane's own value past the end of
// its `width` segment). 8 bytes carry any 4- or 8-byte operand.
uint64_t shuffle_down(unsigned int mask, uint64_t value, unsigned int delta, int width);
// Parks the running lane until every lane of its block that has not returned arrives.
void sync_threads();
// Called (by code build.rs adds after each `__shared__` declaration) when a lane reaches
// the declaration of the `__shared__` variable at `address`: the first lane of each
// block to reach it fills it with poison bytes, so that a read before any lane of this
// block wrote it reads poison instead of what the previous block left there.
void shared_reached(void* address, size_t bytes);

template <typename T>
inline T shuffle_down_as(unsigned int mask, T value, unsigned int delta, int width) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__shfl_down_sync takes 4- or 8-byte values");
    uint64_t bits = 0;
    memcpy(&bits, &value, sizeof(T));
    uint64_t out = shuffle_down(mask, bits, delta, width);
    T result;
    memcpy(&result, &out, sizeof(T));
    return result;
}

}  // namespace standin

#define threadIdx (::standin::lane.thread_idx)
#define blockIdx (::standin::lane.block_idx)
#define blockDim (::standin::lane.block_dim)
#define gridDim (::standin::lane.grid_dim)
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
// Read from the CUBIN (cuLaunchKernel refuses a larger block, as CUDA does).
#define __launch_bounds__(...)
// One copy per OS thread: a block's lanes all run on one thread, one block at a time.
// build.rs rewrites each `__shared__` declaration of a `.cu` file into a
// `__standin_shared__` one followed by a call of ::standin::shared_reached, which poisons
// the variable when a block starts; a `__shared__` it did not rewrite (in a header) does
// not compile, rather than go unpoisoned.
#define __standin_shared__ static thread_local
#define __shared__ __shared___outside_a_cu_file_is_not_poisoned_by_the_stand_in_move_it_to_the_cu_file

template <typename T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    return ::standin::shuffle_down_as(mask, var, delta, width);
}

inline void __syncthreads() { ::standin::sync_threads(); }

inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, 4);
    return i;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}

// A launch's lanes run one at a time on one OS thread, so read-modify-write is atomic
// within a launch; __atomic builtins keep it so between launches that another stream
// runs on another thread at the same time.
inline unsigned int atomicMax(unsigned int* address, unsigned int value) {
    unsigned int old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (old < value &&
           !__atomic_compare_exchange_n(address, &old, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
inline unsigned int atomicMin(unsigned int* address, unsigned int value) {
    unsigned int old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (old > value &&
           !__atomic_compare_exchange_n(address, &old, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
    return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_RELAXED); }
