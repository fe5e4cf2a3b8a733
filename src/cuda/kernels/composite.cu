// Composite (src/pipeline/composite.rs): the refined alpha quantised to u8, with the
// trimap's certain pixels overriding it, and the straight (not premultiplied) RGBA
// cut-out. Exact: clamp, one f32 multiply and round-half-away-from-zero.
#include "common.cuh"

// (v.clamp(0, 1) * 255).round() as u8; a NaN gives 0 as Rust's saturating cast does.
__device__ __forceinline__ u8 alpha_u8(float v) {
    if (v < 0.0f) v = 0.0f;
    if (v > 1.0f) v = 1.0f;
    if (v != v) return 0;
    return (u8)roundf(v * 255.0f);
}

// Alpha for pixel i: the trimap decides where it is certain (when `use_trimap`).
__device__ __forceinline__ u8 composite_alpha(const float* refined, const u8* trimap,
                                              int use_trimap, u64 i) {
    if (use_trimap) {
        u8 t = trimap[i];
        if (t == TRIMAP_FOREGROUND) return 255;
        if (t == TRIMAP_BACKGROUND) return 0;
    }
    return alpha_u8(refined[i]);
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
    u8* alpha, u8* rgba) {
    u64 i = global_index();
    if (i >= n) return;
    u8 a = composite_alpha(refined, trimap, use_trimap, i);
    alpha[i] = a;
    const u8* p = rgb + i * 3u;
    u8* o = rgba + i * 4u;
    o[0] = p[0];
    o[1] = p[1];
    o[2] = p[2];
    o[3] = a;
}
