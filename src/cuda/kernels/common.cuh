// Shared by every kernel file (passed to NVRTC as the header "common.cuh"). No CUDA
// headers: NVRTC compiles these without a toolkit installed, so the few types and the
// f16 rounding are written here.
//
// Exactness: the module is compiled with --fmad=false, so `a * b + c` rounds twice as it
// does in Rust (which never contracts to FMA); divisions are IEEE (--prec-div=true) and
// denormals are kept (--ftz=false). That is what lets most kernels match the CPU stages
// bit for bit.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

// Trimap values (src/stages/trimap.rs).
#define TRIMAP_BACKGROUND 0
#define TRIMAP_UNKNOWN 128
#define TRIMAP_FOREGROUND 255

// Luma in [0, 1] (BT.601 weights) of one RGB8 pixel, f32 in the CPU's order
// (guided_filter.rs `luma_of`): the guided filter's guide.
__device__ __forceinline__ float luma_of(const u8* p) {
    return (0.299f * (float)p[0] + 0.587f * (float)p[1] + 0.114f * (float)p[2]) / 255.0f;
}

// One thread per element of a 1-D range: grids are 1-D so that images up to the decode
// limit never hit the 65535 limit of grid y/z.
__device__ __forceinline__ u64 global_index() {
    return (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x;
}

// Thread `i` of a resize's horizontal pass, which writes `dst_w` outputs for each of the
// `rows` source rows it covers: output column `x` of covered row `row`. False for the
// threads past the end.
struct HorizontalCell {
    u64 i;
    u32 x;
    u64 row;
};
__device__ __forceinline__ bool horizontal_cell(u32 dst_w, u32 rows, HorizontalCell* cell) {
    u64 i = global_index();
    if (i >= (u64)dst_w * rows) return false;
    cell->i = i;
    cell->x = (u32)(i % dst_w);
    cell->row = i / dst_w;
    return true;
}

// The max (min) of `v` over the warp, valid in lane 0.
__device__ __forceinline__ u32 warp_max_u32(u32 v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        u32 other = __shfl_down_sync(0xffffffffu, v, offset);
        v = other > v ? other : v;
    }
    return v;
}

__device__ __forceinline__ u32 warp_min_u32(u32 v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        u32 other = __shfl_down_sync(0xffffffffu, v, offset);
        v = other < v ? other : v;
    }
    return v;
}

// f32 -> IEEE binary16 bits, round to nearest even: the half crate's software conversion
// (half::f16::from_f32) line for line, so that f16 model inputs match the CPU's exactly.
__device__ __forceinline__ u16 f32_to_f16_bits(float value) {
    u32 x = __float_as_uint(value);
    u32 sign = x & 0x80000000u;
    u32 exp = x & 0x7f800000u;
    u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        // Infinity or NaN: a NaN keeps its top mantissa bits and gets the quiet bit.
        u32 nan_bit = man == 0u ? 0u : 0x0200u;
        return (u16)((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }
    u32 half_sign = sign >> 16;
    int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) {
        return (u16)(half_sign | 0x7c00u);
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return (u16)half_sign;
        }
        u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        u32 round_bit = 1u << (13 - half_exp);
        // Round bit set and (sticky bits or an odd result): round to nearest even.
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) {
            half_man += 1u;
        }
        return (u16)(half_sign | half_man);
    }
    u32 bits = half_sign | ((u32)half_exp << 10) | (man >> 13);
    u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
        // A carry out of the mantissa bumps the exponent, which is the right result.
        bits += 1u;
    }
    return (u16)bits;
}
