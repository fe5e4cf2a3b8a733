// Preprocess: interleaved RGB8 at the source size -> the model's planar NCHW input, f32 or
// f16. The resize is PIL's BILINEAR in 22-bit fixed point (src/stages/preprocess.rs):
// a horizontal pass rounded to u8, then a vertical pass rounded to u8, with the taps
// computed on the host by `Taps::bilinear` and uploaded once per size pair. Then
// `(v * s - mean[c]) / std[c]`. Integer arithmetic and IEEE f32 make it bit-exact.
#include "common.cuh"

#define PRECISION_BITS 22
#define HALF_ROUNDING (1 << (PRECISION_BITS - 1))

__device__ __forceinline__ u8 clip8(i32 acc) {
    i32 v = acc >> PRECISION_BITS;
    return (u8)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// Horizontal pass over source rows [row0, row0 + rows): `tmp` is dst_w x rows, RGB8.
extern "C" __global__ void resize_rgb8_horizontal(
    const u8* src, u32 src_w, u32 row0, u32 rows,
    const u32* first, const u32* count, const i32* weights, u32 max_taps,
    u8* tmp, u32 dst_w) {
    HorizontalCell c;
    if (!horizontal_cell(dst_w, rows, &c)) return;
    const u8* line = src + ((u64)row0 + c.row) * src_w * 3u;
    const u8* s = line + (u64)first[c.x] * 3u;
    const i32* w = weights + (u64)c.x * max_taps;
    i32 a0 = HALF_ROUNDING, a1 = HALF_ROUNDING, a2 = HALF_ROUNDING;
    u32 n = count[c.x];
    for (u32 k = 0; k < n; ++k) {
        i32 wk = w[k];
        a0 += (i32)s[3 * k] * wk;
        a1 += (i32)s[3 * k + 1] * wk;
        a2 += (i32)s[3 * k + 2] * wk;
    }
    u8* out = tmp + c.i * 3u;
    out[0] = clip8(a0);
    out[1] = clip8(a1);
    out[2] = clip8(a2);
}

// The vertical pass for output pixel (x, y); `tmp` starts at source row `tmp_row0`.
__device__ __forceinline__ void vertical_pixel(
    const u8* tmp, u32 w, u32 tmp_row0, const u32* first, const u32* count,
    const i32* weights, u32 max_taps, u32 x, u32 y, u8* px) {
    const u8* s = tmp + ((u64)(first[y] - tmp_row0) * w + x) * 3u;
    const i32* wt = weights + (u64)y * max_taps;
    u64 stride = (u64)w * 3u;
    i32 a0 = HALF_ROUNDING, a1 = HALF_ROUNDING, a2 = HALF_ROUNDING;
    u32 n = count[y];
    for (u32 k = 0; k < n; ++k) {
        i32 wk = wt[k];
        const u8* p = s + k * stride;
        a0 += (i32)p[0] * wk;
        a1 += (i32)p[1] * wk;
        a2 += (i32)p[2] * wk;
    }
    px[0] = clip8(a0);
    px[1] = clip8(a1);
    px[2] = clip8(a2);
}

// Vertical pass to interleaved RGB8 `out` (w x h), and the max of every value into
// `*max_value` (zeroed by the caller) for the "max" scale.
extern "C" __global__ void resize_rgb8_vertical(
    const u8* tmp, u32 w, u32 h, u32 tmp_row0,
    const u32* first, const u32* count, const i32* weights, u32 max_taps,
    u8* out, u32* max_value) {
    u64 i = global_index();
    u32 m = 0;
    // No early return: every lane of the warp takes part in the shuffle below.
    if (i < (u64)w * h) {
        u8 px[3];
        vertical_pixel(tmp, w, tmp_row0, first, count, weights, max_taps,
                       (u32)(i % w), (u32)(i / w), px);
        out[i * 3u] = px[0];
        out[i * 3u + 1u] = px[1];
        out[i * 3u + 2u] = px[2];
        m = px[0] > px[1] ? px[0] : px[1];
        m = m > px[2] ? m : px[2];
    }
    m = warp_max_u32(m);
    if ((threadIdx.x & 31u) == 0u && m > 0u) {
        atomicMax(max_value, m);
    }
}

// The guided filter's guide (guided_filter.rs `fit` with subsample > 1): the vertical
// pass, and straight away the luma of each resized pixel into `luma` (w x h), the same
// f32 expression luma_rgb8 evaluates on the stored RGB8. Nothing else reads the resized
// image, so it is never stored, and neither is its max: one launch less than the resize
// then luma_rgb8, and no max to zero beforehand.
extern "C" __global__ void resize_rgb8_vertical_luma(
    const u8* tmp, u32 w, u32 h, u32 tmp_row0,
    const u32* first, const u32* count, const i32* weights, u32 max_taps, float* luma) {
    u64 i = global_index();
    if (i >= (u64)w * h) return;
    u8 px[3];
    vertical_pixel(tmp, w, tmp_row0, first, count, weights, max_taps,
                   (u32)(i % w), (u32)(i / w), px);
    luma[i] = luma_of(px);
}

// `v * s - mean` then `/ std`, each rounded to f32 as the CPU's lookup table is built.
__device__ __forceinline__ float normalized(u8 v, float s, float mean, float stdev) {
    return ((float)v * s - mean) / stdev;
}

// The "max" scale: 1 / max over the resized image, 1 for an all-black image.
__device__ __forceinline__ float image_max_scale(u32 max_value) {
    return max_value == 0u ? 1.0f : 1.0f / (float)max_value;
}

#define NORMALIZE_KERNEL(NAME, T, STORE)                                                 \
    extern "C" __global__ void NAME(                                                      \
        const u8* rgb, u32 pixels, const u32* max_value, int scale_is_max,                \
        float fixed_scale, float mean0, float mean1, float mean2,                         \
        float std0, float std1, float std2, T* out) {                                     \
        u64 i = global_index();                                                           \
        if (i >= pixels) return;                                                          \
        float s = scale_is_max ? image_max_scale(*max_value) : fixed_scale;               \
        const u8* p = rgb + i * 3u;                                                       \
        out[i] = STORE(normalized(p[0], s, mean0, std0));                                 \
        out[(u64)pixels + i] = STORE(normalized(p[1], s, mean1, std1));                   \
        out[2u * (u64)pixels + i] = STORE(normalized(p[2], s, mean2, std2));              \
    }

// Fused vertical pass + normalisation for a fixed scale: no u8 intermediate.
#define VERTICAL_NORMALIZE_KERNEL(NAME, T, STORE)                                        \
    extern "C" __global__ void NAME(                                                      \
        const u8* tmp, u32 w, u32 h, u32 tmp_row0,                                        \
        const u32* first, const u32* count, const i32* weights, u32 max_taps,             \
        float scale, float mean0, float mean1, float mean2,                               \
        float std0, float std1, float std2, T* out) {                                     \
        u64 i = global_index();                                                           \
        u64 pixels = (u64)w * h;                                                          \
        if (i >= pixels) return;                                                          \
        u8 px[3];                                                                         \
        vertical_pixel(tmp, w, tmp_row0, first, count, weights, max_taps,                 \
                       (u32)(i % w), (u32)(i / w), px);                                   \
        out[i] = STORE(normalized(px[0], scale, mean0, std0));                            \
        out[pixels + i] = STORE(normalized(px[1], scale, mean1, std1));                   \
        out[2u * pixels + i] = STORE(normalized(px[2], scale, mean2, std2));              \
    }

__device__ __forceinline__ float store_f32(float v) { return v; }
__device__ __forceinline__ u16 store_f16(float v) { return f32_to_f16_bits(v); }

NORMALIZE_KERNEL(normalize_rgb8_f32, float, store_f32)
NORMALIZE_KERNEL(normalize_rgb8_f16, u16, store_f16)
VERTICAL_NORMALIZE_KERNEL(resize_rgb8_vertical_normalize_f32, float, store_f32)
VERTICAL_NORMALIZE_KERNEL(resize_rgb8_vertical_normalize_f16, u16, store_f16)
