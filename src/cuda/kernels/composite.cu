// Composite (src/stages/composite.rs): the refined alpha quantised to u8, with the
// trimap's certain pixels overriding it, and the straight (not premultiplied) RGBA
// cut-out. Exact: clamp, one f32 multiply and round-half-away-from-zero. The guided
// filter's alpha is made here too: its linear model, fitted at low resolution
// (guided_filter.cu), is evaluated at full size only where the trimap is unknown.
#include "common.cuh"

// (v.clamp(0, 1) * 255).round() as u8; a NaN gives 0 as Rust's saturating cast does.
__device__ __forceinline__ u8 alpha_u8(float v) {
    if (v < 0.0f) v = 0.0f;
    if (v > 1.0f) v = 1.0f;
    if (v != v) return 0;
    return (u8)roundf(v * 255.0f);
}

// Where the trimap is certain it decides the alpha (into `a`, returning true).
__device__ __forceinline__ bool trimap_decides(u8 t, u8* a) {
    if (t == TRIMAP_FOREGROUND) { *a = 255; return true; }
    if (t == TRIMAP_BACKGROUND) { *a = 0; return true; }
    return false;
}

// Alpha for pixel i: the trimap decides where it is certain (when `use_trimap`).
__device__ __forceinline__ u8 composite_alpha(const float* refined, const u8* trimap,
                                              int use_trimap, u64 i) {
    u8 a;
    if (use_trimap && trimap_decides(trimap[i], &a)) return a;
    return alpha_u8(refined[i]);
}

// Pixel i's alpha `a`, and its straight RGBA cut-out from the RGB8 source; a fully
// transparent pixel carries no colour (RGB 0), as composite::cutout. The pixel is one
// 32-bit store rather than four byte stores: R in the low byte, so that memory holds
// R, G, B, A in that order on the GPU (and the stand-in's host), both little-endian.
// `rgba` is typed u32 so that a buffer not 4-byte aligned is refused at launch (the
// stand-in checks it); a CudaSlice is a whole allocation, 256-byte aligned.
__device__ __forceinline__ void write_cutout(const u8* rgb, u64 i, u8 a, u8* alpha, u32* rgba) {
    alpha[i] = a;
    const u8* p = rgb + i * 3u;
    u32 colour = (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16);
    rgba[i] = (a != 0 ? colour : 0u) | ((u32)a << 24);
}

// Alpha only.
extern "C" __global__ void quantize_alpha(
    const float* refined, const u8* trimap, int use_trimap, u32 n, u8* alpha) {
    u64 i = global_index();
    if (i >= n) return;
    alpha[i] = composite_alpha(refined, trimap, use_trimap, i);
}

// Alpha and the RGBA cut-out in one pass over the pixels.
extern "C" __global__ void quantize_alpha_cutout(
    const float* refined, const u8* trimap, int use_trimap, const u8* rgb, u32 n,
    u8* alpha, u32* rgba) {
    u64 i = global_index();
    if (i >= n) return;
    u8 a = composite_alpha(refined, trimap, use_trimap, i);
    write_cutout(rgb, i, a, alpha, rgba);
}

// Upsampling taps of one axis (host-computed by `UpsampleTaps`: PIL's bilinear weights
// cast to f32): output sample i reads `count[i]` inputs from `first[i]`, weights at
// `weights[i * stride]`.
struct Axis {
    const u32* first;
    const u32* count;
    const float* weights;
    u32 stride;
};

// `LinearModel::alpha` at full-size pixel (x, y) whose trimap value is unknown: A and B
// upsampled from the low-resolution mean_a / mean_b (lw wide), vertical taps first then
// horizontal, each accumulated in f32 from 0 in ascending tap order (the CPU's order:
// it interpolates a whole row vertically, then each pixel horizontally), then
// q = A * luma + B, quantised. Zero-weight taps are multiplied in as the CPU does.
__device__ __forceinline__ u8 model_alpha(
    const float* mean_a, const float* mean_b, u32 lw, Axis xs, Axis ys, u32 x, u32 y,
    const u8* px) {
    u32 x0 = xs.first[x], nx = xs.count[x];
    u32 y0 = ys.first[y], ny = ys.count[y];
    const float* wx = xs.weights + (u64)x * xs.stride;
    const float* wy = ys.weights + (u64)y * ys.stride;
    float a = 0.0f, b = 0.0f;
    for (u32 i = 0; i < nx; ++i) {
        u64 column = (u64)x0 + i;
        float row_a = 0.0f, row_b = 0.0f;
        for (u32 j = 0; j < ny; ++j) {
            u64 k = ((u64)y0 + j) * lw + column;
            row_a = row_a + wy[j] * mean_a[k];
            row_b = row_b + wy[j] * mean_b[k];
        }
        a = a + wx[i] * row_a;
        b = b + wx[i] * row_b;
    }
    return alpha_u8(a * luma_of(px) + b);
}

__device__ __forceinline__ u8 guided_pixel_alpha(
    const float* mean_a, const float* mean_b, u32 lw, Axis xs, Axis ys,
    const u8* rgb, const u8* trimap, u32 w, u64 i) {
    u8 a;
    if (trimap_decides(trimap[i], &a)) return a;
    return model_alpha(mean_a, mean_b, lw, xs, ys, (u32)(i % w), (u32)(i / w), rgb + i * 3u);
}

#define GUIDED_AXES                                                                  \
    Axis xs = {x_first, x_count, x_weights, x_stride};                               \
    Axis ys = {y_first, y_count, y_weights, y_stride};

// Guided-filter alpha at the source size (w x h) from the fitted model (lw wide).
extern "C" __global__ void guided_alpha(
    const float* mean_a, const float* mean_b, u32 lw,
    const u32* x_first, const u32* x_count, const float* x_weights, u32 x_stride,
    const u32* y_first, const u32* y_count, const float* y_weights, u32 y_stride,
    const u8* rgb, const u8* trimap, u32 w, u32 h, u8* alpha) {
    u64 i = global_index();
    if (i >= (u64)w * h) return;
    GUIDED_AXES
    alpha[i] = guided_pixel_alpha(mean_a, mean_b, lw, xs, ys, rgb, trimap, w, i);
}

// The same, and the RGBA cut-out in the same pass.
extern "C" __global__ void guided_alpha_cutout(
    const float* mean_a, const float* mean_b, u32 lw,
    const u32* x_first, const u32* x_count, const float* x_weights, u32 x_stride,
    const u32* y_first, const u32* y_count, const float* y_weights, u32 y_stride,
    const u8* rgb, const u8* trimap, u32 w, u32 h, u8* alpha, u32* rgba) {
    u64 i = global_index();
    if (i >= (u64)w * h) return;
    GUIDED_AXES
    u8 a = guided_pixel_alpha(mean_a, mean_b, lw, xs, ys, rgb, trimap, w, i);
    write_cutout(rgb, i, a, alpha, rgba);
}
